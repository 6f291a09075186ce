"""Evaluation gates: after a stage is scored, decide whether the chain goes on.

`gate: {metric, min, max_drop, test, action}` judges a stage's eval against the previous evaluated
checkpoint that has the metric (the base model for the first stage). A failure with `action: stop`
halts the chain (exit code 3); with `warn` it is logged and marked in the leaderboard.

- `min`: fails when the metric is below it (the value as measured).
- `test`: how the change against the previous checkpoint is judged. The change is measured problem by
  problem (`stats.paired_difference` on lm-eval's per-problem samples): change = this - previous, judged with the
  one test that also makes its printed 95% interval and p (`stats`: Tango's score test for a 0/1 metric, the paired
  t for any other), one-sided at `stats.ALPHA` = 2.5% against the gate's threshold, so a verdict is significant
  exactly when the printed interval's bound lies beyond that threshold:
  - `no_significant_drop` (needs `max_drop`): fails only when the change is significantly below -max_drop: a
    drop that noise can explain passes.
  - `non_inferior` (needs `max_drop`): passes only when the change is significantly above -max_drop: "no
    regression" has to be shown, not merely not disproved.
  - `superior`: passes only on a significant gain (the change significantly above 0).
  When the test can tell nothing (no per-problem samples shared with the previous checkpoint, a zero standard
  error, or too few problems for any outcome to be significant), `superior` and `non_inferior` give the verdict
  "cannot judge", which stops the chain like a failure unless the gate's action is `warn`; `no_significant_drop`
  passes and says that it judged nothing.

Each verdict's reason is one sentence: the change as `stats.describe` writes it (95% interval, p, the
problems gained and lost, n), then what the test concluded; the signs are those of the change (negative: this
checkpoint scores lower).
"""

from __future__ import annotations

from typing import Any

from pipeline.evaluation import stats

NEEDS_MAX_DROP = ("no_significant_drop", "non_inferior")  # the tests that compare only with a max_drop set
CANNOT = "cannot judge"


def _change(value: float, previous: tuple[str, float], paired: dict | None) -> str:
    """`0.700 (01-sft) -> 0.640: -0.060 [-0.101, -0.019], p=0.0042 (Tango score, +2 / -8, n=100)`."""
    name, before = previous
    text = f"{before:.3f} ({name}) -> {value:.3f}"
    if paired and paired["p_value"] is not None:
        return f"{text}: {stats.describe(paired)}"
    return f"{text}: {value - before:+.3f}" + (f" (n={paired['n']})" if paired else "")


def _untestable(paired: dict | None, threshold: float, above: bool) -> str | None:
    """Why no outcome of the paired test could show the change `above` (or below) `threshold` (in the change's own
    direction), or None when one could."""
    if paired is None:
        return "no per-problem samples shared with the previous checkpoint"
    if paired.get("cannot_judge"):
        return paired["cannot_judge"]
    if "gained" in paired and not stats.reachable(paired["n"], threshold, above):
        where = "above" if above else "below"
        return f"over {paired['n']} problems no outcome could be significantly {where} {threshold:+.3f}"
    return None


def _test(test: str, value: float, previous: tuple[str, float], max_drop: float | None,
          paired: dict | None, higher: bool) -> tuple[bool | None, str]:
    """(passed: True or False, None when the test can tell nothing; one-sentence reason) of the gate's `test` on the
    change from `previous` to `value`; for a metric that is better `higher=False` (bits per byte), the change is
    judged turned round: a rise is the drop."""
    threshold = 0.0 if test == "superior" else -max_drop  # in the judged direction (turned round when lower is better)
    wants_above = test != "no_significant_drop"  # the other two pass on a change shown above the threshold
    sign = 1 if higher else -1
    above = wants_above == higher  # the same question in the paired change's own direction
    change = _change(value, previous, paired)
    turned = "" if higher else ", lower is better: the change turned round"
    untestable = _untestable(paired, sign * threshold, above)
    if untestable:
        if test == "no_significant_drop":
            return True, f"{change}: judged nothing ({untestable}{turned})"
        return None, f"{change}: {CANNOT} ({untestable}{turned})"
    p = stats.p_beyond(paired, sign * threshold, above)
    significant = p < stats.ALPHA
    low, high = (paired["ci_low"], paired["ci_high"]) if higher else (-paired["ci_high"], -paired["ci_low"])
    bound, name = (low, "lower") if wants_above else (high, "upper")
    side = {(True, True): ">", (True, False): "<=", (False, True): "<", (False, False): ">="}[wants_above, significant]
    why = (f"one-sided p={p:.2g} {'<' if significant else '>='} {stats.ALPHA} that it is "
           f"{'above' if wants_above else 'below'} {threshold:+.3f}; the 95% interval's {name} bound {bound:+.3f} "
           f"{side} {threshold:+.3f}{turned}")
    limit = f"max_drop {-threshold:.3f}"
    verdicts = {"superior": ("a significant gain", "no significant gain"),
                "non_inferior": (f"shown not worse than {limit}", f"not shown within {limit}"),
                "no_significant_drop": (f"a significant drop beyond {limit}", f"no significant drop beyond {limit}")}
    return significant == wants_above, f"{change}: {verdicts[test][not significant]} ({why})"


def judge(gate: Any, metrics: dict, previous: tuple[str, float] | None, paired: dict | None = None,
          higher: bool = True, sight: dict | None = None) -> dict | None:
    """The verdict of `gate` on a stage's eval `metrics`; None when the stage has no gate.

    `previous` is (checkpoint, value) of the checkpoint to compare with; `paired` its
    `stats.paired_difference(previous, this stage)` on the gate metric, or None when not known; `higher`: whether
    the metric is better higher (lm-eval's `higher_is_better`); `sight`: what the gate can see (`power.sight`),
    recorded with the verdict. The verdict is `pass`, `fail` (action stop), `warn` (action warn) or `cannot judge`
    (a `superior` or `non_inferior` test that could tell nothing: it stops the chain unless the action is warn).
    """
    if not gate.metric:
        return None
    value = metrics[gate.metric]
    test = gate.test
    reasons, notes, judged = [], [], True
    if gate.min is not None and (value < gate.min if higher else value > gate.min):
        reasons.append(f"{value:.4f} < min {gate.min:.4f}" if higher else
                       f"{value:.4f} > min {gate.min:.4f} (lower is better: the bound is a ceiling)")
    compares = gate.max_drop is not None or test not in NEEDS_MAX_DROP
    if compares and previous is not None:
        outcome, text = _test(test, value, previous, gate.max_drop, paired, higher)
        judged = outcome is not None
        (notes if outcome else reasons).append(text)
    passed = not reasons
    verdict = ("pass" if passed else CANNOT if not judged and len(reasons) == 1 else
               "fail" if gate.action == "stop" else "warn")
    return {
        "metric": gate.metric, "value": value, "min": gate.min, "max_drop": gate.max_drop, "test": test,
        "previous": {"checkpoint": previous[0], "value": previous[1]} if previous else None,
        "paired": paired, "higher_is_better": higher, "sight": sight, "action": gate.action, "passed": passed,
        "verdict": verdict, "reason": "; ".join(reasons) or "; ".join(["passed", *notes]),
    }
