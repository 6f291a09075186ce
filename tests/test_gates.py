"""Gate verdicts: floors, allowed drops judged with their paired error, stop vs warn."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.evaluation.gates import judge
from pipeline.evaluation.stats import paired_difference

M = "tiny_gsm/exact_match,strict-match"


def _gate(**kw):
    return SimpleNamespace(**{"metric": M, "min": None, "max_drop": None, "action": "stop", **kw})


def test_no_gate_no_verdict():
    assert judge(_gate(metric=""), {M: 0.1}, None) is None


def test_min_and_max_drop():
    assert judge(_gate(min=0.1), {M: 0.2}, None)["verdict"] == "pass"
    low = judge(_gate(min=0.3), {M: 0.2}, None)
    assert low["verdict"] == "fail" and "< min 0.3000" in low["reason"]
    drop = judge(_gate(max_drop=0.05), {M: 0.2}, ("01-sft", 0.3))
    assert drop["verdict"] == "fail" and "dropped 0.1000" in drop["reason"] and "01-sft" in drop["reason"]
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
    assert p["ci_low"] == pytest.approx(-0.10 - 1.959964 * se) and p["ci_high"] == pytest.approx(-0.10 + 1.959964 * se)
    assert p["p_value"] == pytest.approx(math.erfc(0.10 / se / math.sqrt(2)))
    assert se < math.sqrt(0.52 * 0.48 / 100)  # far below the unpaired stderr of one checkpoint alone
    # the other filter is perfect in both: no difference, no noise
    assert paired_difference(tmp_path / "a", tmp_path / "b", "tiny_gsm/exact_match,flexible-extract")["p_value"] == 1.0
    assert paired_difference(tmp_path / "a", tmp_path / "missing", M) is None


def test_max_drop_fails_only_beyond_its_error(tmp_path):
    before = [1.0] * 52 + [0.0] * 48
    lost12 = [1.0] * 40 + [0.0] * 12 + [0.0] * 48  # drop 0.12, SE 0.033: lower bound 0.066
    lost3 = [1.0] * 49 + [0.0] * 3 + [0.0] * 48  # drop 0.03, SE 0.017: lower bound 0.002
    a = _samples(tmp_path / "a", before)
    big = paired_difference(a, _samples(tmp_path / "b", lost12), M)
    small = paired_difference(a, _samples(tmp_path / "c", lost3), M)
    fail = judge(_gate(max_drop=0.05), {M: 0.40}, ("01-sft", 0.52), big)
    assert fail["verdict"] == "fail" and fail["paired"] == big
    assert "dropped 0.120 +- 0.033 (paired SE, n=100)" in fail["reason"] and "z=3.67" in fail["reason"]
    assert "> max_drop 0.050" in fail["reason"]
    noisy = judge(_gate(max_drop=0.02), {M: 0.49}, ("01-sft", 0.52), small)
    assert noisy["passed"] and "(within noise)" in noisy["reason"] and "<= max_drop 0.020" in noisy["reason"]
    assert not judge(_gate(max_drop=0.0), {M: 0.49}, ("01-sft", 0.52), None)["passed"]  # no samples: point rule
