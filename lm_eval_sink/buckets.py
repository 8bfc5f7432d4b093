"""Per-prompt regression buckets of two lm-eval runs of one task, with paired statistics.

`bucket(reference_samples, candidate_samples, task, settings)` works on parsed samples logs
(lists of the dicts lm-eval writes with `--log_samples`) and returns a `BucketReport`:
- pairing (pairing.py, shared with attribution): docs are joined on (doc_id, filter) and must be
  the same document; different doc sets, filters or documents are one UserError giving how many
  differ and an example. Different `prompt_hash`es are expected across protocols (chat template,
  few-shot) and are counted, not refused.
- buckets for a 0/1 metric: both_pass, regression (reference passes, candidate fails), recovered,
  both_fail; `delta` = candidate mean minus reference mean; `mcnemar_p` = exact two-sided binomial test on
  the discordant pairs (scipy); the delta's interval (`binary_delta_interval`, at any n) is the exact
  conditional interval (Clopper-Pearson on the discordant docs' split, times the discordant share: that test's
  inversion), each end widened to Newcombe's where farther and not across 0, so it excludes 0 exactly when the
  test rejects; where no doc differs, Newcombe's score interval (nonzero width, holds 0).
  Below MIN_N docs `too_few_to_tell` is said before every delta.
- a continuous metric (EQ-Bench): the paired difference (`delta`, seeded paired bootstrap interval, withheld
  below MIN_N docs, Wilcoxon signed-rank p; a note where the two disagree); pass/fail buckets, McNemar and the
  pass rate's exact interval only with a threshold (pass = score >= threshold).
- power (power.py) of the test that runs: McNemar on the 0/1 outcome (the pass/fail one under a
  threshold), Wilcoxon on a continuous metric.
- truncation: whether each generated response of both runs hit the generation limit, over every
  paired doc.
- IFEval: instruction-level accuracy and delta with a cluster bootstrap (whole prompts are
  resampled, never single instructions), a per-instruction-type table with exact McNemar p-values
  and Holm-adjusted ones, and one primary failure kind per regression (failure_kinds.py).
- tasks with a lenient twin filter (GSM8K-CoT, GPQA-CoT): regressions split into format failures
  (the lenient filter still finds the right answer) and wrong answers.
- a note for a run whose generated responses are at most a quarter distinct over 20 or more prompts (a collapsed
  output, e.g. one caption whatever the prompt): its buckets measure the collapse.
Task knowledge (default metric and filter = the strict key, kind, lenient filter, IFEval checker) is data:
data/benchmarks.yaml, the table `attribute` reads too (benchmarks.py).
`protocol_record` / `protocol_differences` turn both runs' protocols.py fingerprints into the report's
`runs` and `protocol_differences`; `with_runs` attaches them. Resolving runs, hashing files and writing
the output folder is the command's (commands/buckets.py). numpy/scipy only, no file I/O here.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import PurePath
from typing import Any

import numpy as np

from lm_eval_sink.benchmarks import Benchmark, benchmark_of, ifeval_instructions, load_benchmarks
from lm_eval_sink.errors import UserError
from lm_eval_sink.failure_kinds import classify_ifeval, is_truncated, kind_counts, max_gen_toks_in, max_gen_toks_of
from lm_eval_sink.schema import did_you_mean
from lm_eval_sink.pairing import filter_of, index_docs, outcome, pair_docs
from lm_eval_sink.power import MAX_N, MIN_N, comparison_power, too_few
from lm_eval_sink.tables import csv_text, markdown_lines

log = logging.getLogger(__name__)

BUCKETS = ("both_pass", "regression", "recovered", "both_fail")
SCHEMA_VERSION = 1
# buckets.json keeps each metric's values as lm-eval writes them; the tables convert (said once, in the JSON).
UNITS = (
    "scores, deltas, intervals and rates are in the metric's own unit as lm-eval writes it: a share of docs (0-1) "
    "for a 0/1 metric, which buckets.md and the report show in points (x100); power.effect_shown is in points "
    "for a 0/1 metric"
)
_BOOT_CHUNK = 256
# a task in no family of data/benchmarks.yaml: metric, filter and kind come from the samples
_GENERIC = Benchmark("generic", ("*",), "unknown", None, None, "")


# --- settings and result -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BucketSettings:
    """Every knob of a bucket comparison (one source of truth for the defaults)."""

    metric: str | None = None  # None: the task table's, else the first metric of the samples
    filter: str | None = None  # None: the task table's, else the only filter of the samples
    threshold: float | None = None  # continuous metrics: pass = score >= threshold
    allow_partial: bool = False  # pair the common docs when the doc sets differ (records the drop)
    n_bootstrap: int = 10_000
    confidence: float = 0.95
    seed: int = 0
    failure_kinds: bool = True  # IFEval: re-run lm-eval's checker on regressions
    max_gen_toks: int | None = None  # None: read from each candidate sample's generation kwargs
    # the difference whose power and documents needed are reported: points for a 0/1 outcome, else the metric's unit;
    # None: power.default_effect, 5% of the metric's range
    effect: float | None = None

    def __post_init__(self) -> None:
        if self.effect is not None and not (np.isfinite(self.effect) and self.effect > 0):
            raise UserError(
                f"--effect must be a positive number (points, or the metric's unit), got {self.effect}",
                "use e.g. --effect 5, or leave it out for 5% of the metric's range",
            )
        if self.n_bootstrap < 100:
            raise UserError(f"--bootstrap must be at least 100, got {self.n_bootstrap}", "use e.g. --bootstrap 10000")
        if not 0.5 <= self.confidence < 1:
            raise UserError(f"--confidence must be in [0.5, 1), got {self.confidence}", "use e.g. --confidence 0.95")
        if self.max_gen_toks is not None and self.max_gen_toks <= 0:
            raise UserError(
                f"--max-gen-toks must be positive, got {self.max_gen_toks}",
                "pass the run's generation limit, e.g. --max-gen-toks 1280",
            )
        if self.threshold is not None and not np.isfinite(self.threshold):
            raise UserError(f"--threshold must be a finite number, got {self.threshold}", "use e.g. --threshold 50")


@dataclass(frozen=True, slots=True)
class BucketReport:
    """Buckets and paired statistics of one task's reference vs candidate samples.

    `counts`/`prompts` are None for a continuous metric without a threshold (`counts_reason`
    says so). `delta_ci` is the interval at `confidence` that `delta_ci_method` names (`delta_interval`; None:
    withheld, the method says why). `too_few_to_tell` is the sentence every output shows before the delta when
    fewer than MIN_N docs are paired. `rows` holds one record per paired doc, sorted by doc_id.
    """

    task: str | None
    metric: str
    filter: str
    kind: str
    threshold: float | None
    n: int
    counts: dict[str, int] | None
    counts_reason: str | None
    prompts: dict[str, list[int]] | None
    reference_score: float
    candidate_score: float
    delta: float
    delta_ci: tuple[float, float] | None
    delta_ci_method: str
    mcnemar_p: float | None
    discordant: int | None
    wilcoxon_p: float | None
    pass_rate: dict[str, Any] | None
    instruction_level: dict[str, Any] | None
    instruction_types: list[dict[str, Any]] | None
    format_split: dict[str, Any] | None
    failure_kinds: dict[str, Any] | None
    truncation: dict[str, Any] | None
    pairing: dict[str, Any]
    rows: list[dict[str, Any]]
    settings: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    runs: dict[str, Any] = field(default_factory=dict)
    protocol_differences: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    power: dict[str, Any] = field(default_factory=dict)
    noise_floor: dict[str, Any] | None = None
    too_few_to_tell: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["delta_ci"] = None if self.delta_ci is None else list(self.delta_ci)
        d["schema_version"] = SCHEMA_VERSION
        d["units"] = UNITS
        return d


# --- statistics ----------------------------------------------------------------------------------


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
    """Column sums over `n_boot` bootstrap resamples of the rows of `columns` [doc, column].

    Rows (docs or whole prompts) are drawn with replacement, seeded; the draws depend only on
    (number of rows, n_boot, seed), so two statistics over the same docs share the same resamples.
    """
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


def _interval(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = 1.0 - confidence
    lo, hi = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def paired_delta_ci(
    reference: np.ndarray, candidate: np.ndarray, n_boot: int, confidence: float, seed: int
) -> tuple[float, float]:
    """Percentile interval of mean(candidate - reference) under a paired bootstrap over docs."""
    d = (np.asarray(candidate, dtype=np.float64) - np.asarray(reference, dtype=np.float64))[:, None]
    sums = resampled_sums(d, n_boot, seed)[:, 0]
    return _interval(sums / d.shape[0], confidence)


def cluster_delta_ci(
    reference_passed: np.ndarray,
    candidate_passed: np.ndarray,
    n_items: np.ndarray,
    n_boot: int,
    confidence: float,
    seed: int,
) -> tuple[float, float]:
    """Interval of an item-level accuracy delta, resampling whole clusters (prompts).

    Per prompt: instructions passed by each run and the instruction count; each resample's delta
    is (sum candidate passed - sum reference passed) / sum instructions.
    """
    cols = np.stack(
        [np.asarray(candidate_passed, float) - np.asarray(reference_passed, float), np.asarray(n_items, float)], axis=1
    )
    sums = resampled_sums(cols, n_boot, seed)
    return _interval(sums[:, 0] / sums[:, 1], confidence)


def wilson_ci(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson's score interval of a binomial proportion k / n."""
    from scipy.stats import norm

    z, p = float(norm.ppf((1 + confidence) / 2)), k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def newcombe_paired_ci(counts: Mapping[str, int], confidence: float) -> tuple[float, float]:
    """Newcombe's (1998) hybrid score interval, method 10, of candidate minus reference for paired 0/1 outcomes
    (`counts`: the four buckets): the Wilson intervals of both rates, combined with their correlation phi (set to
    0 when a margin is empty, and shrunk by n/2 when positive, as Newcombe does). Its width never collapses to 0,
    even when every doc has the same outcome (R. G. Newcombe, "Improved confidence intervals for the difference
    between binomial proportions based on paired data", Statistics in Medicine 17:2635-2650, 1998)."""
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
    """The interval of a paired 0/1 delta (recoveries minus regressions, over `n` docs) that the exact McNemar test
    (`mcnemar_exact`) inverts: given the m = regressions + recovered discordant docs, delta = (m / n)(2 q - 1) with q
    the recovered share of them; the Clopper-Pearson interval of q at `confidence`, mapped the same way. It holds 1/2
    (the delta 0) exactly when the two-sided binomial test against 1/2 does not reject at alpha = 1 - confidence
    (the binomial is symmetric there, so its two-sided p is twice the smaller tail and each bound solves one tail =
    alpha / 2). Conditional on m, as the test and power.py are: its ends lie within [-m / n, m / n]. Needs m > 0."""
    from scipy.stats import binomtest

    m = regressions + recovered
    lo, hi = binomtest(recovered, m, 0.5).proportion_ci(confidence_level=confidence, method="exact")
    lo, hi = _exact_near_half(lo, recovered, m, confidence, upper=False), _exact_near_half(hi, recovered, m, confidence)
    return m / n * (2 * lo - 1), m / n * (2 * hi - 1)


def _exact_near_half(bound: float, k: int, m: int, confidence: float, upper: bool = True) -> float:
    """A Clopper-Pearson bound of k of m within `_NEAR_HALF` of 1/2, on the side of 1/2 that exact arithmetic gives:
    1/2 itself when its tail at 1/2 (P(K <= k) for the upper bound, P(K >= k) for the lower) is exactly alpha / 2,
    the p = alpha boundary, where the delta's end is exactly 0; else at least the nearest float on the right side.
    Farther from 1/2, the solver's error (2e-12) cannot move the bound across it."""
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
    """The interval of a 0/1 delta from its four buckets, and its method. Where no doc differs: Newcombe's, which has
    nonzero width and holds 0 (p = 1), the conditional interval having nothing to split. Else each end is the farther
    of the exact conditional interval's (`exact_conditional_ci`) and Newcombe's, except where the farther one would
    move that end across 0: the conditional end stays there. Whether the interval holds 0 is then the conditional
    interval's answer, which is the exact McNemar test's (`mcnemar_exact`), while its ends keep Newcombe's
    coverage of the population delta. The conditional interval alone ends at the observed delta when every
    discordant doc goes one way: it covered a delta of -10 points over 100 docs in 53% of repetitions, this one in
    91-96% (exact enumeration, docs/buckets.md)."""
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
        return binary_delta_interval(_four(ref_v >= 0.5, cand_v >= 0.5), settings.confidence)
    n = len(ref_v)
    if n < MIN_N or np.ptp(cand_v - ref_v) == 0:
        why = f"{n} paired docs (at least {MIN_N} are needed)" if n < MIN_N else "the per-doc differences do not vary"
        return None, f"withheld: {why}; a bootstrap interval there would claim a certainty the docs do not give"
    ci = paired_delta_ci(ref_v, cand_v, settings.n_bootstrap, settings.confidence, settings.seed)
    return ci, f"paired bootstrap over docs (percentile; {settings.n_bootstrap} resamples, seed {settings.seed})"


def _bucket_of(ref_pass: bool, cand_pass: bool) -> str:
    if ref_pass:
        return "both_pass" if cand_pass else "regression"
    return "recovered" if cand_pass else "both_fail"


def _four(ref_pass: Sequence[bool], cand_pass: Sequence[bool]) -> dict[str, int]:
    counts = dict.fromkeys(BUCKETS, 0)
    for r, c in zip(ref_pass, cand_pass, strict=True):
        counts[_bucket_of(bool(r), bool(c))] += 1
    return counts


# --- filter and metric (pairing itself: pairing.py) -----------------------------------------------


def _choose_filter(
    ref: Sequence[Mapping], cand: Sequence[Mapping], wanted: str | None, spec: Benchmark, labels: tuple[str, str]
) -> str:
    ref_f = sorted({filter_of(r) for r in ref})
    cand_f = sorted({filter_of(r) for r in cand})
    if wanted is not None:
        for name, have in zip(labels, (ref_f, cand_f), strict=True):
            if wanted not in have:
                raise UserError(
                    f"filter {wanted!r} is not in the {name} (it has: {', '.join(have)})",
                    "pass one of those with --filter",
                )
        return wanted
    common = [f for f in ref_f if f in cand_f]
    if spec.filter is not None and spec.filter in common:
        return spec.filter
    if len(common) == 1 and len(ref_f) == len(cand_f) == 1:
        return common[0]
    if not common:
        raise UserError(
            f"{labels[0]} and {labels[1]} share no filter: the reference has {', '.join(ref_f)}, the candidate "
            f"{', '.join(cand_f)}",
            "pass samples of the same task, run with the same filters",
        )
    raise UserError(
        f"{labels[0]} and {labels[1]} hold several filters ({', '.join(common)})", "choose one with --filter"
    )


def _choose_metric(ref_rows: Mapping[int, Mapping], wanted: str | None, spec: Benchmark, label: str) -> str:
    first = ref_rows[min(ref_rows)]
    listed = [m for m in first.get("metrics", []) if isinstance(m, str)]
    available = listed or sorted(
        k for k, v in first.items() if isinstance(v, bool | int | float | list) and k != "doc_id"
    )
    if wanted is None:
        if spec.metric is not None and spec.metric in first:
            return spec.metric
        scalar = [m for m in available if m in first and not isinstance(first[m], list)]
        if not scalar:
            raise UserError(
                f"{label}: no per-sample metric found (keys: {', '.join(sorted(first))})",
                "pass a samples file written by lm-eval --log_samples",
            )
        return scalar[0]
    if wanted not in first:
        raise UserError(
            f"{label}: no metric {wanted!r} in the samples{did_you_mean(wanted, available)} (they have: "
            f"{', '.join(available)})",
            "pass one of those with --metric",
        )
    return wanted


def _response(row: Mapping, filtered: bool) -> str | None:
    key = "filtered_resps" if filtered else "resps"
    v = row.get(key)
    while isinstance(v, list) and v:
        v = v[0]
    return v if isinstance(v, str) else None


# --- the comparison ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Paired:
    """Two samples logs joined per doc under one filter and metric: what every pass of `bucket` reads."""

    spec: Benchmark
    filter: str
    metric: str
    ids: list[int]  # the paired doc_ids, sorted
    pairing: dict[str, Any]  # pairing.pair_docs' record
    ref_rows: dict[int, Mapping[str, Any]]
    cand_rows: dict[int, Mapping[str, Any]]
    ref_v: np.ndarray  # each paired doc's outcome
    cand_v: np.ndarray


def _pair(
    reference_samples: Sequence[Mapping[str, Any]],
    candidate_samples: Sequence[Mapping[str, Any]],
    task: str | None,
    settings: BucketSettings,
    labels: tuple[str, str],
    sides: tuple[str, str] = ("reference", "candidate"),
) -> _Paired:
    """Choose the filter and metric, join the two logs per doc (pairing.pair_docs; `sides` name the runs in its
    errors) and read each doc's outcome."""
    if not reference_samples or not candidate_samples:
        raise UserError(
            f"{labels[0] if not reference_samples else labels[1]}: no samples",
            "pass a samples file written by lm-eval --log_samples",
        )
    spec = benchmark_of(task, load_benchmarks()) or _GENERIC
    filt = _choose_filter(reference_samples, candidate_samples, settings.filter, spec, labels)
    ref_rows = index_docs(reference_samples, filt, labels[0])
    cand_rows = index_docs(candidate_samples, filt, labels[1])
    metric = _choose_metric(ref_rows, settings.metric, spec, labels[0])
    _choose_metric(cand_rows, metric, spec, labels[1])
    ids, pairing = pair_docs(
        ref_rows,
        cand_rows,
        labels,
        allow_partial=settings.allow_partial,
        doc_mismatch_hint=spec.doc_mismatch_hint,
        sides=sides,
    )
    ref_v = np.array([outcome(ref_rows[i], metric, labels[0]) for i in ids])
    cand_v = np.array([outcome(cand_rows[i], metric, labels[1]) for i in ids])
    return _Paired(spec, filt, metric, ids, pairing, ref_rows, cand_rows, ref_v, cand_v)


def bucket(
    reference_samples: Sequence[Mapping[str, Any]],
    candidate_samples: Sequence[Mapping[str, Any]],
    task: str | None = None,
    settings: BucketSettings = BucketSettings(),
    *,
    count_tokens: Callable[[str], int] | None = None,
    fallback_max_gen_toks: tuple[tuple[int, str] | None, tuple[int, str] | None] | None = None,
    labels: tuple[str, str] = ("reference samples", "candidate samples"),
    progress: bool = False,
) -> BucketReport:
    """Pair two samples logs of `task` per doc and compute buckets and paired statistics.

    `count_tokens` (a tokenizer's counter) makes truncation exact; without it the heuristic of
    failure_kinds.is_truncated applies. The generation limit is `settings.max_gen_toks`, else the
    one in each sample's generation kwargs, else `fallback_max_gen_toks` (per run, reference and
    candidate: (value, where it comes from) or None), else unknown (truncation then cannot be told).
    `labels` name the two logs in error messages.
    """
    p = _pair(reference_samples, candidate_samples, task, settings, labels)
    kind = _kind(p.ids, p.ref_v, p.cand_v, p.metric, p.spec, settings)
    stats = paired_stats(p.ids, p.ref_v, p.cand_v, kind, settings)
    rows = _doc_rows(p.ids, stats.prompts, p.ref_v, p.cand_v, p.ref_rows, p.cand_rows)
    by_id = {row["doc_id"]: row for row in rows}
    regressions = stats.prompts["regression"] if stats.prompts else []
    truncation = _mark_truncation(p, regressions, by_id, settings, count_tokens, fallback_max_gen_toks)
    instruction_level, instruction_types, failure = _ifeval_passes(p, by_id, regressions, settings, labels, progress)
    format_split = None
    if p.spec.lenient_filter and p.filter != p.spec.lenient_filter and stats.prompts is not None:
        format_split = _format_split(regressions, candidate_samples, p.spec.lenient_filter, p.metric, by_id, labels[1])
    return BucketReport(
        task=task,
        metric=p.metric,
        filter=p.filter,
        kind=kind,
        threshold=settings.threshold,
        n=len(p.ids),
        reference_score=float(p.ref_v.mean()),
        candidate_score=float(p.cand_v.mean()),
        **{f.name: getattr(stats, f.name) for f in fields(stats)},
        instruction_level=instruction_level,
        instruction_types=instruction_types,
        format_split=format_split,
        failure_kinds=failure,
        truncation=truncation,
        pairing=p.pairing,
        rows=rows,
        settings=asdict(settings),
        notes=_pairing_notes(p.pairing, len(p.ids))
        + _collapse_notes(p.ids, p.ref_rows, p.cand_rows, labels)
        + _self_notes(identical_samples(p), len(p.ids), "reference and candidate")
        + interval_test_notes(stats, settings.confidence),
        power=_power(p, kind, settings),
        too_few_to_tell=too_few(len(p.ids)) if len(p.ids) < MIN_N else None,
    )


def _power(p: _Paired, kind: str, settings: BucketSettings) -> dict[str, Any]:
    """The power of the test `bucket` runs: McNemar on the 0/1 metric, or on pass/fail under `--threshold`;
    Wilcoxon on a continuous metric's differences."""
    if kind == "continuous" and settings.threshold is not None:
        thr = settings.threshold
        passes = (p.cand_v >= thr).astype(float) - (p.ref_v >= thr).astype(float)
        return comparison_power("binary", passes, settings.effect, outcome=f"pass/fail (score >= {thr:g})")
    values = np.concatenate([p.ref_v, p.cand_v])
    return comparison_power(kind, p.cand_v - p.ref_v, settings.effect, values=values, declared_range=p.spec.score_range)


def _ifeval_passes(
    p: _Paired,
    by_id: dict[int, dict[str, Any]],
    regressions: list[int],
    settings: BucketSettings,
    labels: tuple[str, str],
    progress: bool,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None, dict[str, Any] | None]:
    """IFEval only: instruction-level statistics and the failure kinds of the regressions (None elsewhere)."""
    if p.spec.checker != "ifeval":
        return None, None, None
    instruction_level = instruction_types = failure = None
    inst_metric = p.spec.instruction_metrics.get(p.metric)
    if inst_metric is not None:
        instruction_level, instruction_types = _instruction_stats(
            p.ids, p.ref_rows, p.cand_rows, inst_metric, by_id, settings, labels
        )
    if settings.failure_kinds and regressions:
        failure = _failure_kinds(regressions, p.cand_rows, by_id, loose="loose" in p.metric, progress=progress)
    return instruction_level, instruction_types, failure


def _kind(ids, ref_v: np.ndarray, cand_v: np.ndarray, metric: str, spec: Benchmark, settings: BucketSettings) -> str:
    """binary (0/1 per doc) or continuous: the benchmark's declared kind for its metric, else what the values are."""
    is01 = bool(np.isin(ref_v, (0.0, 1.0)).all() and np.isin(cand_v, (0.0, 1.0)).all())
    declared = spec.kind if (spec.metric is None or metric == spec.metric) else None
    kind = declared or ("binary" if is01 else "continuous")
    if kind == "binary" and settings.threshold is not None:
        raise UserError(f"--threshold applies to continuous metrics; {metric!r} is 0/1 per doc", "drop --threshold")
    if kind == "binary" and not is01:
        bad = next(i for i, a, b in zip(ids, ref_v, cand_v, strict=True) if a not in (0.0, 1.0) or b not in (0.0, 1.0))
        raise UserError(
            f"metric {metric!r} is not 0/1 (e.g. doc_id {bad})", "pass --threshold to bucket a continuous score"
        )
    return kind


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
    """Delta with its interval (`delta_interval`); Wilcoxon for a continuous metric; buckets and McNemar for
    pass/fail."""
    delta_ci, method = delta_interval(ref_v, cand_v, kind == "binary", settings)
    wilcoxon_p = _wilcoxon(cand_v - ref_v) if kind == "continuous" else None
    delta = float(cand_v.mean() - ref_v.mean())
    if kind != "binary" and settings.threshold is None:
        reason = "continuous metric: pass --threshold T to split docs into pass (score >= T) / fail buckets"
        return PairedStats(delta, delta_ci, method, wilcoxon_p, None, reason, None, None, None, None)
    thr = 0.5 if kind == "binary" else settings.threshold
    ref_pass, cand_pass = ref_v >= thr, cand_v >= thr
    counts = _four(ref_pass, cand_pass)
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


COLLAPSE_MIN_DOCS = 20  # fewer paired prompts say too little about a model's repertoire
COLLAPSE_DISTINCT = 0.25  # at most this share of distinct responses: a few answers repeated, whatever the prompt


def _collapse_notes(ids, ref_rows, cand_rows, labels: tuple[str, str]) -> list[str]:
    """A run that gives the same few responses to every prompt has collapsed (e.g. a model trained on one caption
    format answers IFEval with captions): its passes and failures measure the collapse, not instruction following.
    """
    notes = []
    for label, rows in zip(labels, (ref_rows, cand_rows), strict=True):
        texts = [t for t in (_generated(rows[i]) for i in ids) if t is not None]
        counts = Counter(texts)
        if len(texts) < COLLAPSE_MIN_DOCS or len(counts) > COLLAPSE_DISTINCT * len(texts):
            continue
        top, count = counts.most_common(1)[0]
        notes.append(
            f"{label}: {len(counts)} distinct responses to {len(texts)} prompts (the most common, {count} times: "
            f"{top[:60]!r}): a collapsed output; its passes and failures measure the collapse, not the model's "
            "instruction following"
        )
    return notes


def identical_samples(p: _Paired) -> bool:
    """Whether both logs hold the same sample for every paired doc: same prompt, responses and outcome (a run
    against itself, or a copy of it)."""
    keys = ("prompt_hash", "resps", "filtered_resps")
    return bool(np.array_equal(p.ref_v, p.cand_v)) and all(
        all(p.ref_rows[i].get(k) == p.cand_rows[i].get(k) for k in keys) for i in p.ids
    )


def interval_test_notes(stats: PairedStats, confidence: float) -> list[str]:
    """A note where a continuous metric's bootstrap interval of the mean difference and the Wilcoxon signed-rank test
    `bucket` runs disagree on whether the runs differ at the same level (one excludes 0, the other does not reject
    at alpha = 1 - confidence): they ask different questions (the mean against the ranks of the differences), so a
    few large differences can move one and not the other. Said in words, so the two figures do not contradict each
    other unspoken. A 0/1 outcome needs no note: its interval excludes 0 exactly when the exact McNemar
    test rejects (`binary_delta_interval`)."""
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


def _self_notes(identical: bool, n: int, what: str) -> list[str]:
    """A note when the two logs are the same samples (`identical_samples` of `n` paired docs): every difference is
    zero by construction."""
    if not identical:
        return []
    return [
        f"{what} give identical samples (prompt, response and score) for all {n} paired docs: a run "
        "compared with itself (or a copy of it) measures nothing; every difference is zero by construction"
    ]


def _pairing_notes(pairing: Mapping[str, Any], n: int) -> list[str]:
    notes = []
    if pairing["prompt_hash_differs"]["count"]:
        notes.append(
            f"{pairing['prompt_hash_differs']['count']} of {n} prompts differ between the runs "
            "(prompt_hash): the protocols differ (chat template, few-shot, system prompt)"
        )
    if pairing["dropped_reference_only"] or pairing["dropped_candidate_only"]:
        notes.append(
            f"--allow-partial: {len(pairing['dropped_reference_only'])} reference-only and "
            f"{len(pairing['dropped_candidate_only'])} candidate-only docs dropped"
        )
    return notes


def _doc_rows(ids, prompts, ref_v, cand_v, ref_rows, cand_rows) -> list[dict[str, Any]]:
    """One record per paired doc; the task-specific fields start empty and are filled by the later passes."""
    bucket_of = {i: b for b, docs in (prompts or {}).items() for i in docs}
    rows = []
    for i, r, c in zip(ids, ref_v, cand_v, strict=True):
        doc = ref_rows[i].get("doc")
        rows.append(
            {
                "doc_id": i,
                "key": doc.get("key") if isinstance(doc, dict) and isinstance(doc.get("key"), int | str) else None,
                "bucket": bucket_of.get(i),
                "reference": float(r),
                "candidate": float(c),
                "difference": float(c - r),
                "prompt_hash_same": ref_rows[i].get("prompt_hash") == cand_rows[i].get("prompt_hash"),
                **dict.fromkeys(_LATER_FIELDS),
            }
        )
    return rows


# Per-doc fields set by the truncation, IFEval and lenient-filter passes (None until then).
_LATER_FIELDS = (
    "truncated",
    "reference_truncated",
    "failure_kind",
    "failure_detail",
    "n_instructions",
    "reference_instructions_passed",
    "candidate_instructions_passed",
    "lenient_candidate",
    "format_split",
    "noise_flip",
)


def _wilcoxon(d: np.ndarray) -> float:
    if not np.any(d != 0):
        return 1.0
    from scipy.stats import wilcoxon

    return float(wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)


def _generated(row: Mapping[str, Any]) -> str | None:
    """The response a generation task's sample holds (None for a log-likelihood request, whose `arg_1` is the
    continuation scored, not generation kwargs)."""
    args = row.get("arguments")
    first = args.get("gen_args_0") if isinstance(args, Mapping) else None
    if isinstance(first, Mapping) and isinstance(first.get("arg_1"), str):
        return None
    return _response(row, filtered=False)


def _truncated_side(
    p: _Paired, side: int, settings: BucketSettings, count_tokens, fallback
) -> tuple[dict[int, bool | None], dict[str, Any]]:
    """Whether each paired doc's response of one run (0 reference, 1 candidate) hit the generation limit, and the
    run's counts."""
    rows, marks, sources = (p.ref_rows, p.cand_rows)[side], {}, set()
    for i in p.ids:
        response = _generated(rows[i])
        if response is None:
            continue
        limit, source = settings.max_gen_toks, "--max-gen-toks"
        if limit is None:
            limit, source = max_gen_toks_of(rows[i]), "the samples' generation kwargs"
        if limit is None and fallback is not None:
            limit, source = fallback
        sources.add(f"{limit} ({source})" if limit is not None else "unknown")
        marks[i] = is_truncated(response, limit, count_tokens)
    counts = {
        "responses": len(marks),
        "truncated": sum(bool(t) for t in marks.values()),
        "unknown": sum(t is None for t in marks.values()),
        "max_gen_toks": sorted(sources),
    }
    return marks, counts


def _mark_truncation(
    p: _Paired, regressions, by_id, settings: BucketSettings, count_tokens, fallbacks
) -> dict[str, Any] | None:
    """Whether each response of both runs hit the generation limit, over every paired doc: each row's `truncated`
    (the candidate's response) and `reference_truncated`, each run's counts, and the regressions whose candidate
    response hit it (None: no generated responses)."""
    fallbacks = fallbacks or (None, None)
    ref_marks, ref_counts = _truncated_side(p, 0, settings, count_tokens, fallbacks[0])
    cand_marks, cand_counts = _truncated_side(p, 1, settings, count_tokens, fallbacks[1])
    if not ref_marks and not cand_marks:
        return None
    for i in p.ids:
        by_id[i].update(truncated=cand_marks.get(i), reference_truncated=ref_marks.get(i))
    method = (
        "token count >= max_gen_toks - max(2, 1%)"
        if count_tokens is not None
        else "heuristic: ends mid-sentence and >= max_gen_toks UTF-8 bytes"
    )
    regs = [cand_marks[i] for i in regressions if i in cand_marks]
    return {
        "reference": ref_counts,
        "candidate": cand_counts,
        "regressions_truncated": sum(bool(t) for t in regs),
        "regressions_unknown": sum(t is None for t in regs),
        "method": method,
        "max_gen_toks": cand_counts["max_gen_toks"],
    }


def _instruction_stats(
    ids: Sequence[int],
    ref_rows: Mapping[int, Mapping],
    cand_rows: Mapping[int, Mapping],
    inst_metric: str,
    by_id: dict[int, dict[str, Any]],
    settings: BucketSettings,
    labels: tuple[str, str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """IFEval's instruction-level accuracy (cluster bootstrap over prompts) and its per-instruction-type table; fills
    each doc's instruction counts in `by_id`."""
    ref_p, cand_p, n_items = [], [], []
    per_type: dict[str, list[tuple[bool, bool]]] = {}
    for i in ids:
        names, ra, cb = _instructions(i, ref_rows[i], cand_rows[i], inst_metric, labels)
        ref_p.append(sum(ra))
        cand_p.append(sum(cb))
        n_items.append(len(ra))
        by_id[i].update(
            n_instructions=len(ra), reference_instructions_passed=sum(ra), candidate_instructions_passed=sum(cb)
        )
        for name, r, c in zip(names, ra, cb, strict=True):
            per_type.setdefault(name, []).append((r, c))
    total = sum(n_items)
    ref_score, cand_score = sum(ref_p) / total, sum(cand_p) / total
    ci, method = None, f"withheld: a cluster bootstrap over {len(ids)} prompts (at least {MIN_N} are needed)"
    rates = (np.array(cand_p) - np.array(ref_p)) / np.array(n_items)
    if len(ids) >= MIN_N and np.ptp(rates) == 0:  # every resample the same ratio: a zero-width interval
        method = "withheld: every prompt's share of instructions gained or lost is the same, so a cluster bootstrap "
        method += "has zero width, a certainty the prompts do not give"
    elif len(ids) >= MIN_N:
        ci = cluster_delta_ci(
            np.array(ref_p),
            np.array(cand_p),
            np.array(n_items),
            settings.n_bootstrap,
            settings.confidence,
            settings.seed,
        )
        method = "cluster bootstrap: whole prompts resampled with their instructions"
    pairs = [p for name in per_type for p in per_type[name]]
    level = {
        "metric": inst_metric,
        "n_instructions": total,
        "reference_score": ref_score,
        "candidate_score": cand_score,
        "delta": cand_score - ref_score,
        "delta_ci": None if ci is None else list(ci),
        "counts": _four([r for r, _ in pairs], [c for _, c in pairs]),
        "method": method,
    }
    return level, _instruction_type_table(per_type)


def _instructions(
    i: int, ref_row: Mapping, cand_row: Mapping, inst_metric: str, labels: tuple[str, str]
) -> tuple[list[str], list[bool], list[bool]]:
    """One doc's instruction ids (`instruction_k` where the doc lists none) and each run's pass per instruction."""
    a, b = ref_row.get(inst_metric), cand_row.get(inst_metric)
    doc = ref_row.get("doc") or {}
    names = doc.get("instruction_id_list")
    for label, v in zip(labels, (a, b), strict=True):
        if not isinstance(v, list):
            raise UserError(
                f"{label}: doc_id {i} has no instruction-level list {inst_metric!r}",
                "pass IFEval samples written by lm-eval --log_samples",
            )
    if len(a) != len(b) or (isinstance(names, list) and len(names) != len(a)):
        raise UserError(
            f"doc_id {i}: the runs list different numbers of instructions ({len(a)} vs {len(b)})",
            "pass two IFEval runs of the same task version",
        )
    names = names if isinstance(names, list) else [f"instruction_{k}" for k in range(len(a))]
    return names, [bool(x) for x in a], [bool(x) for x in b]


def _instruction_type_table(per_type: Mapping[str, list[tuple[bool, bool]]]) -> list[dict[str, Any]]:
    """One row per instruction type: buckets, rates, delta, exact McNemar and Holm-adjusted p; most regressions
    first."""
    table = []
    for name, pairs in per_type.items():
        counts = _four([r for r, _ in pairs], [c for _, c in pairs])
        nn = len(pairs)
        table.append(
            {
                "instruction_id": name,
                "n": nn,
                **counts,
                "reference_rate": sum(r for r, _ in pairs) / nn,
                "candidate_rate": sum(c for _, c in pairs) / nn,
                "delta": (sum(c for _, c in pairs) - sum(r for r, _ in pairs)) / nn,
                "regression_rate": counts["regression"] / nn,
                "mcnemar_p": mcnemar_exact(counts["regression"], counts["recovered"]),
                "too_few_to_test": nn < MIN_N,
            }
        )
    for row, p in zip(table, holm([t["mcnemar_p"] for t in table]), strict=True):
        row["holm_p"] = p
    table.sort(key=lambda t: (-t["regression"], -(t["regression"] - t["recovered"]), t["instruction_id"]))
    return table


def _failure_kinds(regressions, cand_rows, by_id, loose: bool, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    table = ifeval_instructions()
    kinds, disagreements = [], 0
    for i in tqdm(regressions, desc="failure kinds", disable=not progress, leave=False):
        doc = cand_rows[i].get("doc")
        response = _response(cand_rows[i], filtered=True)
        if not isinstance(doc, dict) or response is None:
            by_id[i].update(failure_kind="other", failure_detail="no doc or response in the candidate samples")
            kinds.append("other")
            continue
        fk = classify_ifeval(doc, response, loose, by_id[i]["truncated"], table)
        disagreements += not fk.checker_agrees
        by_id[i].update(failure_kind=fk.kind, failure_detail=fk.detail)
        kinds.append(fk.kind)
    return {
        "counts": kind_counts(kinds),
        "checker": "lm_eval.tasks.ifeval.utils "
        + ("loose" if loose else "strict")
        + " check re-run on the candidate responses",
        "checker_disagreements": disagreements,
        "rule": "truncation (hit the limit and a failed instruction can break by cutting) > language > "
        "phrase_marker > length > format > other",
    }


def _format_split(regressions, candidate_samples, lenient: str, metric: str, by_id, label) -> dict[str, Any] | None:
    if not any(filter_of(r) == lenient for r in candidate_samples):
        return {
            "lenient_filter": lenient,
            "format_failure": None,
            "wrong_answer": None,
            "unknown": len(regressions),
            "reason": f"the candidate samples have no {lenient!r} filter",
        }
    lenient_rows = index_docs(candidate_samples, lenient, label)
    fmt, wrong, unknown = [], [], []
    for i in regressions:
        row = lenient_rows.get(i)
        if row is None or metric not in row:
            unknown.append(i)
            continue
        ok = outcome(row, metric, label) >= 0.5
        by_id[i].update(lenient_candidate=ok, format_split="format_failure" if ok else "wrong_answer")
        (fmt if ok else wrong).append(i)
    return {
        "lenient_filter": lenient,
        "format_failure": len(fmt),
        "wrong_answer": len(wrong),
        "unknown": len(unknown),
        "format_failure_ids": fmt,
        "wrong_answer_ids": wrong,
    }


# --- protocol records (pure: from protocols.py fingerprints) ---------------------------------------

_HF_BACKENDS = ("hf", "hf-auto", "huggingface")
_HF_DEFAULT_MAX_GEN_TOKS = 256  # lm_eval.models.huggingface.HFLM.max_gen_toks (0.4.13)
# buckets.json names three fingerprint fields its own way (`runs.*.protocol`, `protocol_differences`);
# every other field keeps the name protocols.task_view / task_diff give it.
_FIELD_NAMES = {
    "apply_chat_template": "chat_template_applied",
    "chat_template": "chat_template_sha",
    "version": "task_version",
}


def _field_name(field: str, task: str) -> str:
    head, dot, rest = field.removeprefix(f"tasks.{task}.").partition(".")
    return _FIELD_NAMES.get(head, head) + dot + rest


def protocol_record(fp, task: str) -> dict[str, Any]:
    """Model and protocol of one run for `task`, from its fingerprint (buckets.json `runs.<side>`, less the file
    hashes)."""
    from lm_eval_sink.protocols import task_view

    return {
        "model": fp.run["model_name"] or fp.run["pretrained"],
        "model_args": fp.run["model_args"],
        "model_sha": fp.run["model_sha"],
        "protocol": {_field_name(k, task): v for k, v in task_view(fp, task).items()},
        "harness_sha": fp.harness_sha(tasks=(task,)),
        "lm_eval_version": fp.harness["lm_eval_version"],
        "task_hash": (fp.run["task_hashes"] or {}).get(task),
        "default_max_gen_toks": _run_max_gen_toks(fp, task),
    }


def _run_max_gen_toks(fp, task: str) -> dict[str, Any] | None:
    """The generation limit a run used for `task`: the task's generation kwargs, else model_args, else lm-eval's hf
    default."""
    value = max_gen_toks_in((fp.harness["tasks"].get(task) or {}).get("generation_kwargs"))
    if value is not None:
        return {"value": value, "source": "the run's task generation_kwargs"}
    raw = fp.harness["model_args"].get("max_gen_toks")
    if raw is not None:
        try:
            return {"value": int(raw), "source": "the run's model_args"}
        except (TypeError, ValueError):
            return None
    if fp.run["model"] in _HF_BACKENDS:
        return {"value": _HF_DEFAULT_MAX_GEN_TOKS, "source": "lm-eval's hf backend default"}
    return None


def protocol_differences(ref_fp, cand_fp, task: str) -> dict[str, Any]:
    """Every fingerprint field bearing on `task` that differs between the two runs (protocols.task_diff)."""
    from lm_eval_sink.protocols import task_diff

    if ref_fp is None or cand_fp is None:
        return {}
    return {
        _field_name(d.field, task): {"reference": d.a, "candidate": d.b, "affects_scores": d.affects_scores}
        for d in task_diff(ref_fp, cand_fp, (task,))
    }


def _by_effect(diffs: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The fields of `protocol_differences` that can change the task's scores, and those that cannot."""
    can = [k for k, d in diffs.items() if not isinstance(d, Mapping) or d.get("affects_scores") is not False]
    return can, [k for k in diffs if k not in can]


def with_runs(
    report: BucketReport, runs: dict[str, Any], diffs: dict[str, Any], provenance: dict[str, Any]
) -> BucketReport:
    """`report` with both runs' records, their protocol differences and the notes they imply."""
    notes = list(report.notes)
    can, cannot = _by_effect(diffs)
    if can:
        notes.append("protocols differ in " + ", ".join(can) + ": the delta mixes model and protocol effects")
    if cannot:
        notes.append("the protocols also differ in " if can else "the protocols differ only in ")
        notes[-1] += ", ".join(cannot) + ", which cannot change this task's scores"
    can, _ = _by_effect((runs.get("repeat") or {}).get("protocol_differences_from_reference") or {})
    if can:
        notes.append(
            "the repeat's protocol differs from the reference's in "
            + ", ".join(can)
            + ": its flips mix run-to-run noise and those differences"
        )
    limits = {
        k: runs[k]["protocol"]["limit"]
        for k in runs
        if runs[k].get("protocol") and runs[k]["protocol"].get("limit") is not None
    }
    if limits:
        notes.append(
            "non-final: run with --limit ("
            + ", ".join(f"{k} {v:g}" for k, v in limits.items())
            + "); these are not full-benchmark scores"
        )
    return replace(report, runs=runs, protocol_differences=diffs, notes=notes, provenance=provenance)


def with_noise_floor(
    report: BucketReport,
    reference_samples: Sequence[Mapping[str, Any]],
    repeat_samples: Sequence[Mapping[str, Any]],
    settings: BucketSettings,
    labels: tuple[str, str] = ("reference samples", "repeat samples"),
) -> BucketReport:
    """`report` with the noise floor of a second run of the reference under the same protocol (`--repeat`).

    The two reference runs are paired as the comparison was (same metric and filter); a doc "flips" when its
    pass/fail differs between them. The flip rate, and the reference->repeat regressions as a rate, say how many
    regressions noise alone gives over the comparison's docs; each regression on a doc that flipped is marked
    (`noise_flip`).
    """
    if report.counts is None:
        raise UserError(
            "--repeat needs pass/fail outcomes, and the metric is continuous",
            "pass --threshold T to split docs into pass (score >= T) / fail, or drop --repeat",
        )
    fixed = replace(settings, metric=report.metric, filter=report.filter, failure_kinds=False)
    p = _pair(reference_samples, repeat_samples, report.task, fixed, labels, ("reference", "repeat"))
    thr = 0.5 if report.kind == "binary" else float(report.threshold)
    ref_pass = dict(zip(p.ids, (p.ref_v >= thr).tolist(), strict=True))
    rep_pass = dict(zip(p.ids, (p.cand_v >= thr).tolist(), strict=True))
    common = [row["doc_id"] for row in report.rows if row["doc_id"] in ref_pass]
    if not common:
        raise UserError(f"{labels[1]}: no doc of the comparison is in the repeat", "pass a second run of the same task")
    flips = {i for i in common if ref_pass[i] != rep_pass[i]}
    down = sum(1 for i in common if ref_pass[i] and not rep_pass[i])
    regressions = (report.prompts or {}).get("regression", [])
    expected = down / len(common) * report.n
    floor = {
        "n": len(common),
        "flips": len(flips),
        "flip_rate": len(flips) / len(common),
        "pass_to_fail": down,
        "fail_to_pass": len(flips) - down,
        "expected_regressions": expected,
        "regressions": len(regressions),
        "explained_by_noise": min(len(regressions), math.floor(expected + 0.5)),
        "regressions_on_flipping_docs": sorted(i for i in regressions if i in flips),
        "identical": identical_samples(p),
    }
    rows = [
        {**row, "noise_flip": (row["doc_id"] in flips) if row["doc_id"] in ref_pass else None} for row in report.rows
    ]
    notes = [*report.notes, _noise_sentence(floor)]
    if floor["identical"]:
        notes += _self_notes(True, len(p.ids), "the reference and its repeat")
        notes.append(_identical_repeat_reason(p))
    return replace(report, rows=rows, noise_floor=floor, notes=notes)


NOISE_SOURCES = (
    "another batch size (padding and batched kernels change the numerics), another machine or GPU (other kernels), "
    "or sampling (do_sample with temperature > 0) under another seed"
)


def _decoding(p: _Paired) -> str:
    """How the reference's samples were produced, from their requests: greedy decoding, sampling, or log-likelihood
    scoring of fixed continuations (no generation)."""
    kinds = set()
    for i in p.ids:
        args = p.ref_rows[i].get("arguments")
        gen = (args.get("gen_args_0") or {}).get("arg_1") if isinstance(args, Mapping) else None
        if isinstance(gen, str):
            kinds.add("loglikelihood")
        elif isinstance(gen, Mapping):
            sampled = gen.get("do_sample") is True and gen.get("temperature", 1.0) not in (0, 0.0)
            kinds.add("sampling" if sampled else "greedy")
    return kinds.pop() if len(kinds) == 1 else "unknown"


def _identical_repeat_reason(p: _Paired) -> str:
    """Why a repeat gave the reference's samples again, and what would measure run-to-run noise."""
    why = {
        "greedy": "greedy decoding with the same model, settings and machine is deterministic",
        "loglikelihood": "log-likelihood scoring of fixed choices with the same model, settings and machine is "
        "deterministic",
        "sampling": "sampling with the same seed and settings draws the same tokens",
    }.get(_decoding(p), "the same model, settings and seed on the same machine reproduce every sample")
    return (
        f"why the repeat is identical: {why}, so a repeat under the same conditions measures no noise; to measure "
        f"run-to-run noise, repeat the reference with {NOISE_SOURCES}"
    )


def _noise_sentence(f: Mapping[str, Any]) -> str:
    """The noise floor in words, with its figures."""
    return (
        f"noise floor (--repeat, a second run of the reference): {f['flips']} of {f['n']} docs flip between the two "
        f"reference runs (flip rate {100 * f['flip_rate']:.1f}%: {f['pass_to_fail']} pass->fail, "
        f"{f['fail_to_pass']} fail->pass); at that rate noise alone gives about {f['expected_regressions']:.1f} "
        f"regressions, so {f['explained_by_noise']} of the candidate's {f['regressions']} regressions could be noise "
        f"alone; {len(f['regressions_on_flipping_docs'])} of them are on docs that flipped between the reference "
        "runs (noise_flip in prompts.csv)"
    )


# --- reports (text) --------------------------------------------------------------------------------


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{100 * x:.1f}" if pct else f"{x:.4g}"
    return str(x)


def summary_markdown(report: Mapping[str, Any], top: int = 15) -> str:
    """The Markdown summary of a saved report (buckets.json), tables first."""
    lines = _heading_lines(report) + _bucket_lines(report) + _score_lines(report) + power_lines(report)
    lines += _regression_lines(report) + _instruction_type_lines(report, top)
    if notes(report):
        lines += ["Notes:", ""] + [f"- {n}" for n in notes(report)] + [""]
    return "\n".join(lines)


def notes(report: Mapping[str, Any]) -> list[str]:
    """Every note of a saved report (buckets.json) in words, for buckets.md and the HTML report alike: the responses
    that hit the generation limit, then the report's own notes."""
    tr = report.get("truncation")
    return ([_truncation_sentence(tr)] if tr else []) + list(report.get("notes") or [])


def figure_title(report: Mapping[str, Any]) -> str:
    """The bucket figure's title (buckets.png, the report's figure): "too few to tell" first below MIN_N docs."""
    what = f"{report['task']}: {report['metric']} ({report['filter']}), {report['n']} paired docs"
    return ("too few to tell: " if report.get("too_few_to_tell") else "") + what


def _heading_lines(report: Mapping[str, Any]) -> list[str]:
    """Title, the two runs and the number of paired docs."""
    lines = [f"# Regression buckets: {report['task']} ({report['metric']}, filter {report['filter']})", ""]
    runs = report.get("runs") or {}
    for side in ("reference", "candidate"):
        r = runs.get(side)
        if r:
            run = f" (run {PurePath(r['run']).name})" if r.get("run") else ""
            lines.append(f"- {side}: {r.get('model') or r['samples_file']}{run}")
    lines += [f"- paired docs: {report['n']}", ""]
    if report.get("too_few_to_tell"):
        lines += [
            f"**{report['too_few_to_tell'][0].upper()}{report['too_few_to_tell'][1:]}.** Every figure below describes "
            "these docs only; none is evidence of a difference between the models.",
            "",
        ]
    return lines


def _bucket_lines(report: Mapping[str, Any]) -> list[str]:
    """The four buckets' counts and shares, or why there are none (a continuous metric without a threshold)."""
    if not report.get("counts"):
        return [f"buckets: {report['counts_reason']}", ""]
    n, counts = report["n"], report["counts"]
    rows = [[b, counts[b], f"{100 * counts[b] / n:.1f}%"] for b in BUCKETS]
    return [*markdown_lines(["bucket", "prompts", "share"], rows), ""]


def _delta_text(delta: float, ci: Sequence[float] | None, pct: bool, too_few: bool) -> str:
    """A delta with its interval ("withheld" when there is none), "too few to tell" first below MIN_N docs."""
    interval = f"[{_fmt(ci[0], pct)}, {_fmt(ci[1], pct)}]" if ci is not None else "[interval withheld]"
    return ("too few to tell: " if too_few else "") + f"{_fmt(delta, pct)} {interval}"


def _score_lines(report: Mapping[str, Any]) -> list[str]:
    """One score table: the metric, and the instruction-level accuracy (IFEval) or pass rate (threshold) if any;
    then how each interval was computed."""
    r, pct, few = report, report["kind"] == "binary", bool(report.get("too_few_to_tell"))
    mcnemar = _fmt(r["mcnemar_p"])
    delta = _delta_text(r["delta"], r["delta_ci"], pct, few)
    tests = [mcnemar if pct else "n/a", _fmt(r["wilcoxon_p"])]  # a continuous metric's McNemar is its pass rate's
    rows = [[r["metric"], _fmt(r["reference_score"], pct), _fmt(r["candidate_score"], pct), delta, *tests]]
    methods = [f"{r['metric']}: {r.get('delta_ci_method') or 'paired bootstrap over docs'}"]
    il = r.get("instruction_level")
    if il:
        what = f"{il['metric']} ({il['n_instructions']} instructions)"
        delta = _delta_text(il["delta"], il["delta_ci"], True, few)
        rows.append([what, _fmt(il["reference_score"], True), _fmt(il["candidate_score"], True), delta, "n/a", "n/a"])
        methods.append(f"{il['metric']}: {il['method']}")
    pr = r.get("pass_rate")
    if pr:
        what = f"pass rate (score >= {pr['threshold']:g})"
        delta = _delta_text(pr["delta"], pr["delta_ci"], True, few)
        rows.append([what, _fmt(pr["reference"], True), _fmt(pr["candidate"], True), delta, mcnemar, "n/a"])
        methods.append(f"pass rate: {pr.get('delta_ci_method') or 'paired bootstrap over docs'}")
    conf = round(100 * r["settings"]["confidence"])
    unit = " (points)" if pct else f" ({r['metric']} in its own unit" + ("; pass rate in points)" if pr else ")")
    head = ["score" + unit, "reference", "candidate", f"delta [{conf}% CI]"]
    return [*markdown_lines([*head, "McNemar p", "Wilcoxon p"], rows), "", "Intervals: " + "; ".join(methods), ""]


def _regression_lines(report: Mapping[str, Any]) -> list[str]:
    """What the regressions are: failure kinds (IFEval), format failures vs wrong answers (truncation: `notes`)."""
    lines = []
    fk = report.get("failure_kinds")
    if fk:
        lines += ["Failure kinds of the regressions (one primary kind each):", ""]
        lines += [*markdown_lines(["kind", "regressions"], fk["counts"].items()), ""]
    fs = report.get("format_split")
    if fs:
        lines += [
            f"Regressions split by the {fs['lenient_filter']} filter: format failures (lenient answer "
            f"right, strict wrong) {_fmt(fs['format_failure'])}, "
            f"wrong answers {_fmt(fs['wrong_answer'])}, unknown {fs['unknown']}.",
            "",
        ]
    return lines


def _truncation_sentence(tr: Mapping[str, Any]) -> str:
    """Responses that hit the generation limit, per run over every paired doc, and among the regressions."""
    counts, limits = [], []
    for side in ("reference", "candidate"):
        c = tr[side]
        counts.append(
            f"{side} {c['truncated']} of {c['responses']}" + (f" ({c['unknown']} unknown)" if c["unknown"] else "")
        )
        limits.append(", ".join(c["max_gen_toks"]))
    limit = limits[0] if limits[0] == limits[1] else f"reference {limits[0]}; candidate {limits[1]}"
    unknown = f" ({tr['regressions_unknown']} unknown)" if tr["regressions_unknown"] else ""
    return (
        f"Responses that hit the generation limit: {', '.join(counts)}; regressions {tr['regressions_truncated']}"
        f"{unknown} (max_gen_toks {limit}; {tr['method']})."
    )


def power_lines(report: Mapping[str, Any]) -> list[str]:
    """What the comparison could have detected (power.comparison_power's record), in points for a 0/1 outcome."""
    pw = report.get("power")
    if not pw:
        return []
    if pw["too_few"]:
        return [f"Power: {pw['too_few']}; no statement about what this comparison could detect.", ""]
    binary = pw["discordant_share"] is not None
    unit = " points" if binary else f" ({report['metric']} units)"
    spread = (
        f"discordant share {100 * pw['discordant_share']:.1f}%"
        if binary
        else f"sd of the per-doc differences {pw['sd_difference']:.4g}"
    )
    what = f"a difference of {pw['effect_shown']:g}{unit} ({pw['effect_source']})"
    exact = " (the exact McNemar test buckets runs: {:.0%})"
    if pw["mde"] is None:
        mde = pw["not_detectable"]
    else:
        mde = (
            f"{100 * pw['mde']:.1f}" if binary else f"{pw['mde']:.4g}"
        ) + f"{unit} (power {pw['target_power']:g} there"
        mde += f"; the exact McNemar test buckets runs: {pw['power_at_mde_exact']:.0%})" if binary else ")"
    if pw["effect_impossible"]:
        power, needed = f"none at this discordant share: {pw['effect_impossible']}", "n/a (see above)"
    else:
        power = f"{pw['power_at_effect']:.0%}" + (exact.format(pw["power_at_effect_exact"]) if binary else "")
        needed = str(pw["n_for_effect"]) if pw["n_for_effect"] is not None else f"more than {MAX_N:,}"
    return [
        f"Power (alpha {pw['alpha']:g} two-sided, power {pw['target_power']:g}; the test: {pw['test']}; "
        f"{pw['method']}; {pw['n']} paired docs, {spread}):",
        "",
        f"- minimum detectable difference at this n: {mde}",
        f"- power to detect {what}: {power}",
        f"- paired docs that difference would need for power {pw['target_power']:g}: {needed}",
        "",
    ]


_TYPE_COLUMNS = ("instruction_id", "n", "regression", "recovered", "reference %", "candidate %", "delta")


def _instruction_type_lines(report: Mapping[str, Any], top: int) -> list[str]:
    """The `top` instruction types by regressions (IFEval), with per-type and Holm-adjusted McNemar p-values."""
    types = report.get("instruction_types")
    if not types:
        return []
    rows = [
        [
            t["instruction_id"],
            t["n"],
            t["regression"],
            t["recovered"],
            f"{100 * t['reference_rate']:.1f}",
            f"{100 * t['candidate_rate']:.1f}",
            *(
                ("too few to test", "-", "-")
                if t.get("too_few_to_test")
                else (f"{100 * t['delta']:+.1f}", f"{t['mcnemar_p']:.3g}", f"{t['holm_p']:.3g}")
            ),
        ]
        for t in types[:top]
    ]
    intro = (
        f"Instruction types by regressions (top {min(top, len(types))} of {len(types)}; points; McNemar p "
        f"per type and Holm-adjusted over all {len(types)} types; types with fewer than {MIN_N} instructions are "
        "too few to test; descriptive, types are not independent tests of one hypothesis):"
    )
    return [intro, "", *markdown_lines([*_TYPE_COLUMNS, "McNemar p", "Holm p"], rows), ""]


CSV_COLUMNS = (
    "doc_id",
    "key",
    "bucket",
    "reference",
    "candidate",
    "difference",
    "prompt_hash_same",
    *_LATER_FIELDS,
)


def rows_csv(report: Mapping[str, Any]) -> str:
    """One CSV row per paired doc of a saved report."""
    return csv_text(
        CSV_COLUMNS, (["" if row.get(c) is None else row[c] for c in CSV_COLUMNS] for row in report["rows"])
    )
