"""One record per paired doc (`doc_rows`) and the passes that fill its task-specific fields: truncation of both
runs' responses (`mark_truncation`), IFEval's instruction level, instruction types and failure kinds
(`ifeval_passes`), and the lenient filter's format split (`format_split`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lm_eval_sink.benchmarks import ifeval_instructions
from lm_eval_sink.buckets.paired import Paired, generated, response_text
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.buckets.stats import cluster_delta_ci, four, holm, mcnemar_exact
from lm_eval_sink.errors import UserError
from lm_eval_sink.failure_kinds import classify_ifeval, is_truncated, kind_counts, max_gen_toks_of
from lm_eval_sink.pairing import filter_of, index_docs, outcome
from lm_eval_sink.power import MIN_N


def doc_rows(ids, prompts, ref_v, cand_v, ref_rows, cand_rows) -> list[dict[str, Any]]:
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
                **dict.fromkeys(LATER_FIELDS),
            }
        )
    return rows


# Per-doc fields set by the truncation, IFEval and lenient-filter passes (None until then).
LATER_FIELDS = (
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


def _truncated_side(
    p: Paired, side: int, settings: BucketSettings, count_tokens, fallback
) -> tuple[dict[int, bool | None], dict[str, Any]]:
    """Whether each response of one run (0 reference, 1 candidate) hit the generation limit, and the run's counts."""
    rows, marks, sources = (p.ref_rows, p.cand_rows)[side], {}, set()
    for i in p.ids:
        response = generated(rows[i])
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


def mark_truncation(
    p: Paired, regressions, by_id, settings: BucketSettings, count_tokens, fallbacks
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


def ifeval_passes(
    p: Paired,
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
        "counts": four([r for r, _ in pairs], [c for _, c in pairs]),
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
    """One row per instruction type (buckets, rates, delta, McNemar and Holm p), most regressions first."""
    table = []
    for name, pairs in per_type.items():
        counts = four([r for r, _ in pairs], [c for _, c in pairs])
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
        response = response_text(cand_rows[i], filtered=True)
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


def lenient_split(regressions, candidate_samples, lenient: str, metric: str, by_id, label) -> dict[str, Any] | None:
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
