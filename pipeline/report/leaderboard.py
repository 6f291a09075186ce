"""Leaderboard export: one row per evaluated checkpoint, rebuilt from run folders alone.

    python -m pipeline.report.leaderboard RUN_DIR [RUN_DIR ...] --out DIR

writes `leaderboard.{csv,json,md,html}` to DIR; several runs combine into one table. The
orchestrator calls the same code after every stage. The HTML is self-contained (inline styles,
matplotlib charts as inline SVG; no network) and fits 1280 px without sideways scrolling: each run's
headline (`pipeline.report.headline`: title, a table of at most 8 columns, one sentence per stage, the
sweep's own table), the gate metric per stage with 95% error bars, a beta x learning-rate heatmap per
sweep (soup, merge and the selected candidate marked), and every column of every checkpoint and candidate
in a collapsible details table. The CSV and JSON rows are flat and typed: numbers as numbers, a paired
difference as `<what>_diff`, `_ci_low`, `_ci_high`, `_p`, `_n` (and `_gained`, `_lost` for a 0/1 metric); a value
not known is left out.
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
from pathlib import Path

from pipeline import faults
from pipeline.files import write_json, write_text
from pipeline.report import charts, headline
from pipeline.runfolder import RunPaths, StageRecord, candidates, leaderboard_file, stage_folders
from pipeline.settings import SCHEDULE, kinds, reported

STEP_TIMES = ("forward_s", "backward_s", "optimizer_s", "data_wait_s", "eval_s", "save_s")  # telemetry's breakdown
PAIRED = ("diff", "ci_low", "ci_high", "p_value", "n", "gained", "lost")  # of stats.paired_difference


def _paired(prefix: str, paired: dict | None) -> dict:
    """`paired` (a `stats.paired_difference`) as flat columns `<prefix>_diff`, ..., `<prefix>_n`."""
    return {f"{prefix}_{k.removesuffix('_value')}": paired[k] for k in PAIRED if k in (paired or {})}


def _hyper(config: dict, record: StageRecord) -> dict:
    """The settings a row shows (`settings.reported`), a list (DPO's losses) joined with `+`."""
    shown = reported(config, record.kind)
    return {k: "+".join(map(str, v)) if isinstance(v, list) else v for k, v in shown.items()}


def _gate(gate: dict | None) -> dict:
    if not gate:
        return {}
    return {"gate": gate["verdict"], "gate_test": gate.get("test"), "gate_metric": gate["metric"],
            "gate_value": gate["value"], **_paired("gate", gate.get("paired"))}


def _row(run: Path, record: StageRecord, checkpoint: str, candidate: str | None, config: dict | None = None,
         extra: dict | None = None) -> dict:
    """One flat, typed row: numbers as numbers, no prose, no sentinels; a key without a value is left out."""
    metrics, ev = record.metrics or {}, record.eval
    row = {"run": run.name, "checkpoint": checkpoint, "kind": "candidate" if record.candidate else "stage",
           "stage": record.stage, "candidate": candidate, **_hyper(config or record.config or {}, record)}
    for name, value in ev["metrics"].items():
        row[name] = value
        if name in ev.get("stderr", {}):
            row[f"{name} stderr"] = ev["stderr"][name]
    row.update(prompt_format=ev.get("prompt_format"), **_gate(record.gate), **(extra or {}))
    row.update({k: metrics.get(k) for k in ("tokens", "tokens_per_s", "mfu", "padding_fraction")})
    row.update(train_wall_time_s=record.wall_time_s, eval_wall_time_s=ev.get("wall_time_s"))
    row.update({key: metrics[key] for key in STEP_TIMES if metrics.get(key)})
    return {k: v for k, v in row.items() if v not in (None, "")}


def rows(heads: list[headline.Headline]) -> list[dict]:
    """Leaderboard rows of every evaluated checkpoint (stages, then their sweep candidates) of each run (its
    headline `heads` carries the stages' paired test differences)."""
    out = []
    for h in heads:
        run, tested = h.run, {r["checkpoint"]: r for r in h.rows}
        for stage_dir in stage_folders(run):
            record, cands = StageRecord.read(stage_dir), candidates(stage_dir)
            if record.eval:
                selected = record.selected  # a sweep: show the winner's settings
                config = cands[selected].config if selected in cands else None
                head = tested.get(stage_dir.name, {})  # `test_vs`: the earlier checkpoint when not the input
                out.append(_row(run, record, stage_dir.name, selected, config,
                                {**_paired("test_vs_input", head.get("vs_input")), "test_vs": head.get("vs")}))
            table = {c["candidate"]: c for c in (record.metrics or {}).get("candidates", [])}
            for name, c in cands.items():
                picked = table.get(name, {})
                extra = {"selection_half": picked.get("selection_half"),
                         **_paired("selection_vs_input", picked.get("vs_input"))}
                if c.eval:
                    out.append(_row(run, c, stage_dir.name, name, extra=extra))
    return out


def splits(heads: list[headline.Headline]) -> dict[str, str]:
    """`{task: split}` of every task scored in the runs of `heads`."""
    return {task: split for h in heads for task, split in h.splits.items()}


def columns(table: list[dict]) -> list[str]:
    """All column names: identity, hyperparameters, metrics (each with its stderr), then the rest."""
    seen: dict[str, None] = {}
    for row in table:
        seen.update(dict.fromkeys(row))
    own = dict.fromkeys(k for kind in kinds().values() for k in kind.report_keys)
    head = ["run", "checkpoint", "kind", "stage", "candidate", *SCHEDULE, *own, "lora_r"]
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


def headers(table: list[dict], split: dict[str, str]) -> dict[str, str]:
    """Column name -> header: a metric's says which split (`split`: task -> split) its number comes from, e.g.
    `gsm8k_local_val/exact_match,strict-match [validation]`."""
    return {c: f"{c} [{split[c.split('/')[0]]}]" if "/" in c and c.split("/")[0] in split else c
            for c in columns(table)}


def metric_names(table: list[dict]) -> list[str]:
    """The metric columns (`task/metric,filter`), without their stderr."""
    return [c for c in columns(table) if "/" in c and not c.endswith(" stderr")]


STYLE = ("body{font-family:sans-serif;margin:1.5em;max-width:1200px}table{border-collapse:collapse;font-size:13px}"
         "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f3f4f6}"
         "td.n{text-align:right;white-space:nowrap}tr.fail td{background:#fee2e2}tr.warn td{background:#fef3c7}"
         ".scroll{overflow-x:auto}.scroll td,.scroll th{white-space:nowrap}.chart svg{max-width:100%;height:auto}"
         "h2{font-size:16px}h3{font-size:14px}")


def _label(table: list[dict]):
    several = len({r["run"] for r in table}) > 1
    return lambda r: f"{r['run']}/{r['checkpoint']}" if several else r["checkpoint"]


def _html_table(head: tuple[str, ...], body: list[list[str]], marks: list[str]) -> str:
    """A table whose first column is a name and the others right-aligned figures; `marks`: each row's class."""
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    tr = "".join(f"<tr{mark}>" + "".join(f"<td{' class=n' if j else ''}>{html.escape(c)}</td>" for j, c in
                                          enumerate(row)) + "</tr>" for row, mark in zip(body, marks, strict=True))
    return f"<table><thead><tr>{th}</tr></thead><tbody>{tr}</tbody></table>"


def _headline_html(h: headline.Headline) -> str:
    """One run's headline as HTML: title, stage table, sentences, sweep tables."""
    if not h.rows:
        return ""
    marks = [f' class="{r["gate"]}"' if r.get("gate") in ("fail", "warn") else "" for r in h.rows]
    out = [f"<h2>{html.escape(headline.title(h))}</h2>",
           f"<p>validation: <code>{html.escape(str(h.validation))}</code>; test: <code>{html.escape(str(h.test))}"
           "</code>; \u0394 test: paired difference to the stage's input on the same test problems.</p>",
           _html_table(headline.COLUMNS, [headline.cells(r) for r in h.rows], marks),
           "<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in headline.sentences(h)) + "</ul>"]
    for stage, sweep in h.sweeps.items():
        out += [f"<h3>{html.escape(stage)}: sweep (selected on the selection half of validation; the gate judges the "
                "other half)</h3>",
                _html_table(*headline.sweep_table(sweep), [""] * len(sweep))]
    return "".join(out)


def _details(table: list[dict], split: dict[str, str]) -> str:
    cols, names = columns(table), headers(table, split)
    head = "".join(f"<th>{html.escape(names[c])}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                   for r in table)
    return ('<details id="details"><summary>Every checkpoint and sweep candidate: hyperparameters, metrics with '
            f'stderr, paired differences, throughput</summary><div class="scroll"><table><thead><tr>{head}</tr>'
            f"</thead><tbody>{body}</tbody></table></div></details>")


def _sweeps(run_dirs: list[Path]) -> list[tuple[str, StageRecord, dict[str, StageRecord]]]:
    """(folder name, record, candidates' records) of every sweep stage (one candidate selected), in run order."""
    records = [(d, StageRecord.read(d)) for run in map(Path, run_dirs) for d in stage_folders(run)]
    return [(d.name, r, candidates(d)) for d, r in records if r.selected]


def to_html(table: list[dict], heads: list[headline.Headline]) -> str:
    """The self-contained page: each run's headline, charts (inline SVG), the details table."""
    stages = [r for r in table if r["kind"] == "stage"]
    metrics, label = metric_names(table), _label(table)
    gated = [m for m in metrics if any(r.get("gate_metric") == m for r in table)] or metrics
    svgs = [charts.metric_per_stage(stages, m, label) for m in gated]
    svgs += [charts.sweep_heatmap(*sweep) for sweep in _sweeps([h.run for h in heads])]
    return (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>Leaderboard</title><style>{STYLE}</style>'
            f'</head><body><h1>Leaderboard</h1><div id="leaderboard">{"".join(map(_headline_html, heads))}</div>'
            f"<div id=\"charts\">{''.join(f'<div class=chart>{c}</div>' for c in svgs)}</div>"
            f"{_details(table, splits(heads))}</body></html>\n")


def to_markdown(heads: list[headline.Headline]) -> str:
    """The runs' headlines as Markdown."""
    return "# Leaderboard\n\n" + "\n".join(filter(None, map(headline.markdown, heads)))


def export(run_dirs: list[Path], out: Path) -> list[dict]:
    """Rebuild the leaderboard of `run_dirs` and write it in every format into `out`; return the rows."""
    heads = [headline.build(run) for run in run_dirs]  # read each run folder once, for every format
    table = rows(heads)
    write_text(leaderboard_file(out, "csv"), to_csv(table))
    faults.point("leaderboard")
    write_json(leaderboard_file(out, "json"), {"columns": columns(table), "splits": splits(heads), "rows": table,
                                                "headline": {h.run.name: h.rows for h in heads}})
    write_text(leaderboard_file(out, "md"), to_markdown(heads))
    write_text(leaderboard_file(out, "html"), to_html(table, heads))
    return table


def main(argv: list[str] | None = None) -> int:
    """Command line: rebuild (and combine) leaderboards from run folders."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.report.leaderboard", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (<output_root>/<run_name>)")
    parser.add_argument("--out", type=Path, required=True, help="folder for leaderboard.{csv,json,md,html}")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not RunPaths(r).stages.is_dir()]
    if missing:
        parser.error(f"not a run folder (no stages/): {', '.join(missing)}")
    table = export(args.runs, args.out)
    print(json.dumps({"rows": len(table), "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
