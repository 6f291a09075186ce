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


def test_the_detectable_change_solves_connors_equation_and_is_inf_only_when_nothing_can_be_seen():
    za, zb = power.norm.ppf(1 - ALPHA), power.norm.ppf(POWER_CLAIMED)
    for n, churn in ((150, 0.3), (1319, 0.04), (40, 0.0)):
        d = power.detectable(n, churn)
        moved = max(churn, d)
        assert n * d - power.CORRECTION == pytest.approx(za * np.sqrt(n * moved) + zb * np.sqrt(n * (moved - d * d)))
    assert power.detectable(3, 0.5) == power.detectable(1, 0.5) == np.inf  # 3 problems: even all gained is noise
    assert power.detectable(6, 1.0) == pytest.approx(0.996, abs=1e-3)  # 6 all gained: only the largest change
    assert power.detectable(40, 0.0) == pytest.approx(power.detectable(40, 0.05))  # a churn below the change: the same
    one_sided = power.TTestPower().solve_power(nobs=2, alpha=ALPHA, power=POWER_CLAIMED, alternative="larger")
    assert power.detectable(2, sd=1.0) == pytest.approx(one_sided) and power.detectable(2, sd=3.0) == pytest.approx(
        3 * one_sided)


def test_every_text_of_the_sight_says_what_it_saw():
    assert power.describe(0.0331, 150, "t/exact_match,strict-match", "churn 0.040") == \
        "sees \u00b10.033 on t/exact_match,strict-match (80% power, n=150, churn 0.040)"
    assert power.describe(np.inf, 1, "m", "s") == "sees no change on m (80% power, n=1, s)"
    assert power.blind("no_significant_drop", 0.1, 0.05, 150, 0.02) == \
        "the metric sits at its floor: 0.020 of 150 problems leaves about 3 right answers to lose"
    assert power.blind("superior", None, 0.05, 150, 0.98) == \
        "the metric sits at its ceiling: 0.980 of 150 problems leaves about 3 wrong answers to gain"
    assert power.blind("non_inferior", 0.1, 0.05, 100, 0.05) is None  # 5 right answers to lose: not the floor
    assert power.blind("superior", None, 0.05, 100, 0.95) is None
    assert power.blind("non_inferior", 0.05, 0.05, 100, 0.5) is None  # a max_drop the gate just sees
    assert power.blind("non_inferior", 0.049, 0.05, 100, 0.5) == \
        "max_drop 0.049 is below the smallest change this gate detects (0.050)"
    assert power.blind("superior", None, np.inf, 2, None) == "2 problems detect no change"


def test_the_measured_sight_reports_the_input_the_churn_and_the_half():
    before = {i: float(i < 20) for i in range(0, 200, 2)}  # 100 problems of a half, 10 right
    after = [1.0] * 8 + [0.0] * 2 + [1.0] * 3 + [0.0] * 87  # 2 lost, 3 gained
    paired = compare(list(before.values()), after)
    sight = power.sight(_gate(max_drop=0.1), paired, before, "gate")
    assert (sight["n"], sight["rate"], sight["churn"], sight["half"]) == (100, 0.1, 0.05, "gate")
    assert sight["text"] == power.describe(power.detectable(100, 0.05), 100, "t/exact_match,strict-match, gate half",
                                           "churn 0.050")
    floor = power.sight(_gate(max_drop=0.1), compare([1.0] * 2 + [0.0] * 98, [0.0] + [1.0] + [0.0] * 98),
                        {i: float(i < 2) for i in range(100)})
    assert floor["blind"].startswith("the metric sits at its floor: 0.020 of 100 problems")
    assert power.sight(_gate(max_drop=0.1), compare([0.0] * 10, [0.0] * 9 + [1.0]), {})["rate"] == 0.0
    assert power.sight(_gate(max_drop=0.1), None, {}) is None
    continuous = power.sight(_gate(metric="t/bits_per_byte,none", max_drop=0.5), compare([1.0, 2.0, 3.0],
                                                                                          [1.1, 2.3, 3.2]), {})
    assert continuous["text"].endswith("(80% power, n=3, SD of the paired differences 0.1)")


def test_before_the_run_the_sight_of_each_kind_of_gate_is_stated():
    assert power.planned(_gate(max_drop=0.1), None, False) == {
        "n": None, "text": "n unknown before its task is loaded: its sight is measured once it has judged"}
    assert power.planned(_gate(), 301, True) == {
        "n": 150, "text": "judges no change (no max_drop), only its floor, over n=150"}
    assert power.planned(_gate(metric="t/bits_per_byte,none", test="superior"), 90, False) == {
        "n": 90, "text": "a continuous metric over n=90: its sight is measured once it has judged"}
    two = power.planned(_gate(max_drop=0.1), 5, True)
    assert two["n"] == 2 and two["may_miss"] == "2 problems detect no change" and two["text"] == (
        "sees no change on t/exact_match,strict-match (80% power, n=2, assumed: input 0.5, answers changing "
        "independently, churn 0.50, the most there can be)")


def test_the_problems_a_gate_judges_are_known_from_the_task_and_the_limit():
    from pipeline.config import load_config

    cfg = load_config(["recipe=smollm2"])
    assert power.problem_count(cfg, {"limit": None}, "gsm8k_local_val") == 500
    assert power.problem_count(cfg, {"limit": 150}, "gsm8k_local_val") == 150
    assert power.problem_count(cfg, {"limit": 900}, "gsm8k_local_val") == 500  # no more than the task has
    assert power.problem_count(cfg, {"limit": {"gsm8k_local": 40}}, "gsm8k_local_val") == 500
    assert power.problem_count(cfg, {"limit": 40}, "someone_elses_task") == 40
    assert power.problem_count(cfg, {"limit": 0}, "someone_elses_task") is None
    staged = load_config(["recipe=smollm2", "eval.limit=400", "sft.eval.limit=120"])
    assert power.before_run(staged, "sft")["n"] == 120 and power.before_run(staged, "dpo")["n"] == 200
    assert power.before_run(load_config(["recipe=smollm2", "sft.gate.metric="]), "sft") is None
    odd = load_config(["recipe=smollm2", "sft.gate.metric=gsm8k_local_val/exact_match,take/first"])
    assert power.before_run(odd, "sft")["n"] == 500  # the task is what comes before the first '/'


def test_a_floor_or_an_allowed_drop_outside_the_metrics_range_is_impossible():
    def why(metric: str, **kw):
        return power.impossible(_gate(metric=f"t/{metric}", **kw))

    assert why("exact_match,strict-match", min=1.5) == \
        "min 1.5 lies outside [0, 1], the values exact_match takes (a 0/1 metric, scored as a share)"
    assert why("exact_match,strict-match", max_drop=-0.1) == \
        "max_drop -0.1 is not a drop exact_match can make (a 0/1 metric, scored as a share in [0, 1])"
    assert why("acc,none", max_drop=1.5).startswith("max_drop 1.5 is not a drop acc can make")
    assert why("bits_per_byte,none", min=-0.5) == \
        "min -0.5 lies outside [0, inf], the values bits_per_byte takes (a continuous metric)"
    assert why("bits_per_byte,none", max_drop=-1.0) == \
        "max_drop -1 is not a drop bits_per_byte can make (a continuous metric in [0, inf])"
    assert why("acc,none", min=0.0, max_drop=1.0) is None and why("acc,none", min=1.0, max_drop=0.0) is None
    assert why("loglik,none", min=-5.0) is None and why("loglik,none", max_drop=3.0) is None  # a range not known
    assert why("loglik,none", max_drop=-3.0) == \
        "max_drop -3 is not a drop loglik can make (a continuous metric in [-inf, inf])"
