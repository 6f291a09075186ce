"""Data mixtures: load sources, map columns, weight, mix, fingerprint.

A mixture (`data_mixtures/NAME.yaml`) lists sources. Each source is a local file
(`path`: .jsonl, .json, .parquet or .csv), a Hub dataset (`hub`, `name`, `split`, `revision`) or a generator
of the recipe's extension (`generator: NAME`, `split`; pipeline/extension.py). A stage's `data` is a mixture of
one source (a folder of files: one source per file; pipeline/data/sources.py), read by the same functions, which
take a mixture's name or a stage's `settings.Data`. `columns` maps a target field to
a source column; targets are the columns of TRL's formats (`messages`, `text`, `prompt`, `completion`, `chosen`,
`rejected`, `label`; pipeline/data/formats.py), `answer` (RL's reference), `user` / `assistant` / `system` (a
single-turn chat built into `messages`), `tools` (JSON schemas of the tools a row's tool calls use) and
`chat_template_kwargs` (per-row template switches such as SmolLM3's think / no_think, passed to the chat
template). Without `columns`, every target is taken from the column of its name, when there is one. `remove` lists
regular expressions deleted from every text the source's columns give (e.g. GSM8K's calculator annotations
`<<48/2=24>>`: `remove: ["<<[^>]*>>"]`). `weight` <= 1
takes that fraction of the source's rows, > 1 that many rows (cycling if the source is smaller). Rows are
shuffled with the mixture seed after mixing.

Hub sources are read with `datasets.load_dataset`, from the Hub or, with `hub_mirror=DIR`, from a local
copy of the repository in `DIR/<owner>/<repo>` (see `hub_source`). The weight picks rows before they
are normalised. Prompts become conversations, and preference rows reach TRL in its conversational form
whatever mix of strings and conversations the source uses (`normalise`).

A relative `path` resolves against the mixture's own file. Every malformed row is a `ConfigError` naming
the file (or Hub split) and row.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline import extension, keys
from pipeline.data import sources as data_sources
from pipeline.data.formats import TARGETS, of_row, tool_name
from pipeline.errors import ConfigError
from pipeline.recipe_files import MIXTURES_DIR, yaml_problem
from pipeline.settings import Data, kind_of
from pipeline.suggest import explain_error

ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tool_calls", "name", "tool_call_id")  # what a message of TRL's tool-calling format adds
LABELS = {"true": True, "false": False, "1": True, "0": False}  # an unpaired row's label as a CSV cell writes it
HEAD_ROWS = 8  # rows of each source the preflight renders and checks against its stage (`head`)
log = logging.getLogger("pipeline")


@dataclass
class SourceConfig:
    path: str = ""
    hub: str = ""
    name: str = ""  # Hub dataset config name
    split: str = "train"
    revision: str = "main"
    generator: str = ""
    columns: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)  # regular expressions deleted from every text of a row
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


def source_name(source: str | Data) -> str:
    """A mixture's name or a stage's data, for messages: `mixture NAME`, `data VALUE`."""
    return str(source) if isinstance(source, Data) else f"mixture {source}"


def _data_spec(data: Data) -> DictConfig:
    """A stage's `data` as a mixture: one source, or one per file of a folder."""
    found = [data_sources.parse(data.value)]
    if "path" in found[0]:
        path = Path(os.path.expanduser(found[0]["path"]))
        found = [{"path": str(p)} for p in (data_sources.files(path) if path.is_dir() else [path])]
    sources = [{**s, "columns": data.columns, **({"revision": data.revision} if "hub" in s else {})} for s in found]
    return OmegaConf.merge(OmegaConf.structured(MixtureConfig), {"description": str(data), "sources": sources})


def load_spec(source: str | Data) -> DictConfig:
    """Parse and validate a mixture YAML against the schema (unknown keys, types, sources); a stage's `data` is the
    mixture of its one source (`_data_spec`)."""
    if isinstance(source, Data):
        spec, where = _data_spec(source), str(source)
    else:
        path = mixture_path(source)
        schema, where = OmegaConf.structured(MixtureConfig), f"mixture {path}"
        try:
            spec = OmegaConf.merge(schema, OmegaConf.load(path))
        except OmegaConfBaseException as err:
            raise explain_error(schema, err, where) from None
        except Exception as err:  # noqa: BLE001 - YAML parser errors come in many types
            raise ConfigError(f"cannot parse mixture {path}: {yaml_problem(err)}") from None
    if not spec.sources:
        raise ConfigError(f"{where} has no sources")
    for i, src in enumerate(spec.sources):
        kinds = [k for k in ("path", "hub", "generator") if src[k]]
        if len(kinds) != 1:
            raise ConfigError(f"{where} source {i}: set exactly one of path, hub, generator")
        bad = [t for t in src.columns if t not in TARGETS]
        if bad:
            raise ConfigError(f"{where} source {i}: unknown target column {bad}; targets: {TARGETS}")
        if src.weight <= 0:
            raise ConfigError(f"{where} source {i}: weight must be > 0, got {src.weight}")
        for pattern in src.remove:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ConfigError(f"{where} source {i}: remove pattern {pattern!r} is not a regular expression "
                                  f"({err})") from None
        if src.path and not isinstance(source, Data):  # relative to the mixture's own file, wherever the run starts
            src.path = str(path.resolve().parent / Path(src.path).expanduser())
    return spec


def _local_file(src: DictConfig, cfg: DictConfig) -> Path | None:
    if src.generator:
        return extension.generator(cfg, src.generator, "a mixture source")(cfg, src.split)
    if src.path:
        path = Path(src.path)
        if not path.is_file():
            raise ConfigError(f"dataset file not found: {path}")
        return path
    return None


def stage_mixtures(cfg: DictConfig, stage: str) -> list[str | Data]:
    """Every mixture a stage reads (`StageKind.mixtures`: its mixture or data, and e.g. a DPO stage's on-policy
    prompts)."""
    return [source for source, _, _ in kind_of(cfg, stage).mixtures(cfg[stage])]


def _rules(src: DictConfig) -> dict:
    """How a source's rows are normalised: `normalise`'s `columns` and `remove` as plain Python values."""
    return {"columns": OmegaConf.to_container(src.columns), "remove": list(src.remove)}


def _file_rows(file: Path, src: DictConfig) -> list[dict]:
    """Every row of a local file, normalised; a file is one format (a row of another is refused, naming both)."""
    rows, first, rules = [], None, _rules(src)
    for where, raw in _read_rows(file):
        rows.append(normalise(raw, where=where, **rules))
        first = first or (where, of_row(rows[0]))
        if of_row(rows[-1]) != first[1]:
            raise ConfigError(f"{where} is {of_row(rows[-1])}, but {first[0]} is {first[1]}: a file holds rows of one "
                              "format")
    if not rows:
        raise ConfigError(f"dataset {file} is empty")
    return rows


def fingerprints(name: str | Data, cfg: DictConfig) -> list[dict]:
    """One fingerprint per source of a mixture, of what decides the rows it gives (`pipeline.keys`' rule): a local
    file's name and sha256 (not its folder: a moved checkout is the same data), a Hub source's id, config, split
    and the commit the run pinned its revision to (`keys.resolved`), or the sha256 of its `hub_mirror` copy; and
    how its rows are picked and
    normalised (`weight`, `columns`, `remove`, the mixture's `seed`).

    Local files (every row) and Hub sources read from `hub_mirror` (the rows the weight picks) are also
    checked here, so a malformed row stops the run before any training; Hub sources read from the Hub
    are checked when loaded.
    """
    out = []
    spec = load_spec(name)
    for i, src in enumerate(spec.sources):
        file = _local_file(src, cfg)
        if file is not None:
            _file_rows(file, src)
        if file is None:
            args = hub_source(src.hub, src.name, [src.split], cfg)
            mirror = {"mirror": _mirror_digest(args)} if args["path"] != src.hub else {}
            if mirror:
                _load_hub(src, i, spec.seed, cfg)
            revision = src.revision if mirror else keys.resolved(src.hub, src.revision, "dataset")  # the run's commit
            out.append({"hub": src.hub, "name": src.name, "split": src.split, "revision": revision, **mirror})
        elif src.generator:
            out.append({"generator": src.generator, "split": src.split, "sha256": keys.file_digest(file)})
        else:
            out.append({"file": file.name, "sha256": keys.file_digest(file)})
        out[-1].update(weight=src.weight, seed=spec.seed, **_rules(src))
    return out


def _mirror_digest(args: dict) -> str:
    """The contents of what a source reads of its `hub_mirror` copy (`hub_source`'s arguments): the files its
    `data_files` patterns pick, or, for a copy read through its card, the whole copy."""
    root = Path(args["path"])
    if "data_files" not in args:
        return keys.path_digest(root)
    picked = sorted({p for patterns in args["data_files"].values() for pattern in patterns for p in root.glob(pattern)
                     if p.is_file()})
    return keys.key({p.relative_to(root).as_posix(): keys.file_digest(p) for p in picked})


def head(name: str | Data, cfg: DictConfig, rows: int = HEAD_ROWS) -> list[tuple[str, dict]]:
    """The first `rows` rows of each source of a mixture, normalised, each with where it is from (`file:line`,
    `repo[split] row N`): what the preflight checks a stage's columns and chat template on. A Hub source is read
    as a stream (from `hub_mirror` when it has a copy); offline, from the datasets cache, and a source that is not
    there is refused (its stage could not load it either); a Hub that cannot be reached is logged and skipped."""
    out = []
    for src in load_spec(name).sources:
        file = _local_file(src, cfg)
        found = _read_rows(file, rows) if file is not None else _hub_head(src, cfg, rows)
        rules = _rules(src)
        out += [(where, normalise(row, where=where, **rules)) for where, row in found]
    return out


def _hub_head(src: DictConfig, cfg: DictConfig, rows: int) -> list[tuple[str, dict]]:
    """The first `rows` rows of a Hub split, each with its location (see `head`)."""
    import datasets
    import huggingface_hub

    args = hub_source(src.hub, src.name, [src.split], cfg)
    label = f"{src.hub}[{'/'.join(filter(None, (src.name, src.split)))}]"
    hub = args["path"] == src.hub  # not a local copy
    offline = hub and (huggingface_hub.is_offline_mode() or datasets.config.HF_HUB_OFFLINE)
    revision = {"revision": keys.resolved(src.hub, src.revision, "dataset")} if hub else {}
    try:
        if offline:  # what the stage would load: the datasets cache
            found = datasets.load_dataset(**args, split=src.split, **revision)
            found = list(found.select(range(min(rows, len(found)))))
        else:  # a stream has no slices (`train[:-500]`): the split's first rows
            stream = datasets.load_dataset(**args, split=src.split.split("[")[0], streaming=True, **revision)
            found = list(itertools.islice(stream, rows))
    except ConnectionError as err:
        if offline:
            raise ConfigError(f"hub dataset {label} is not in the local datasets cache and HF_HUB_OFFLINE / "
                              "HF_DATASETS_OFFLINE is set: set hub_mirror to a local copy, or go online") from None
        log.warning("could not reach the Hub to check the rows of %s (%s); they are checked when its stage loads "
                    "them", label, str(err).splitlines()[0] if str(err) else type(err).__name__)
        return []
    except (ValueError, FileNotFoundError) as err:  # no such dataset, config or split
        raise ConfigError(f"hub dataset {label} ({args['path']}): {str(err).splitlines()[0]}") from None
    except Exception as err:  # noqa: BLE001 - a dataset that does not stream: its stage loads it whole
        log.warning("could not read the first rows of %s to check them (%s: %s); they are checked when its stage "
                    "loads them", label, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return []
    return [(f"{label} row {i + 1}", row) for i, row in enumerate(found)]


def _csv_rows(path: Path, limit: int | None) -> list[tuple[str, dict]]:
    """Rows of a CSV file with a header line (cells are strings), each with its location (`file:line`)."""
    rows = []
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh)
        try:
            if reader.fieldnames is None:  # reads the header line; None: an empty file
                return []
            while limit is None or len(rows) < limit:
                line = reader.line_num + 1  # the line this row starts on
                row = next(reader, None)
                if row is None:
                    break
                rows.append((f"{path}:{line}", row))
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}:{reader.line_num + 1}: not UTF-8 text (byte {err.object[err.start]:#04x}); "
                              "save the file as UTF-8") from None
        except csv.Error as err:
            raise ConfigError(f"{path}:{reader.line_num}: malformed CSV ({err})") from None
    return rows


def _read_rows(path: Path, limit: int | None = None) -> list[tuple[str, dict]]:
    """Rows of a local file (the first `limit` ones, when given), each with its location (`file:line` for
    JSONL and CSV)."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _csv_rows(path, limit)
    if suffix == ".parquet":
        import datasets

        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
        ds = ds.select(range(min(limit, len(ds)))) if limit is not None else ds
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(ds)]
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                              "save it as UTF-8") from None
        except ValueError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, list):
            raise ConfigError(f"{path}: expected a JSON list of rows")
        return [(f"{path} row {i + 1}", row) for i, row in enumerate(data[:limit])]
    rows = []
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                  f"{err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{lineno}", json.loads(line)))
            except ValueError as err:
                raise ConfigError(f"{path}:{lineno}: malformed JSON line ({err.args[0]})") from None
    return rows


def _check_messages(messages: Any, where: str) -> list[dict]:
    """Known roles and string contents; an assistant turn may carry `tool_calls` instead of content (TRL's
    tool-calling format: then its content is ''), and keeps them, as a tool turn keeps its `name` and
    `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: messages must be a non-empty list of {{role, content}}")
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not (isinstance(m.get("content"), str) or calls and m.get("content") is None):
            raise ConfigError(f"{where}: each message needs a string 'content', got {m!r:.80}")
        if m.get("role") not in ROLES:
            raise ConfigError(f"{where}: unknown message role {m.get('role')!r} (allowed: {', '.join(ROLES)})")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list)
                                  or not all(isinstance(tool_name(c), str) for c in calls)):
            raise ConfigError(f"{where}: tool_calls belong to an assistant turn, a list of {{type: function, "
                              f"function: {{name, arguments}}}}; got {calls!r:.80} in a {m['role']} turn")
        out.append({"role": m["role"], "content": m.get("content") or "", **{k: m[k] for k in TOOL_KEYS if k in m}})
    return out


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words (a number, a string, ...), not Python's type name."""
    kinds = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "a list"), (dict, "an object"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "null" if value is None else "a value")


def _as_chat(value: Any, role: str, target: str, where: str) -> list[dict]:
    """A string as one `role` turn, a list as checked messages; anything else is refused."""
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: {target} is empty")
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return _check_messages(value, where)
    raise ConfigError(f"{where}: {target} must be a string or a list of {{role, content}} messages, "
                      f"got {json_kind(value)}")


def _check_answers(messages: list[dict], target: str, where: str) -> None:
    """A chat needs at least one assistant turn, and no empty one (a tool call is not empty)."""
    answers = [m for m in messages if m["role"] == "assistant"]
    if not answers:
        raise ConfigError(f"{where}: {target} has no assistant turn")
    if not all(m["content"].strip() or m.get("tool_calls") for m in answers):
        raise ConfigError(f"{where}: {target} has an empty assistant turn")


def _same(a: list[dict], b: list[dict]) -> bool:
    return [(m["role"], m["content"].strip()) for m in a] == [(m["role"], m["content"].strip()) for m in b]


def _split_prompt(prompt: list[dict], reply: list[dict], target: str, where: str) -> tuple[list[dict], list[dict]]:
    """(the prompt, the reply) of a reply that may be a whole conversation repeating the prompt (smoltalk2
    `Preference`: string prompt, chosen = [user, assistant]): its turns up to the prompt's last become the prompt."""
    if reply[0]["role"] == "assistant":
        return prompt, reply
    n = len(prompt)
    for end in range(n, len(reply)):
        if reply[end]["role"] == "assistant" and _same(reply[end - n:end], prompt):
            return reply[:end], reply[end:]
    raise ConfigError(f"{where}: {target} starts with a {reply[0]['role']} turn but does not repeat the prompt "
                      "before an assistant turn")


def _preference(out: dict, where: str) -> None:
    """Prompt, chosen and rejected, in any mix of strings and conversations, as conversations that TRL's DPO
    accepts: prompt = the messages before the answer, chosen / rejected = the answer turns only."""
    if "chosen" not in out or "rejected" not in out:
        raise ConfigError(f"{where}: a preference row needs both chosen and rejected")
    if "prompt" not in out:  # implicit prompt: the turns chosen and rejected share (TRL's own extraction)
        from trl.data_utils import extract_prompt

        out.update(extract_prompt(out))
    prompt = _as_chat(out["prompt"], "user", "prompt", where)
    lead_c, chosen = _split_prompt(prompt, _as_chat(out["chosen"], "assistant", "chosen", where), "chosen", where)
    lead_r, rejected = _split_prompt(prompt, _as_chat(out["rejected"], "assistant", "rejected", where), "rejected",
                                     where)
    if not (_same(lead_c, prompt) or _same(lead_r, prompt) or _same(lead_c, lead_r)):
        raise ConfigError(f"{where}: chosen and rejected repeat different prompts")
    _check_answers(chosen, "chosen", where)
    _check_answers(rejected, "rejected", where)
    if _same(chosen, rejected):
        raise ConfigError(f"{where}: preference row has chosen equal to rejected")
    out.update(prompt=max(lead_c, lead_r, key=len), chosen=chosen, rejected=rejected)


def _reply(out: dict, target: str, where: str) -> tuple[list[dict], list[dict]]:
    """(prompt, reply) of a row's prompt and its answer `target` (a completion), both as conversations."""
    if "prompt" not in out:
        raise ConfigError(f"{where}: a {target} needs its prompt (a prompt column)")
    prompt = _as_chat(out["prompt"], "user", "prompt", where)
    lead, reply = _split_prompt(prompt, _as_chat(out[target], "assistant", target, where), target, where)
    _check_answers(reply, target, where)
    return lead, reply


def _label(value: Any, where: str) -> bool:
    """An unpaired row's label: true (desirable) or false, as JSON, a number 1 / 0 or a CSV cell writes it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | str) and str(value).strip().lower() in LABELS:
        return LABELS[str(value).strip().lower()]
    raise ConfigError(f"{where}: label must be true (a desirable completion) or false, got {json_kind(value)}")


def _tools(value: Any, where: str) -> str | None:
    """A row's tool schemas as a JSON string (TRL's SFT reads either form; Arrow stores schemas of every shape
    as one): a list of objects, or its JSON text; the null fields Arrow adds to a struct are left out."""
    from trl.trainer.utils import remove_none_values

    if value is None:
        return None
    try:
        tools = json.loads(value) if isinstance(value, str) else value
    except ValueError as err:
        raise ConfigError(f"{where}: tools is text but not JSON ({err})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ConfigError(f"{where}: tools must be a list of JSON schemas (objects), got {json_kind(tools)}")
    return json.dumps(remove_none_values(tools))


def _removed(value: Any, remove: Sequence[str]) -> Any:
    """`value` with every match of the `remove` patterns deleted from its text (a string, or the contents of a
    conversation's messages)."""
    if isinstance(value, str):
        for pattern in remove:
            value = re.sub(pattern, "", value)
        return value
    if isinstance(value, list):
        return [{**m, "content": _removed(m["content"], remove)} if isinstance(m, dict) and "content" in m else m
                for m in value]
    return value


def normalise(row: dict, columns: dict, where: str, remove: Sequence[str] = ()) -> dict:
    """Map one source row into the target fields; raise `ConfigError` naming `where` if malformed.

    Chats are checked (known roles, string contents or tool calls, an assistant turn, none empty). A `prompt`
    always becomes a conversation (a string: one user turn), so PPO, GRPO and on-policy sampling get a chat; a
    prompt-completion row becomes `messages` (the completion's turns as assistant turns, so assistant-only loss
    is TRL's completion-only loss); with `label` (unpaired preference, KTO) the completion stays apart, as a
    conversation, and the label a boolean; with `chosen` / `rejected` every mix of string and conversational forms
    is brought to the conversational form TRL's DPO accepts (see `_preference`). `tools` is JSON text,
    `chat_template_kwargs` a dict (None: {}). Every match of a `remove` pattern is deleted from the mapped texts.
    """
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: row is not a JSON object")
    mapping = dict(columns) or {t: t for t in TARGETS if t in row}
    out = {}
    for target, column in mapping.items():
        if column not in row:
            raise ConfigError(f"{where}: row has no column '{column}' (mapped to '{target}'; "
                              f"row columns: {', '.join(map(str, row))})")
        out[target] = _removed(row[column], remove) if remove else row[column]
    if "user" in out or "assistant" in out:
        turns = [(r, out.pop(r)) for r in ("system", "user", "assistant") if r in out]
        out["messages"] = [{"role": r, "content": c} for r, c in turns]
    if "completion" in out and "label" not in out:  # prompt-completion: one conversation
        if "messages" in out:
            raise ConfigError(f"{where}: a row is conversational (messages) or prompt-completion, not both; map the "
                              "columns of one")
        lead, completion = _reply(out, "completion", where)
        del out["prompt"], out["completion"]
        out["messages"] = lead + completion
    if "messages" in out:
        out["messages"] = _check_messages(out["messages"], where)
        _check_answers(out["messages"], "chat row", where)
    if "label" in out:
        if "completion" not in out:
            raise ConfigError(f"{where}: a labelled row (unpaired preference) needs a prompt and a completion")
        out["prompt"], out["completion"] = _reply(out, "completion", where)
        out["label"] = _label(out["label"], where)
    elif "chosen" in out or "rejected" in out:
        _preference(out, where)
    elif "prompt" in out:
        out["prompt"] = _as_chat(out["prompt"], "user", "prompt", where)
    if "tools" in out:
        out["tools"] = _tools(out["tools"], where)
    if "chat_template_kwargs" in out:
        kwargs = out["chat_template_kwargs"] or {}
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{where}: chat_template_kwargs must be a mapping, got {json_kind(kwargs)}")
        out["chat_template_kwargs"] = kwargs
    if not out:
        raise ConfigError(f"{where}: no usable column (map one of {', '.join(TARGETS)})")
    return out


def _normalise_batch(batch: dict, indices: list[int], columns: dict, remove: list[str], label: str,
                     picked: list[int]) -> dict:
    """`normalise` over a batch of a Hub split; `picked` maps a position to the split's own row number."""
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    out = [normalise(row, columns, f"{label} row {picked[i] + 1}", remove)
           for row, i in zip(rows, indices, strict=True)]
    return {key: [r[key] for r in out] for key in out[0]}


def _pick(n: int, weight: float, seed: int) -> list[int]:
    """Row numbers a source contributes: a seeded shuffle, cut to the weighted count or cycled past it."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(n).tolist()
    count = round(n * weight) if weight <= 1 else int(weight)
    return order[:count] if count <= n else [order[i % n] for i in range(count)]


def hub_source(repo: str, name: str, splits: list[str], cfg: DictConfig) -> dict:
    """`datasets.load_dataset` arguments (path, name, data_files) for a Hub dataset: the Hub itself, or the
    copy of the repository under `hub_mirror` (`<hub_mirror>/<owner>/<repo>`) when there is one. A copy with
    the repository's card (README.md, as `huggingface-cli download` leaves it) is read like the Hub (configs,
    splits, types from the card); one without reads `<config>/<split>.<ext>` (or `<config>/<split>-*`)."""
    root = Path(cfg.hub_mirror).resolve() / repo if cfg.hub_mirror else None
    if root is None or not root.is_dir():
        return {"path": repo, "name": name or None}
    if (root / "README.md").is_file():
        return {"path": str(root), "name": name or None}
    folder = f"{name}/" if name else ""
    return {"path": str(root), "name": None,
            "data_files": {s: [f"{folder}{s}.*", f"{folder}{s}-*"] for s in (split.split("[")[0] for split in splits)}}


def _load_hub(src: DictConfig, i: int, seed: int, cfg: DictConfig) -> Any:
    """A Hub split, weighted first (only the picked rows are normalised), normalised in batches."""
    import datasets

    args = hub_source(src.hub, src.name, [src.split], cfg)
    label = f"{src.hub}[{'/'.join(filter(None, (src.name, src.split)))}]"
    revision = {"revision": keys.resolved(src.hub, src.revision, "dataset")} if args["path"] == src.hub else {}
    try:
        raw = datasets.load_dataset(**args, split=src.split, **revision)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"hub dataset {label} ({args['path']}): {err}") from None
    picked = _pick(len(raw), src.weight, seed + i)
    return raw.select(picked).map(
        _normalise_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
        fn_kwargs={**_rules(src), "label": label, "picked": picked})


def load_mixture(name: str | Data, cfg: DictConfig, render: Callable[[dict], str] | None = None):
    """Load, normalise, weight and shuffle a mixture (or a stage's `data`) into one `datasets.Dataset`.

    With `render` (a chat template), chat rows become `text` so chat and plain sources can mix.
    """
    import datasets

    spec = load_spec(name)
    parts = []
    for i, src in enumerate(spec.sources):
        file = _local_file(src, cfg)
        if file is None:
            ds = _load_hub(src, i, spec.seed, cfg)
        else:
            rows = _file_rows(file, src)
            keys = list(dict.fromkeys(k for row in rows for k in row))  # a key some rows leave out is None there
            ds = datasets.Dataset.from_list([{k: row.get(k) for k in keys} for row in rows],
                                            on_mixed_types="use_json")  # tool calls of every shape, kept as given
            ds = ds.select(_pick(len(ds), src.weight, spec.seed + i))
        if not len(ds):  # a small weight of a small source
            log.warning("%s source %d: weight %g picks no row", source_name(name), i, src.weight)
            continue
        if render is not None and "messages" in ds.column_names:
            ds = ds.map(lambda r: {"text": render(r)}, remove_columns=ds.column_names)
        parts.append(ds)
    if not parts:
        raise ConfigError(f"{source_name(name)}: its weights pick no row")
    names = [sorted(p.column_names) for p in parts]
    if any(n != names[0] for n in names):
        raise ConfigError(f"{source_name(name)}: sources give different columns {names}")
    try:
        return datasets.concatenate_datasets(parts).shuffle(seed=spec.seed)
    except ValueError as err:  # columns of one name, other types (a source with tool calls, one without)
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{source_name(name)}: its sources' columns differ in type ({reason})") from None
