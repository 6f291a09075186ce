"""The paired statistics the gates, sweeps and reports use (`pipeline.evaluation.stats`), checked by simulation:
unchanged checkpoints are rarely called different, and the intervals cover the true difference."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.evaluation.stats import compare, describe, mcnemar_midp, newcombe_interval

RATES, SIZES = (0.01, 0.02, 0.5, 0.9), (150, 500, 1319)
RUNS = 2000  # simulated pairs of evaluations per setting: Monte Carlo SE of a 5% rate about 0.5%
COVERAGE_RUNS = 600  # per setting and true difference: SE of a 95% coverage about 0.9%, of the average of 15 0.23%


def _tables(rate: float, diff: float, n: int, rng: np.random.Generator, runs: int) -> np.ndarray:
    """`runs` simulated 2x2 tables (both right, gained, lost, neither) of `n` problems: the first checkpoint scores
    `rate`, the second `rate + diff`, and a share of the problems the rarer outcome covers changes answer."""
    moving = min(rate, 1 - rate)  # about this share of problems flips one way or the other
    gained, lost = (moving + diff) / 2, (moving - diff) / 2
    return rng.multinomial(n, [rate - lost, gained, lost, 1 - rate - gained], size=runs)


def test_compare_names_the_test_and_counts_the_problems_that_changed():
    # 1319 problems, 21 gained and 10 lost (the CPU recipe's published test result): mid-p about 0.05
    a = [0.0] * 1288 + [1.0] * 10 + [0.0] * 21
    b = [0.0] * 1288 + [0.0] * 10 + [1.0] * 21
    p = compare(a, b)
    assert (p["gained"], p["lost"], p["n"], p["test"]) == (21, 10, 1319, "McNemar mid-p")
    assert p["p_value"] == pytest.approx(mcnemar_midp(21, 10)) and 0.04 < p["p_value"] < 0.06
    assert p["diff"] == pytest.approx(11 / 1319)
    assert p["ci_low"] < p["bound_low"] < p["diff"] < p["bound_high"] < p["ci_high"]
    assert describe(p) == "+0.008 [-0.000, +0.017], p=0.05 (McNemar mid-p, +21 / -10, n=1319)"
    continuous = compare([0.1, 0.3, 0.2, 0.5], [0.2, 0.35, 0.2, 0.7])
    assert continuous["test"] == "paired t" and "gained" not in continuous
    assert continuous["ci_low"] < continuous["diff"] < continuous["ci_high"]
    # no problem changed: no difference, but an interval that still admits a small one
    same = compare([0.0] * 150, [0.0] * 150)
    assert same["p_value"] == 1.0 and same["ci_low"] < 0 < same["ci_high"]


@pytest.mark.parametrize("rate", RATES)
def test_unchanged_checkpoints_are_rarely_called_different(rate):
    rng = np.random.default_rng(int(rate * 1000))
    for n in SIZES:
        tables = _tables(rate, 0.0, n, rng, RUNS)
        rejected = np.mean([mcnemar_midp(int(g), int(lo)) < 0.05 for _, g, lo, _ in tables])
        assert rejected <= 0.05 + 2 * np.sqrt(0.05 * 0.95 / RUNS), (rate, n, rejected)


@pytest.mark.parametrize("rate", RATES)
def test_intervals_cover_the_true_difference(rate):
    rng = np.random.default_rng(int(rate * 1000) + 1)
    moving = min(rate, 1 - rate)
    coverages = []
    for n in SIZES:
        for diff in (-moving / 2, -moving / 4, 0.0, moving / 4, moving / 2):
            tables = _tables(rate, diff, n, rng, COVERAGE_RUNS)
            hits = [lo <= diff <= hi for lo, hi in
                    (newcombe_interval(int(b), int(g), int(lo), n, 0.95) for b, g, lo, _ in tables)]
            coverages.append(float(np.mean(hits)))
            assert coverages[-1] >= 0.90, (rate, n, diff, coverages[-1])
    assert np.mean(coverages) >= 0.94, (rate, coverages)
