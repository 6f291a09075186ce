"""The run's headline: which model is final, and did each stage help, for sure?

Built from a run folder alone: a title (run, recipe, date, code version, final model), one row per scored
checkpoint (validation score, test score, the paired test difference to the stage's input with its 95%
interval and p, the gate's verdict, the training time), one sentence per stage, and each sweep's candidates
in a table of their own. The leaderboard writes it as Markdown and HTML and the run prints it at its end.

The validation metric is the one the gates judge (else the first on a validation split); the test metric is
the same metric and filter on a task whose split is `test`, except after a gate on a continuous metric (bits per
byte): then the first 0/1 metric scored on test (the accuracy the report is about), when there is one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.evaluation import stats
from pipeline.evaluation.power import binary, measure
from pipeline.rl import diagnostics
from pipeline.runfolder import BASE, RunPaths, StageRecord, candidates, eval_dir, input_stage, recall, stage_folders

COLUMNS = ("checkpoint", "validation", "test", "test strict / flexible / answers stopped",
           "\u0394 test [95% CI], p (test, problems gained / lost, n)",
           "gate (the smallest change it detects, in its metric)", "train time")
SWEEP_COLUMNS = ("selection half", "\u0394 vs input on it [95% CI], p",  # after the candidate and its settings
                 "told apart from the selected on it?")


@dataclass
class Headline:
    """One run's headline, read once from its folder (`build`) and written by every report."""

    run: Path
    manifest: dict  # manifest.json: recipe, date, code version
    splits: dict[str, str]  # task -> split, from the eval records
    validation: str | None  # the validation metric
    test: str | None  # the test metric
    rows: list[dict]  # one per scored checkpoint (`stage_row`)
    sweeps: dict[str, list[dict]]  # sweep stage folder name -> its candidates (`sweep_rows`)


def metrics(records: list[StageRecord], split: dict[str, str]) -> tuple[str | None, str | None]:
    """(validation metric, test metric) of a run's records (`split`: task -> split): the gated metric (else the
    first one scored on a validation split) and the same metric and filter on a test split (a 0/1 one, when there
    is one, for a continuous gated metric); None where there is none."""
    scored = list(dict.fromkeys(k for r in records for k in r.scores()))
    on = {k: split.get(k.partition("/")[0]) for k in scored}
    gated = [r.gate["metric"] for r in records if r.gate and on.get(r.gate["metric"]) == "validation"]
    validation = gated[-1] if gated else next((k for k in scored if on[k] == "validation"), None)
    name = (validation or next((k for k in scored if on[k] == "test"), "")).partition("/")[2]
    tests = [k for k in scored if on[k] == "test"]
    test = next((k for k in tests if k.partition("/")[2] == name), None)
    if validation and not binary(validation):
        test = next((k for k in tests if binary(k)), test)
    return validation, test


def stage_row(folder: Path, record: StageRecord, validation: str | None, test: str | None) -> dict:
    """The typed row of a scored stage folder: its scores, the paired test difference to its input stage (else to
    the last stage before it scored on test, named in `vs`), gate verdict and training time."""
    row = {"checkpoint": folder.name, "stage": record.stage, "selected": record.selected,
           "model": record.output_model, "validation": record.scores().get(validation),
           "test": record.scores().get(test), "gate": (record.gate or {}).get("verdict"),
           "gate_metric": (record.gate or {}).get("metric"), "sight": (record.gate or {}).get("sight"),
           "train_s": record.wall_time_s,
           "formats": formats(record.scores(), test), "diagnostics": (record.metrics or {}).get("diagnostics")}
    source = earlier = input_stage(folder) if folder.name != BASE and row["test"] is not None else None
    while earlier is not None and test not in StageRecord.read(earlier).scores():
        earlier = input_stage(earlier) if earlier.name != BASE else None  # its input was not scored on test
    if earlier is not None:
        row["vs_input"] = stats.paired_difference(eval_dir(earlier), eval_dir(folder), test)
        if earlier != source and row["vs_input"]:
            row["vs"] = earlier.name
    return row


def sweep_rows(stage: Path, record: StageRecord) -> list[dict]:
    """The candidates of the sweep stage folder `stage` (its `record`): settings, selection-half score, paired
    differences to the input and to the selected candidate on that half, and whether it was selected; empty for
    other stages."""
    cands = candidates(stage)
    out = []
    for c in (record.metrics or {}).get("candidates", []):
        config = (cands[c["candidate"]].config if c["candidate"] in cands else None) or {}
        swept = sorted((record.config or {}).get("sweep") or {})
        out.append({"candidate": c["candidate"], "settings": {k: config.get(k) for k in swept},
                    "selection_half": c.get("selection_half"), "vs_input": c.get("vs_input"),
                    "vs_selected": c.get("vs_selected"), "selected": c["candidate"] == record.selected,
                    "picked": (record.metrics or {}).get("picked")})
    return out


def build(run: Path) -> Headline:
    """The headline of the run folder `run`."""
    run = Path(run)
    folders = [(d, StageRecord.read(d)) for d in stage_folders(run)]
    records = [r for _, r in folders]
    split = {task: s for r in records for task, s in ((r.eval or {}).get("splits") or {}).items()}
    validation, test = metrics(records, split)
    return Headline(run, recall(RunPaths(run).manifest, json.loads) or {}, split, validation, test,
                    [stage_row(d, r, validation, test) for d, r in folders if r.eval],
                    {d.name: rows for d, r in folders if (rows := sweep_rows(d, r))})


def title(h: Headline) -> str:
    """`demo: recipe demo, 2026-12-04, code d60ef77, final model runs/demo/stages/03-dpo/model` (code: the git commit,
    else the installed package's version)."""
    code = h.manifest.get("code") or {}
    version = code["git_commit"][:7] if code.get("git_commit") else f"smol-pipeline {code.get('version') or '?'}"
    commit = version + (" (uncommitted changes)" if code.get("git_dirty") else "")
    final = next((r["model"] for r in reversed(h.rows) if r["checkpoint"] != BASE and r["model"]), None)
    return (f"{h.run.name}: recipe {h.manifest.get('recipe', '?')}, {(h.manifest.get('created') or '?')[:10]}, "
            f"code {commit}, final model {final or '(none trained)'}")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _change(p: dict | None) -> str:
    return stats.describe(p) if p else ""


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def formats(scores: dict, metric: str | None) -> dict:
    """Format against reasoning on `metric`'s task: its strict and flexible exact match and the share of answers
    that stopped within the token budget (`lmeval.mark_stops`), those it scored."""
    task = (metric or "").partition("/")[0]
    names = {"strict": "exact_match,strict-match", "flexible": "exact_match,flexible-extract"}
    out = {k: scores[f"{task}/{v}"] for k, v in names.items() if f"{task}/{v}" in scores}
    stopped = [v for k, v in scores.items() if k.startswith(f"{task}/stopped,")]
    return {**out, "stopped": stopped[0]} if stopped else out


def _formats(row: dict) -> str:
    f = row.get("formats") or {}
    if not f:
        return ""
    stopped = f"{f['stopped']:.0%}" if "stopped" in f else "?"
    return f"{_num(f.get('strict')) or '?'} / {_num(f.get('flexible')) or '?'} / {stopped}"


def _gate(row: dict) -> str:
    """The gate's verdict and the smallest change it detects in its metric, on the problems it judged: `pass (sees
    \u00b10.033 exact_match)`, `warn (sees \u00b10.041 exact_match, gate half; blind)`."""
    sight = row.get("sight")
    if not row.get("gate") or not sight or "detectable" not in sight:
        return row.get("gate") or ""
    seen = f"sees \u00b1{sight['detectable']:.3f}" if sight["detectable"] != float("inf") else "sees nothing"
    where = measure(row["gate_metric"]) + (f", {sight['half']} half" if sight.get("half") else "")
    return f"{row['gate']} ({seen} {where}{'; blind' if sight.get('blind') else ''})"


def cells(row: dict) -> list[str]:
    """A stage row as the text of the `COLUMNS`."""
    name = row["checkpoint"] + (f" ({row['selected']})" if row.get("selected") else "")
    versus = f" vs {row['vs']}" if row.get("vs") else ""
    return [name, _num(row["validation"]), _num(row["test"]), _formats(row), _change(row.get("vs_input")) + versus,
            _gate(row), _duration(row.get("train_s"))]


def sentence(row: dict) -> str | None:
    """`dpo on test: -0.006 [-0.016, +0.004], p=0.26 (Tango score, +4 / -12, n=1319): no significant change`;
    None without a paired test."""
    p = row.get("vs_input")
    if not p:
        return None
    verdict = ("not testable" if p["p_value"] is None else "a significant gain" if p["ci_low"] > 0 else
               "a significant drop" if p["ci_high"] < 0 else "no significant change")
    versus = f" vs {row['vs']}" if row.get("vs") else ""
    return f"{row['stage']} on test{versus}: {stats.describe(p)}: {verdict}"


def sentences(h: Headline) -> list[str]:
    """The headline's sentences: each stage's change on test, then why each preference or RL stage moved as it did
    (`pipeline.rl.diagnostics`)."""
    return [*filter(None, map(sentence, h.rows)),
            *(f"why {s}" for r in h.rows if (s := diagnostics.sentence(r["stage"], r.get("diagnostics") or {})))]


def sweep_table(rows: list[dict]) -> tuple[tuple[str, ...], list[list[str]]]:
    """A sweep's candidate rows as a table: the candidate, its swept settings, then the `SWEEP_COLUMNS`."""
    keys = list(rows[0]["settings"]) if rows else []
    def text(value: object) -> str:
        return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
    body = [[r["candidate"] + (" (selected)" if r["selected"] else ""), *(text(r["settings"].get(k)) for k in keys),
             _num(r.get("selection_half")), _change(r.get("vs_input")), told_apart(r.get("vs_selected"))] for r in rows]
    return ("candidate", *(k.replace("_", " ") for k in keys), *SWEEP_COLUMNS), body


def told_apart(p: dict | None) -> str:
    """Whether a candidate differs from the selected one on the selection half: `no (p=0.61)`."""
    if not p:
        return ""
    if p["p_value"] is None:
        return "no (not testable)"
    return f"{'yes' if stats.significant(p) else 'no'} (p={p['p_value']:.2g})"


def _table(head: tuple[str, ...], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in body)]


def markdown(h: Headline) -> str:
    """The headline as Markdown: title, stage table, sentences, sweep tables ("" when nothing is scored)."""
    if not h.rows:
        return ""
    named = "; ".join(f"{split}: `{metric}`" for split, metric in (("validation", h.validation), ("test", h.test))
                      if metric)
    lines = [f"## {title(h)}", "", f"{named}; \u0394 test: paired difference to the stage's input on the same test "
             "problems (to the last checkpoint before it scored on test when its input was not).", "",
             *_table(COLUMNS, [cells(r) for r in h.rows]), ""]
    lines += [f"- {s}" for s in sentences(h)]
    lines += [f"- the gate of {r['stage']} cannot see what it judges: {r['sight']['blind']}; it "
              f"{r['sight']['text']}" for r in h.rows if (r.get("sight") or {}).get("blind")]
    for stage, sweep in h.sweeps.items():
        picked = next((r["picked"] for r in sweep if r.get("picked")), "selected")
        lines += ["", f"### {stage}: sweep ({picked}, on the selection half of validation; the gate judges the other "
                  "half)", "", *_table(*sweep_table(sweep))]
    return "\n".join(lines) + "\n"
