"""What a gate can see (`pipeline.evaluation.power`): the smallest change it detects, checked against the gates'
own test by simulation; gates that cannot see; metrics that are better lower."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf
from scipy.stats import t as student_t
from test_stats import _law

from pipeline.evaluation import power
from pipeline.evaluation.gates import judge
from pipeline.evaluation.stats import ALPHA, compare, score_p
from pipeline.settings import GateConfig

POWER_CLAIMED = power.POWER


@pytest.mark.parametrize(("n", "churn"), [(50, 0.3), (150, 0.1), (500, 0.1), (1319, 0.04), (1319, 0.6)])
def test_the_detectable_change_is_found_with_at_least_80_percent_power(n, churn):
    """Exact: every table weighed by its probability, at the change the sight states and the churn it assumed."""
    change = power.detectable(n, churn)
    g, lo, prob = _law(n, (churn + change) / 2, (churn - change) / 2)
    found = float(np.sum(prob[score_p(g, lo, n, 0.0, above=True) < ALPHA]))
    assert 0.80 <= found <= 0.90, (change, found)  # at least what it states, and not far more


def test_the_detectable_change_of_a_continuous_metric_is_found_with_80_percent_power():
    rng = np.random.default_rng(0)
    n, sd, runs = 60, 0.3, 4000
    change = power.detectable(n, sd=sd)
    diffs = rng.normal(change, sd, size=(runs, n))
    t = diffs.mean(axis=1) / (diffs.std(axis=1, ddof=1) / np.sqrt(n))
    found = float(np.mean(t > student_t.ppf(1 - ALPHA, n - 1)))
    assert found >= POWER_CLAIMED - 2 * np.sqrt(0.16 / runs), found


def _gate(**kw):
    return OmegaConf.structured(GateConfig(**{"metric": "t/exact_match,strict-match", **kw}))


def test_the_sight_is_measured_on_the_change_judged_and_says_what_it_is():
    before = dict.fromkeys(range(150), 0.0) | {i: 1.0 for i in range(30)}
    paired = compare([before[i] for i in range(150)], [before[i] for i in range(150)][:146] + [1.0] * 4)
    sight = power.sight(_gate(max_drop=0.1), paired, before)
    assert sight["churn"] == pytest.approx(4 / 150) and sight["detectable"] == pytest.approx(
        power.detectable(150, 4 / 150))
    assert "on t/exact_match,strict-match (80% power, n=150, churn 0.027)" in sight["text"]
    assert sight["blind"] is None and 0.06 < sight["detectable"] < 0.07  # a drop of 0.1 it would see
    tight = power.sight(_gate(max_drop=0.05), paired, before)
    assert tight["blind"].startswith("max_drop 0.050 is below the smallest change this gate detects")
    seen = compare([0.0] * 150, [1.0] * 40 + [0.0] * 110)  # a significant change: the gate saw it, never "blind"
    assert power.sight(_gate(max_drop=0.0001), seen, dict.fromkeys(range(150), 0.0))["blind"] is None
    assert power.sight(_gate(), paired, before) is None  # a drop test without max_drop judges no change
    bpb = compare([1.0 + 0.01 * i for i in range(90)], [1.0 + 0.01 * i + 0.05 * (i % 3) for i in range(90)])
    continuous = power.sight(_gate(metric="t/bits_per_byte,none", max_drop=0.5), bpb, {})
    d = [0.05 * (i % 3) for i in range(90)]
    assert continuous["sd"] == pytest.approx(np.std(d, ddof=1)) and continuous["rate"] is None
    assert continuous["detectable"] == pytest.approx(power.detectable(90, sd=np.std(d, ddof=1)))


def test_the_floor_blinds_only_a_gate_that_looks_for_a_drop():
    assert "sits at its floor" in power.blind("no_significant_drop", 0.02, 0.01, 150, 0.013)
    assert power.blind("superior", None, 0.01, 150, 0.013) is None  # at the floor a gain can still be seen
    assert "sits at its ceiling" in power.blind("superior", None, 0.01, 150, 0.99)
    assert power.blind("non_inferior", 0.05, 0.01, 150, 0.99) is None
    assert power.blind("superior", None, power.detectable(1, 0.5), 1, None) == "1 problem detect no change"


def test_a_gate_on_a_metric_better_lower_judges_the_change_turned_round():
    before = [1.0 + 0.01 * i for i in range(40)]
    worse = [v + 0.2 for v in before]  # bits per byte up by 0.2 on every problem: worse
    gate = OmegaConf.structured(GateConfig(metric="t/bits_per_byte,none", max_drop=0.05))
    verdict = judge(gate, {gate.metric: 1.395}, ("01-sft", 1.195), compare(before, worse), higher=False)
    assert not verdict["passed"] and "a significant drop beyond max_drop 0.050" in verdict["reason"]
    assert "lower is better" in verdict["reason"] and verdict["higher_is_better"] is False
    better = judge(gate, {gate.metric: 0.995}, ("01-sft", 1.195), compare(before, [v - 0.2 for v in before]),
                   higher=False)
    assert better["passed"]
    ceiling = judge(OmegaConf.structured(GateConfig(metric=gate.metric, min=1.2)), {gate.metric: 1.3}, None,
                    higher=False)
    assert not ceiling["passed"] and "1.3000 > min 1.2000 (lower is better" in ceiling["reason"]


def test_before_the_run_each_gate_states_its_sight_under_a_stated_assumption():
    from pipeline.chain.plan import build
    from pipeline.config import load_config

    cfg = load_config(["recipe=smollm2", "eval.limit={gsm8k_local_val: 150}"])
    gates = {s["stage"]: s["gate"] for s in build(cfg)["stages"] if "gate" in s}
    assert gates["sft"]["n"] == 150 and gates["dpo"]["n"] == 75  # eval.limit 150; the sweep's gate judges half
    assert gates["sft"]["assumed"] and gates["sft"]["rate"] == power.ASSUMED_RATE
    assert gates["sft"]["detectable"] == pytest.approx(power.detectable(150, 0.5))
    assert "assumed: input 0.5, answers changing independently" in gates["sft"]["text"]
    assert gates["sft"]["may_miss"].startswith("max_drop 0.020 is below")
    cpu = {s["stage"]: s["gate"] for s in build(load_config(["recipe=smollm2_cpu"]))["stages"] if "gate" in s}
    assert cpu["sft"]["text"] == "a continuous metric over n=500: its sight is measured once it has judged"
    tiny = load_config(["recipe=tiny", "eval.limit={tiny_gsm_val: 150}",
                        "dpo.gate.metric=tiny_gsm_val_bpb/bits_per_byte,none"])
    assert power.before_run(tiny, "sft")["n"] == 150  # 150 of the 300 validation problems, by eval.limit
    assert "continuous metric over n=150" in power.before_run(tiny, "dpo")["text"]  # half of its 300
