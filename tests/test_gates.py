"""Gate verdicts: floors, allowed drops, stop vs warn."""

from __future__ import annotations

from types import SimpleNamespace

from pipeline.gates import judge

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
