"""Hub-style model cards: `<stage>/model/README.md` for every stage's checkpoint, and the cards `report/hub.py`
pushes (the final model's, each stage's and sweep candidate's).

Built from the run's config and its stage records: the chain of stages up to this model with their data, the
settings each model was really trained with (a sweep's selected candidate's) and each stage's gain over its input
with its 95% interval, the eval table with stderr, the selection record of sweep stages, a usage snippet (the Hub
repository and revision when the run pushes, else the model's path in the run folder) and the framework versions.
The YAML header is huggingface_hub's ModelCardData: `base_model` (the Hub base model) with `base_model_relation`
(finetune; merge for a soup or merge; adapter for a PEFT adapter), `datasets` (the Hub sources of the mixtures;
local files are named in the stages table only), `model-index` (each metric on the dataset its lm-eval task reads:
the Hub id, config and split), `library_name`, `pipeline_tag`, tags (trl, smol-pipeline, the stage kinds), and
`license` / `language` from the base model's own card when it is at hand (a local folder or the Hub cache).
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache
from omegaconf import DictConfig

from pipeline import extension
from pipeline.evaluation import stats
from pipeline.files import write_text
from pipeline.report import headline
from pipeline.runfolder import BASE, StageRecord, model_dir, stage_folders, stage_label, stored_path
from pipeline.settings import reported

FRAMEWORKS = ("transformers", "trl", "torch", "datasets", "accelerate", "peft", "lm_eval")
MERGES = ("soup", "merge")  # the sweep candidates that average models rather than train one


def _num(value) -> str:
    if isinstance(value, list):
        return ", ".join(map(_num, value))
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


def _hyper(config: dict, record: StageRecord) -> str:
    shown = reported(config, record.kind)
    return ", ".join(f"{k}={_num(v)}" for k, v in shown.items())


def _data(record: StageRecord) -> str:
    mixture = (record.config or {}).get("mixture") or (record.config or {}).get("data")
    sources = ", ".join(str(d.get("hub") or d.get("file") or d.get("split") or "?") for d in record.data or [])
    return f"{_num(mixture) or '-'} ({sources})" if sources else _num(mixture) or "-"


def _gain(gate: dict | None) -> str:
    """The stage's change over its input on the gate metric, as `stats.describe` writes it."""
    p = (gate or {}).get("paired")
    return stats.describe(p) if p else ""


def _chain(records: list[tuple[str, StageRecord]]) -> list[str]:
    lines = ["| stage | data mixture (sources) | trained with | steps | loss first -> last | gain on the gate metric "
             "(95% CI, paired) | gate |", "|---|---|---|---|---|---|---|"]
    for name, r in records:
        m, gate = r.metrics or {}, r.gate
        loss = f"{_num(m.get('loss_first'))} -> {_num(m.get('loss_last'))}" if m.get("loss_first") else ""
        verdict = f"{gate['verdict']}: {gate['reason']}" if gate else ""
        hyper = _hyper(m.get("trained_with") or r.config or {}, r)  # a sweep: its selected model's settings
        lines.append(f"| {name} | {_data(r)} | {hyper} | {_num(m.get('steps'))} | {loss} | "
                     f"{_gain(gate)} | {verdict.replace('|', '/')} |")
    return lines


def _evals(records: list[tuple[str, StageRecord]]) -> list[str]:
    metrics = sorted({k for _, r in records for k in r.scores()})
    lines = ["| checkpoint | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for name, r in records:
        ev = r.eval or {}
        stderr = ev.get("stderr", {})
        cells = [f"{ev['metrics'][k]:.4f}" + (f" +- {stderr[k]:.4f}" if k in stderr else "")
                 if k in ev.get("metrics", {}) else "" for k in metrics]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _selection(name: str, record: StageRecord) -> list[str]:
    m = record.metrics or {}
    if not m.get("candidates"):
        return []
    metric = m.get("selected_by") or "metric"
    rule, half = m.get("tie_rule", ""), m.get("selection_problems")
    if half:
        rule += f", on the selection half ({half} problems; the gate judges the other)"
    lines = [f"### {name}: selected `{m['selected']}` by `{metric}`", "", f"Rule: {rule}.", "",
             f"| candidate | {metric} | selection half | difference to the input on it [95% CI], p | told apart from "
             "the selected on it? |", "|---|---|---|---|---|"]
    for c in m["candidates"]:
        p = c.get("vs_input")
        paired = stats.describe(p, digits=4) if p else ""
        mark = " (selected)" if c["candidate"] == m["selected"] else ""
        lines.append(f"| {c['candidate']}{mark} | {_num(c.get(metric))} | {_num(c.get('selection_half'))} | {paired} | "
                     f"{headline.told_apart(c.get('vs_selected'))} |")
    return [*lines, ""]


def _records(run_dir: Path, folder: Path, label: str) -> list[tuple[str, StageRecord]]:
    """(label, record) of the base, every stage before the one of `folder`, and `folder` (a stage or a candidate)."""
    stage = label.partition("/")[0]
    earlier = [(p.name, StageRecord.read(p)) for p in stage_folders(run_dir) if p.name < stage]
    return [*earlier, (label, StageRecord.read(folder))]


def _is_hub_id(name: str) -> bool:
    return not Path(name).exists() and name.count("/") == 1


def _base_card(base: str) -> ModelCardData | None:
    """The base model's own card data, when its README is at hand (a local folder or the Hub cache)."""
    local = Path(base) / "README.md"
    cached = try_to_load_from_cache(base, "README.md") if _is_hub_id(base) else None
    path = local if local.is_file() else Path(cached) if isinstance(cached, str) else None
    return ModelCard.load(path).data if path else None


def revision(label: str) -> str:
    """The Hub branch the model of a stage or sweep candidate (`stage_label`: `02-dpo`, `02-dpo/beta0.1-lr1e-05`)
    is pushed to: `02-dpo`, `02-dpo-beta0.1-lr1e-05`, with what a branch name cannot hold replaced by `_`."""
    return re.sub(r"[^\w.-]+|\.{2,}", "_", label.replace("/", "-")).strip("._")


def _hub_dataset(task: dict, cfg: DictConfig) -> str | None:
    """The Hub id of the dataset an lm-eval task config reads (`dataset_path`, or the repository of which it reads
    the `hub_mirror` copy); None for local files."""
    path, mirror = str(task.get("dataset_path") or ""), Path(cfg.hub_mirror).resolve() if cfg.hub_mirror else None
    if mirror and Path(path).is_absolute() and Path(path).is_relative_to(mirror):
        return Path(path).relative_to(mirror).as_posix()
    return path if _is_hub_id(path) else None


def _results(record: StageRecord, cfg: DictConfig) -> list[EvalResult]:
    """The record's scores as the Hub's `model-index` reads them: per metric, the dataset its task reads (the Hub
    id, or the task's name for local data), the task's config and split, and lm-eval's metric."""
    ev = record.eval or {}
    configs, splits, out = ev.get("task_configs") or {}, ev.get("splits") or {}, []
    for key, value in record.scores().items():
        task, _, metric = key.partition("/")
        hub = _hub_dataset(configs.get(task) or {}, cfg)
        out.append(EvalResult(task_type="text-generation", dataset_type=hub or task, dataset_name=task,
                              dataset_config=(configs.get(task) or {}).get("dataset_name") if hub else None,
                              dataset_split=splits.get(task, "test"), metric_type=metric.split(",")[0],
                              metric_name=metric, metric_value=value))
    return out


def _versions() -> list[str]:
    out = []
    for name in FRAMEWORKS:
        try:
            out.append(f"- {name}: {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return out


def _usage(cfg: DictConfig, run_dir: Path, folder: Path, branch: str | None) -> list[str]:
    """Loading the model: from the Hub repository (at `branch` unless None: main) when the run pushes, else from
    its path in the run folder."""
    if cfg.push_to_hub:
        model = f'"{cfg.push_to_hub}"' + (f', revision="{branch}"' if branch else "") + ")"
    else:
        model = f'"{stored_path(model_dir(folder), run_dir)}")  # its path in the run folder'
    return ["```python", "from transformers import pipeline", "", f'chat = pipeline("text-generation", model={model}',
            'messages = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many does he have?"}]',
            'print(chat(messages, max_new_tokens=256)[0]["generated_text"][-1]["content"])', "```"]


def _published(cfg: DictConfig, branch: str | None) -> list[str]:
    """Where this model is on the Hub (when the run pushes)."""
    if not cfg.push_to_hub:
        return []
    where = f"revision `{branch}` of `{cfg.push_to_hub}`, whose main branch" if branch else (
        f"the main branch of `{cfg.push_to_hub}`: it")
    return [f"This is {where} holds the run's final model; each stage's model is the revision named after the stage "
            "(`revision=` of `from_pretrained`).", ""]


def card(cfg: DictConfig, run_dir: Path, folder: Path, main: bool = False) -> ModelCard:
    """The model card of the checkpoint of `folder` (a stage's or a sweep candidate's) in the run `cfg` (in
    `run_dir`): the chain up to it; `main`: as the repository's main branch shows the final model."""
    label = stage_label(Path(folder).resolve(), Path(run_dir).resolve())
    records = _records(run_dir, folder, label)
    trained, record = [(n, r) for n, r in records if n != BASE], records[-1][1]
    base = cfg.model.name_or_path
    built = bool(cfg.get("extension")) and base == getattr(extension.load(cfg.extension), "SECTION", None)
    hub_base = base if not built and _is_hub_id(base) else None
    adapter = (model_dir(folder) / "adapter_config.json").is_file()  # a PEFT adapter (stages save merged models)
    relation = "adapter" if adapter else "merge" if record.candidate in MERGES or record.selected in MERGES else (
        "finetune")
    hub_data = sorted({d["hub"] for _, r in trained for d in r.data or [] if d.get("hub")})
    known = _base_card(base) if not built else None
    results, branch = _results(record, cfg), None if main else revision(label)
    data = ModelCardData(model_name=f"{cfg.run_name}/{label}", library_name="peft" if adapter else "transformers",
                         pipeline_tag="text-generation", base_model=hub_base,
                         base_model_relation=relation if hub_base else None,
                         datasets=hub_data or None, license=getattr(known, "license", None),
                         language=getattr(known, "language", None),
                         tags=["smol-pipeline", "trl", *dict.fromkeys(r.stage or "" for _, r in trained)],
                         eval_results=results or None)
    body = [f"# {cfg.run_name} / {label}", "",
            f"Trained by smol-pipeline (recipe `{cfg.recipe}`, seed {cfg.seed}) from base model `{base}`"
            + (f" (built by the recipe's extension `{cfg.extension}`)" if built else "") + ".", "",
            *_published(cfg, branch),
            "## Usage", "", *_usage(cfg, run_dir, folder, branch), "",
            "## Stages", "", *_chain(trained), "",
            "## Evaluation (+- is lm-eval's stderr; each task's dataset and split are in the metadata)", "",
            *_evals(records), ""]
    selections = [line for n, r in trained for line in _selection(n, r)]
    if selections:
        body += ["## Selection", "", *selections]
    body += ["## Framework versions", "", *_versions(), ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def write(cfg: DictConfig, run_dir: Path, stage_dir: Path) -> Path | None:
    """Write `stage_dir/model/README.md` for the run `cfg` in `run_dir`; None when the stage has no checkpoint
    folder."""
    model = model_dir(stage_dir)
    if not model.is_dir():
        return None
    write_text(model / "README.md", card(cfg, run_dir, stage_dir).content)  # atomic: sweep array tasks may race
    return model / "README.md"
