"""Evaluation gates: after a stage is scored, decide whether the chain goes on.

`gate: {metric, min, max_drop, action}` passes when the metric is at least `min` and has dropped
by at most `max_drop` from the previous evaluated checkpoint that has the metric (the base model
for the first stage). A failure with `action: stop` halts the chain (exit code 3); with `warn` it
is logged and marked in the leaderboard.
"""

from __future__ import annotations

from typing import Any

EXIT_GATE_STOP = 3


class GateStop(RuntimeError):
    """A gate with `action: stop` failed: the chain halts after this stage."""


def judge(gate: Any, metrics: dict, previous: tuple[str, float] | None) -> dict | None:
    """The verdict of `gate` on a stage's eval `metrics`; None when the stage has no gate."""
    if not gate.metric:
        return None
    value = metrics[gate.metric]
    reasons = []
    if gate.min is not None and value < gate.min:
        reasons.append(f"{value:.4f} < min {gate.min:.4f}")
    if gate.max_drop is not None and previous is not None and previous[1] - value > gate.max_drop:
        reasons.append(f"dropped {previous[1] - value:.4f} from {previous[1]:.4f} ({previous[0]}) "
                       f"> max_drop {gate.max_drop:.4f}")
    passed = not reasons
    return {
        "metric": gate.metric, "value": value, "min": gate.min, "max_drop": gate.max_drop,
        "previous": {"checkpoint": previous[0], "value": previous[1]} if previous else None,
        "action": gate.action, "passed": passed,
        "verdict": "pass" if passed else ("fail" if gate.action == "stop" else "warn"),
        "reason": "; ".join(reasons) or "passed",
    }
