"""Power of paired comparisons: Connor's (1987) formulas against published worked examples, a seeded simulation of
the tests `buckets` runs, one model for every figure of a record (properties over generated data), and the defaults
for a metric's scale."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lm_eval_sink.buckets.stats import mcnemar_exact
from lm_eval_sink.power import (
    MIN_N,
    TARGET_POWER,
    comparison_power,
    connor_mde,
    connor_n,
    connor_power,
    default_effect,
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


def test_exact_and_approximate_power_against_a_seeded_simulation():
    """2000 comparisons of 100 docs with 16.2% regressions and 3.8% recoveries (psi 0.2, delta = the MDE): the exact
    McNemar test buckets runs rejects as often as its enumerated power says; the asymptotic McNemar z-test as often as
    Connor's formula says (0.8); the exact test is the more conservative of the two here."""
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


def test_continuous_power_is_the_wilcoxon_tests_own():
    """A continuous metric is tested with Wilcoxon's signed-rank test: 2000 seeded comparisons of 40 normal differences
    at the stated MDE reject about as often as the target says (the normal approximation with Wilcoxon's asymptotic
    relative efficiency 3/pi; without it the MDE is too small and the simulated power 0.76)."""
    from scipy.stats import wilcoxon

    n, sd = 40, 10.0
    delta = mean_mde(n, sd)
    assert mean_n(sd, delta) == n  # its power at the MDE: test_the_normal_approximation_rises_..._meets_its_mde
    d = np.random.default_rng(1).normal(-delta, sd, size=(2000, n))
    rejected = np.mean(wilcoxon(d, axis=1).pvalue <= 0.05)
    assert abs(rejected - TARGET_POWER) < 0.03  # 3.4 binomial sds, the approximation's error at n = 40 included


# --- the defects of issue 42: figures of one record that contradicted each other ---------------------------------


def test_an_mde_never_exceeds_the_discordant_share():
    """2 of 100 docs disagree: no difference above 2 points can occur, and none at all is detectable at this n; on
    main the MDE was 3.9 points, and the record's own power there 51%."""
    two = comparison_power("binary", np.array([-1, 1] + [0] * 98))
    assert two["mde"] is None and two["discordant_share"] == 0.02
    assert two["not_detectable"].startswith("not detectable at this n: even a difference as large as the discordant")
    need = two["n_for_mde"]  # the documents that would make the largest possible difference detectable
    assert connor_power(need, 0.02, 0.02) >= TARGET_POWER > connor_power(need - 1, 0.02, 0.02)
    assert f"{need} paired docs at this discordant share would make it detectable" in two["not_detectable"]
    # a 5-point difference needs at least 5% of docs to disagree: no power is claimed for it
    assert two["power_at_effect"] is None and two["n_for_effect"] is None
    assert two["effect_impossible"] == "a difference of 5 points needs at least 5% of the docs to disagree; 2.0% do"
    # 5 of 100 discordant (6.2 points on main): still not detectable; the 5-point figures come from the same psi
    five = comparison_power("binary", np.array([-1, -1, -1, 1, 1] + [0] * 95))
    assert five["mde"] is None and five["n_for_mde"] == five["n_for_effect"] == connor_n(0.05, 0.05)
    assert five["power_at_effect"] == pytest.approx(connor_power(100, 0.05, 0.05)) and five["power_at_effect"] < 0.8
    # 20 of 100: the oracle's MDE, at which the record's own power is the target
    twenty = comparison_power("binary", np.array([-1] * 16 + [1] * 4 + [0] * 80))
    assert round(100 * twenty["mde"], 1) == 12.4 and twenty["mde"] <= 0.2
    assert connor_power(100, 0.2, twenty["mde"]) == pytest.approx(TARGET_POWER, abs=1e-9)
    assert twenty["power_at_mde_exact"] == pytest.approx(exact_mcnemar_power(100, 0.2, twenty["mde"]))
    assert twenty["power_at_effect"] == pytest.approx(connor_power(100, 0.2, 0.05)) and twenty["n_for_effect"] == 626


def test_the_continuous_default_effect_follows_the_metrics_scale():
    """A 0-1 continuous score: the default effect is 5% of its range (0.05), not 5 of its units, which claimed ~100%
    power and "1 doc needed" on main; a declared 0-100 range gives 5; otherwise both runs' own range."""
    rng = np.random.default_rng(0)
    ref = rng.uniform(0, 1, 50)
    cand = np.clip(ref + rng.normal(0, 0.2, 50), 0, 1)
    pw = comparison_power("continuous", cand - ref, values=np.concatenate([ref, cand]))
    assert pw["effect"] == pytest.approx(0.05) and pw["effect_source"] == "default: 5% of a 0-1 score's range, 0 to 1"
    assert 0.3 < pw["power_at_effect"] < TARGET_POWER and pw["n_for_effect"] > 50
    assert default_effect(None, (0.0, 100.0)) == (5.0, "default: 5% of the metric's range, 0 to 100")
    assert default_effect(np.array([20.0, 60.0, 100.0])) == (4.0, "default: 5% of both runs' range, 20 to 100")
    assert comparison_power("binary", np.array([-1] * 16 + [1] * 4 + [0] * 80))["effect_shown"] == 5.0
    given_effect = comparison_power("continuous", cand - ref, 0.1, values=np.concatenate([ref, cand]))
    assert given_effect["effect"] == 0.1 and given_effect["effect_source"] == "--effect"


def test_too_few_to_tell():
    few = comparison_power("binary", np.array([-1, 0, 0, 1, 0]))
    assert few["too_few"] == f"too few to tell: 5 paired docs (at least {MIN_N} are needed)" and few["mde"] is None
    same = comparison_power("binary", np.zeros(50))
    assert same["too_few"] == "too few to tell: no doc where the runs disagree" and same["n_for_effect"] is None
    flat = comparison_power("continuous", np.full(30, 2.0), values=np.arange(60.0))
    assert flat["too_few"] == "too few to tell: the per-doc differences do not vary"


# --- properties: one model, figures that cannot contradict each other ----------------------------------------------

_n = st.integers(min_value=MIN_N, max_value=2000)
_share = st.floats(min_value=0.005, max_value=1.0)
_fraction = st.floats(min_value=0.01, max_value=1.0)


@given(n=_n, psi=_share, f=_fraction, more=st.integers(1, 500), g=_fraction)
def test_connor_power_rises_with_n_and_the_effect(n, psi, f, more, g):
    delta = f * psi
    p = connor_power(n, psi, delta)
    assert 0.0 <= p <= 1.0
    assert connor_power(n + more, psi, delta) >= p - 1e-12
    larger = delta + g * (psi - delta)
    assert connor_power(n, psi, larger) >= p - 1e-12
    assert connor_power(n, psi, -delta) == pytest.approx(p)  # two-sided


@given(n=_n, psi=_share)
def test_connor_mde_is_where_its_power_reaches_the_target(n, psi):
    mde = connor_mde(n, psi)
    if mde is None:
        assert connor_power(n, psi, psi) < TARGET_POWER
        return
    assert 0 < mde <= psi
    assert connor_power(n, psi, mde) == pytest.approx(TARGET_POWER, abs=1e-7)


@given(psi=_share, f=_fraction)
def test_connor_n_is_the_fewest_docs_that_reach_the_target(psi, f):
    delta = f * psi
    n = connor_n(psi, delta)
    assert connor_power(n, psi, delta) >= TARGET_POWER
    assert n == 1 or connor_power(n - 1, psi, delta) < TARGET_POWER


@given(n=st.integers(2, 2000), sd=st.floats(0.01, 100.0), f=st.floats(0.01, 3.0), more=st.integers(1, 500))
def test_the_normal_approximation_rises_with_n_and_the_effect_and_meets_its_mde(n, sd, f, more):
    delta = f * sd
    p = mean_power(n, sd, delta)
    assert 0.0 <= p <= 1.0 and mean_power(n + more, sd, delta) >= p - 1e-12 and mean_power(n, sd, 1.5 * delta) >= p
    assert mean_power(n, sd, mean_mde(n, sd)) == pytest.approx(TARGET_POWER, abs=1e-7)
    needed = mean_n(sd, delta)
    assert mean_power(needed, sd, delta) >= TARGET_POWER and (needed == 1 or mean_power(needed - 1, sd, delta) < 0.8)


@given(n=st.integers(1, 300), psi=_share, f=st.floats(-1.0, 1.0))
def test_exact_mcnemar_power_is_a_probability_and_at_most_alpha_under_the_null(n, psi, f):
    assert 0.0 <= exact_mcnemar_power(n, psi, f * psi) <= 1.0 + 1e-12
    assert exact_mcnemar_power(n, psi, 0.0) <= 0.05 + 1e-12


@st.composite
def _paired_01(draw):
    n = draw(st.integers(MIN_N, 400))
    regressions = draw(st.integers(0, n))
    recoveries = draw(st.integers(0, n - regressions))
    return np.array([-1.0] * regressions + [1.0] * recoveries + [0.0] * (n - regressions - recoveries))


@given(d=_paired_01(), effect=st.floats(0.5, 60.0))
def test_a_0_1_record_never_contradicts_itself(d, effect):
    """On generated paired 0/1 data: the MDE is at most the discordant share; the power at the effect reaches the
    target exactly when the effect is at least the MDE, and exactly when its documents needed are at most n."""
    pw = comparison_power("binary", d, effect)
    if pw["too_few"]:
        assert np.count_nonzero(d) == 0
        return
    psi, n = pw["discordant_share"], pw["n"]
    assert pw["mde"] is None or 0 < pw["mde"] <= psi
    assert (pw["mde"] is None) == (pw["not_detectable"] is not None)
    if pw["effect_impossible"] is not None:
        assert pw["effect"] > psi and pw["power_at_effect"] is None
        return
    reaches = pw["power_at_effect"] >= TARGET_POWER
    assert reaches == (pw["n_for_effect"] <= n)
    if pw["mde"] is not None and not math.isclose(pw["effect"], pw["mde"], rel_tol=1e-6):
        assert reaches == (pw["effect"] > pw["mde"])
    elif pw["mde"] is None:
        assert not reaches


def test_the_documents_needed_are_found_in_a_few_dozen_evaluations_at_any_n():
    """The search went one n at a time from the closed form, whose relative error (the far tail, ~3e-6) times n is
    the number of steps: 2,000 for an effect of 0.01 points, hours for 0.0001. Bisection: a few dozen, the same
    answer; an effect too small for any study is 'more than MAX_N', not a hang or an OverflowError."""
    from lm_eval_sink.power import MAX_N, _smallest_n, mean_n

    calls: list[int] = []

    def power_at(n: int) -> float:
        calls.append(n)
        assert len(calls) < 200, "searched one n at a time"
        return 0.8 if n >= 1_000_000_007 else 0.5

    assert _smallest_n(power_at, 1_000_300_000.0, 0.8) == 1_000_000_007 and len(calls) < 100
    calls.clear()
    assert _smallest_n(power_at, 3.0, 0.8) == 1_000_000_007 and len(calls) < 100
    n = connor_n(1.0, 1e-5)  # 0.001 points with every doc discordant: 7.8e10 docs
    assert connor_power(n, 1.0, 1e-5) >= TARGET_POWER > connor_power(n - 1, 1.0, 1e-5)
    assert connor_n(1.0, 1e-6) is None and connor_n(1.0, 1e-300) is None  # 7.8e12 docs: more than MAX_N, 10**12
    assert mean_n(1.0, 1e-300) is None and MAX_N == 10**12
    pw = comparison_power("binary", np.array([-1] * 16 + [1] * 4 + [0] * 80), 1e-250)
    assert pw["n_for_effect"] is None and pw["power_at_effect"] < TARGET_POWER
