"""`help=true`: every key of a loaded config, with its value, type, help text and where its value came from."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.settings import enabled_stages, is_section, kind_of, stage_names
from pipeline.suggest import show


def _kind(hint: Any) -> str:
    """A field's type in words (`help=true`), not as a Python type."""
    text = str(hint)
    for word, kind in (("list", "list"), ("dict", "mapping"), ("bool", "true/false"), ("int", "integer"),
                       ("float", "number"), ("str", "text")):
        if word in text:
            return kind
    return "any value"


def _source_of(sources: dict[str, str], key: str) -> str:
    """Where the value of dotted `key` (or of keys under it) came from, as `load_with_sources` records it; empty
    for a default."""
    return ", ".join(dict.fromkeys(s for k, s in sources.items() if k == key or k.startswith(f"{key}.")))


def _leaf(key: str, value: Any, field_: Any, sources: dict[str, str]) -> str:
    resumable = " [a resume may change it]" if field_.metadata.get("resumable") else ""
    origin = f" [{source}]" if (source := _source_of(sources, key)) else ""
    return f"  {key}={show(value)}  ({_kind(field_.type)}) {field_.metadata.get('help', '')}{resumable}{origin}"


def _section(node: DictConfig, key: str, text: str, sources: dict[str, str]) -> list[str]:
    """A config section's lines: its values, then its subsections; one line when every value is null."""
    values = OmegaConf.to_container(node)
    if all(v is None for v in values.values()):
        return [f"  {key}.*=null  {text}; keys: {', '.join(values)}"]
    schema_fields = {f.name: f for f in fields(OmegaConf.get_type(node))}
    lines = [f"\n{key}: {text}"]
    lines += [_leaf(f"{key}.{n}", node[n], f, sources) for n, f in schema_fields.items() if not is_section(node[n])]
    for name in [n for n in schema_fields if is_section(node[n])]:
        lines += _section(node[name], f"{key}.{name}", schema_fields[name].metadata.get("help", ""), sources)
    return lines


def describe(cfg: DictConfig, sources: dict[str, str] | None = None) -> str:
    """Every key of the loaded config `cfg` (dotted, as overrides name it) with its value, type and help text, and
    where its value came from (`sources`, as `load_with_sources` records them); of the stage sections, only those
    of the stages `cfg` runs, in its order."""
    runs, stages, sources = enabled_stages(cfg), stage_names(cfg), sources or {}
    others = [n for n in stages if n not in runs]
    top = OmegaConf.get_type(cfg).__dataclass_fields__
    hidden = f" (the keys of {', '.join(others)} appear when stages=[...] runs them)" if others else ""
    lines = [f"recipe {cfg.recipe}: stages {', '.join(runs)}{hidden}"]
    if sources:
        lines.append(f"a value set over its default is marked with where it came from: "
                     f"{', '.join(f'[{s}]' for s in dict.fromkeys(sources.values()))}")
    lines += [_leaf(n, cfg[n], f, sources) for n, f in top.items() if not is_section(cfg[n])]
    for name in [n for n in top if is_section(cfg[n])]:
        lines += _section(cfg[name], name, top[name].metadata["help"], sources)
    for name in runs:
        kind = kind_of(cfg, name)
        text = kind.help if name == kind.name else f"a stage of kind {kind.name} ({kind.help})"
        lines += _section(cfg[name], name, text, sources)
        if kind.trl_config:
            lines.append(f"  {name}.<field>: any other field of TRL's {kind.trl_config.partition(':')[2]} passes to "
                         "it under its own name")
    for name in [n for n in cfg if n not in top and n not in stages]:
        lines += _section(cfg[name], name, f"settings of the recipe extension {cfg.extension}", sources)
    return "\n".join(lines)
