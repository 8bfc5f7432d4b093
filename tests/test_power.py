"""Power of paired comparisons: Connor's (1987) formulas against published worked examples and a seeded simulation
of the tests `buckets` runs."""

from __future__ import annotations

import numpy as np
import pytest

from lm_eval_sink.buckets import mcnemar_exact
from lm_eval_sink.power import (
    MIN_N,
    comparison_power,
    connor_mde,
    connor_n,
    connor_power,
    exact_mcnemar_power,
    mean_mde,
    mean_n,
    mean_power,
)


def test_connor_against_worked_examples():
    # the oracle: 100 pairs, 20 discordant -> a minimum detectable difference of 12.4 points
    assert round(100 * connor_mde(100, 0.20), 1) == 12.4
    # Connor (1987) p. 209 as worked by powerandsamplesize.com ("Compare Paired Proportions, McNemar's Z-test,
    # 2-sided"): p01 = 0.45, p10 = 0.05, alpha 0.05, power 0.8 -> 23 pairs
    assert connor_n(0.45 + 0.05, 0.05 - 0.45) == 23
    assert connor_power(23, 0.5, 0.4) >= 0.8 > connor_power(22, 0.5, 0.4)
    # the three functions agree with each other
    d = connor_mde(100, 0.2)
    assert connor_power(100, 0.2, d) == pytest.approx(0.8, abs=1e-6) and connor_n(0.2, d) in (100, 101)


def test_exact_and_approximate_power_against_a_seeded_simulation():
    """2000 comparisons of 100 docs with 16.2% regressions and 3.8% recoveries (psi 0.2, delta = the MDE): the exact
    McNemar test buckets runs rejects as often as its enumerated power says; the asymptotic McNemar z-test as often as
    Connor's formula says (0.8); the exact test is the more conservative of the two."""
    n, psi = 100, 0.2
    delta = connor_mde(n, psi)
    draws = np.random.default_rng(0).multinomial(n, [(psi + delta) / 2, (psi - delta) / 2, 1 - psi], size=2000)
    p_exact = {}
    for b, c, _ in draws:
        if (b, c) not in p_exact:
            p_exact[(b, c)] = mcnemar_exact(int(b), int(c))
    rejected_exact = np.mean([p_exact[(b, c)] <= 0.05 for b, c, _ in draws])
    z = np.array([(b - c) / np.sqrt(b + c) if b + c else 0.0 for b, c, _ in draws])
    rejected_z = np.mean(np.abs(z) > 1.959964)
    sd = np.sqrt(0.8 * 0.2 / len(draws))  # binomial sd of a rejection rate near 0.8
    exact = exact_mcnemar_power(n, psi, delta)
    assert abs(rejected_exact - exact) < 3 * sd and abs(rejected_z - 0.8) < 3 * sd
    assert exact < connor_power(n, psi, delta)
    assert exact_mcnemar_power(n, psi, 0.0) <= 0.05  # under the null: at most alpha (conservative)


def test_continuous_power_against_a_seeded_simulation():
    n, sd = 40, 10.0
    delta = mean_mde(n, sd)
    assert mean_power(n, sd, delta) == pytest.approx(0.8, abs=1e-5)  # plus the far tail's 1e-6
    assert mean_n(sd, delta) == n
    d = np.random.default_rng(1).normal(-delta, sd, size=(2000, n))
    z = d.mean(axis=1) / (sd / np.sqrt(n))  # the known-sd z-test the normal approximation describes
    assert abs(np.mean(np.abs(z) > 1.959964) - 0.8) < 3 * np.sqrt(0.16 / 2000)


def test_comparison_power_says_too_few_and_raises_psi_to_the_effect():
    few = comparison_power("binary", np.array([-1, 0, 0, 1, 0]))
    assert few["too_few"] == f"too few to tell: 5 paired docs (at least {MIN_N} are needed)" and few["mde"] is None
    same = comparison_power("binary", np.zeros(50))
    assert same["too_few"] == "too few to tell: no doc where the runs disagree" and same["n_for_effect"] is None
    flat = comparison_power("continuous", np.full(30, 2.0))
    assert flat["too_few"] == "too few to tell: the per-doc differences do not vary"
    # 100 docs, 16 regressions and 4 recoveries: psi 0.2, the oracle's MDE; a 5-point drop needs Connor's n
    d = np.array([-1] * 16 + [1] * 4 + [0] * 80)
    pw = comparison_power("binary", d, effect=5)
    assert pw["discordant_share"] == 0.2 and round(100 * pw["mde"], 1) == 12.4 and pw["effect"] == 0.05
    assert pw["n_for_effect"] == connor_n(0.2, 0.05) and pw["power_at_effect"] == pytest.approx(
        connor_power(100, 0.2, 0.05)
    )
    assert pw["power_at_effect_exact"] < pw["power_at_effect"] and pw["discordant_share_assumed"] is None
    # 2 discordant docs of 100: a 5-point drop needs at least 5% discordant, assumed for its power and n
    low = comparison_power("binary", np.array([-1, 1] + [0] * 98), effect=5)
    assert low["discordant_share_assumed"] == 0.05 and low["n_for_effect"] == connor_n(0.05, 0.05)
