"""Evaluation gates: after a stage is scored, decide whether the chain goes on.

`gate: {metric, min, max_drop, action}` judges a stage's eval against the previous evaluated
checkpoint that has the metric (the base model for the first stage). A failure with `action: stop`
halts the chain (exit code 3); with `warn` it is logged and marked in the leaderboard.

- `min`: fails when the metric is below it (the value as measured).
- `max_drop`, judged with its error: the drop is measured problem by problem against the previous
  checkpoint (`stats.paired_difference` on lm-eval's per-problem samples), drop = -diff with its
  paired standard error SE. The gate fails only when the drop exceeds `max_drop` by more than
  z * SE, z = 1.645: the one-sided 95% lower bound of the drop is above `max_drop`, so a drop that
  noise can explain passes and the verdict says so. Without shared per-problem samples (other
  problems, or none kept) the point difference is compared with `max_drop` and the verdict says
  that no error was known.
"""

from __future__ import annotations

from typing import Any

EXIT_GATE_STOP = 3
Z_ONE_SIDED = 1.645  # one-sided 95%


def _drop_reason(value: float, previous: tuple[str, float], max_drop: float, paired: dict | None) -> tuple[bool, str]:
    """(failed, explanation) of the max_drop rule."""
    name, before = previous
    if paired is None:
        drop = before - value
        text = f"dropped {drop:.4f} from {before:.4f} ({name}; no paired samples, no error known)"
        return drop > max_drop, f"{text} {'>' if drop > max_drop else '<='} max_drop {max_drop:.4f}"
    drop, se = -paired["diff"], paired["se"]
    z = drop / se if se > 0 else float("inf") if drop > 0 else 0.0
    low = drop - Z_ONE_SIDED * se
    text = (f"{'dropped' if drop >= 0 else 'rose'} {abs(drop):.3f} +- {se:.3f} (paired SE, n={paired['n']}) from "
            f"{before:.4f} ({name}), z={z:.2f}; 95% lower bound of the drop {low:.3f}")
    if low > max_drop:
        return True, f"{text} > max_drop {max_drop:.3f}"
    return False, f"{text} <= max_drop {max_drop:.3f}" + (" (within noise)" if drop > max_drop else "")


def judge(gate: Any, metrics: dict, previous: tuple[str, float] | None, paired: dict | None = None) -> dict | None:
    """The verdict of `gate` on a stage's eval `metrics`; None when the stage has no gate.

    `previous` is (checkpoint, value) of the checkpoint to compare with; `paired` its
    `stats.paired_difference(previous, this stage)` on the gate metric, or None when not known.
    """
    if not gate.metric:
        return None
    value = metrics[gate.metric]
    reasons, notes = [], []
    if gate.min is not None and value < gate.min:
        reasons.append(f"{value:.4f} < min {gate.min:.4f}")
    if gate.max_drop is not None and previous is not None:
        failed, text = _drop_reason(value, previous, gate.max_drop, paired)
        (reasons if failed else notes).append(text)
    passed = not reasons
    return {
        "metric": gate.metric, "value": value, "min": gate.min, "max_drop": gate.max_drop,
        "previous": {"checkpoint": previous[0], "value": previous[1]} if previous else None,
        "paired": paired, "action": gate.action, "passed": passed,
        "verdict": "pass" if passed else ("fail" if gate.action == "stop" else "warn"),
        "reason": "; ".join(reasons) or "; ".join(["passed", *notes]),
    }
