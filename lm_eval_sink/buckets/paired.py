"""Two samples logs joined per doc under one filter and metric (`pair`; the join itself: pairing.py), and what
a sample's response is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_eval_sink.benchmarks import Benchmark, benchmark_of, load_benchmarks
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.errors import UserError
from lm_eval_sink.pairing import filter_of, index_docs, outcome, pair_docs
from lm_eval_sink.schema import did_you_mean

# a task in no family of data/benchmarks.yaml: metric, filter and kind come from the samples
_GENERIC = Benchmark.model_construct(name="generic", tasks=["*"], construct_="unknown", strict=None, lenient=None)


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


def response_text(row: Mapping, filtered: bool) -> str | None:
    key = "filtered_resps" if filtered else "resps"
    v = row.get(key)
    while isinstance(v, list) and v:
        v = v[0]
    return v if isinstance(v, str) else None


@dataclass(frozen=True, slots=True)
class Paired:
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


def pair(
    reference_samples: Sequence[Mapping[str, Any]],
    candidate_samples: Sequence[Mapping[str, Any]],
    task: str | None,
    settings: BucketSettings,
    labels: tuple[str, str],
    sides: tuple[str, str] = ("reference", "candidate"),
) -> Paired:
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
    return Paired(spec, filt, metric, ids, pairing, ref_rows, cand_rows, ref_v, cand_v)


def identical_samples(p: Paired) -> bool:
    """Whether both logs hold the same sample for every paired doc: same prompt, responses and outcome (a run
    against itself, or a copy of it)."""
    keys = ("prompt_hash", "resps", "filtered_resps")
    return bool(np.array_equal(p.ref_v, p.cand_v)) and all(
        all(p.ref_rows[i].get(k) == p.cand_rows[i].get(k) for k in keys) for i in p.ids
    )


def generated(row: Mapping[str, Any]) -> str | None:
    """The response a generation task's sample holds (None for a log-likelihood request, whose `arg_1` is the
    continuation scored, not generation kwargs)."""
    args = row.get("arguments")
    first = args.get("gen_args_0") if isinstance(args, Mapping) else None
    if isinstance(first, Mapping) and isinstance(first.get("arg_1"), str):
        return None
    return response_text(row, filtered=False)
