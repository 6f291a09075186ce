"""Hub-style model cards: `<stage>/model/README.md` for every stage's checkpoint (the last is the final model).

Built from the run's config and its stage records: the base model, the chain
of stages up to this one with their data and key hyperparameters, the eval table with stderr, the
gate verdicts, and the selection record of sweep stages (each candidate's paired difference to the
stage's input). The YAML header carries `model-index` metadata (huggingface_hub's ModelCardData).
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from omegaconf import DictConfig

from pipeline import extension
from pipeline.files import write_text
from pipeline.runfolder import BASE, StageRecord, candidates, stage_folders

KEYS = ("learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
        "beta", "loss_type")


def _num(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


def _hyper(config: dict) -> str:
    parts = [f"{k}={_num(config[k])}" for k in KEYS if config.get(k) not in (None, -1)]
    if (config.get("lora") or {}).get("r"):
        parts.append(f"lora_r={config['lora']['r']}")
    return ", ".join(parts)


def _data(record: StageRecord) -> str:
    mixture = (record.config or {}).get("mixture")
    sources = ", ".join(str(d.get("path") or d.get("split") or d.get("name") or "?") for d in record.data or [])
    return f"{_num(mixture) or '-'} ({sources})" if sources else _num(mixture) or "-"


def _chain(records: list[tuple[str, StageRecord]]) -> list[str]:
    lines = ["| stage | data mixture (sources) | key hyperparameters | steps | loss first -> last | gate |",
             "|---|---|---|---|---|---|"]
    for name, r in records:
        m, gate = r.metrics or {}, r.gate
        loss = f"{_num(m.get('loss_first'))} -> {_num(m.get('loss_last'))}" if m.get("loss_first") else ""
        verdict = f"{gate['verdict']}: {gate['reason']}" if gate else ""
        lines.append(f"| {name} | {_data(r)} | {_hyper(r.config or {})} | {_num(m.get('steps'))} | {loss} | "
                     f"{verdict.replace('|', '/')} |")
    return lines


def _evals(records: list[tuple[str, StageRecord]]) -> list[str]:
    metrics = sorted({k for _, r in records for k in r.scores()})
    lines = ["| checkpoint | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for name, r in records:
        ev = r.eval or {}
        cells = [f"{ev['metrics'][k]:.4f} +- {ev.get('stderr', {}).get(k, float('nan')):.4f}"
                 if k in ev.get("metrics", {}) else "" for k in metrics]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _selection(name: str, record: StageRecord) -> list[str]:
    m = record.metrics or {}
    if not m.get("candidates"):
        return []
    metric = m.get("selected_by") or "metric"
    lines = [f"### {name}: selected `{m['selected']}` by `{metric}`", "", f"Rule: {m.get('tie_rule', '')}.", "",
             f"| candidate | {metric} | difference to the input (paired SE) | 95% CI | p |", "|---|---|---|---|---|"]
    for c in m["candidates"]:
        p = c.get("vs_input")
        paired = (f"{p['diff']:+.4f} +- {p['se']:.4f} | [{p['ci_low']:+.4f}, {p['ci_high']:+.4f}] | "
                  f"{p['p_value']:.3g}") if p else " | | "
        mark = " (selected)" if c["candidate"] == m["selected"] else ""
        lines.append(f"| {c['candidate']}{mark} | {_num(c.get(metric))} | {paired} |")
    return [*lines, ""]


def _records(run_dir: Path, stage_dir: Path) -> list[tuple[str, StageRecord]]:
    """(folder name, record) of the base and every stage up to `stage_dir`; a sweep stage's record carries its
    selected candidate's training config (the settings the selected model was trained with)."""
    out = []
    for folder in (p for p in stage_folders(run_dir) if p.name <= Path(stage_dir).name):
        record = StageRecord.read(folder)
        chosen = candidates(folder).get(record.selected) if record.selected else None
        if chosen is not None and chosen.config is not None:
            record.config = chosen.config
        out.append((folder.name, record))
    return out


def card(cfg: DictConfig, run_dir: Path, stage_dir: Path) -> ModelCard:
    """The model card of `stage_dir`'s checkpoint: the chain of the run `cfg` (in `run_dir`) up to (and including)
    that stage."""
    records = _records(run_dir, stage_dir)
    trained = [(n, r) for n, r in records if n != BASE]
    base = cfg.model.name_or_path
    built = bool(cfg.get("extension")) and base == getattr(extension.load(cfg.extension), "SECTION", None)
    own, splits = records[-1][1].scores(), (records[-1][1].eval or {}).get("splits") or {}
    results = []
    for key, value in own.items():
        task, _, metric = key.partition("/")
        results.append(EvalResult(task_type="text-generation", dataset_type=task, dataset_name=task,
                                  dataset_split=splits.get(task, "test"), metric_type=metric.split(",")[0],
                                  metric_name=metric, metric_value=value))
    data = ModelCardData(model_name=f"{cfg.run_name}/{Path(stage_dir).name}", library_name="transformers",
                         base_model=None if built or Path(base).exists() else base,
                         tags=["smol-pipeline", *(r.stage or "" for _, r in trained)],
                         eval_results=results or None)
    body = [f"# {cfg.run_name} / {Path(stage_dir).name}", "",
            f"Trained by smol-pipeline (recipe `{cfg.recipe}`, seed {cfg.seed}) from base model `{base}`"
            + (f" (built by the recipe's extension `{cfg.extension}`)" if built else "") + ".", "",
            "## Stages", "", *_chain(trained), "",
            "## Evaluation (+- is lm-eval's stderr; each task's split is in the metadata)", "", *_evals(records), ""]
    selections = [line for n, r in trained for line in _selection(n, r)]
    if selections:
        body += ["## Selection", "", *selections]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def write(cfg: DictConfig, run_dir: Path, stage_dir: Path) -> Path | None:
    """Write `stage_dir/model/README.md` for the run `cfg` in `run_dir`; None when the stage has no checkpoint
    folder."""
    model = Path(stage_dir) / "model"
    if not model.is_dir():
        return None
    write_text(model / "README.md", card(cfg, run_dir, stage_dir).content)  # atomic: sweep array tasks may race
    return model / "README.md"
