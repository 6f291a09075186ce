"""What a gate can see (`pipeline.evaluation.power`): the smallest change it detects, checked against the gates'
own test by simulation; gates that cannot see; metrics that are better lower."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from pipeline.evaluation import power
from pipeline.evaluation.gates import judge
from pipeline.evaluation.stats import compare, newcombe_interval
from pipeline.settings import GateConfig


@pytest.mark.parametrize(("n", "rate"), [(500, 0.3), (1319, 0.1)])
def test_the_detectable_change_is_found_with_about_80_percent_power(n, rate):
    change = power.detectable(n, rate)
    psi = 2 * rate * (1 - rate)  # the churn the bound assumes
    gained, lost = (psi + change) / 2, (psi - change) / 2
    rng = np.random.default_rng(n)
    tables = rng.multinomial(n, [rate - lost, gained, lost, 1 - rate - gained], size=400)
    found = np.mean([newcombe_interval(int(b), int(g), int(lo), n, 0.90)[0] > 0 for b, g, lo, _ in tables])
    assert 0.72 <= found <= 0.90, (change, found)  # Connor's normal approximation against the gates' own bound


def test_a_gate_at_the_floor_or_with_a_max_drop_below_its_sight_is_blind():
    # the CPU recipe's validation at SmolLM2-135M's 1.3%: two or three right answers out of 150
    change = power.detectable(150, 0.013)
    assert 0.03 < change < 0.035
    assert "sits at its floor" in power.blind("no_significant_drop", 0.02, change, 150, 0.013)
    wide = power.detectable(500, 0.5)
    assert power.blind("no_significant_drop", 0.02, wide, 500, 0.5).startswith("max_drop 0.020 is below")
    assert power.blind("no_significant_drop", 0.1, wide, 500, 0.5) is None
    assert power.blind("superior", None, wide, 500, 0.5) is None  # superior has no max_drop to fall short of
    sight = power.sight(OmegaConf.structured(GateConfig(metric="t/m,f", max_drop=0.02)), dict.fromkeys(range(150), 0.0))
    assert sight["rate"] == 0.0 and sight["blind"] and "n=150, input 0.000" in sight["text"]
    continuous = power.sight(OmegaConf.structured(GateConfig(metric="t/bpb,none", max_drop=0.5)),
                             {i: 1.0 + 0.1 * (i % 3) for i in range(90)})
    assert continuous["rate"] is None and continuous["blind"] is None
    assert continuous["detectable"] == pytest.approx(power.detectable(90, sd=np.std([1.0, 1.1, 1.2] * 30, ddof=1)))
    assert power.detectable(3, 0.5) > 0.7  # three problems detect only the largest change there is


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


def test_before_the_run_each_gate_states_its_sight_at_the_most_noise():
    from pipeline.chain.plan import build
    from pipeline.config import load_config

    cfg = load_config(["recipe=smollm2", "eval.limit={gsm8k_local_val: 150}"])
    gates = {s["stage"]: s["gate"] for s in build(cfg)["stages"] if "gate" in s}
    assert gates["sft"]["n"] == 150 and gates["dpo"]["n"] == 75  # eval.limit 150; the sweep's gate judges half
    assert gates["sft"]["assumed"] and gates["sft"]["rate"] == power.ASSUMED_RATE
    assert gates["sft"]["detectable"] == pytest.approx(power.detectable(150, 0.5))
    assert gates["sft"]["blind"].startswith("max_drop 0.020 is below")
    cpu = {s["stage"]: s["gate"] for s in build(load_config(["recipe=smollm2_cpu"]))["stages"] if "gate" in s}
    assert cpu["sft"]["text"] == "a continuous metric over n=500: its sight is known once its input is scored"
    tiny = load_config(["recipe=tiny", "eval.limit={tiny_gsm_val: 150}",
                        "dpo.gate.metric=tiny_gsm_val_bpb/bits_per_byte,none"])
    assert power.before_run(tiny, "sft")["n"] == 150  # 150 of the 300 validation problems, by eval.limit
    assert "continuous metric over n=150" in power.before_run(tiny, "dpo")["text"]  # half of its 300
