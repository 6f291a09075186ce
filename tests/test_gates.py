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
