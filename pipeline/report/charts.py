"""Leaderboard charts drawn with matplotlib (no pyplot, no display) and returned as inline SVG text.

- `metric_per_stage`: one horizontal error bar per checkpoint (value +- 1.96 stderr); checkpoints are
  rows, so their names never overlap, and nothing joins them as a sequence.
- `sweep_heatmap`: a sweep's beta x learning-rate grid coloured by the selection metric on the selection
  half, each cell with its value and paired difference to the stage's input (95% interval); soup and
  merge beside it on the same colour scale, the soup's ingredients marked, the selected candidate framed
  in red. The scale spans at least one score's 95% noise, so a difference within noise stays one shade.

The SVG is deterministic (fixed hash salt, no date), so a rebuilt leaderboard is byte-identical.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path

import matplotlib
from matplotlib import cm, colors
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pipeline.grid import swept_value
from pipeline.runfolder import StageRecord

RC = {"svg.hashsalt": "smol-pipeline", "svg.fonttype": "none", "font.size": 9}  # applied per chart, not globally
VERDICT_COLOURS = {"pass": "#15803d", "warn": "#d97706", "fail": "#dc2626", "": "#2563eb"}


def to_svg(fig: Figure) -> str:
    """The figure as an `<svg>` element (no XML prologue), for inlining in HTML."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


@matplotlib.rc_context(RC)
def metric_per_stage(rows: list[dict], metric: str, label: Callable[[dict], str]) -> str:
    """`metric` of each checkpoint row with a 95% error bar (1.96 x lm-eval's stderr), coloured by gate verdict."""
    points = [r for r in rows if isinstance(r.get(metric), (int, float))]
    fig = Figure(figsize=(7.5, 1.0 + 0.35 * len(points)))
    ax = fig.add_subplot()
    for y, row in enumerate(points):
        err = 1.96 * (row.get(f"{metric} stderr") or 0.0)
        colour = VERDICT_COLOURS.get(str(row.get("gate") or "").partition(":")[0], VERDICT_COLOURS[""])
        ax.errorbar(row[metric], y, xerr=err, fmt="o", color=colour, capsize=3)
        ax.annotate(f"{row[metric]:.3f}", (row[metric] + err, y), xytext=(4, 0), textcoords="offset points",
                    va="center", fontsize=8)
    ax.set_yticks(range(len(points)), [label(r) for r in points])
    ax.invert_yaxis()  # chain order, top to bottom
    ax.set_ylim(len(points) - 0.5, -0.5)
    ax.set_xlim(left=0)
    ax.margins(x=0.15)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{metric} per stage (95% error bars; colour: gate verdict)", fontsize=9, loc="left")
    return to_svg(fig)


def _cell_text(value: float | None, paired: dict | None) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" + (f"\n{paired['diff']:+.3f}\n[{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}]"
                             if paired else "")


def anchored_norm(values: list[float], n: int | None) -> colors.Normalize:
    """A colour scale over `values` (scores, each the mean of `n` 0/1 results) that spans at least one score's 95%
    noise (1.96 sqrt(p(1-p)/n)) each way around their middle: a difference within noise stays one shade."""
    low, high = min(values, default=0.0), max(values, default=1.0)
    middle = (low + high) / 2
    noise = 1.96 * math.sqrt(max(middle * (1 - middle), 0.01) / n) if n else 0.0
    return colors.Normalize(min(low, middle - noise), max(high, middle + noise, low + 1e-9))


@matplotlib.rc_context(RC)
def sweep_heatmap(name: str, record: StageRecord, cands: dict[str, StageRecord]) -> str:
    """The sweep stage `name` (its record and its candidates' records) as a heatmap of its selection metric over its
    swept settings (the last one across, the others down), soup and merge beside."""
    m = record.metrics or {}
    metric, selected = "selection_half", m.get("selected")
    table = {c["candidate"]: c for c in m.get("candidates", [])}
    keys = sorted((record.config or {}).get("sweep") or {})
    across, down = (keys[-1] if keys else None), keys[:-1]
    grid = {n: c.config or {} for n, c in cands.items() if n not in ("soup", "merge")}
    def row_of(config: dict) -> tuple:
        return tuple(config.get(k) for k in down)
    rows, cols = sorted({row_of(c) for c in grid.values()}), sorted({c.get(across) for c in grid.values()})
    extras = [n for n in ("soup", "merge") if n in table]
    fig = Figure(figsize=(2.2 + 1.8 * (len(cols) + len(extras)), 1.4 + 0.9 * max(len(rows), 1)))
    widths = [max(len(cols), 1)] + ([len(extras)] if extras else [])
    axes = fig.subplots(1, len(widths), width_ratios=widths, squeeze=False)[0]
    values = [t.get(metric) for t in table.values() if isinstance(t.get(metric), (int, float))]
    norm = anchored_norm(values, m.get("selection_problems"))
    cells = {(rows.index(row_of(c)), cols.index(c.get(across))): n for n, c in grid.items()}
    soup = {Path(s).parent.name for s in ((cands["soup"].config if "soup" in cands else None) or {}).get("sources", [])}
    _draw(axes[0], [[table.get(cells.get((i, j)), {}).get(metric) for j in range(len(cols))]
                    for i in range(len(rows))], norm,
          lambda i, j: cells.get((i, j)), table, metric, selected, soup)
    axes[0].set_xticks(range(len(cols)), [swept_value(v) for v in cols])
    axes[0].set_yticks(range(len(rows)), [", ".join(map(swept_value, r)) for r in rows])
    axes[0].set(xlabel=(across or "").replace("_", " "), ylabel=" / ".join(k.replace("_", " ") for k in down))
    if extras:
        _draw(axes[1], [[table[n].get(metric) for n in extras]], norm, lambda i, j: extras[j], table, metric,
              selected, set())
        axes[1].set_xticks(range(len(extras)), extras)
        axes[1].set_yticks([])
    fig.colorbar(cm.ScalarMappable(norm=norm, cmap="viridis"), ax=list(axes), shrink=0.8,
                 label=f"{m.get('selected_by') or ''} on the selection half")
    fig.suptitle(f"{name}: {m.get('selected_by') or ''} on the selection half ({m.get('selection_problems')} problems; "
                 "below: paired difference to the input on them, 95% CI; the colour scale spans at least one score's "
                 "noise)\nred frame: "
                 f"selected {selected}" + ("; \u25c6 in the soup" if soup else ""), fontsize=8, x=0.02, ha="left")
    return to_svg(fig)


def _draw(ax, values: list[list[float | None]], norm, name_at: Callable[[int, int], str | None], table: dict,
          metric: str, selected: str | None, soup: set[str]) -> None:
    """One heatmap panel: cells coloured by value, annotated, the selected one framed, soup ingredients marked."""
    data = [[float("nan") if v is None else v for v in row] for row in values]
    ax.imshow(data, cmap="viridis", norm=norm, aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            name = name_at(i, j)
            text = _cell_text(value, table.get(name, {}).get("vs_input")) + (" \u25c6" if name in soup else "")
            light = value is not None and norm(value) < 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if light else "black")
            if name and name == selected:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="#dc2626", linewidth=3))
