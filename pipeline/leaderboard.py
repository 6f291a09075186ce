"""Leaderboard export: one row per evaluated checkpoint, rebuilt from run folders alone.

    python -m pipeline.leaderboard RUN_DIR [RUN_DIR ...] --out DIR

writes `leaderboard.{csv,json,md,html}` to DIR; several runs combine into one table. The
orchestrator calls the same code after every stage. The HTML is self-contained (inline styles and
an inline SVG plot of each metric across checkpoints; no network).
"""

from __future__ import annotations

import argparse
import csv
import html
import io
import json
from pathlib import Path

from pipeline.files import read_json, write_json, write_text

HYPER = ("learning_rate", "num_train_epochs", "max_steps", "per_device_train_batch_size",
         "gradient_accumulation_steps", "beta", "loss_type")
FORMATS = ("csv", "json", "md", "html")


def _row(run: Path, record: dict, checkpoint: str, candidate: str, config: dict | None = None) -> dict:
    config, metrics, ev = config or record.get("config") or {}, record.get("metrics") or {}, record["eval"]
    row = {"run": run.name, "checkpoint": checkpoint, "stage": record.get("stage", ""), "candidate": candidate}
    row.update({k: config[k] for k in HYPER if k in config})
    if config.get("lora", {}).get("r"):
        row["lora_r"] = config["lora"]["r"]
    for name, value in ev["metrics"].items():
        row[name] = value
        if name in ev.get("stderr", {}):
            row[f"{name} stderr"] = ev["stderr"][name]
    row["prompt_format"] = ev.get("prompt_format", "")  # base and stages may be scored on different formats
    gate = record.get("gate")
    row["gate"] = f"{gate['verdict']}: {gate['reason']}" if gate else ""
    row.update(tokens=metrics.get("tokens"), tokens_per_s=metrics.get("tokens_per_s"), mfu=metrics.get("mfu"),
               padding_fraction=metrics.get("padding_fraction"),
               train_wall_time_s=record.get("wall_time_s"), eval_wall_time_s=ev.get("wall_time_s"))
    return row


def rows(run_dirs: list[Path]) -> list[dict]:
    """Leaderboard rows of every evaluated checkpoint (stages, then their sweep candidates) of each run."""
    out = []
    for run in map(Path, run_dirs):
        for stage_dir in sorted((run / "stages").glob("*")):
            record = read_json(stage_dir / "stage.json")
            cands = {c.name: read_json(c / "stage.json") for c in sorted((stage_dir / "candidates").glob("*"))}
            if record and record.get("eval"):
                selected = (record.get("metrics") or {}).get("selected")  # a sweep: show the winner's settings
                config = (cands.get(selected) or {}).get("config") if selected else None
                out.append(_row(run, record, stage_dir.name, f"selected: {selected}" if selected else "", config))
            out += [_row(run, c, stage_dir.name, name) for name, c in cands.items() if c and c.get("eval")]
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


def to_markdown(table: list[dict]) -> str:
    """The table as a Markdown pipe table."""
    cols = columns(table)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in cols) + " |" for r in table]
    return "\n".join(lines) + "\n"


def metric_names(table: list[dict]) -> list[str]:
    """The metric columns (`task/metric,filter`), without their stderr."""
    return [c for c in columns(table) if "/" in c and not c.endswith(" stderr")]


def _plot(table: list[dict], metric: str, width: int = 520, height: int = 220) -> str:
    pad = 40
    points = [(i, r[metric]) for i, r in enumerate(table) if isinstance(r.get(metric), (int, float))]
    top = max([v for _, v in points] + [1e-9]) * 1.1
    n = max(len(table) - 1, 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return pad + i * (width - 2 * pad) / n, height - pad - v / top * (height - 2 * pad)

    parts = [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{html.escape(metric)}">',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>',
             f'<text x="{pad}" y="16" font-size="12">{html.escape(metric)}</text>',
             f'<text x="2" y="{pad + 4}" font-size="10">{top:.3g}</text>']
    runs = {r["run"] for r in table}
    for run in sorted(runs):
        coords = [xy(i, v) for i, v in points if table[i]["run"] == run]
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
        parts.append(f'<polyline fill="none" stroke="#2563eb" stroke-width="2" points="{path}"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="#2563eb"/>' for x, y in coords]
    for i, row in enumerate(table):
        x, _ = xy(i, 0)
        label = row["checkpoint"] + (f"/{row['candidate']}" if row["candidate"] else "")
        parts.append(f'<text x="{x:.1f}" y="{height - pad + 14}" font-size="9" text-anchor="middle">'
                     f"{html.escape(label)}</text>")
    return "".join(parts) + "</svg>"


def to_html(table: list[dict]) -> str:
    """A self-contained HTML page: the table and one inline SVG plot per metric."""
    cols = columns(table)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(
        "<tr" + (' class="fail"' if str(r.get("gate", "")).startswith(("fail", "warn")) else "") + ">"
        + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in table)
    plots = "".join(_plot(table, m) for m in metric_names(table))
    style = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:13px}"
             "th,td{border:1px solid #ccc;padding:3px 6px;text-align:left}th{background:#f3f4f6}"
             "tr.fail td{background:#fee2e2}.plot{margin:1em 1em 0 0;border:1px solid #eee}")
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>Leaderboard</title>"
            f"<style>{style}</style></head><body><h1>Leaderboard</h1>"
            f"<table id=\"leaderboard\"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
            f"<div id=\"plots\">{plots}</div></body></html>\n")


def export(run_dirs: list[Path], out: Path) -> list[dict]:
    """Rebuild the leaderboard of `run_dirs` and write it in every format into `out`; return the rows."""
    table = rows(run_dirs)
    out = Path(out)
    write_text(out / "leaderboard.csv", to_csv(table))
    write_json(out / "leaderboard.json", {"columns": columns(table), "rows": table})
    write_text(out / "leaderboard.md", to_markdown(table))
    write_text(out / "leaderboard.html", to_html(table))
    return table


def main(argv: list[str] | None = None) -> int:
    """Command line: rebuild (and combine) leaderboards from run folders."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.leaderboard", description=__doc__.splitlines()[0])
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
