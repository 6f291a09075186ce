"""The paired statistics the gates, sweeps and reports use (`pipeline.evaluation.stats`): checked against an
independent implementation (statsmodels' McNemar, a direct maximum-likelihood fit), on every 2x2 table up to 60
problems (the verdict and the printed p never disagree), and by exact enumeration of the tables a pair of
evaluations can give (the one-sided error of the gates' test, the coverage of its interval)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import optimize
from scipy.special import gammaln
from scipy.stats import t as t_dist
from scipy.stats import ttest_1samp
from statsmodels.stats.contingency_tables import mcnemar

from pipeline.evaluation.stats import (
    ALPHA,
    compare,
    describe,
    higher_is_better,
    p_beyond,
    per_problem,
    problem_scores,
    reachable,
    score_interval,
    score_p,
    significant,
    tango_z,
)

MC_ALLOWANCE = 2 * np.sqrt(ALPHA * (1 - ALPHA) / 10_000)  # 2 Monte Carlo SE of 10,000 simulated pairs: 0.31%
THRESHOLDS = (0.0, -0.01, -0.03, -0.1, 0.05)  # superior's 0; -max_drop of the drop tests; a few more


def _all_tables(largest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gained, lost, n) of every paired 2x2 table of 1..`largest` problems (both-right and neither cells do not
    enter the test: only their sum does)."""
    rows = [(g, lo, n) for n in range(1, largest + 1) for g in range(n + 1) for lo in range(n + 1 - g)]
    return tuple(np.array(c, dtype=float) for c in zip(*rows, strict=True))


def _law(n: int, up: float, down: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gained, lost, probability) of every table of `n` problems when each problem is gained with probability `up`
    and lost with `down` (the multinomial law of a pair of evaluations), cells below 1e-13 left out."""
    g, lo = np.meshgrid(np.arange(n + 1.0), np.arange(n + 1.0), indexing="ij")
    rest = n - g - lo
    fits = rest >= 0
    rest = np.where(fits, rest, 0)
    log = (gammaln(n + 1) - gammaln(g + 1) - gammaln(lo + 1) - gammaln(rest + 1) + g * np.log(up) + lo * np.log(down)
           + rest * np.log1p(-up - down))
    prob = np.where(fits, np.exp(log), 0.0)
    keep = prob > 1e-13
    return g[keep], lo[keep], prob[keep]


def test_compare_names_the_test_and_agrees_with_statsmodels_mcnemar():
    # 1319 problems, 21 gained and 10 lost (the CPU recipe's published test result)
    a = [0.0] * 1288 + [1.0] * 10 + [0.0] * 21
    b = [0.0] * 1288 + [0.0] * 10 + [1.0] * 21
    p = compare(a, b)
    assert (p["gained"], p["lost"], p["n"], p["test"]) == (21, 10, 1319, "Tango score")
    assert p["p_value"] == pytest.approx(mcnemar([[1288, 10], [21, 0]], exact=False, correction=True).pvalue)
    assert p["diff"] == pytest.approx(11 / 1319) and p["ci_low"] < 0 < p["diff"] < p["ci_high"]
    assert describe(p) == "+0.008 [-0.001, +0.018], p=0.072 (Tango score, +21 / -10, n=1319)"
    continuous = compare([0.1, 0.3, 0.2, 0.5], [0.2, 0.35, 0.2, 0.7])
    assert continuous["test"] == "paired t" and "gained" not in continuous
    assert continuous["ci_low"] < continuous["diff"] < continuous["ci_high"]
    same = compare([0.0] * 150, [0.0] * 150)  # no problem changed: no difference, an interval that admits a small one
    assert same["p_value"] == 1.0 and -0.04 < same["ci_low"] < 0 < same["ci_high"] < 0.04


def test_nothing_to_test_is_said_not_tested():
    one = compare([0.0], [1.0])
    assert one["p_value"] is None and "1 shared problem" in one["cannot_judge"]
    assert describe(one) == "+1.000, not testable: 1 shared problem: no outcome could be significant (+1 / -0, n=1)"
    moved = compare([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])  # every problem moved alike: no noise to test against
    assert moved["p_value"] is None and "same amount" in moved["cannot_judge"]
    assert compare([0.0] * 5, [1.0] * 5)["p_value"] is None  # five of five gained: still too few to tell
    assert compare([0.0] * 6, [1.0] * 6)["p_value"] < 0.05  # six of six: the fewest the test can call


def test_the_constrained_fit_is_the_maximum_likelihood_table():
    # the score statistic's variance comes from the table of difference delta that fits best: check it against a
    # direct numerical maximisation of the multinomial likelihood
    tables = ((12, 2, 100, -0.03), (3, 9, 60, 0.05), (0, 0, 150, -0.02), (30, 25, 1319, 0.0),
              (1, 0, 1, -0.5))  # the last: a variance below 1 (one problem, a threshold near the edge)
    for gained, lost, n, delta in tables:
        def minus_log_lik(q: float, gained=gained, lost=lost, n=n, delta=delta) -> float:
            up, rest = q + delta, 1 - 2 * q - delta
            return -(gained * np.log(up) + lost * np.log(q) + (n - gained - lost) * np.log(rest))
        q = optimize.minimize_scalar(minus_log_lik, bounds=(max(0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12),
                                     method="bounded", options={"xatol": 1e-12}).x
        u = gained - lost - n * delta
        expected = np.sign(u) * max(abs(u) - 1, 0) / np.sqrt(n * (2 * q + delta * (1 - delta)))  # Edwards: 1 problem
        assert tango_z(gained, lost, n, delta) == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_every_table_up_to_60_problems_gets_one_answer_from_its_p_and_its_interval():
    gained, lost, n = _all_tables(60)
    low, high = score_interval(gained, lost, n)
    assert np.all(low <= (gained - lost) / n) and np.all((gained - lost) / n <= high)
    for threshold in THRESHOLDS:
        for above, bound in ((True, low), (False, high)):
            significant = score_p(gained, lost, n, threshold, above) < ALPHA
            beyond = bound > threshold if above else bound < threshold
            clear = np.abs(bound - threshold) > 1e-9  # a bound that is the threshold itself decides nothing
            assert np.array_equal(significant[clear], beyond[clear]), threshold
    two_sided = 2 * score_p(gained, lost, n, 0.0, above=True)
    two_sided = np.minimum(two_sided, 2 - two_sided)
    assert np.array_equal(two_sided < 2 * ALPHA, (low > 0) | (high < 0))
    # the printed p of a compare and the gates' p come from the same test
    table = compare([1.0] * 52 + [0.0] * 48, [1.0] * 55 + [0.0] * 45)
    assert p_beyond(table, 0.0, above=True) == pytest.approx(table["p_value"] / 2)


def _error(n: int, up: float, down: float, threshold: float, above: bool) -> float:
    g, lo, prob = _law(n, up, down)
    return float(np.sum(prob[score_p(g, lo, n, threshold, above) < ALPHA]))


@pytest.mark.slow
@pytest.mark.parametrize("rate", (0.01, 0.1, 0.5, 0.9))
def test_the_gates_one_sided_error_is_their_alpha(rate):
    """Exact (every table weighed by its probability, no Monte Carlo luck): the chance that `superior` passes an
    unchanged model, that `non_inferior` passes a model exactly max_drop worse, and that `no_significant_drop` fails
    one exactly max_drop worse, at n from 50 to 1,319 and churn (answers changing) from 1% to 20%."""
    worst = []
    for n in (50, 150, 500, 1319):
        for churn in (0.01, 0.05, 0.1, 0.2):
            for drop in (0.0, 0.01, 0.03):
                up, down = (churn - drop) / 2, (churn + drop) / 2  # a true change of -drop
                if up <= 0 or down > min(rate, 1 - rate):  # no such pair at this score
                    continue
                errors = [_error(n, up, down, -drop, above=True)]  # superior (drop 0) / non_inferior passing
                if drop:
                    errors.append(_error(n, up, down, -drop, above=False))  # no_significant_drop failing
                worst.append((max(errors), n, churn, drop))
    assert worst and max(worst)[0] <= ALPHA + MC_ALLOWANCE, max(worst)
    if rate == 0.5:  # where many answers can change, the test is not so timid that it never rejects
        assert max(worst)[0] > ALPHA / 2, max(worst)


@pytest.mark.slow
@pytest.mark.parametrize("n", (50, 150, 500, 1319))
def test_the_interval_covers_the_true_change_within_a_band(n):
    """Exact coverage of the 95% interval: at least 95% everywhere; at most 98% where 15 or more problems are
    expected to change (with fewer, every interval that keeps its level is wider: the counts are few)."""
    for churn in (0.02, 0.1, 0.3):
        coverages = []
        for change in (-churn / 2, 0.0, churn / 4, churn / 2):
            up, down = (churn + change) / 2, (churn - change) / 2
            g, lo, prob = _law(n, up, down)
            low, high = score_interval(g, lo, n)
            coverages.append(float(np.sum(prob[(low <= change + 1e-12) & (change - 1e-12 <= high)])))
        assert min(coverages) >= 0.95, (churn, coverages)
        if n * churn >= 15:
            assert max(coverages) <= 0.98, (churn, coverages)


def test_per_problem_values_are_read_from_lm_evals_rows():
    rows = [{"doc_id": 0, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 1.0, "resps": 3},
            {"doc_id": 1, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 0, "target": 2},
            {"doc_id": 0, "acc": 1.0, "acc_norm": 0.0, "target": 3},  # no metrics list, no filter: every number
            {"doc_id": 1, "metrics": ["exact_match"], "exact_match": [1, 0]}]  # not one number: none
    text = "\n".join(json.dumps(r) for r in rows) + "\n\n"
    assert problem_scores(text) == {"exact_match,strict-match": {0: 1.0, 1: 0.0}, "acc,none": {0: 1.0},
                                    "acc_norm,none": {0: 0.0}}


def test_which_way_is_better_comes_from_lm_evals_record():
    result = {"higher_is_better": {"t": {"bits_per_byte": False, "exact_match": True}}}
    assert higher_is_better(result, "t/bits_per_byte,none") is False
    assert higher_is_better(result, "t/exact_match,strict-match") is True
    assert higher_is_better(result, "t/acc,none") is True and higher_is_better(result, "u/bits_per_byte,none") is True
    assert higher_is_better(None, "t/bits_per_byte,none") is True and higher_is_better({}, "t/x,none") is True


def test_significant_is_the_two_sided_95_percent_test():
    assert significant({"p_value": 0.0499}) and not significant({"p_value": 0.05})
    assert not significant({"p_value": 0.06}) and not significant({"p_value": None})


def test_the_printed_change_shows_its_interval_p_test_and_counts():
    assert describe(compare([0.0] * 50 + [1.0] * 50, [1.0] * 10 + [0.0] * 40 + [1.0] * 48 + [0.0] * 2)) == \
        "+0.080 [+0.003, +0.170], p=0.043 (Tango score, +10 / -2, n=100)"
    assert describe(compare([0.1 * i for i in range(10)], [0.1 * i + 0.01 * (i % 3) for i in range(10)])) == \
        "+0.009 [+0.003, +0.015], p=0.01 (paired t, n=10)"
    assert describe(compare([0.0] * 300, [1.0] * 100 + [0.0] * 200), digits=2) == \
        "+0.33 [+0.28, +0.39], p<1e-4 (Tango score, +100 / -0, n=300)"
    assert describe(compare([0.5] * 4, [0.7] * 4)) == \
        "+0.200, not testable: every problem moved by the same amount: no noise to test against (n=4)"
    assert describe(compare([0.5], [0.7])) == "+0.200, not testable: one shared problem (n=1)"


def test_the_task_is_up_to_the_first_slash_and_the_metric_up_to_the_first_comma():
    from pipeline.evaluation import power

    metric = "t/exact_match,take/first,v2"  # a filter name may hold either
    assert power.measure(metric) == "exact_match" and power.binary(metric)
    assert higher_is_better({"higher_is_better": {"t": {"exact_match": False}}}, metric) is False


def test_a_threshold_is_reachable_exactly_when_some_table_is_significant_beyond_it():
    g, lo, n = _all_tables(30)
    for threshold in (-0.9, -0.6, -0.31, 0.0, 0.2, 0.5):
        for above in (True, False):
            p = score_p(g, lo, n, threshold, above)
            for size in range(1, 31):
                assert reachable(size, threshold, above) == bool((p[n == size] < ALPHA).any()), (size, threshold)


def test_compare_takes_pairs_and_needs_two_problems_for_a_standard_error():
    with pytest.raises(ValueError):
        compare([0.0, 1.0], [1.0])
    two = compare([1.0, 2.0], [1.5, 2.7])
    assert two["se"] == pytest.approx(0.1) and two["p_value"] is not None and two["test"] == "paired t"
    alike = compare([1.0, 2.0], [1.5, 2.5])
    assert alike["cannot_judge"].startswith("every problem moved by the same amount")
    assert (alike["ci_low"], alike["ci_high"]) == (0.5, 0.5)


def test_the_one_sided_p_of_a_continuous_change_is_the_one_sample_t_of_its_differences():
    a = [0.1 * i for i in range(12)]
    b = [x + 0.05 + 0.02 * ((-1) ** i) + 0.01 * (i % 3) for i, x in enumerate(a)]
    d = np.array(b) - np.array(a)
    paired = compare(a, b)
    for threshold in (0.0, 0.05, 0.1):
        for above, side in ((True, "greater"), (False, "less")):
            expected = ttest_1samp(d - threshold, 0.0, alternative=side).pvalue
            assert p_beyond(paired, threshold, above) == pytest.approx(expected)


def test_numbers_come_back_as_floats_and_a_test_names_itself_even_when_it_cannot_judge(tmp_path):
    assert isinstance(tango_z(3, 1, 10, 0.0), float) and isinstance(score_interval(3, 1, 10)[0], float)
    assert isinstance(score_interval(3, 1, 10)[1], float)
    assert compare([0.5] * 4, [0.7] * 4)["test"] == "paired t"
    older = {k: v for k, v in compare([0.0] * 50, [1.0] * 10 + [0.0] * 40).items() if k != "test"}
    assert describe(older).endswith("(paired, +10 / -0, n=50)")  # a record written before the test was named
    rows = [{"doc_id": i, "filter": "take/first", "metrics": ["exact_match"], "exact_match": float(i % 2)}
            for i in range(4)]
    (tmp_path / "samples_t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert per_problem(tmp_path, "t/exact_match,take/first") == {0: 0.0, 1: 1.0, 2: 0.0, 3: 1.0}


def test_a_continuous_change_s_interval_is_the_95_percent_t_interval():
    a = [0.1 * i for i in range(12)]
    b = [x + 0.05 + 0.02 * ((-1) ** i) + 0.01 * (i % 3) for i, x in enumerate(a)]
    d = np.array(b) - np.array(a)
    paired, half_width = compare(a, b), t_dist.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    assert paired["ci_low"] == pytest.approx(d.mean() - half_width) and paired["ci_high"] == pytest.approx(
        d.mean() + half_width)
