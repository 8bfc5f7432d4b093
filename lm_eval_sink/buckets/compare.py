"""`bucket`: pair two samples logs of one task per doc and compute its buckets, paired statistics, power and
per-doc passes into one frozen `BucketReport`, with the notes the pairing and the outputs call for."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from lm_eval_sink.benchmarks import Benchmark
from lm_eval_sink.buckets.paired import generated, identical_samples, pair
from lm_eval_sink.buckets.rows import doc_rows, ifeval_passes, lenient_split, mark_truncation
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.buckets.stats import interval_test_notes, paired_stats
from lm_eval_sink.errors import UserError
from lm_eval_sink.power import MIN_N, comparison_power, too_few

SCHEMA_VERSION = 1
UNITS = (
    "scores, deltas, intervals and rates are in the metric's own unit as lm-eval writes it: a share of docs (0-1) "
    "for a 0/1 metric, which buckets.md and the report show in points (x100); power.effect_shown is in points "
    "for a 0/1 metric"
)


@dataclass(frozen=True, slots=True)
class BucketReport:
    """Buckets and paired statistics of one task's reference vs candidate samples (buckets.json; None fields say
    why in `counts_reason`, `delta_ci_method`); `rows` holds one record per paired doc, sorted by doc_id."""

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
    """Pair two samples logs of `task` per doc and compute buckets and paired statistics. `count_tokens` makes
    truncation exact (else failure_kinds' heuristic); `fallback_max_gen_toks` is each run's (limit, source) where
    the samples record none; `labels` name the two logs in errors."""
    p = pair(reference_samples, candidate_samples, task, settings, labels)
    kind = metric_kind(p.ids, p.ref_v, p.cand_v, p.metric, p.spec, settings)
    stats = paired_stats(p.ids, p.ref_v, p.cand_v, kind, settings)
    rows = doc_rows(p.ids, stats.prompts, p.ref_v, p.cand_v, p.ref_rows, p.cand_rows)
    by_id = {row["doc_id"]: row for row in rows}
    regressions = stats.prompts["regression"] if stats.prompts else []
    truncation = mark_truncation(p, regressions, by_id, settings, count_tokens, fallback_max_gen_toks)
    instruction_level, instruction_types, failure = ifeval_passes(p, by_id, regressions, settings, labels, progress)
    format_split = None
    if p.spec.lenient_filter and p.filter != p.spec.lenient_filter and stats.prompts is not None:
        format_split = lenient_split(regressions, candidate_samples, p.spec.lenient_filter, p.metric, by_id, labels[1])
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
        + self_notes(identical_samples(p), len(p.ids), "reference and candidate")
        + interval_test_notes(stats, settings.confidence),
        power=power_of(kind, p.ref_v, p.cand_v, settings, p.spec.score_range),
        too_few_to_tell=too_few(len(p.ids)) if len(p.ids) < MIN_N else None,
    )


def power_of(
    kind: str, ref_v: np.ndarray, cand_v: np.ndarray, settings: BucketSettings, score_range: list[float] | None = None
) -> dict[str, Any]:
    """The power of the test a paired comparison runs, at the level of its interval (alpha = 1 - confidence): McNemar
    on the 0/1 metric, or on pass/fail under `--threshold`; Wilcoxon on a continuous metric's differences."""
    alpha = round(1 - settings.confidence, 12)  # 0.05, not 0.050000000000000044
    if kind == "continuous" and settings.threshold is not None:
        thr = settings.threshold
        passes = (cand_v >= thr).astype(float) - (ref_v >= thr).astype(float)
        return comparison_power("binary", passes, settings.effect, outcome=f"pass/fail (score >= {thr:g})", alpha=alpha)
    spread = {"values": np.concatenate([ref_v, cand_v]), "declared_range": score_range}
    return comparison_power(kind, cand_v - ref_v, settings.effect, alpha=alpha, **spread)


def metric_kind(
    ids, ref_v: np.ndarray, cand_v: np.ndarray, metric: str, spec: Benchmark, settings: BucketSettings
) -> str:
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


COLLAPSE_MIN_DOCS = 20  # fewer paired prompts say too little about a model's repertoire
COLLAPSE_DISTINCT = 0.25  # at most this share of distinct responses: a few answers repeated, whatever the prompt


def _collapse_notes(ids, ref_rows, cand_rows, labels: tuple[str, str]) -> list[str]:
    """A run that gives the same few responses to every prompt has collapsed (e.g. a model trained on one caption
    format answers IFEval with captions): its passes and failures measure the collapse, not instruction following."""
    notes = []
    for label, rows in zip(labels, (ref_rows, cand_rows), strict=True):
        texts = [t for t in (generated(rows[i]) for i in ids) if t is not None]
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


def self_notes(identical: bool, n: int, what: str) -> list[str]:
    """A note when the two logs hold the same samples: every difference is zero by construction."""
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
