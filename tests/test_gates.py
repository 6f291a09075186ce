"""Gate verdicts: floors, the three tests of a change (no significant drop, non-inferior, superior) judged with
their paired error on constructed per-problem samples, stop vs warn."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
from statsmodels.stats.contingency_tables import mcnemar

from pipeline.evaluation.gates import judge
from pipeline.evaluation.stats import ALPHA, compare, describe, half_mean, paired_difference

M = "tiny_gsm/exact_match,strict-match"


def _gate(**kw):
    return SimpleNamespace(**{"metric": M, "min": None, "max_drop": None, "test": "no_significant_drop",
                              "action": "stop", **kw})


def test_no_gate_no_verdict():
    assert judge(_gate(metric=""), {M: 0.1}, None) is None


def test_min_and_max_drop():
    assert judge(_gate(min=0.1), {M: 0.2}, None)["verdict"] == "pass"
    low = judge(_gate(min=0.3), {M: 0.2}, None)
    assert low["verdict"] == "fail" and "< min 0.3000" in low["reason"]
    drop = judge(_gate(max_drop=0.05), {M: 0.2}, ("01-sft", 0.3))
    assert drop["verdict"] == "pass" and "0.300 (01-sft) -> 0.200: -0.100: judged nothing (no per-problem" in \
        drop["reason"]
    assert judge(_gate(max_drop=0.05), {M: 0.27}, ("01-sft", 0.3))["passed"]
    assert judge(_gate(max_drop=0.0), {M: 0.5}, None)["passed"]  # no baseline: nothing to drop from


def test_warn_is_marked_not_stopped():
    verdict = judge(_gate(min=0.9, action="warn"), {M: 0.2}, None)
    assert verdict["verdict"] == "warn" and not verdict["passed"] and verdict["action"] == "warn"


def _samples(folder: Path, outcomes: list[float]) -> Path:
    """An eval folder with lm-eval's per-problem rows (both answer filters) for `outcomes` of problems 0..n-1."""
    rows = [{"doc_id": i, "filter": f, "metrics": ["exact_match"], "exact_match": v if f == "strict-match" else 1.0}
            for i, v in enumerate(outcomes) for f in ("strict-match", "flexible-extract")]
    folder.mkdir(parents=True)
    (folder / "samples_tiny_gsm.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_paired_difference_counts_only_the_problems_that_changed(tmp_path):
    # 100 problems: 40 right in both, 12 lost, 2 gained, 46 wrong in both -> diff -0.10
    before = [1.0] * 40 + [1.0] * 12 + [0.0] * 2 + [0.0] * 46
    after = [1.0] * 40 + [0.0] * 12 + [1.0] * 2 + [0.0] * 46
    p = paired_difference(_samples(tmp_path / "a", before), _samples(tmp_path / "b", after), M)
    d = [b - a for a, b in zip(before, after, strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d))
    assert p["n"] == 100 and p["diff"] == pytest.approx(-0.10) and p["se"] == pytest.approx(se)
    assert (p["gained"], p["lost"], p["test"]) == (2, 12, "Tango score")
    assert p["p_value"] == pytest.approx(mcnemar([[40, 12], [2, 46]], exact=False, correction=True).pvalue)
    assert p["p_value"] < 0.05
    assert p["ci_low"] < -0.10 < p["ci_high"] < 0
    assert se < math.sqrt(0.52 * 0.48 / 100)  # far below the unpaired stderr of one checkpoint alone
    # the other filter is perfect in both: no difference, no noise
    assert paired_difference(tmp_path / "a", tmp_path / "b", "tiny_gsm/exact_match,flexible-extract")["p_value"] == 1.0
    assert paired_difference(tmp_path / "a", tmp_path / "missing", M) is None


def _changes(tmp_path: Path) -> tuple[Path, dict]:
    """Paired differences from one checkpoint (52 of 100 right) to constructed others, by name."""
    before = [1.0] * 52 + [0.0] * 48
    after = {
        "lost12": [1.0] * 40 + [0.0] * 12 + [0.0] * 48,  # -0.12, SE 0.033: upper bound -0.066
        "lost3": [1.0] * 49 + [0.0] * 3 + [0.0] * 48,  # -0.03, SE 0.017: bounds -0.058 .. -0.002
        "gained10": [1.0] * 52 + [1.0] * 10 + [0.0] * 38,  # +0.10, SE 0.030: lower bound +0.051
        "gained2": [1.0] * 52 + [1.0] * 2 + [0.0] * 46,  # +0.02, SE 0.014: lower bound -0.003
    }
    a = _samples(tmp_path / "a", before)
    return a, {k: paired_difference(a, _samples(tmp_path / k, v), M) for k, v in after.items()}


def _verdict(test: str, paired: dict, max_drop: float | None = None) -> dict:
    return judge(_gate(test=test, max_drop=max_drop), {M: 0.52 + paired["diff"]}, ("01-sft", 0.52), paired)


def test_no_significant_drop_fails_only_beyond_its_error(tmp_path):
    _, p = _changes(tmp_path)
    fail = _verdict("no_significant_drop", p["lost12"], 0.05)
    assert fail["verdict"] == "fail" and fail["paired"] == p["lost12"] and fail["test"] == "no_significant_drop"
    high = p["lost12"]["ci_high"]
    assert fail["reason"].startswith(f"0.520 (01-sft) -> 0.400: {describe(p['lost12'])}: a significant drop beyond "
                                     "max_drop 0.050 (one-sided p=")
    assert fail["reason"].endswith(f"that it is below -0.050; the 95% interval's upper bound {high:+.3f} < -0.050)")
    noisy = _verdict("no_significant_drop", p["lost3"], 0.02)  # a 0.03 drop that noise explains passes
    assert noisy["passed"] and "-0.030" in noisy["reason"] and "no significant drop beyond max_drop 0.020" in \
        noisy["reason"]
    blind = judge(_gate(max_drop=0.0), {M: 0.49}, ("01-sft", 0.52), None)  # no samples: nothing judged, and said
    assert blind["verdict"] == "pass" and "judged nothing (no per-problem samples" in blind["reason"]


def test_non_inferior_passes_only_when_the_drop_is_shown_within_max_drop(tmp_path):
    _, p = _changes(tmp_path)
    small = _verdict("non_inferior", p["lost3"], 0.02)  # the same 0.03 drop: not shown to be within 0.02
    assert not small["passed"] and "not shown within max_drop 0.020 (one-sided p=" in small["reason"]
    assert "the 95% interval's lower bound -0.098 <= -0.020" in small["reason"]
    assert _verdict("non_inferior", p["lost3"], 0.10)["passed"]  # within 0.10 it is shown
    gained = _verdict("non_inferior", p["gained2"], 0.05)
    assert gained["passed"] and "+0.020" in gained["reason"] and "shown not worse than max_drop 0.050" in \
        gained["reason"]


def test_superior_passes_only_on_a_significant_gain(tmp_path):
    _, p = _changes(tmp_path)
    win = _verdict("superior", p["gained10"])  # no max_drop needed
    assert win["passed"] and "+0.100" in win["reason"] and "a significant gain (one-sided p=" in win["reason"]
    assert "the 95% interval's lower bound +0.042 > +0.000" in win["reason"]
    small = _verdict("superior", p["gained2"])
    assert not small["passed"] and "no significant gain (one-sided p=" in small["reason"]
    assert "lower bound -0.035 <= +0.000" in small["reason"]
    assert not _verdict("superior", p["lost3"])["passed"]


def test_nothing_to_judge_is_never_a_pass():
    one = compare([0.0], [1.0])  # one shared problem, gained
    for action in ("stop", "warn"):
        verdict = judge(_gate(test="superior", action=action), {M: 1.0}, ("01-sft", 0.0), one)
        assert verdict["verdict"] == "cannot judge" and not verdict["passed"], verdict
        assert "cannot judge (1 shared problem" in verdict["reason"]
    unknown = judge(_gate(test="non_inferior", max_drop=0.05), {M: 0.6}, ("01-sft", 0.5), None)
    assert unknown["verdict"] == "cannot judge" and "no per-problem samples" in unknown["reason"]
    few = compare([0.0] * 3, [0.0] * 3)  # 3 problems, none changed: even 3 gained would not show "within 0.01"
    verdict = judge(_gate(test="non_inferior", max_drop=0.01), {M: 0.0}, ("01-sft", 0.0), few)
    assert verdict["verdict"] == "cannot judge" and "(3 shared problems: no outcome could be" in verdict["reason"]
    alike = compare([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])  # every problem moved alike: zero standard error
    bpb = judge(_gate(metric="t/bits_per_byte,none", test="superior"), {"t/bits_per_byte,none": 2.5},
                ("01-sft", 2.0), alike)
    assert bpb["verdict"] == "cannot judge" and "same amount" in bpb["reason"]
    drop = judge(_gate(max_drop=0.05), {M: 1.0}, ("01-sft", 0.0), one)
    assert drop["verdict"] == "pass" and "judged nothing (1 shared problem" in drop["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("test", ["superior", "non_inferior", "no_significant_drop"])
def test_every_verdict_up_to_16_problems_follows_the_p_it_prints(test):
    for n in range(1, 17):
        for g in range(n + 1):
            for lo in range(n + 1 - g):
                before = [0.0] * g + [1.0] * lo + [1.0] * ((n - g - lo) // 2) + [0.0] * ((n - g - lo + 1) // 2)
                after = [1.0] * g + [0.0] * lo + before[g + lo:]
                value, start = sum(after) / n, sum(before) / n
                verdict = judge(_gate(test=test, max_drop=0.05), {M: value}, ("a", start), compare(before, after))
                printed = re.search(r"one-sided p=([0-9.e+-]+) ([<>]=?) ", verdict["reason"])
                if printed is None:
                    assert verdict["verdict"] in ("cannot judge", "pass") and "judge" in verdict["reason"]
                    continue
                p, said = float(printed[1]), printed[2]
                assert (said == "<") == (p < ALPHA) or abs(p - ALPHA) < 1e-3, verdict["reason"]
                significant = said == "<"
                assert verdict["passed"] == (significant != (test == "no_significant_drop")), verdict["reason"]


def test_p_below_double_precision_is_a_bound_not_zero(tmp_path):
    a = _samples(tmp_path / "x", [0.0] * 1000 + [1.0] * 1000)
    b = _samples(tmp_path / "y", [1.0] * 999 + [0.0] + [1.0] * 1000)  # 999 of 1000 gained, z about 31
    paired = paired_difference(a, b, M)
    verdict = judge(_gate(test="superior"), {M: 0.9995}, ("01-sft", 0.5), paired)
    assert paired["p_value"] < 1e-15 and "p<1e-4" in verdict["reason"] and "p=0" not in verdict["reason"]


def test_halves_split_the_problems_by_doc_id_parity(tmp_path):
    # the even problems all gained, the odd ones are unchanged: selection sees the gain, the gate does not
    before = [0.0] * 20
    after = [1.0 if i % 2 == 0 else 0.0 for i in range(20)]
    a, b = _samples(tmp_path / "a", before), _samples(tmp_path / "b", after)
    assert half_mean(b, M, "selection") == (1.0, 10) and half_mean(b, M, "gate") == (0.0, 10)
    assert paired_difference(a, b, M, "selection")["diff"] == 1.0
    gate = paired_difference(a, b, M, "gate")
    assert gate["n"] == 10 and gate["diff"] == 0.0 and gate["p_value"] == 1.0
    assert half_mean(tmp_path / "missing", M, "gate") is None


def test_a_metric_better_lower_is_judged_against_its_threshold_turned_round():
    before = [1.0 + 0.01 * i for i in range(40)]
    bpb = "t/bits_per_byte,none"
    verdicts = {}
    for rise in (0.03, 0.07):  # bits per byte up on every problem (a little noise): within max_drop 0.05, beyond it
        paired = compare(before, [v + rise + 0.001 * (-1) ** i for i, v in enumerate(before)])
        verdicts[rise] = judge(_gate(metric=bpb, max_drop=0.05), {bpb: 1.2 + rise}, ("01-sft", 1.2), paired,
                               higher=False)
    assert verdicts[0.03]["verdict"] == "pass" and verdicts[0.03]["reason"].endswith(
        ": no significant drop beyond max_drop 0.050 (one-sided p=1 >= 0.025 that it is below -0.050; the 95% "
        "interval's upper bound -0.030 >= -0.050, lower is better: the change turned round)")
    assert verdicts[0.07]["verdict"] == "fail" and verdicts[0.07]["reason"].startswith(
        "1.200 (01-sft) -> 1.270: +0.070 [+0.070, +0.070], p<1e-4 (paired t, n=40): a significant drop beyond "
        "max_drop 0.050 (one-sided p=1.1e-52 < 0.025 that it is below -0.050; the 95% interval's upper bound -0.070 "
        "< -0.050")


def test_a_threshold_no_table_can_reach_is_named_with_its_side():
    lost = compare([1.0] * 10, [0.0] * 10)  # all 10 lost: still not significantly below -0.9
    drop = judge(_gate(max_drop=0.9), {M: 0.0}, ("01-sft", 1.0), lost)
    assert drop["verdict"] == "pass" and drop["reason"] == (
        "passed; 1.000 (01-sft) -> 0.000: -1.000 [-1.000, -0.311], p=0.0044 (Tango score, +0 / -10, n=10): judged "
        "nothing (over 10 problems no outcome could be significantly below -0.900)")
    errors = compare([0.0] * 10, [1.0] * 10)  # a 0/1 metric better lower: all 10 rose, not significantly above +0.9
    rose = judge(_gate(max_drop=0.9), {M: 1.0}, ("01-sft", 0.0), errors, higher=False)
    assert rose["reason"].endswith("judged nothing (over 10 problems no outcome could be significantly above +0.900, "
                                   "lower is better: the change turned round)")
    one = judge(_gate(test="superior"), {M: 1.0}, ("01-sft", 0.0), compare([0.0], [1.0]))
    assert one["reason"] == ("0.000 (01-sft) -> 1.000: +1.000 (n=1): cannot judge (1 shared problem: no outcome could "
                             "be significant)")


REASONS = {  # the one sentence each verdict prints (both sides of each test)
    ("superior", "gained10", None): "passed; 0.520 (01-sft) -> 0.620: +0.100 [+0.042, +0.186], p=0.0044 (Tango score, "
    "+10 / -0, n=100): a significant gain (one-sided p=0.0022 < 0.025 that it is above +0.000; the 95% interval's "
    "lower bound +0.042 > +0.000)",
    ("superior", "gained2", None): "0.520 (01-sft) -> 0.540: +0.020 [-0.035, +0.085], p=0.48 (Tango score, +2 / -0, "
    "n=100): no significant gain (one-sided p=0.24 >= 0.025 that it is above +0.000; the 95% interval's lower bound "
    "-0.035 <= +0.000)",
    ("non_inferior", "lost3", 0.1): "passed; 0.520 (01-sft) -> 0.490: -0.030 [-0.098, +0.026], p=0.25 (Tango score, "
    "+0 / -3, n=100): shown not worse than max_drop 0.100 (one-sided p=0.023 < 0.025 that it is above -0.100; the "
    "95% interval's lower bound -0.098 > -0.100)",
    ("non_inferior", "lost3", 0.02): "0.520 (01-sft) -> 0.490: -0.030 [-0.098, +0.026], p=0.25 (Tango score, +0 / -3, "
    "n=100): not shown within max_drop 0.020 (one-sided p=0.5 >= 0.025 that it is above -0.020; the 95% interval's "
    "lower bound -0.098 <= -0.020)",
    ("no_significant_drop", "lost12", 0.05): "0.520 (01-sft) -> 0.400: -0.120 [-0.210, -0.061], p=0.0015 (Tango "
    "score, +0 / -12, n=100): a significant drop beyond max_drop 0.050 (one-sided p=0.013 < 0.025 that it is below "
    "-0.050; the 95% interval's upper bound -0.061 < -0.050)",
    ("no_significant_drop", "lost3", 0.02): "passed; 0.520 (01-sft) -> 0.490: -0.030 [-0.098, +0.026], p=0.25 (Tango "
    "score, +0 / -3, n=100): no significant drop beyond max_drop 0.020 (one-sided p=0.5 >= 0.025 that it is below "
    "-0.020; the 95% interval's upper bound +0.026 >= -0.020)",
}


def test_each_verdict_prints_its_change_its_test_and_the_bound_it_compared(tmp_path):
    _, p = _changes(tmp_path)
    for (test, change, max_drop), reason in REASONS.items():
        verdict = _verdict(test, p[change], max_drop)
        assert verdict["reason"] == reason and verdict["passed"] == reason.startswith("passed; ")
        assert verdict["verdict"] == ("pass" if verdict["passed"] else "fail")


def test_a_verdict_records_what_it_judged(tmp_path):
    _, p = _changes(tmp_path)
    sight = {"detectable": 0.05}
    verdict = judge(_gate(test="non_inferior", max_drop=0.1, min=0.3, action="warn"), {M: 0.49}, ("01-sft", 0.52),
                    p["lost3"], True, sight)
    assert verdict == {"metric": M, "value": 0.49, "min": 0.3, "max_drop": 0.1, "test": "non_inferior",
                       "previous": {"checkpoint": "01-sft", "value": 0.52}, "paired": p["lost3"],
                       "higher_is_better": True, "sight": sight, "action": "warn", "passed": True, "verdict": "pass",
                       "reason": REASONS["non_inferior", "lost3", 0.1]}
    floor_only = judge(_gate(min=0.3), {M: 0.49}, ("01-sft", 0.52), p["lost12"])  # no max_drop: no comparison
    assert floor_only["passed"] and floor_only["reason"] == "passed"
    both = judge(_gate(test="superior", min=0.9, action="warn"), {M: 1.0 - 0.5}, ("01-sft", 0.0),
                 compare([0.0], [1.0]))  # below its floor, and the change cannot be judged: a failure, not "cannot"
    assert both["verdict"] == "warn" and both["reason"].startswith("0.5000 < min 0.9000; 0.000 (01-sft) -> 0.500")


def test_a_floor_is_met_at_the_floor_and_a_gain_on_a_metric_better_lower_is_a_fall():
    assert judge(_gate(min=0.3), {M: 0.3}, None)["passed"]
    bpb = "t/bits_per_byte,none"
    assert judge(_gate(metric=bpb, min=1.2), {bpb: 1.2}, None, higher=False)["passed"]
    before = [1.0 + 0.01 * i for i in range(40)]
    fell = compare(before, [v - 0.2 + 0.001 * (-1) ** i for i, v in enumerate(before)])
    gain = judge(_gate(metric=bpb, test="superior"), {bpb: 1.0}, ("01-sft", 1.2), fell, higher=False)
    assert gain["passed"] and gain["reason"].endswith(
        "the 95% interval's lower bound +0.200 > +0.000, lower is better: the change turned round)")
