"""Per-document pairing of two lm-eval sample logs of one task, the one implementation `buckets`, `recovery` and
`attribute` use: `index_docs` (one filter, keyed by doc_id), `pair_docs` (same doc sets and documents, or a
UserError) and `outcome` (one doc's metric). The rules: docs/buckets.md "Pairing". Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lm_eval_sink.errors import UserError


def filter_of(row: Mapping[str, Any]) -> str:
    """The filter a samples line was scored under (lm-eval writes "none" for unfiltered tasks)."""
    return str(row.get("filter", "none"))


def index_docs(rows: Sequence[Mapping[str, Any]], filt: str, label: str) -> dict[int, Mapping[str, Any]]:
    """doc_id -> the line under filter `filt`; non-integer or repeated doc_ids are UserErrors."""
    out: dict[int, Mapping[str, Any]] = {}
    for row in rows:
        if filter_of(row) != filt:
            continue
        doc_id = row["doc_id"]
        if not isinstance(doc_id, int) or isinstance(doc_id, bool):
            raise UserError(
                f"{label}: doc_id {doc_id!r} is not an integer", "pass a samples file written by lm-eval --log_samples"
            )
        if doc_id in out:
            raise UserError(
                f"{label}: doc_id {doc_id} appears twice under filter {filt!r}",
                "pass one run's samples file, not several concatenated",
            )
        out[doc_id] = row
    if not out:
        have = sorted({filter_of(r) for r in rows})
        raise UserError(
            f"{label}: no samples under filter {filt!r} (filters present: {', '.join(have)})",
            "pass samples of the same task with that filter",
        )
    return out


def outcome(row: Mapping[str, Any], metric: str, label: str) -> float:
    """The per-sample value of `metric` in one line, as a float (booleans are 0/1)."""
    if metric not in row:
        raise UserError(
            f"{label}: doc_id {row['doc_id']} has no metric {metric!r}",
            "pass samples of one task written by one lm-eval run",
        )
    v = row[metric]
    if isinstance(v, list):
        raise UserError(
            f"{label}: metric {metric!r} holds a list per doc (an instruction-level metric)",
            "use a prompt-level metric, e.g. prompt_level_strict_acc; instruction-level statistics come with it",
        )
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    if isinstance(v, Mapping) and "sink_strength_prompt" in v:
        raise UserError(
            f"{label}: Sink Strength samples: metric {metric!r} holds each prompt's sink statistics, no score of a "
            "document to compare",
            "pass samples of a scored task (e.g. ifeval, gsm8k_cot_zeroshot); S is compared by lm-eval-sink strength "
            "or screen",
        )
    shown = f"an object with keys {', '.join(map(str, list(v)[:5]))}" if isinstance(v, Mapping) else repr(v)[:80]
    raise UserError(
        f"{label}: doc_id {row['doc_id']}: metric {metric!r} is {shown}, not a finite number",
        "choose a numeric per-sample metric",
    )


def _drop_nulls(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_nulls(v) for v in obj]
    return obj


def doc_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str | None, bool]:
    """Why two lines do not hold the same document, for the error message (None: they do), and whether they do only
    once null fields are dropped."""
    ha, hb, da, db = a.get("doc_hash"), b.get("doc_hash"), a.get("doc"), b.get("doc")
    if ha is not None and ha == hb:
        return None, False
    hashes = "has different doc_hash" if ha is not None and hb is not None else "lacks a doc_hash in one log"
    if da is None or db is None:
        return f"{hashes} and a doc is missing", False
    if da == db:  # equal docs under two different hashes: the hashes are not of these docs
        if ha is None or hb is None:
            return None, False
        return f"{hashes} although the logged docs are equal (the hashes were not computed from these docs)", False
    if _drop_nulls(da) == _drop_nulls(db):
        return None, True
    if isinstance(da, dict) and isinstance(db, dict):
        keys = sorted(k for k in set(da) | set(db) if _drop_nulls(da.get(k)) != _drop_nulls(db.get(k)))
        if keys:
            return (
                f"{hashes}: field {keys[0]!r} differs: {str(da.get(keys[0]))[:40]!r} vs {str(db.get(keys[0]))[:40]!r}",
                False,
            )
    return f"{hashes}: the docs differ", False


def pair_docs(
    reference: Mapping[int, Mapping[str, Any]],
    candidate: Mapping[int, Mapping[str, Any]],
    labels: tuple[str, str] = ("reference samples", "candidate samples"),
    *,
    allow_partial: bool = False,
    doc_mismatch_hint: str | None = None,
    sides: tuple[str, str] = ("reference", "candidate"),
) -> tuple[list[int], dict[str, Any]]:
    """Pair two `index_docs` results: the paired doc_ids (sorted) and the record (counts, dropped doc_ids with
    `allow_partial`, prompt and target hash differences); `sides` name the runs and `doc_mismatch_hint` is the fix
    offered in an error."""
    ids_r, ids_c = set(reference), set(candidate)
    only_r, only_c = sorted(ids_r - ids_c), sorted(ids_c - ids_r)
    if (only_r or only_c) and not allow_partial:
        example, side = (only_r[0], sides[0]) if only_r else (only_c[0], sides[1])
        raise UserError(
            f"the runs have different doc sets: {len(only_r)} doc_ids only in the {sides[0]}, "
            f"{len(only_c)} only in the {sides[1]} "
            f"({labels[0]}: {len(ids_r)} docs, {labels[1]}: {len(ids_c)}; e.g. doc_id {example} is only in the {side})",
            "run both with the same --limit/--samples, or pass --allow-partial to pair the "
            f"{len(ids_r & ids_c)} common docs",
        )
    common = sorted(ids_r & ids_c)
    if not common:
        raise UserError(f"{labels[0]} and {labels[1]} share no doc_id", "pass two runs of the same task")
    different, nulls_only = {}, 0
    for i in common:
        why, by_nulls = doc_difference(reference[i], candidate[i])
        if why is not None:
            different[i] = why
        nulls_only += by_nulls
    if different:
        i = next(iter(different))
        raise UserError(
            f"{len(different)} of {len(common)} paired doc_ids hold different documents in the two runs "
            f"(e.g. doc_id {i} {different[i]})",
            doc_mismatch_hint or "pass two runs of the same task on the same dataset",
        )
    prompt_diff = [i for i in common if reference[i].get("prompt_hash") != candidate[i].get("prompt_hash")]
    target_diff = [i for i in common if reference[i].get("target_hash") != candidate[i].get("target_hash")]
    info = {
        "n_reference": len(ids_r),
        "n_candidate": len(ids_c),
        "n_paired": len(common),
        "dropped_reference_only": only_r,
        "dropped_candidate_only": only_c,
        "prompt_hash_differs": {"count": len(prompt_diff), "examples": prompt_diff[:5]},
        "target_hash_differs": {"count": len(target_diff), "examples": target_diff[:5]},
        "docs_equal_after_dropping_nulls": nulls_only,
    }
    return common, info
