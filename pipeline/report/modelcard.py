"""Hub-style model cards: `<stage>/model/README.md` for every stage's checkpoint (the last is the final model).

Built from the run's config and its stage records: the lineage (the Hub base model, or the input stage's
Hub repo when the run pushes), the chain of stages up to this one with their data, the settings each
model was really trained with (a sweep's selected candidate's) and each stage's gain over its input with
its 95% interval, the eval table with stderr and each task's split, the selection record of sweep stages,
a usage snippet and the framework versions. The YAML header carries huggingface_hub's ModelCardData:
`model-index`, `base_model`, `datasets` (the Hub sources of the mixtures), `pipeline_tag`, tags, and
`license` / `language` taken from the base model's own card when it is at hand (a local folder or the
Hub cache).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache
from omegaconf import DictConfig

from pipeline import extension
from pipeline.files import write_text
from pipeline.runfolder import BASE, StageRecord, model_dir, stage_folders

FRAMEWORKS = ("transformers", "trl", "torch", "datasets", "accelerate", "peft", "lm_eval")
KEYS = ("learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
        "beta", "loss_type")


def _num(value) -> str:
    if isinstance(value, list):
        return ", ".join(map(_num, value))
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)


def _hyper(config: dict) -> str:
    parts = [f"{k}={_num(config[k])}" for k in KEYS if config.get(k) not in (None, -1)]
    if (config.get("lora") or {}).get("r"):
        parts.append(f"lora_r={config['lora']['r']}")
    return ", ".join(parts)


def _data(record: StageRecord) -> str:
    mixture = (record.config or {}).get("mixture") or (record.config or {}).get("data")
    sources = ", ".join(str(d.get("hub") or d.get("path") or d.get("split") or "?") for d in record.data or [])
    return f"{_num(mixture) or '-'} ({sources})" if sources else _num(mixture) or "-"


def _gain(gate: dict | None) -> str:
    """The stage's change over its input on the gate metric: `+0.030 [+0.006, +0.054], p=0.012`."""
    p = (gate or {}).get("paired")
    return f"{p['diff']:+.3f} [{p['ci_low']:+.3f}, {p['ci_high']:+.3f}], p={p['p_value']:.2g}" if p else ""


def _chain(records: list[tuple[str, StageRecord]]) -> list[str]:
    lines = ["| stage | data mixture (sources) | trained with | steps | loss first -> last | gain on the gate metric "
             "(95% CI, paired) | gate |", "|---|---|---|---|---|---|---|"]
    for name, r in records:
        m, gate = r.metrics or {}, r.gate
        loss = f"{_num(m.get('loss_first'))} -> {_num(m.get('loss_last'))}" if m.get("loss_first") else ""
        verdict = f"{gate['verdict']}: {gate['reason']}" if gate else ""
        hyper = _hyper(m.get("trained_with") or r.config or {})  # a sweep: its selected model's settings
        lines.append(f"| {name} | {_data(r)} | {hyper} | {_num(m.get('steps'))} | {loss} | "
                     f"{_gain(gate)} | {verdict.replace('|', '/')} |")
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
    rule, half = m.get("tie_rule", ""), m.get("selection_problems")
    if half:
        rule += f", on the selection half ({half} problems; the gate judges the other)"
    lines = [f"### {name}: selected `{m['selected']}` by `{metric}`", "", f"Rule: {rule}.", "",
             f"| candidate | {metric} | selection half | difference to the input on it (paired SE) | 95% CI | p |",
             "|---|---|---|---|---|---|"]
    for c in m["candidates"]:
        p = c.get("vs_input")
        paired = (f"{p['diff']:+.4f} +- {p['se']:.4f} | [{p['ci_low']:+.4f}, {p['ci_high']:+.4f}] | "
                  f"{p['p_value']:.3g}") if p else " | | "
        mark = " (selected)" if c["candidate"] == m["selected"] else ""
        lines.append(f"| {c['candidate']}{mark} | {_num(c.get(metric))} | {_num(c.get('selection_half'))} | {paired} |")
    return [*lines, ""]


def _records(run_dir: Path, stage_dir: Path) -> list[tuple[str, StageRecord]]:
    """(folder name, record) of the base and every stage up to `stage_dir`."""
    return [(p.name, StageRecord.read(p)) for p in stage_folders(run_dir) if p.name <= Path(stage_dir).name]


def _is_hub_id(name: str) -> bool:
    return not Path(name).exists() and name.count("/") == 1


def _base_card(base: str) -> ModelCardData | None:
    """The base model's own card data, when its README is at hand (a local folder or the Hub cache)."""
    local = Path(base) / "README.md"
    cached = try_to_load_from_cache(base, "README.md") if _is_hub_id(base) else None
    path = local if local.is_file() else Path(cached) if isinstance(cached, str) else None
    return ModelCard.load(path).data if path else None


def _repo(cfg: DictConfig, stage: str) -> str | None:
    """The Hub repo a stage's checkpoint is pushed to (`tracking`'s naming), or None when the run does not push."""
    return f"{cfg.hub_model_id}-{stage}" if cfg.push_to_hub and cfg.hub_model_id else None


def _lineage(cfg: DictConfig, trained: list[tuple[str, StageRecord]], built: bool) -> str | None:
    """`base_model`: the input stage's Hub repo when the run pushes, else the Hub base model (None: not on the Hub)."""
    if len(trained) > 1 and _repo(cfg, trained[-2][0]):
        return _repo(cfg, trained[-2][0])
    base = cfg.model.name_or_path
    return base if not built and _is_hub_id(base) else None


def _versions() -> list[str]:
    out = []
    for name in FRAMEWORKS:
        try:
            out.append(f"- {name}: {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return out


def _usage(model: str) -> list[str]:
    return ["```python", "from transformers import pipeline", "",
            f'chat = pipeline("text-generation", model="{model}")',
            'messages = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many does he have?"}]',
            'print(chat(messages, max_new_tokens=256)[0]["generated_text"][-1]["content"])', "```"]


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
    hub_data = sorted({d["hub"] for _, r in trained for d in r.data or [] if d.get("hub")})
    known = _base_card(base) if not built else None
    name = Path(stage_dir).name
    data = ModelCardData(model_name=f"{cfg.run_name}/{name}", library_name="transformers",
                         pipeline_tag="text-generation", base_model=_lineage(cfg, trained, built),
                         datasets=hub_data or None, license=getattr(known, "license", None),
                         language=getattr(known, "language", None),
                         tags=["smol-pipeline", "trl", *dict.fromkeys(r.stage or "" for _, r in trained)],
                         eval_results=results or None)
    model = _repo(cfg, name) or str(model_dir(Path(stage_dir).resolve()))
    body = [f"# {cfg.run_name} / {name}", "",
            f"Trained by smol-pipeline (recipe `{cfg.recipe}`, seed {cfg.seed}) from base model `{base}`"
            + (f" (built by the recipe's extension `{cfg.extension}`)" if built else "") + ".", "",
            "## Usage", "", *_usage(model), "",
            "## Stages", "", *_chain(trained), "",
            "## Evaluation (+- is lm-eval's stderr; each task's split is in the metadata)", "", *_evals(records), ""]
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
