"""The run's headline: which model is final, and did each stage help, for sure?

Built from a run folder alone: a title (run, recipe, date, code version, final model), one row per scored
checkpoint (validation score, test score, the paired test difference to the stage's input with its 95%
interval and p, the gate's verdict, the training time), one sentence per stage, and each sweep's candidates
in a table of their own. The leaderboard writes it as Markdown and HTML and the run prints it at its end.

The validation metric is the one the gates judge (else the first on a validation split); the test metric is
the same metric and filter on a task whose split is `test`.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.evaluation import stats
from pipeline.files import read_json
from pipeline.runfolder import BASE, StageRecord, candidates, eval_dir, input_stage, stage_folders

COLUMNS = ("checkpoint", "validation", "test", "\u0394 test [95% CI]", "p", "gate", "train time")
SWEEP_COLUMNS = ("candidate", "beta", "learning rate", "selection half", "\u0394 vs input on it [95% CI]", "p")


def _splits(records: list[StageRecord]) -> dict[str, str]:
    return {task: split for r in records for task, split in ((r.eval or {}).get("splits") or {}).items()}


def metrics(records: list[StageRecord]) -> tuple[str | None, str | None]:
    """(validation metric, test metric) of a run's records: the gated metric (else the first one scored on a
    validation split) and the same metric and filter on a test split; None where there is none."""
    split = _splits(records)
    scored = list(dict.fromkeys(k for r in records for k in r.scores()))
    on = {k: split.get(k.partition("/")[0]) for k in scored}
    gated = [r.gate["metric"] for r in records if r.gate and on.get(r.gate["metric"]) == "validation"]
    validation = gated[-1] if gated else next((k for k in scored if on[k] == "validation"), None)
    name = (validation or next((k for k in scored if on[k] == "test"), "")).partition("/")[2]
    test = next((k for k in scored if on[k] == "test" and k.partition("/")[2] == name), None)
    return validation, test


def stage_rows(run: Path) -> list[dict]:
    """One typed row per scored checkpoint of the run folder `run`, in chain order."""
    folders = [(d, StageRecord.read(d)) for d in stage_folders(run)]
    validation, test = metrics([r for _, r in folders])
    out = []
    for folder, record in folders:
        if not record.eval:
            continue
        row = {"checkpoint": folder.name, "stage": record.stage, "selected": record.selected,
               "model": record.output_model, "validation": record.scores().get(validation),
               "test": record.scores().get(test), "gate": (record.gate or {}).get("verdict"),
               "train_s": record.wall_time_s}
        source = input_stage(folder) if folder.name != BASE else None
        if test and source is not None:
            row["vs_input"] = stats.paired_difference(eval_dir(source), eval_dir(folder), test)
        out.append(row)
    return out


def sweep_rows(stage: Path) -> list[dict]:
    """The candidates of the sweep stage folder `stage`: settings, selection-half score, paired difference to
    the input on that half, and whether it was selected."""
    record, cands = StageRecord.read(stage), candidates(stage)
    out = []
    for c in (record.metrics or {}).get("candidates", []):
        config = (cands[c["candidate"]].config if c["candidate"] in cands else None) or {}
        out.append({"candidate": c["candidate"], "beta": config.get("beta"),
                    "learning_rate": config.get("learning_rate"),
                    "selection_half": c.get("selection_half"), "vs_input": c.get("vs_input"),
                    "selected": c["candidate"] == record.selected})
    return out


def _code(run: Path) -> str:
    code = (read_json(Path(run) / "manifest.json") or {}).get("code") or {}
    commit = (code.get("git_commit") or "unknown")[:7]
    return commit + (" (uncommitted changes)" if code.get("git_dirty") else "")


def title(run: Path, rows: list[dict]) -> str:
    """`demo: recipe demo, 2026-12-04, code d60ef77, final model runs/demo/stages/03-dpo/model`."""
    manifest = read_json(Path(run) / "manifest.json") or {}
    final = next((r["model"] for r in reversed(rows) if r["checkpoint"] != BASE and r["model"]), None)
    return (f"{Path(run).name}: recipe {manifest.get('recipe', '?')}, {(manifest.get('created') or '?')[:10]}, "
            f"code {_code(run)}, final model {final or '(none trained)'}")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _interval(p: dict | None) -> str:
    return f"{p['diff']:+.3f} [{p['ci_low']:+.3f}, {p['ci_high']:+.3f}]" if p else ""


def _p(p: dict | None) -> str:
    return "" if not p else f"{p['p_value']:.2g}" if p["p_value"] >= 1e-4 else "<1e-4"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def cells(row: dict) -> list[str]:
    """A stage row as the text of the `COLUMNS`."""
    name = row["checkpoint"] + (f" ({row['selected']})" if row.get("selected") else "")
    return [name, _num(row["validation"]), _num(row["test"]), _interval(row.get("vs_input")), _p(row.get("vs_input")),
            row.get("gate") or "", _duration(row.get("train_s"))]


def sentence(row: dict) -> str | None:
    """`dpo: -0.006 on test [-0.016, +0.004], p 0.26: no significant change`; None without a paired test."""
    p = row.get("vs_input")
    if not p:
        return None
    verdict = ("a significant gain" if p["ci_low"] > 0 else "a significant drop" if p["ci_high"] < 0
               else "no significant change")
    return f"{row['stage']}: {p['diff']:+.3f} on test [{p['ci_low']:+.3f}, {p['ci_high']:+.3f}], " \
           f"p {_p(p)}, n={p['n']}: {verdict}"


def sweep_cells(row: dict) -> list[str]:
    """A sweep candidate row as the text of the `SWEEP_COLUMNS`."""
    lr = row.get("learning_rate")
    return [row["candidate"] + (" (selected)" if row["selected"] else ""),
            "" if row.get("beta") is None else f"{row['beta']:g}", "" if lr is None else f"{lr:g}",
            _num(row.get("selection_half")), _interval(row.get("vs_input")), _p(row.get("vs_input"))]


def _table(head: tuple[str, ...], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in body)]


def markdown(run: Path) -> str:
    """The run's headline as Markdown: title, stage table, sentences, sweep tables ("" when nothing is scored)."""
    rows = stage_rows(run)
    if not rows:
        return ""
    validation, test = metrics([StageRecord.read(d) for d in stage_folders(run)])
    lines = [f"## {title(run, rows)}", "", f"validation: `{validation}`; test: `{test}`; \u0394 test: paired "
             "difference to the stage's input on the same test problems.", "",
             *_table(COLUMNS, [cells(r) for r in rows]), ""]
    lines += [f"- {s}" for s in map(sentence, rows) if s]
    for stage in stage_folders(run):
        sweep = sweep_rows(stage)
        if sweep:
            lines += ["", f"### {stage.name}: sweep (selected on the selection half of validation; the gate judges "
                      "the other half)", "", *_table(SWEEP_COLUMNS, [sweep_cells(r) for r in sweep])]
    return "\n".join(lines) + "\n"
