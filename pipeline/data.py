"""Data mixtures: load sources, map columns, weight, mix, fingerprint.

A mixture (`data_mixtures/NAME.yaml`) lists sources. Each source is a local file
(`path`: .jsonl, .json or .parquet), a Hub dataset (`hub`, `name`, `split`, `revision`) or a
built-in generator (`generator: tiny`, `split`). `columns` maps a target field to a source
column; targets are `messages`, `text`, `prompt`, `chosen`, `rejected`, `answer`, and `user` /
`assistant` / `system` (a single-turn chat built into `messages`), and `chat_template_kwargs`
(per-row template switches such as SmolLM3's think / no_think, passed to the chat template).
Unmapped targets are taken from a column of the same name when there is one. `weight` <= 1 takes
that fraction of the source's rows, > 1 that many rows (cycling if the source is smaller). Rows are
shuffled with the mixture seed after mixing.

Relative paths resolve against the current directory (the repository root for the shipped
mixtures). Every malformed row is a `ConfigError` naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.config import MIXTURES_DIR, ConfigError, explain_error
from pipeline.files import sha256_file
from pipeline.tiny import data as tiny_data

TARGETS = ("messages", "text", "prompt", "chosen", "rejected", "answer", "user", "assistant", "system",
           "chat_template_kwargs")
ROLES = ("system", "user", "assistant", "tool")
GENERATORS = {"tiny": tiny_data.split_file}  # `generator: NAME` -> (run config, split) -> local JSONL file


@dataclass
class SourceConfig:
    path: str = ""
    hub: str = ""
    name: str = ""  # Hub dataset config name
    split: str = "train"
    revision: str = "main"
    generator: str = ""
    columns: dict[str, str] = field(default_factory=dict)
    weight: float = 1.0


@dataclass
class MixtureConfig:
    description: str = ""
    seed: int = 0
    tokens: float = 0  # about how many tokens one pass over the weighted mixture holds (published); read by plan=true
    sources: list[SourceConfig] = field(default_factory=list)


def mixture_path(name: str) -> Path:
    """The YAML file of a mixture given by name (`data_mixtures/NAME.yaml`) or by path."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else MIXTURES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in MIXTURES_DIR.glob("*.yaml")))
        raise ConfigError(f"data mixture '{name}' not found ({path}); shipped mixtures: {known}")
    return path


def load_spec(name: str) -> DictConfig:
    """Parse and validate a mixture YAML against the schema (unknown keys, types, sources)."""
    path = mixture_path(name)
    schema = OmegaConf.structured(MixtureConfig)
    try:
        spec = OmegaConf.merge(schema, OmegaConf.load(path))
    except OmegaConfBaseException as err:
        raise explain_error(schema, err, f"mixture {path}") from None
    if not spec.sources:
        raise ConfigError(f"mixture {path} has no sources")
    for i, src in enumerate(spec.sources):
        kinds = [k for k in ("path", "hub", "generator") if src[k]]
        if len(kinds) != 1:
            raise ConfigError(f"mixture {path} source {i}: set exactly one of path, hub, generator")
        if src.generator and src.generator not in GENERATORS:
            raise ConfigError(f"mixture {path} source {i}: unknown generator '{src.generator}' ({tuple(GENERATORS)})")
        bad = [t for t in src.columns if t not in TARGETS]
        if bad:
            raise ConfigError(f"mixture {path} source {i}: unknown target column {bad}; targets: {TARGETS}")
        if src.weight <= 0:
            raise ConfigError(f"mixture {path} source {i}: weight must be > 0, got {src.weight}")
    return spec


def _local_file(src: DictConfig, cfg: DictConfig) -> Path | None:
    if src.generator:
        return GENERATORS[src.generator](cfg, src.split)
    if src.path:
        path = Path(src.path)
        if not path.is_file():
            raise ConfigError(f"dataset file not found: {path} (from a mixture source)")
        return path
    return None


def stage_mixtures(cfg: DictConfig, stage: str) -> list[str]:
    """Every mixture a stage reads (its own, and the on-policy prompts of a DPO stage)."""
    section = cfg[stage]
    names = [section.mixture] if section.mixture else []
    if "on_policy" in section and section.on_policy.enabled:
        names.append(section.on_policy.mixture)
    return names


def fingerprints(name: str, cfg: DictConfig) -> list[dict]:
    """One fingerprint per source of a mixture: sha256 of local files, name + revision for Hub data.

    Local files are also parsed and every row checked here, so a malformed row stops the run
    before any training (Hub sources are checked when loaded).
    """
    out = []
    for src in load_spec(name).sources:
        file = _local_file(src, cfg)
        if file is not None:
            columns = OmegaConf.to_container(src.columns)
            if not [normalise(row, columns, where) for where, row in _read_rows(file)]:
                raise ConfigError(f"dataset {file} is empty")
        if file is None:
            out.append({"hub": src.hub, "name": src.name, "split": src.split, "revision": src.revision})
        elif src.generator:
            out.append({"generator": src.generator, "split": src.split, "sha256": sha256_file(file)})
        else:
            out.append({"path": src.path, "sha256": sha256_file(file)})
    return out


def _read_rows(path: Path) -> list[tuple[str, dict]]:
    """Rows of a local file, each with its location (`file:line` for JSONL)."""
    if path.suffix == ".parquet":
        import datasets

        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(ds)]
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, list):
            raise ConfigError(f"{path}: expected a JSON list of rows")
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(data)]
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{lineno}", json.loads(line)))
            except ValueError as err:
                raise ConfigError(f"{path}:{lineno}: malformed JSON line ({err.args[0]})") from None
    return rows


def _check_messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: messages must be a non-empty list of {{role, content}}")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: each message needs a string 'content', got {m!r:.80}")
        if m.get("role") not in ROLES:
            raise ConfigError(f"{where}: unknown message role {m.get('role')!r} (allowed: {', '.join(ROLES)})")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def normalise(row: dict, columns: dict, where: str) -> dict:
    """Map one source row into the target fields; raise `ConfigError` naming `where` if malformed."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: row is not a JSON object")
    mapping = dict(columns) or {t: t for t in TARGETS if t in row}
    out = {}
    for target, column in mapping.items():
        if column not in row:
            raise ConfigError(f"{where}: row has no column '{column}' (mapped to '{target}'; "
                              f"row columns: {', '.join(map(str, row))})")
        out[target] = row[column]
    if "user" in out or "assistant" in out:
        turns = [(r, out.pop(r)) for r in ("system", "user", "assistant") if r in out]
        out["messages"] = [{"role": r, "content": c} for r, c in turns]
    for key in ("messages", "chosen", "rejected"):
        if key in out and not isinstance(out[key], str):
            out[key] = _check_messages(out[key], where)
    if isinstance(out.get("prompt"), list):
        out["prompt"] = _check_messages(out["prompt"], where)
    if "chosen" in out and out.get("chosen") == out.get("rejected"):
        raise ConfigError(f"{where}: preference row has chosen equal to rejected")
    if not out:
        raise ConfigError(f"{where}: no usable column (map one of {', '.join(TARGETS)})")
    return out


def _normalise_indexed(row: dict, index: int, columns: dict, label: str) -> dict:
    return normalise(row, columns, f"{label} row {index + 1}")


def _subsample(ds: Any, weight: float, seed: int) -> Any:
    n = len(ds)
    count = round(n * weight) if weight <= 1 else int(weight)
    order = ds.shuffle(seed=seed)
    if count <= n:
        return order.select(range(count))
    return order.select([i % n for i in range(count)])


def load_mixture(name: str, cfg: DictConfig, render: Callable[[dict], str] | None = None):
    """Load, normalise, weight and shuffle a mixture into one `datasets.Dataset`.

    With `render` (a chat template), chat rows become `text` so chat and plain sources can mix.
    """
    import datasets

    spec = load_spec(name)
    parts = []
    for i, src in enumerate(spec.sources):
        columns = OmegaConf.to_container(src.columns)
        file = _local_file(src, cfg)
        if file is not None:
            rows = [normalise(row, columns, where) for where, row in _read_rows(file)]
            if not rows:
                raise ConfigError(f"dataset {file} is empty")
            ds = datasets.Dataset.from_list(rows)
        else:
            raw = datasets.load_dataset(src.hub, src.name or None, split=src.split, revision=src.revision)
            label = f"{src.hub}[{src.name}/{src.split}]"
            ds = raw.map(_normalise_indexed, with_indices=True, remove_columns=raw.column_names,
                         fn_kwargs={"columns": columns, "label": label})
        if render is not None and "messages" in ds.column_names:
            ds = ds.map(lambda r: {"text": render(r)}, remove_columns=ds.column_names)
        parts.append(_subsample(ds, src.weight, spec.seed + i))
    names = [sorted(p.column_names) for p in parts]
    if any(n != names[0] for n in names):
        raise ConfigError(f"mixture '{name}': sources give different columns {names}")
    return datasets.concatenate_datasets(parts).shuffle(seed=spec.seed)
