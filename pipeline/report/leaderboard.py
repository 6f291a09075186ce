"""Leaderboard export: one row per evaluated checkpoint, rebuilt from run folders alone.

    python -m pipeline.report.leaderboard RUN_DIR [RUN_DIR ...] --out DIR

writes `leaderboard.{csv,json,md,html}` to DIR; several runs combine into one table. The
orchestrator calls the same code after every stage. The HTML is self-contained (inline styles,
matplotlib charts as inline SVG; no network) and fits 1280 px without sideways scrolling: a headline
table (one row per stage: metrics with stderr, gate verdict), the gate metric per stage with 95%
error bars, a beta x learning-rate heatmap per sweep (soup, merge and the selected candidate
marked), and every column of every checkpoint and candidate in a collapsible details table.
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
from pathlib import Path

from pipeline.evaluation import stats
from pipeline.files import write_json, write_text
from pipeline.report import charts
from pipeline.runfolder import StageRecord, candidates, stage_folders

STEP_TIMES = ("forward_s", "backward_s", "optimizer_s", "data_wait_s", "eval_s", "save_s")  # telemetry's breakdown
HYPER = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
         "gradient_accumulation_steps", "beta", "loss_type")


def _row(run: Path, record: StageRecord, checkpoint: str, candidate: str, config: dict | None = None,
         paired: dict | None = None) -> dict:
    config, metrics, ev = config or record.config or {}, record.metrics or {}, record.eval
    row = {"run": run.name, "checkpoint": checkpoint, "stage": record.stage or "", "candidate": candidate}
    row.update({k: config[k] for k in HYPER if k in config})
    if config.get("lora", {}).get("r"):
        row["lora_r"] = config["lora"]["r"]
    for name, value in ev["metrics"].items():
        row[name] = value
        if name in ev.get("stderr", {}):
            row[f"{name} stderr"] = ev["stderr"][name]
    row["splits"] = ", ".join(f"{task}: {split}" for task, split in (ev.get("splits") or {}).items())
    row["prompt_format"] = ev.get("prompt_format", "")  # base and stages may be scored on different formats
    gate = record.gate
    row["gate"] = f"{gate['verdict']}: {gate['reason']}" if gate else ""
    row["gate_metric"] = gate["metric"] if gate else ""
    if paired:
        row["vs input (paired)"] = stats.describe(paired)
    row.update(tokens=metrics.get("tokens"), tokens_per_s=metrics.get("tokens_per_s"), mfu=metrics.get("mfu"),
               padding_fraction=metrics.get("padding_fraction"),
               train_wall_time_s=record.wall_time_s, eval_wall_time_s=ev.get("wall_time_s"))
    row.update({key: metrics[key] for key in STEP_TIMES if metrics.get(key) is not None})
    return row


def rows(run_dirs: list[Path]) -> list[dict]:
    """Leaderboard rows of every evaluated checkpoint (stages, then their sweep candidates) of each run."""
    out = []
    for run in map(Path, run_dirs):
        for stage_dir in stage_folders(run):
            record, cands = StageRecord.read(stage_dir), candidates(stage_dir)
            if record.eval:
                selected = record.selected  # a sweep: show the winner's settings
                config = cands[selected].config if selected in cands else None
                out.append(_row(run, record, stage_dir.name, f"selected: {selected}" if selected else "", config))
            vs = {c["candidate"]: c.get("vs_input") for c in (record.metrics or {}).get("candidates", [])}
            out += [_row(run, c, stage_dir.name, name, paired=vs.get(name)) for name, c in cands.items() if c.eval]
    return out


def columns(table: list[dict]) -> list[str]:
    """All column names: identity, hyperparameters, metrics (each with its stderr), then the rest."""
    seen: dict[str, None] = {}
    for row in table:
        seen.update(dict.fromkeys(row))
    head = ["run", "checkpoint", "stage", "candidate", *HYPER, "lora_r"]
    metrics = [c for c in seen if "/" in c]
    return [c for c in head if c in seen] + metrics + [c for c in seen if c not in head and c not in metrics]


def _fmt(value) -> str:
    if value is None:
        return ""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def to_csv(table: list[dict]) -> str:
    """The table as CSV (header + one line per row)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(table), lineterminator="\n")
    writer.writeheader()
    writer.writerows(table)
    return buf.getvalue()


def headers(table: list[dict]) -> dict[str, str]:
    """Column name -> header: a metric's says which split its number comes from, e.g.
    `gsm8k_local_val/exact_match,strict-match [validation]` (from the rows' `splits`)."""
    split = dict(part.split(": ", 1) for r in table for part in filter(None, (r.get("splits") or "").split(", ")))
    return {c: f"{c} [{split[c.split('/')[0]]}]" if "/" in c and c.split("/")[0] in split else c
            for c in columns(table)}


def to_markdown(table: list[dict]) -> str:
    """The table as a Markdown pipe table (metric headers name their split)."""
    cols, names = columns(table), headers(table)
    lines = ["| " + " | ".join(names[c] for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in cols) + " |" for r in table]
    return "\n".join(lines) + "\n"


def metric_names(table: list[dict]) -> list[str]:
    """The metric columns (`task/metric,filter`), without their stderr."""
    return [c for c in columns(table) if "/" in c and not c.endswith(" stderr")]


STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:1200px}table{border-collapse:collapse;font-size:13px}"
         "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f3f4f6}"
         "#leaderboard{width:100%}#leaderboard td,#leaderboard th{overflow-wrap:anywhere}tr.fail td{background:#fee2e2}"
         "#leaderboard :is(td,th):nth-child(-n+2){white-space:nowrap;overflow-wrap:normal}"
         ".scroll{overflow-x:auto}.scroll td,.scroll th{white-space:nowrap}.chart svg{max-width:100%;height:auto}"
         ".reason{color:#555;font-size:12px}")


def _label(table: list[dict]):
    several = len({r["run"] for r in table}) > 1
    return lambda r: f"{r['run']}/{r['checkpoint']}" if several else r["checkpoint"]


def _fail(row: dict) -> str:
    return ' class="fail"' if str(row.get("gate", "")).startswith(("fail", "warn")) else ""


def _with_stderr(row: dict, metric: str) -> str:
    value, err = row.get(metric), row.get(f"{metric} stderr")
    if not isinstance(value, (int, float)):
        return ""
    return f"{value:.3f}" + (f" \u00b1 {err:.3f}" if isinstance(err, (int, float)) else "")


def _verdict(row: dict) -> str:
    verdict, _, reason = str(row.get("gate") or "").partition(": ")
    return f"<b>{html.escape(verdict)}</b> <span class=reason>{html.escape(reason)}</span>" if verdict else ""


def _headline(stages: list[dict], metrics: list[str], label) -> str:
    names = headers(stages)
    head = "".join(f"<th>{html.escape(names.get(c, c))}</th>" for c in ["checkpoint", "selected", *metrics, "gate"])
    body = "".join(f"<tr{_fail(r)}><td>{html.escape(label(r))}</td>"
                   f"<td>{html.escape(r['candidate'].removeprefix('selected: '))}</td>"
                   + "".join(f"<td>{_with_stderr(r, m)}</td>" for m in metrics)
                   + f"<td>{_verdict(r)}</td></tr>" for r in stages)
    return f'<table id="leaderboard"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _details(table: list[dict]) -> str:
    cols = columns(table)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(f"<tr{_fail(r)}>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                   for r in table)
    return ('<details id="details"><summary>Every checkpoint and sweep candidate: hyperparameters, paired '
            f'differences, throughput</summary><div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div></details>")


def _sweeps(run_dirs: list[Path]) -> list[tuple[str, StageRecord, dict[str, StageRecord]]]:
    """(folder name, record, candidates' records) of every sweep stage (one candidate selected), in run order."""
    records = [(d, StageRecord.read(d)) for run in map(Path, run_dirs) for d in stage_folders(run)]
    return [(d.name, r, candidates(d)) for d, r in records if r.selected]


def to_html(table: list[dict], run_dirs: list[Path]) -> str:
    """The self-contained page: headline table, charts (inline SVG), details table."""
    stages = [r for r in table if not r["candidate"] or r["candidate"].startswith("selected")]
    metrics, label = metric_names(table), _label(table)
    gated = [m for m in metrics if any(r.get("gate_metric") == m for r in table)] or metrics
    svgs = [charts.metric_per_stage(stages, m, label) for m in gated]
    svgs += [charts.sweep_heatmap(*sweep) for sweep in _sweeps(run_dirs)]
    runs = ", ".join(sorted({r["run"] for r in table}))
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>Leaderboard</title><style>{STYLE}</style>'
            f"</head><body><h1>Leaderboard</h1><p>Run {html.escape(runs)}: one row per stage; \u00b1 is lm-eval's "
            f"standard error.</p>{_headline(stages, metrics, label)}"
            f"<div id=\"charts\">{''.join(f'<div class=chart>{c}</div>' for c in svgs)}</div>"
            f"{_details(table)}</body></html>\n")


def export(run_dirs: list[Path], out: Path) -> list[dict]:
    """Rebuild the leaderboard of `run_dirs` and write it in every format into `out`; return the rows."""
    table = rows(run_dirs)
    out = Path(out)
    write_text(out / "leaderboard.csv", to_csv(table))
    write_json(out / "leaderboard.json", {"columns": columns(table), "rows": table})
    write_text(out / "leaderboard.md", to_markdown(table))
    write_text(out / "leaderboard.html", to_html(table, run_dirs))
    return table


def main(argv: list[str] | None = None) -> int:
    """Command line: rebuild (and combine) leaderboards from run folders."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.report.leaderboard", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (<output_root>/<run_name>)")
    parser.add_argument("--out", type=Path, required=True, help="folder for leaderboard.{csv,json,md,html}")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "stages").is_dir()]
    if missing:
        parser.error(f"not a run folder (no stages/): {', '.join(missing)}")
    table = export(args.runs, args.out)
    print(json.dumps({"rows": len(table), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
