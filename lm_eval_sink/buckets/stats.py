"""The paired statistics of two runs' per-doc outcomes: buckets, exact McNemar and its interval for a 0/1 outcome,
the bootstrap and Wilcoxon for a continuous one (`paired_stats`; derivations: docs/buckets.md "Statistics").
numpy/scipy only, no I/O."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.power import MIN_N

BUCKETS = ("both_pass", "regression", "recovered", "both_fail")
_BOOT_CHUNK = 256


def mcnemar_exact(regressions: int, recovered: int) -> float:
    """Exact two-sided McNemar p-value: binomial test of the discordant pairs against 1/2."""
    n = regressions + recovered
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(regressions, n, 0.5, alternative="two-sided").pvalue)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values (family-wise error), in the input order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def resampled_sums(columns: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Column sums over `n_boot` seeded resamples of the rows (docs or whole prompts) of `columns` [doc, column];
    the draws depend only on (rows, n_boot, seed), so two statistics over the same docs share them."""
    columns = np.asarray(columns, dtype=np.float64)
    n = columns.shape[0]
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, columns.shape[1]), dtype=np.float64)
    for start in range(0, n_boot, _BOOT_CHUNK):
        stop = min(n_boot, start + _BOOT_CHUNK)
        idx = rng.integers(0, n, size=(stop - start, n))
        for j in range(columns.shape[1]):
            out[start:stop, j] = columns[:, j][idx].sum(axis=1)
    return out


def cluster_delta_ci(
    reference_passed: np.ndarray,
    candidate_passed: np.ndarray,
    n_items: np.ndarray | None,
    n_boot: int,
    confidence: float,
    seed: int,
) -> tuple[float, float]:
    """Percentile interval of an item-level delta under a paired bootstrap over whole prompts: each resample's delta is
    (sum candidate passed - sum reference passed) / sum items (`n_items` None: one item per doc, the mean per-doc
    difference, with no column of ones to resample)."""
    d = np.asarray(candidate_passed, float) - np.asarray(reference_passed, float)
    sums = resampled_sums(d[:, None] if n_items is None else np.stack([d, np.asarray(n_items, float)], 1), n_boot, seed)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(sums[:, 0] / (len(d) if n_items is None else sums[:, 1]), [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def wilson_ci(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson's score interval of a binomial proportion k / n."""
    from scipy.stats import norm

    z, p = float(norm.ppf((1 + confidence) / 2)), k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def newcombe_paired_ci(counts: Mapping[str, int], confidence: float) -> tuple[float, float]:
    """Newcombe's (1998) hybrid score interval, method 10, of candidate minus reference from the four buckets: both
    rates' Wilson intervals combined with their correlation phi (0 when a margin is empty, shrunk by n/2 when
    positive); never of zero width (docs/buckets.md)."""
    a, b, c, d = (counts[k] for k in BUCKETS)  # both_pass, regression, recovered, both_fail
    n = a + b + c + d
    ref, cand = (a + b) / n, (a + c) / n
    (l1, u1), (l2, u2) = wilson_ci(a + b, n, confidence), wilson_ci(a + c, n, confidence)
    margins, cross = (a + b) * (c + d) * (a + c) * (b + d), a * d - b * c
    phi = 0.0
    if margins and cross > n / 2:
        phi = (cross - n / 2) / math.sqrt(margins)
    elif margins and cross < 0:
        phi = cross / math.sqrt(margins)

    def spread(x: float, y: float) -> float:
        return math.sqrt(max(x * x + y * y - 2 * phi * x * y, 0.0))

    theta = cand - ref
    return theta - spread(cand - l2, u1 - ref), theta + spread(u2 - cand, ref - l1)


EXACT_CI_METHOD = (
    "exact conditional interval (Clopper-Pearson on the discordant docs' split, times the discordant share), each "
    "end widened to Newcombe's score interval where that is farther and on the same side of 0: excludes 0 exactly "
    "when the exact McNemar test rejects"
)
NEWCOMBE_CI_METHOD = (
    "Newcombe's hybrid score interval for paired proportions (method 10): no doc where the runs differ, so the exact "
    "conditional interval has no discordant doc to split (the exact McNemar test's p is 1)"
)
_NEAR_HALF = 1e-9  # scipy finds a Clopper-Pearson bound within 2e-12 (brentq's xtol); nearer 1/2, exact arithmetic


def exact_conditional_ci(regressions: int, recovered: int, n: int, confidence: float) -> tuple[float, float]:
    """The interval of a paired 0/1 delta over `n` docs that the exact McNemar test inverts: the Clopper-Pearson
    interval of the recovered share q of the m > 0 discordant docs, mapped to (m / n)(2 q - 1); it holds 0 exactly
    when the test does not reject at alpha = 1 - confidence (docs/buckets.md)."""
    from scipy.stats import binomtest

    m = regressions + recovered
    lo, hi = binomtest(recovered, m, 0.5).proportion_ci(confidence_level=confidence, method="exact")
    lo, hi = _exact_near_half(lo, recovered, m, confidence, upper=False), _exact_near_half(hi, recovered, m, confidence)
    return m / n * (2 * lo - 1), m / n * (2 * hi - 1)


def _exact_near_half(bound: float, k: int, m: int, confidence: float, upper: bool = True) -> float:
    """A Clopper-Pearson bound of k of m within `_NEAR_HALF` of 1/2, put on the side of 1/2 that exact arithmetic
    gives (1/2 itself where the tail at 1/2 is exactly alpha / 2: p = alpha, the delta's end exactly 0)."""
    if abs(bound - 0.5) > _NEAR_HALF:
        return bound
    from fractions import Fraction

    tail = sum(math.comb(m, j) for j in (range(k + 1) if upper else range(k, m + 1)))
    gap = Fraction(tail, 2**m) - Fraction(1 - confidence) / 2  # > 0: the bound lies beyond 1/2, holding it
    if gap == 0:
        return 0.5
    above = (gap > 0) == upper
    return max(bound, math.nextafter(0.5, 1.0)) if above else min(bound, math.nextafter(0.5, 0.0))


def binary_delta_interval(counts: Mapping[str, int], confidence: float) -> tuple[tuple[float, float], str]:
    """The interval of a 0/1 delta from its four buckets, and its method: Newcombe's where no doc differs, else each
    end the farther of the exact conditional interval's and Newcombe's unless that crosses 0, so it holds 0 exactly
    when the exact McNemar test does not reject (coverage: docs/buckets.md)."""
    b, c = counts["regression"], counts["recovered"]
    newcombe = newcombe_paired_ci(counts, confidence)
    if b + c == 0:
        return newcombe, NEWCOMBE_CI_METHOD
    lo, hi = exact_conditional_ci(b, c, sum(counts.values()), confidence)
    wide_lo, wide_hi = min(lo, newcombe[0]), max(hi, newcombe[1])
    lo = wide_lo if (lo <= 0) == (wide_lo <= 0) else lo
    hi = wide_hi if (hi >= 0) == (wide_hi >= 0) else hi
    return (lo, hi), EXACT_CI_METHOD


def delta_interval(
    ref_v: np.ndarray, cand_v: np.ndarray, binary: bool, settings: BucketSettings
) -> tuple[tuple[float, float] | None, str]:
    """The interval of mean(candidate - reference) and the method, in words. A 0/1 outcome: `binary_delta_interval`
    at any n; any other metric: the seeded paired bootstrap, withheld (None) below MIN_N docs or when the differences
    do not vary (a bootstrap there has zero width)."""
    if binary:
        return binary_delta_interval(four(ref_v >= 0.5, cand_v >= 0.5), settings.confidence)
    n = len(ref_v)
    if n < MIN_N or np.ptp(cand_v - ref_v) == 0:
        why = f"{n} paired docs (at least {MIN_N} are needed)" if n < MIN_N else "the per-doc differences do not vary"
        return None, f"withheld: {why}; a bootstrap interval there would claim a certainty the docs do not give"
    ci = cluster_delta_ci(ref_v, cand_v, None, settings.n_bootstrap, settings.confidence, settings.seed)
    return ci, f"paired bootstrap over docs (percentile; {settings.n_bootstrap} resamples, seed {settings.seed})"


def _bucket_of(ref_pass: bool, cand_pass: bool) -> str:
    if ref_pass:
        return "both_pass" if cand_pass else "regression"
    return "recovered" if cand_pass else "both_fail"


def four(ref_pass: Sequence[bool], cand_pass: Sequence[bool]) -> dict[str, int]:
    counts = dict.fromkeys(BUCKETS, 0)
    for r, c in zip(ref_pass, cand_pass, strict=True):
        counts[_bucket_of(bool(r), bool(c))] += 1
    return counts


def wilcoxon_test(d: np.ndarray) -> float:
    if not np.any(d != 0):
        return 1.0
    from scipy.stats import wilcoxon

    return float(wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)


@dataclass(frozen=True, slots=True)
class PairedStats:
    """The paired statistics of one metric over the paired docs (BucketReport's fields of the same names)."""

    delta: float
    delta_ci: tuple[float, float] | None
    delta_ci_method: str
    wilcoxon_p: float | None
    counts: dict[str, int] | None
    counts_reason: str | None
    prompts: dict[str, list[int]] | None
    mcnemar_p: float | None
    discordant: int | None
    pass_rate: dict[str, Any] | None


def paired_stats(ids, ref_v: np.ndarray, cand_v: np.ndarray, kind: str, settings: BucketSettings) -> PairedStats:
    """Delta with its interval; Wilcoxon for a continuous metric; buckets and McNemar for pass/fail."""
    delta_ci, method = delta_interval(ref_v, cand_v, kind == "binary", settings)
    wilcoxon_p = wilcoxon_test(cand_v - ref_v) if kind == "continuous" else None
    delta = float(cand_v.mean() - ref_v.mean())
    if kind != "binary" and settings.threshold is None:
        reason = "continuous metric: pass --threshold T to split docs into pass (score >= T) / fail buckets"
        return PairedStats(delta, delta_ci, method, wilcoxon_p, None, reason, None, None, None, None)
    thr = 0.5 if kind == "binary" else settings.threshold
    ref_pass, cand_pass = ref_v >= thr, cand_v >= thr
    counts = four(ref_pass, cand_pass)
    buckets = [_bucket_of(bool(r), bool(c)) for r, c in zip(ref_pass, cand_pass, strict=True)]
    pass_rate = None
    if kind == "continuous":
        rp, cp = ref_pass.astype(float), cand_pass.astype(float)
        rate_ci, rate_method = delta_interval(rp, cp, True, settings)
        pass_rate = {
            "threshold": thr,
            "reference": float(rp.mean()),
            "candidate": float(cp.mean()),
            "delta": float(cp.mean() - rp.mean()),
            "delta_ci": list(rate_ci),
            "delta_ci_method": rate_method,
        }
    return PairedStats(
        delta=delta,
        delta_ci=delta_ci,
        delta_ci_method=method,
        wilcoxon_p=wilcoxon_p,
        counts=counts,
        counts_reason=None,
        prompts={b: [i for i, x in zip(ids, buckets, strict=True) if x == b] for b in BUCKETS},
        mcnemar_p=mcnemar_exact(counts["regression"], counts["recovered"]),
        discordant=counts["regression"] + counts["recovered"],
        pass_rate=pass_rate,
    )


def interval_test_notes(stats: PairedStats, confidence: float) -> list[str]:
    """A note where a continuous metric's bootstrap interval of the mean difference and the Wilcoxon test disagree
    at the same level (the mean against the ranks of the differences); a 0/1 interval always agrees with its test."""
    ci, p = stats.delta_ci, stats.wilcoxon_p
    if ci is None or p is None:
        return []
    alpha = 1 - confidence
    excludes, rejects = ci[0] > 0 or ci[1] < 0, p < alpha
    if excludes == rejects:
        return []
    says, test = ("excludes 0", "does not reject") if excludes else ("holds 0", "rejects")
    return [
        f"the {confidence:.0%} bootstrap interval of the mean difference, [{ci[0]:.4g}, {ci[1]:.4g}] (the metric's "
        f"unit), {says}, while the Wilcoxon signed-rank test {test} at alpha {alpha:g} (p = {p:.3g}): the interval "
        "is of the mean, the test of the ranks of the per-doc differences, and a few large differences move the mean "
        "more than the ranks; the test is the comparison's significance (its power is the one reported)"
    ]
