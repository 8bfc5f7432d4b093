"""The statistical cores of buckets and predict: properties over generated paired data (hypothesis, the fixed `ci`
profile of conftest.py) and the library oracles each hand-written part is held against (statsmodels, scipy's
bootstrap, a published worked example). Spearman, the permutation test and exact McNemar call scipy themselves: no
test against scipy there, it could not fail."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.buckets.stats import (
    BUCKETS,
    EXACT_CI_METHOD,
    NEWCOMBE_CI_METHOD,
    _exact_near_half,
    binary_delta_interval,
    cluster_delta_ci,
    exact_conditional_ci,
    holm,
    interval_test_notes,
    mcnemar_exact,
    newcombe_paired_ci,
    paired_stats,
    wilson_ci,
)
from lm_eval_sink.errors import UserError
from lm_eval_sink.power import MIN_N
from lm_eval_sink.predict import fit_task

FAST = BucketSettings(n_bootstrap=200, failure_kinds=False)
_p = st.floats(min_value=0.0, max_value=1.0)
_score = st.floats(min_value=-100.0, max_value=100.0, allow_nan=False)


def _holds(ci, point) -> bool:
    return ci[0] - 1e-9 <= point <= ci[1] + 1e-9


# --- paired 0/1 and continuous outcomes ------------------------------------------------------------------------------


@st.composite
def _paired(draw, binary: bool):
    n = draw(st.integers(1, 60))
    values = st.integers(0, 1).map(float) if binary else _score
    ref = np.array(draw(st.lists(values, min_size=n, max_size=n)))
    cand = np.array(draw(st.lists(values, min_size=n, max_size=n)))
    return ref, cand


@given(pair=_paired(binary=True))
def test_paired_0_1_statistics(pair):
    """Counts sum to n; McNemar's p is a probability; the interval holds the delta and never has zero width: where a
    doc differs, it holds the exact conditional interval, lies on its side of 0 and within it and Newcombe's together,
    and where the conditional one holds 0, each end is the farther of the two; Newcombe's where no doc differs."""
    ref, cand = pair
    stats = paired_stats(list(range(len(ref))), ref, cand, "binary", FAST)
    assert sum(stats.counts.values()) == len(ref) and set(stats.counts) == set(BUCKETS)
    assert stats.discordant == stats.counts["regression"] + stats.counts["recovered"]
    assert 0.0 <= stats.mcnemar_p <= 1.0
    assert _holds(stats.delta_ci, stats.delta) and -1.0 <= stats.delta_ci[0] <= stats.delta_ci[1] <= 1.0
    if stats.discordant == 0:
        assert stats.delta_ci_method == NEWCOMBE_CI_METHOD and stats.delta_ci[1] - stats.delta_ci[0] > 0.05
        assert stats.mcnemar_p == 1.0
    else:
        b, c = stats.counts["regression"], stats.counts["recovered"]
        lo, hi = exact_conditional_ci(b, c, len(ref), FAST.confidence)
        wide = newcombe_paired_ci(stats.counts, FAST.confidence)
        assert stats.delta_ci_method == EXACT_CI_METHOD and stats.delta_ci[1] > stats.delta_ci[0]
        assert min(lo, wide[0]) <= stats.delta_ci[0] <= lo and hi <= stats.delta_ci[1] <= max(hi, wide[1])
        assert (stats.delta_ci[0] > 0, stats.delta_ci[1] < 0) == (lo > 0, hi < 0)
        if lo <= 0 <= hi:
            assert stats.delta_ci == (min(lo, wide[0]), max(hi, wide[1]))


def test_every_doc_regressed_is_no_zero_width_bootstrap():
    """20 docs that all regressed (or all recovered): every bootstrap resample is the same, so its interval was
    -100 [-100, -100], a certainty 20 docs do not give; the exact conditional interval has width."""
    for ref, cand in ((1.0, 0.0), (0.0, 1.0)):
        stats = paired_stats(list(range(20)), np.full(20, ref), np.full(20, cand), "binary", FAST)
        assert stats.delta_ci_method == EXACT_CI_METHOD
        assert stats.delta_ci[1] - stats.delta_ci[0] > 0.2 and _holds(stats.delta_ci, stats.delta)


_CONFIDENCES = [0.5, 0.75, 0.8, 0.875, 0.9, 0.95, 0.99]


def _exact_mcnemar_p(regressions: int, recovered: int) -> Fraction:
    """The exact McNemar p in rational arithmetic: twice the smaller binomial tail at 1/2, at most 1."""
    m = regressions + recovered
    return min(Fraction(1), Fraction(2 * sum(math.comb(m, j) for j in range(min(regressions, recovered) + 1)), 2**m))


@st.composite
def _split(draw):
    n = draw(st.integers(1, 300))
    m = draw(st.integers(1, n))
    recovered = draw(st.integers(0, m))
    both_pass = draw(st.integers(0, n - m))
    return n, m - recovered, recovered, both_pass


@given(split=_split(), confidence=st.sampled_from(_CONFIDENCES))
def test_the_0_1_interval_excludes_0_exactly_when_the_exact_mcnemar_test_rejects(split, confidence):
    """Every split of up to 300 docs: the interval excludes 0 exactly when the exact McNemar test rejects at alpha =
    1 - confidence (p < alpha, p in rational arithmetic), both the exact conditional interval (which ends exactly at 0
    when p = alpha) and the interval users see, widened by Newcombe's (`binary_delta_interval`, at any split of the
    docs that agree); scipy's p agrees with the rational one to its rounding. Before, the bootstrap gave 4
    regressions of 100 [-8.0, -1.0] against p = 0.125."""
    n, regressions, recovered, both_pass = split
    lo, hi = exact_conditional_ci(regressions, recovered, n, confidence)
    p, alpha = _exact_mcnemar_p(regressions, recovered), Fraction(1 - confidence)
    assert (lo > 0 or hi < 0) == (p < alpha)
    both_fail = n - regressions - recovered - both_pass
    counts = {"both_pass": both_pass, "regression": regressions, "recovered": recovered, "both_fail": both_fail}
    (shown_lo, shown_hi), _ = binary_delta_interval(counts, confidence)
    assert (shown_lo > 0 or shown_hi < 0) == (p < alpha) and shown_lo <= lo < hi <= shown_hi
    assert (lo == 0 or hi == 0) == (p == alpha)
    assert mcnemar_exact(regressions, recovered) == pytest.approx(float(p), rel=1e-9)
    m = regressions + recovered
    assert -m / n <= lo < hi <= m / n and _holds((lo, hi), (recovered - regressions) / n)


def test_the_0_1_interval_ends_at_0_exactly_where_p_equals_alpha():
    """At a confidence level whose alpha is a power-of-two fraction, p = alpha happens (3 of 3 discordant docs one
    way at 0.75: p = 0.25): the interval's end is exactly 0 there, neither side of it (scipy's Clopper-Pearson bound
    is found by a solver to 2e-12: 4 of 4 at 0.875 gave an end of 3.5e-14)."""
    found = 0
    for confidence, m in itertools.product([0.5, 0.75, 0.875, 0.9375], range(1, 13)):
        for k in range(m + 1):
            if _exact_mcnemar_p(m - k, k) == Fraction(1 - confidence):
                lo, hi = exact_conditional_ci(m - k, k, 2 * m, confidence)
                assert (hi if 2 * k < m else lo) == 0.0 and mcnemar_exact(m - k, k) == pytest.approx(1 - confidence)
                found += 1
    assert found >= 6
    # a solver's bound within 1e-9 of 1/2 is put on the side exact arithmetic gives (4 of 4 one way: p = 0.125 holds
    # 1/2 at 0.95; 6 of 6: p = 0.031 does not)
    assert _exact_near_half(0.5 - 1e-12, 0, 4, 0.95) > 0.5 and _exact_near_half(0.5 + 1e-12, 0, 6, 0.95) < 0.5
    assert _exact_near_half(0.5 + 1e-12, 4, 4, 0.95, upper=False) < 0.5


# scipy's Wilcoxon test enumerates all 2^n sign flips for n <= 13 with ties: half the examples keep this one cheap
@settings(max_examples=20)
@given(pair=_paired(binary=False), threshold=_score)
def test_paired_continuous_statistics(pair, threshold):
    """Wilcoxon's p is a probability; the bootstrap interval holds the delta, and is withheld below MIN_N docs or
    when the differences do not vary; with a threshold, the pass/fail counts sum to n and the pass rate's interval
    holds its delta."""
    ref, cand = pair
    stats = paired_stats(list(range(len(ref))), ref, cand, "continuous", FAST)
    assert 0.0 <= stats.wilcoxon_p <= 1.0 and stats.counts is None
    if len(ref) < MIN_N or np.ptp(cand - ref) == 0:
        assert stats.delta_ci is None and stats.delta_ci_method.startswith("withheld: ")
    else:
        assert _holds(stats.delta_ci, stats.delta)
    with_threshold = paired_stats(
        list(range(len(ref))), ref, cand, "continuous", BucketSettings(n_bootstrap=200, threshold=threshold)
    )
    assert sum(with_threshold.counts.values()) == len(ref) and 0.0 <= with_threshold.mcnemar_p <= 1.0
    rate = with_threshold.pass_rate
    assert _holds(rate["delta_ci"], rate["delta"])


def test_a_continuous_interval_that_disagrees_with_wilcoxon_says_so():
    """A continuous metric's bootstrap interval is of the mean difference, Wilcoxon's test of the ranks: 15 docs a
    point better and one 30 points worse hold 0 in the interval while the test rejects (p = 0.003), and a note says
    so; where both agree, none."""
    d = np.array([1.0] * 15 + [-30.0])
    stats = paired_stats(list(range(16)), np.full(16, 50.0), 50.0 + d, "continuous", FAST)
    assert stats.delta_ci[0] < 0 < stats.delta_ci[1] and stats.wilcoxon_p < 0.01
    [note] = interval_test_notes(stats, 0.95)
    assert note.startswith("the 95% bootstrap interval of the mean difference, [") and ", holds 0, while the " in note
    assert f"Wilcoxon signed-rank test rejects at alpha 0.05 (p = {stats.wilcoxon_p:.3g})" in note
    agree = paired_stats(list(range(16)), np.full(16, 50.0), 50.0 + np.abs(d), "continuous", FAST)
    assert agree.delta_ci[0] > 0 and agree.wilcoxon_p < 0.05 and interval_test_notes(agree, 0.95) == []


@given(k=st.integers(0, 500), extra=st.integers(0, 500), confidence=st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_wilson_against_statsmodels(k, extra, confidence):
    from statsmodels.stats.proportion import proportion_confint

    n = k + max(extra, 1 if k == 0 else 0)
    lo, hi = proportion_confint(k, n, alpha=1 - confidence, method="wilson")
    assert wilson_ci(k, n, confidence) == pytest.approx((lo, hi), abs=1e-12)


def test_newcombe_against_a_published_example():
    """Cavo et al. (2012), complete response before and after consolidation therapy: 59 both, 6 before only, 16 after
    only, 80 neither; Newcombe's square-and-add interval (method 10) of after minus before is 0.0621 (95% CI 0.0046
    to 0.1186) in Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), chapter 8."""
    counts = {"both_pass": 59, "regression": 6, "recovered": 16, "both_fail": 80}
    lo, hi = newcombe_paired_ci(counts, 0.95)
    assert (round(lo, 4), round(hi, 4)) == (0.0046, 0.1186)
    # four docs failed by both runs: an interval of some width around 0, never [0, 0]
    lo, hi = newcombe_paired_ci({"both_pass": 0, "regression": 0, "recovered": 0, "both_fail": 4}, 0.95)
    assert lo < -0.4 and hi > 0.4 and lo == pytest.approx(-hi)


# --- bootstraps against scipy.stats.bootstrap ------------------------------------------------------------------------


def _scipy_percentile(samples: tuple, statistic, **options) -> tuple[tuple[float, float], float]:
    """scipy's percentile bootstrap interval (20,000 other draws) and the agreement it allows: a tenth of its sd,
    about four Monte Carlo sds of the two endpoints' difference."""
    from scipy.stats import bootstrap

    rng = np.random.default_rng(1)
    res = bootstrap(samples, statistic, n_resamples=20_000, method="percentile", rng=rng, vectorized=True, **options)
    return (res.confidence_interval.low, res.confidence_interval.high), 0.1 * res.standard_error


def test_paired_bootstrap_against_scipy():
    """The same percentile interval of the mean paired difference as scipy's bootstrap."""
    rng = np.random.default_rng(7)
    ref = rng.normal(60, 10, 60)
    cand = ref + rng.gamma(2.0, 3.0, 60) - 7  # skewed differences: the percentile method's tails matter
    want, tol = _scipy_percentile((cand - ref,), np.mean)
    ci = cluster_delta_ci(ref, cand, None, 20_000, 0.95, 0)  # one item per doc, as delta_interval asks
    assert ci == pytest.approx(want, abs=tol) and ci == cluster_delta_ci(ref, cand, np.ones(60), 20_000, 0.95, 0)


def test_cluster_bootstrap_against_scipy():
    """IFEval's instruction-level interval resamples whole prompts: scipy's paired bootstrap of the ratio of sums over
    prompts gives the same interval."""
    rng = np.random.default_rng(3)
    items = rng.integers(1, 5, 80)
    ref = rng.binomial(items, 0.7)
    cand = rng.binomial(items, 0.6)

    def ratio(diff, n, axis=-1):
        return diff.sum(axis=axis) / n.sum(axis=axis)

    want, tol = _scipy_percentile((cand - ref, items), ratio, paired=True)
    assert cluster_delta_ci(ref, cand, items, 20_000, 0.95, 0) == pytest.approx(want, abs=tol)


@given(
    rows=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=40),
    seed=st.integers(0, 2**16),
)
def test_the_cluster_interval_holds_its_estimate(rows, seed):
    items = np.array([n for n, _, _ in rows])
    ref = np.array([min(a, n) for n, a, _ in rows])
    cand = np.array([min(b, n) for n, _, b in rows])
    ci = cluster_delta_ci(ref, cand, items, 200, 0.95, seed)
    assert _holds(ci, (cand.sum() - ref.sum()) / items.sum())


# --- Holm ------------------------------------------------------------------------------------------------------------


@given(p=st.lists(_p, min_size=1, max_size=30))
def test_holm_against_statsmodels_and_its_properties(p):
    from statsmodels.stats.multitest import multipletests

    adjusted = holm(p)
    assert adjusted == pytest.approx(list(multipletests(p, method="holm")[1]), abs=1e-12)
    assert all(raw <= adj <= 1.0 for raw, adj in zip(p, adjusted, strict=True))
    order = np.argsort(p, kind="stable")
    assert all(adjusted[i] <= adjusted[j] for i, j in itertools.pairwise(order))  # monotone in the raw p


# --- predict: the OLS prediction interval ----------------------------------------------------------------------------


@st.composite
def _pairs(draw):
    s = draw(st.lists(st.integers(-300, 300), min_size=3, max_size=7, unique=True).map(lambda v: np.array(v) / 100))
    d = np.array(draw(st.lists(st.floats(-50, 50), min_size=len(s), max_size=len(s))))
    return s, d


def _fit(s, d):
    try:
        return fit_task("t", tuple(f"p{i}" for i in range(len(s))), s, d)
    except UserError:  # all deltas equal: Spearman's rho is undefined (the command refuses such pairs)
        assume(False)


@given(pairs=_pairs(), x=st.lists(st.floats(-10, 10), min_size=1, max_size=5))
def test_the_prediction_interval_against_statsmodels(pairs, x):
    import statsmodels.api as sm

    s, d = pairs
    fit = _fit(s, d)
    frame = sm.OLS(d, sm.add_constant(s)).fit().get_prediction(sm.add_constant(np.array(x), has_constant="add"))
    table = frame.summary_frame(alpha=0.05)
    ours = np.array([fit.prediction_interval(v) for v in x])
    scale = 1 + np.abs(d).max()
    assert ours[:, 0] == pytest.approx(table["obs_ci_lower"].to_numpy(), abs=1e-7 * scale)
    assert ours[:, 1] == pytest.approx(table["obs_ci_upper"].to_numpy(), abs=1e-7 * scale)
