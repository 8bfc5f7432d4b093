"""Attribution of a reference-vs-candidate gap: lineage, protocol, access vs capacity, construct, mixture.

"A Gap to a Reference Is Not a Loss" (2026): per benchmark family, the observed gap (candidate minus reference,
points) and what it is made of (docs/protocols.md, "Gap attribution"). Pure: takes parsed results, sample rows and
registry entries and returns data; reading runs and writing the report is commands/attribute.py's.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

from lm_eval_sink.benchmarks import Benchmark, benchmark_of
from lm_eval_sink.errors import UserError
from lm_eval_sink.keys import CONTENT
from lm_eval_sink.pairing import index_docs, outcome, pair_docs
from lm_eval_sink.power import MIN_N
from lm_eval_sink.protocols import generation_cap, limit_text, match_protocol, short_text, task_diff
from lm_eval_sink.tables import markdown_lines
from lm_eval_sink.vendors import name_forms, run_stated_values, stated_differences, verified_text

SCHEMA_VERSION = 1
# Config fields that name the language model a VLM (or adapter) was built from.
LINEAGE_CONFIG_FIELDS = (
    "text_config._name_or_path",
    "llm_config._name_or_path",
    "language_config._name_or_path",
    "base_model_name_or_path",
)


def _pts(x: float | None) -> float | None:
    """Points (0-100) rounded so that reruns are byte-identical."""
    return None if x is None else round(float(x), 6)


# --- measurements ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measurement:
    """One model's score on one benchmark under one protocol (points), from a run or the registry."""

    role: str  # reference | candidate
    model: str  # display name
    model_key: str  # identity: two measurements of the same weights share it
    benchmark: str
    task: str | None
    strict: float | None
    lenient: float | None
    protocol_key: str  # equal keys = same protocol
    protocol_label: str
    source: dict[str, Any]
    registry_model: str | None = None
    samples: str | None = None
    limit: Any = None
    n: int | None = None
    n_total: int | None = None  # the task's documents before --limit (lm-eval's n-samples "original")
    stated: dict[str, Any] | None = None  # registry entries: what the source states about the protocol
    fingerprint: Any = field(default=None, compare=False)  # ProtocolFingerprint of a run

    def to_json(self) -> dict[str, Any]:
        """Every field but the fingerprint, scores rounded; `protocol_label` as `protocol`, `stated` as
        `stated_protocol`."""
        renamed = {"protocol_label": "protocol", "stated": "stated_protocol"}
        out = {renamed.get(f.name, f.name): getattr(self, f.name) for f in fields(self) if f.name != "fingerprint"}
        return {**out, "strict": _pts(self.strict), "lenient": _pts(self.lenient)}


# --- per-prompt access vs capacity -----------------------------------------------------------


def per_prompt_split(
    ref_rows: list[dict[str, Any]],
    cand_rows: list[dict[str, Any]],
    strict_key: str,
    lenient_key: str | None,
    *,
    ref_where: str = "reference",
    cand_where: str = "candidate",
    allow_partial: bool = False,
    doc_mismatch_hint: str | None = None,
) -> dict[str, Any]:
    """Pair two sample logs per doc (pairing.py; other doc sets only with `allow_partial`) and split the strict gap
    per prompt, in points: gap = mean(c_s - r_s), capacity = mean(c_l - r_l), access = gap - capacity, and the
    strict regressions the lenient check forgives (access) or not (capacity)."""
    metric, flt = strict_key.split(",", 1)
    ref_docs, cand_docs = index_docs(ref_rows, flt, ref_where), index_docs(cand_rows, flt, cand_where)
    ids, pairing = pair_docs(
        ref_docs, cand_docs, (ref_where, cand_where), allow_partial=allow_partial, doc_mismatch_hint=doc_mismatch_hint
    )
    n = len(ids)
    r_s = [outcome(ref_docs[d], metric, ref_where) for d in ids]
    c_s = [outcome(cand_docs[d], metric, cand_where) for d in ids]
    gap = 100.0 * sum(c - r for c, r in zip(c_s, r_s, strict=True)) / n
    out: dict[str, Any] = {
        "n": n,
        "dropped": {
            "reference_only": len(pairing["dropped_reference_only"]),
            "candidate_only": len(pairing["dropped_candidate_only"]),
        },
        "prompt_hash_differs": pairing["prompt_hash_differs"]["count"],
        "reference": {"strict": _pts(100.0 * sum(r_s) / n)},
        "candidate": {"strict": _pts(100.0 * sum(c_s) / n)},
        "gap": _pts(gap),
        "access": None,
        "capacity": None,
        "strict_regressions": sum(1 for r, c in zip(r_s, c_s, strict=True) if r > c),
        "strict_recoveries": sum(1 for r, c in zip(r_s, c_s, strict=True) if c > r),
    }
    if lenient_key:
        r_l = _lenient_outcomes(ref_rows, ids, lenient_key, ref_where)
        c_l = _lenient_outcomes(cand_rows, ids, lenient_key, cand_where)
        out["reference"]["lenient"] = _pts(100.0 * sum(r_l) / n)
        out["candidate"]["lenient"] = _pts(100.0 * sum(c_l) / n)
        out.update(_lenient_parts(ids, (r_s, c_s), (r_l, c_l), gap))
    return out


def _lenient_parts(
    ids: list[int], strict: tuple[list[float], list[float]], lenient: tuple[list[float], list[float]], gap: float
) -> dict[str, Any]:
    """The lenient half of a per-prompt split: capacity = mean(c_l - r_l), access = gap - capacity, and which strict
    regressions the lenient check forgives (access) or not (capacity). Pairs are (reference, candidate) outcomes."""
    (r_s, c_s), (r_l, c_l) = strict, lenient
    capacity = 100.0 * sum(c - r for c, r in zip(c_l, r_l, strict=True)) / len(ids)
    access_docs = [d for d, r, c, lc in zip(ids, r_s, c_s, c_l, strict=True) if r > c and lc >= r]
    capacity_docs = [d for d, r, c, lc in zip(ids, r_s, c_s, c_l, strict=True) if r > c and lc < r]
    return {
        "capacity": _pts(capacity),
        "access": _pts(gap - capacity),
        "regressions_access": len(access_docs),
        "regressions_capacity": len(capacity_docs),
        "access_doc_ids": access_docs[:50],
        "capacity_doc_ids": capacity_docs[:50],
        "lenient_regressions": sum(1 for r, c in zip(r_l, c_l, strict=True) if r > c),
    }


def _lenient_outcomes(rows: list[dict[str, Any]], ids: list[int], key: str, where: str) -> list[float]:
    """The lenient outcome of each paired doc (the lenient filter must hold every one of them)."""
    metric, flt = key.split(",", 1)
    docs = index_docs(rows, flt, where)
    missing = [d for d in ids if d not in docs]
    if missing:
        raise UserError(
            f"{where}: {len(missing)} paired docs have no sample under filter {flt!r} (e.g. doc_id {missing[0]})",
            "pass samples of one lm-eval run, written with every filter of the task",
        )
    return [outcome(docs[d], metric, where) for d in ids]


def aggregate_split(ref: Measurement, cand: Measurement) -> dict[str, Any]:
    """Gap and, when both have a lenient score, its access / capacity parts from aggregate scores."""
    gap = cand.strict - ref.strict
    if ref.lenient is None or cand.lenient is None:
        return {"gap": _pts(gap), "access": None, "capacity": None}
    capacity = cand.lenient - ref.lenient
    return {"gap": _pts(gap), "access": _pts(gap - capacity), "capacity": _pts(capacity)}


# --- lineage ---------------------------------------------------------------------------------


def lineage(ref: dict[str, Any], cand: dict[str, Any], declared: str | None = None) -> dict[str, Any]:
    """Is the reference the candidate's parent? `ref`/`cand`: `commands.attribute.model_info`'s dicts (key, names,
    stated parents, registry model); `declared`: "parent" | "not-parent" | None. A model compared with itself (one
    key or registry entry) is "same model", whatever its card says."""
    if declared not in (None, "parent", "not-parent"):
        raise UserError(
            f"--lineage {declared!r} is not one of parent, not-parent",
            "declare --lineage parent or --lineage not-parent",
        )
    if same_model(ref["key"], ref.get("registry_model"), cand["key"], cand.get("registry_model")):
        how = "reference and candidate are the same model" + (
            f" (registry entry {ref['registry_model']})" if ref["key"] != cand["key"] else ""
        )
        return {"status": "same_model", "flagged": False, "how": how, "evidence": [], "declared": declared}
    evidence = [{"parent": p, "source": s} for p, s in cand.get("parents", [])]
    ref_names = set().union(*(name_forms(n) for n in ref.get("names", []))) if ref.get("names") else set()
    if evidence:
        found = "parent" if any(name_forms(e["parent"]) & ref_names for e in evidence) else "not_parent"
    else:
        found = None
    decl = {"parent": "parent", "not-parent": "not_parent"}.get(declared or "")
    if found is None and decl is None:
        status, how = (
            "unknown",
            "no model-card, config or registry field names the candidate's parent, and none was declared",
        )
    elif found is None:
        status, how = decl, "declared by the user"
    elif decl is None or decl == found:
        status, how = found, "; ".join(f"{e['source']} names {e['parent']}" for e in evidence)
    else:
        status, how = (
            "mismatched",
            f"declared {declared}, but " + "; ".join(f"{e['source']} names {e['parent']}" for e in evidence),
        )
    return {
        "status": status,
        "flagged": status != "parent",
        "how": how,
        "evidence": evidence,
        "declared": declared,
    }


def same_model(key_a: str, registry_a: str | None, key_b: str, registry_b: str | None) -> bool:
    """Whether two models are one: the same identity key, or the same registry entry (matched by name, hub id or
    --as, never by a folder's name)."""
    return key_a == key_b or (registry_a is not None and registry_a == registry_b)


# --- the attribution -------------------------------------------------------------------------


# What every gap's interval is (attribution.json's `intervals`, said once in attribution.md and the report).
INTERVALS = (
    "each gap's [low, high] is a 95% interval for two unpaired shares of documents (Newcombe's, from each side's "
    "Wilson interval: no pairing of documents assumed, so wider than buckets' paired one; a registry figure held "
    f'fixed); "too few to tell" below {MIN_N} documents on a measured side, as buckets says it'
)


@dataclass(frozen=True, slots=True)
class Attribution:
    """The full report: per benchmark comparisons, protocol sensitivity, vendor figures; lineage and mixture."""

    benchmarks: list[dict[str, Any]]
    lineage: list[dict[str, Any]]
    mixture: dict[str, Any]
    inputs: list[dict[str, Any]]
    measurements: list[dict[str, Any]]
    registry: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "units": "scores, gaps and their parts in points (x100 of lm-eval's share of docs); a gap is candidate "
            "minus reference",
            "intervals": INTERVALS,
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "unverified_registry_figures": unverified_figures(self),
        }


def _differing(r: Measurement, c: Measurement) -> list[dict[str, Any]]:
    """Protocol fields in which two measurements differ (as far as their sources record them), named first a capped
    measurement against an uncapped one or another cap (a registry figure has none)."""
    caps = {m.role: generation_cap(m.fingerprint, m.task) for m in (r, c)}
    words = {k: "the task's own" if v is None else f"{v} tokens (--gen_kwargs)" for k, v in caps.items()}
    capped = caps["reference"] != caps["candidate"]
    cap = [{"field": "generation cap (max_gen_toks)", **words, "affects_scores": True}] if capped else []
    return cap + _recorded_differences(r, c)


def _recorded_differences(r: Measurement, c: Measurement) -> list[dict[str, Any]]:
    """The recorded protocol fields in which two measurements differ: both fingerprints, else what each states (a
    run states every field of `vendors.STATED_KEYS`); a field one side does not state may or may not differ."""
    if r.fingerprint is not None and c.fingerprint is not None:
        out = [
            {"field": d.field, "reference": d.a, "candidate": d.b, "affects_scores": d.affects_scores}
            for d in task_diff(r.fingerprint, c.fingerprint, (r.task, c.task))
        ]
        if r.task != c.task:
            out.insert(0, {"field": "task", "reference": r.task, "candidate": c.task, "affects_scores": True})
        return out
    a, b = _stated(r), _stated(c)
    differ, one_side = stated_differences(
        a, b, "a" if r.fingerprint is not None else "b" if c.fingerprint is not None else None
    )
    return [{"field": d["field"], "reference": d["a"], "candidate": d["b"], "affects_scores": True} for d in differ] + [
        {"field": k, "reference": a.get(k, "not stated"), "candidate": b.get(k, "not stated"), "affects_scores": None}
        for k in one_side
    ]


def _stated(m: Measurement) -> dict[str, Any]:
    """What a measurement's protocol states: a run's recorded values, a registry figure's stated fields."""
    return run_stated_values(m.fingerprint, m.task or "") if m.fingerprint is not None else dict(m.stated or {})


def _side(m: Measurement) -> dict[str, Any]:
    return {"model": m.model, "strict": _pts(m.strict), "lenient": _pts(m.lenient), "source": m.source, "task": m.task}


def _compare(
    r: Measurement, c: Measurement, kind: str, samples_rows: Any, bench: Any, allow_partial: bool
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "kind": kind,
        "protocol": r.protocol_label if kind == "same_protocol" else f"{r.protocol_label} vs {c.protocol_label}",
        "reference": _side(r),
        "candidate": _side(c),
        "non_final": r.limit is not None or c.limit is not None,
        "limit": {"reference": r.limit, "candidate": c.limit},
    }
    split = aggregate_split(r, c)  # gap, access, capacity
    row.update(
        split, split_from="aggregate" if split["access"] is not None else None, per_prompt=None, protocol_part=None
    )
    if kind == "same_protocol" and r.samples and c.samples and bench is not None and bench.strict:
        pp = per_prompt_split(
            samples_rows(r.samples),
            samples_rows(c.samples),
            bench.strict,
            bench.lenient,
            ref_where=r.samples,
            cand_where=c.samples,
            allow_partial=allow_partial,
            doc_mismatch_hint=bench.doc_mismatch_hint,
        )
        row.update({k: pp[k] for k in split}, per_prompt=pp, split_from="samples" if pp["access"] is not None else None)
        pp["matches_results"] = (
            (r.n == c.n == pp["n"] and abs(pp["gap"] - split["gap"]) < 1e-6) if r.n and c.n else None
        )
    row["explanation"] = split_explanation(row["gap"], row["access"], row["capacity"], bench.lenient if bench else None)
    binary = bench is not None and bench.kind == "binary"
    pp = row["per_prompt"]  # a gap from paired samples: the interval and the count of the documents it was taken on
    sides = ((pp["candidate"]["strict"], pp["n"]), (pp["reference"]["strict"], pp["n"])) if pp else None
    row["gap_interval"], row["too_few_to_tell"] = gap_interval(*(sides or ((c.strict, c.n), (r.strict, r.n))), binary)
    if kind != "same_protocol":
        row["differing_fields"] = _differing(r, c)
        row.update(access=None, capacity=None, split_from=None, explanation=None)
        if kind == "protocol_artefact":
            _same_model_parts(row, r, c)
    return row


def _same_model_parts(row: dict[str, Any], r: Measurement, c: Measurement) -> None:
    """The same model under two protocol keys: the whole gap is a protocol artefact only when a protocol field that
    can change scores differs (`--limit` is no protocol field: a subset is named as one); otherwise the row becomes
    `unexplained`, its gap left unexplained, with a sentence naming what was compared."""
    if protocol_fields(row["differing_fields"]):
        row["protocol_part"] = row["gap"]
        return
    row["kind"] = "unexplained"
    row["unexplained"] = row["gap"]
    unknown = [d["field"] for d in row["differing_fields"] if d.get("affects_scores") is None]
    unstated = f" (one side does not state {', '.join(unknown)})" if unknown else ""
    row["explanation"] = (
        f"the gap {_f(row['gap'])} is left unexplained: the same model, and no recorded protocol field that can "
        f"change scores differs{unstated}, so it is not called a protocol artefact; documents compared: reference "
        f"{documents(r)}, candidate {documents(c)}"
    )


def gap_interval(
    cand: tuple[float, int | None], ref: tuple[float, int | None], binary: bool
) -> tuple[list[float] | None, bool]:
    """A gap's 95% interval in points (`INTERVALS`; none for a score that is no share of documents) and whether it is
    too few to tell (buckets' rule); each side is (points, documents), a registry figure's documents None (fixed)."""
    from lm_eval_sink.buckets.stats import wilson_ci

    counts = [n for _, n in (cand, ref) if n is not None]
    few = bool(counts) and min(counts) < MIN_N
    if not binary or not counts:
        return None, few
    sides = []
    for points, n in (cand, ref):
        p = points / 100
        low, high = (p, p) if n is None else wilson_ci(round(p * n), n, 0.95)
        sides.append((p, low, high))
    (p1, l1, u1), (p2, l2, u2) = sides
    low = p1 - p2 - math.hypot(p1 - l1, u2 - p2)
    high = p1 - p2 + math.hypot(u1 - p1, p2 - l2)
    return [_pts(100 * low), _pts(100 * high)], few


def gap_text(gap: float, interval: list[float] | None, too_few: bool) -> str:
    """A gap with its interval, "too few to tell" first below `power.MIN_N` documents (as `buckets` says it)."""
    shown = f"{_f(gap)} [{_f(interval[0])}, {_f(interval[1])}]" if interval else f"{_f(gap)} [no interval]"
    return ("too few to tell: " if too_few else "") + shown


def protocol_fields(fields: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The differing fields that make a protocol difference: those that can change scores, `--limit` (which
    documents, not how each is scored) left out."""
    return [d for d in fields if d.get("affects_scores") and d["field"] != "limit"]


def documents(m: Measurement) -> str:
    """Which documents a measurement scored: a `--limit` subset (n of the task's total), all of them, or a registry
    figure's (not recorded)."""
    if m.source.get("kind") == "registry":
        return f"the registry figure {m.source['id']} (its documents not recorded)"
    of = f" of {m.n_total}" if m.n_total is not None else ""
    count = f"{m.n}{of} documents" if m.n is not None else "documents not recorded"
    if m.limit is None and _fewer(m.n, m.n_total):  # lm-eval's --samples: chosen documents, no --limit recorded
        return f"a subset ({count}; no --limit recorded; not final)"
    if m.limit is None:
        return f"all {count}" if m.n is not None else count
    return f"a --limit {limit_text(m.limit)} subset ({count}; not final)"


def _fewer(n: int | None, total: int | None) -> bool:
    """Whether a run scored fewer documents than its task holds (as lm-eval's n-samples records them)."""
    return n is not None and total is not None and n < total


def split_explanation(
    gap: float | None, access: float | None, capacity: float | None, lenient: str | None
) -> str | None:
    """One sentence, with the figures, when a part exceeds the gap or takes the opposite sign (None otherwise): the
    parts are capacity = the gap under lenient answer extraction and access = gap - capacity, which need not lie
    between 0 and the gap."""
    if gap is None or access is None or capacity is None:
        return None
    tol = 1e-9
    larger = [name for name, v in (("access", access), ("capacity", capacity)) if abs(v) > abs(gap) + tol]
    opposite = access * capacity < -tol
    if not larger and not opposite:
        return None
    facts = (["they take opposite signs"] if opposite else []) + (
        [f"{' and '.join(larger)} {'exceed' if len(larger) > 1 else 'exceeds'} the gap in size"] if larger else []
    )
    lenient_text = f" ({lenient})" if lenient else ""
    return (
        f"access {access:+.2f} and capacity {capacity:+.2f} add up to the gap {gap:+.2f} although "
        + " and ".join(facts)
        + f": capacity is the gap under lenient answer extraction{lenient_text}, {capacity:+.2f}, and access = gap - "
        f"capacity is what strict extraction adds to it, {access:+.2f}; neither part is bounded by the gap"
    )


_Compare = Callable[[Measurement, Measurement, str], dict[str, Any]]  # _compare with the benchmark's settings bound


def _protocol_effect(rows: list[dict[str, Any]], baseline: str | None) -> dict[str, Any] | None:
    gaps: dict[str, list[float]] = {}
    for row in rows:
        if row["kind"] in ("same_protocol", "reported_gap"):
            gaps.setdefault(row["protocol"], []).append(row["gap"])
    if len(gaps) < 2:
        return None
    labels = list(gaps)
    base = baseline if baseline in gaps else labels[0]
    base_gap = gaps[base][0]
    values = [g for gs in gaps.values() for g in gs]
    return {
        "gaps": gaps,
        "baseline": base,
        "effects": {p: _pts(gs[0] - base_gap) for p, gs in gaps.items() if p != base},
        "sign_flip": any(v > 0 for v in values) and any(v < 0 for v in values),
        "spread": _pts(max(values) - min(values)),
        "baseline_requested": baseline,
        "baseline_found": baseline in gaps if baseline else None,
    }


@dataclass(frozen=True, slots=True)
class AttributeOptions:
    """The `attribute` command's options (one per flag, docs/protocols.md), checked as they are built: `mixture` a
    dict or `--mixture` "KEY=VALUE" texts, `as_names` `--as [FOLDER=]NAME` texts; a file None is the bundled one."""

    vendor: bool = False
    registry_file: str | Path | None = field(default=None, metadata=CONTENT)
    benchmarks_file: str | Path | None = field(default=None, metadata=CONTENT)
    declared_lineage: str | None = None
    mixture: dict[str, str] | None = None
    baseline_protocol: str | None = None
    allow_partial: bool = False
    as_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.mixture is not None and not isinstance(self.mixture, dict):
            object.__setattr__(self, "mixture", _parse_mixture(self.mixture))
        object.__setattr__(self, "as_names", tuple(self.as_names))
        parse_as(self.as_names)


def _parse_mixture(items: Any) -> dict[str, str] | None:
    """`--mixture KEY=VALUE` texts as a dict (None when there are none); a text without a key is the one-line error."""
    facts = {}
    for item in items:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise UserError(f"--mixture {item!r} is not KEY=VALUE", "e.g. --mixture text_share=0.1")
        k, v = item.split("=", 1)
        facts[k.strip()] = v.strip()
    return facts or None


def parse_as(items: tuple[str, ...]) -> dict[str | None, str]:
    """`--as NAME` (key None: the one local model) and `--as FOLDER=NAME`, by folder."""
    out: dict[str | None, str] = {}
    for item in items:
        folder, eq, name = item.rpartition("=")
        if not name.strip() or (eq and not folder.strip()):
            raise UserError(f"--as {item!r} names no registry model", "pass --as NAME or --as FOLDER=NAME")
        out[folder.strip() if eq else None] = name.strip()
    return out


@dataclass(frozen=True, slots=True)
class Evidence:
    """What an attribution reads besides the two sides' measurements, as the command gathered it (`registry`: how
    models were matched to registry entries and, with --vendor, which have no vendor figures)."""

    benchmarks: dict[str, Benchmark]
    lineage: list[dict[str, Any]]
    reported_gaps: list[Any]
    vendor_scores: list[Any]
    inputs: list[dict[str, Any]]
    registry: dict[str, Any]
    samples_rows: Callable[[str], list[dict[str, Any]]]


def attribute(
    references: list[Measurement], candidates: list[Measurement], evidence: Evidence, options: AttributeOptions
) -> Attribution:
    """Pair reference and candidate measurements per benchmark and attribute each gap (`options`: the mixture, the
    baseline protocol and `allow_partial` are read here)."""
    out = []
    for name in _common_benchmarks(references, candidates, evidence.reported_gaps):
        bench = evidence.benchmarks.get(name)
        compare = partial(
            _compare, samples_rows=evidence.samples_rows, bench=bench, allow_partial=options.allow_partial
        )
        rs = [m for m in references if m.benchmark == name]
        cs = [m for m in candidates if m.benchmark == name]
        reported = [g for g in evidence.reported_gaps if g.benchmark == name]
        vendor = [s for s in evidence.vendor_scores if s.benchmark == name]
        out.append(_benchmark_report(name, bench, rs, cs, reported, vendor, options.baseline_protocol, compare))
    meas = [m.to_json() for m in [*references, *candidates]]
    return Attribution(
        benchmarks=out,
        lineage=evidence.lineage,
        mixture={  # the recipe facts as the user declared them, or a note that nothing was (never inferred)
            "declared": dict(sorted((options.mixture or {}).items())) or None,
            "note": "declared by the user, shown as given, never inferred"
            if options.mixture
            else "not declared: how much text, and in what output format, the VL recipe held is unknown",
        },
        inputs=list(evidence.inputs),
        measurements=meas,
        registry=evidence.registry,
    )


def _common_benchmarks(references: list[Measurement], candidates: list[Measurement], reported: list[Any]) -> list[str]:
    """The benchmarks both sides were measured on, and those of reported gaps; none is the one-line error."""
    ref_b = {m.benchmark for m in references}
    cand_b = {m.benchmark for m in candidates} | {g.benchmark for g in reported}
    common = sorted((ref_b & cand_b) | {g.benchmark for g in reported})
    if not common:
        raise UserError(
            f"reference and candidate share no benchmark (reference: {', '.join(sorted(ref_b)) or 'none'}; "
            f"candidate: {', '.join(sorted(cand_b)) or 'none'})",
            "pass runs of the same tasks",
        )
    return common


def _benchmark_report(
    name: str,
    bench: Benchmark | None,
    rs: list[Measurement],
    cs: list[Measurement],
    reported: list[Any],
    vendor_scores: list[Any],
    baseline_protocol: str | None,
    compare: _Compare,
) -> dict[str, Any]:
    """One benchmark's section: its comparisons with their protocol parts, the pairs left uncompared, the
    measurements without a partner and the vendor figures beside the measured ones."""
    rows, not_compared, held = _comparisons(rs, cs, reported, compare)
    unpaired = [
        {"role": m.role, "model": m.model, "protocol": m.protocol_label, "strict": _pts(m.strict)}
        for m in [*rs, *cs]
        if id(m) not in held
    ]
    vend = [
        _vendor_row(s, m, bench is not None and bench.kind == "binary")
        for s in vendor_scores
        for m in [*rs, *cs]
        if m.registry_model == s.model and m.source.get("id") != s.id
    ]
    effect = _protocol_effect(rows, baseline_protocol)
    if effect:
        for row in rows:
            if row["kind"] in ("same_protocol", "reported_gap") and row["protocol"] in effect["effects"]:
                row["protocol_part"] = effect["effects"][row["protocol"]]
    return {
        "benchmark": name,
        "construct": bench.construct if bench else "unknown",
        "construct_why": bench.why if bench else "not in benchmarks.yaml",
        "strict_key": bench.strict if bench else None,
        "lenient_key": bench.lenient if bench else None,
        "comparisons": rows,
        "not_compared": not_compared,
        "unpaired": unpaired,
        "protocol_effect": effect,
        "vendor": vend,
    }


def _comparisons(
    rs: list[Measurement], cs: list[Measurement], reported: list[Any], compare: _Compare
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[int]]:
    """The rows that attribute a gap, in report order (pairs under one protocol, the registry's reported gaps, the
    same weights under two protocols); the pairs not compared (different models under different protocols, neither
    with a partner: shown with their differing fields, the gap not attributed); the ids of the measurements held."""
    pairs = [
        (r, c, "same_protocol" if r.protocol_key == c.protocol_key else "protocol_artefact" if _same(r, c) else "")
        for r in rs
        for c in cs
    ]
    paired = {id(m) for r, c, kind in pairs if kind for m in (r, c)}
    confounded = [(r, c) for r, c, kind in pairs if not kind and not {id(r), id(c)} & paired]
    rows = [compare(r, c, kind) for r, c, kind in pairs if kind == "same_protocol"]
    rows += [_reported_row(g) for g in reported]
    rows += [compare(r, c, kind) for r, c, kind in pairs if kind == "protocol_artefact"]
    not_compared = [{**compare(r, c, "confounded"), "gap": None} for r, c in confounded]
    return rows, not_compared, paired | {id(m) for pair in confounded for m in pair}


def _same(r: Measurement, c: Measurement) -> bool:
    return same_model(r.model_key, r.registry_model, c.model_key, c.registry_model)


def _reported_row(g: Any) -> dict[str, Any]:
    """A registry `Gap` as a comparison row: its gap as reported, never split."""
    return {
        "kind": "reported_gap",
        "protocol": g.protocol.id,
        "gap": _pts(g.value),
        "access": None,
        "capacity": None,
        "split_from": None,
        "protocol_part": None,
        "reference": {"model": g.reference},
        "candidate": {"model": g.candidate},
        "non_final": False,
        "source": {"kind": "registry", "id": g.id, **g.source.model_dump()},
        "stated_protocol": g.protocol.model_dump(),
        "note": g.note,
        "entry": {"id": g.id, **g.verification()},
    }


def _vendor_row(s: Any, m: Measurement, binary: bool) -> dict[str, Any]:
    """A vendor figure beside a measurement: the gap with its interval, the protocol fields they differ in (a
    generation cap first)."""
    interval, few = gap_interval((m.strict, m.n), (s.value, None), binary)
    cap = generation_cap(m.fingerprint, m.task)
    capped = [{"field": "generation cap (max_gen_toks)", "vendor": "the task's own", "measured": cap}] if cap else []
    pair, one_side = stated_differences(s.protocol.stated, _stated(m), "b" if m.fingerprint is not None else None)
    differ = [{"field": d["field"], "vendor": d["a"], "measured": d["b"]} for d in pair]
    unstated = [k for k in one_side if k not in s.protocol.stated]
    return {
        "model": s.model,
        "role": m.role,
        "vendor": {
            "id": s.id,
            "value": _pts(s.value),
            "source": s.source.model_dump(),
            "protocol": s.protocol.model_dump(),
            **s.verification(),
        },
        "measured": {"value": _pts(m.strict), "protocol": m.protocol_label, "source": m.source, "limit": m.limit},
        "measured_minus_vendor": _pts(m.strict - s.value),
        "gap_interval": interval,
        "too_few_to_tell": few,
        "protocol_differences": capped + differ,
        "vendor_unstated": unstated,
    }


# --- report ----------------------------------------------------------------------------------


def _f(x: float | None, signed: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:+.2f}" if signed else f"{x:.2f}"


def _fields(fields: list[dict[str, Any]]) -> str:
    """The differing fields that can change scores, short (the JSON keeps them all, in full); the fields one side
    does not state; or that only fields that cannot change scores here differ. Never claims a difference it lacks."""
    differ = [d for d in fields if d.get("affects_scores")]
    unknown = [d["field"] for d in fields if d.get("affects_scores") is None]
    rest = [d["field"] for d in fields if d.get("affects_scores") is False]
    if differ:
        text = "; ".join(
            f"{d['field']}: {short_text(d.get('reference'), 24)} vs {short_text(d.get('candidate'), 24)}"
            for d in differ[:6]
        )
        return (
            text
            + (" ..." if len(differ) > 6 else "")
            + (f"; not stated on one side: {', '.join(unknown)}" if unknown else "")
        )
    if unknown:
        return f"no recorded field that can change scores differs, but one side does not state {', '.join(unknown)}"
    return "they differ only in fields that cannot change scores here" + (f" ({', '.join(rest)})" if rest else "")


def _why_not_compared(fields: list[dict[str, Any]]) -> str:
    """Why two models' measurements are not compared: their protocols differ, only their documents (`--limit`) do,
    or their protocols are not shown to be the same."""
    if protocol_fields(fields):
        return "different models under different protocols"
    if any(d["field"] == "limit" and d.get("affects_scores") for d in fields):
        return "different models on different document subsets (--limit)"
    return "different models; their protocols are not shown to be the same"


def to_markdown(att: Attribution) -> str:
    """The report as Markdown: lineage, registry matches and missing vendor figures, mixture, one section per
    benchmark, the registry figures nobody read in their source."""
    lines = ["# Gap attribution (candidate minus reference, points)", ""]
    for li in att.lineage:
        flag = " **FLAGGED**" if li["flagged"] else ""
        status = li["status"].replace("_", " ")
        lines.append(f"- lineage {li['reference']} -> {li['candidate']}: {status}{flag} ({li['how']})")
    lines += _registry_lines(att.registry)
    caveat = subset_line(att.benchmarks, att.measurements)
    if caveat:
        lines.append(f"- {caveat}")
    mix = att.mixture
    declared = ", ".join(f"{k}={v}" for k, v in (mix["declared"] or {}).items())
    lines.append(f"- mixture: {declared + ' (declared)' if mix['declared'] else mix['note']}")
    lines.append(f"- intervals: {INTERVALS}")
    for b in att.benchmarks:
        lines += _benchmark_lines(b)
    unverified = unverified_figures(att)
    if unverified:
        lines += [
            "",
            "## Registry figures not verified in their source",
            "",
            *(f"- {u}" for u in unverified),
            "",
            "`lm-eval-sink vendor show MODEL` says what was searched for each.",
        ]
    return "\n".join(lines) + "\n"


def _registry_lines(registry: dict[str, Any]) -> list[str]:
    """Which models were matched to a registry entry and how; with --vendor, the models without vendor figures."""
    lines = [
        f"- registry: {m['model']} is the registry's {m['registry_model']} ({m['by']})" for m in registry["matches"]
    ]
    missing = registry.get("vendor_missing")
    if missing:
        lines.append(
            f"- vendor figures: none in the registry for {', '.join(missing)} (a local folder is matched to a registry "
            "entry only by --as NAME or its recorded hub id; `lm-eval-sink vendor add` records a figure)"
        )
    return lines


def _benchmark_lines(b: dict[str, Any]) -> list[str]:
    """One benchmark's section: its comparisons, the protocol effect, the pairs not compared or without a partner,
    the vendor figures."""
    lines = ["", f"## {b['benchmark']} (construct: {b['construct']}: {b['construct_why']})", ""]
    if b["comparisons"]:
        lines += _table([_comparison_cells(r) for r in b["comparisons"]])
        lines += [f"- {r['protocol']}: {r['explanation']}" for r in b["comparisons"] if r.get("explanation")]
    if b["protocol_effect"]:
        lines += ["", _protocol_line(b["protocol_effect"])]
    for r in b["not_compared"]:
        why, labels = _why_not_compared(r["differing_fields"]), r["protocol"].split(" vs ")
        ref, cand = labels[0], labels[-1]
        lines.append(
            f"- not compared ({why}): {r['reference']['model']} ({ref}) vs {r['candidate']['model']} ({cand}): "
            + _fields(r["differing_fields"])
        )
    for u in b["unpaired"]:
        lines.append(f"- no partner: {u['role']} {u['model']} under {u['protocol']} ({_f(u['strict'], False)})")
    if b["vendor"]:
        lines += ["", *_table([_vendor_cells(v) for v in b["vendor"]])]
    return lines


def _table(rows: list[dict[str, str]]) -> list[str]:
    """A Markdown table of rows given as {header: cell}."""
    return markdown_lines(list(rows[0]), [list(r.values()) for r in rows])


def _comparison_cells(r: dict[str, Any]) -> dict[str, str]:
    """One comparison row of a benchmark's table, by header."""
    return {
        "protocol": r["protocol"],
        "kind": r["kind"],
        "reference": f"{r['reference']['model']} {_f(r['reference'].get('strict'), False)}",
        "candidate": f"{r['candidate']['model']} {_f(r['candidate'].get('strict'), False)}",
        "gap": gap_text(r["gap"], r.get("gap_interval"), bool(r.get("too_few_to_tell"))),
        "access": _f(r["access"]),
        "capacity": _f(r["capacity"]),
        "protocol part": _f(r["protocol_part"]),
        "unexplained": _f(r.get("unexplained")),
        "split from": r["split_from"] or "-",
        "note": _comparison_note(r),
    }


def _comparison_note(r: dict[str, Any]) -> str:
    """The note cell: a --limit run, the registry source of a reported gap, the fields behind a protocol artefact,
    the per-prompt counts."""
    notes = []
    if r.get("non_final"):
        notes.append("--limit run: not final")
    if r["kind"] == "reported_gap":
        notes.append(f"{r['source']['id']} ({r['source']['kind']}, {verified_text(r['entry'])})")
    for side in ("reference", "candidate"):
        src = r[side].get("source") or {}
        if src.get("kind") == "registry":
            notes.append(f"{side} figure {src['id']}: {verified_text(src)}")
    if r["kind"] == "protocol_artefact":
        notes.append("same model: " + _fields(r["differing_fields"]))
    if r["kind"] == "unexplained":
        rest = [d for d in r["differing_fields"] if d["field"] != "limit"]
        subset = "; the documents differ (--limit)" if len(rest) < len(r["differing_fields"]) else ""
        notes.append("same model: " + (_fields(rest) if rest else "no protocol field differs") + subset)
    pp = r.get("per_prompt")
    if pp:
        note = f"{pp['n']} prompts, {pp['strict_regressions']} strict regressions"
        if pp.get("access") is not None:
            note += f" ({pp['regressions_access']} access, {pp['regressions_capacity']} capacity)"
        if pp["prompt_hash_differs"]:
            note += f", prompt hashes differ on {pp['prompt_hash_differs']}"
        notes.append(note)
    return "; ".join(notes)


def _protocol_line(pe: dict[str, Any]) -> str:
    """The gap under each protocol, each protocol's effect against the baseline, the spread and the sign."""
    gaps = ", ".join(
        f"{_f(g[0])} under {p}" + (f" ({len(g)} sources)" if len(g) > 1 else "") for p, g in pe["gaps"].items()
    )
    effects = ", ".join(f"{p} {_f(e)}" for p, e in pe["effects"].items())
    return (
        f"protocol: gap {gaps}; effect vs {pe['baseline']}: {effects}; spread {_f(pe['spread'], False)}; "
        f"sign {'FLIPS' if pe['sign_flip'] else 'unchanged'}"
    )


def _vendor_cells(v: dict[str, Any]) -> dict[str, str]:
    """One vendor figure beside the measured one, with the protocol fields in which they differ, by header."""
    diffs = (
        "; ".join(f"{d['field']}: vendor {d['vendor']} vs {d['measured']}" for d in v["protocol_differences"])
        or "none found"
    )
    if v["vendor_unstated"]:
        diffs += f" (vendor does not state {', '.join(v['vendor_unstated'])})"
    limit, src = v["measured"].get("limit"), v["measured"].get("source") or {}
    caveat = f" (--limit {limit_text(limit)} run: not final)" if limit is not None else ""
    caveat += f" ({src['id']}, {verified_text(src)})" if src.get("kind") == "registry" else ""
    return {
        "model": v["model"],
        "vendor says": _f(v["vendor"]["value"], False),
        "source": f"{v['vendor']['source']['id']} ({verified_text(v['vendor'])})",
        "measured": _f(v["measured"]["value"], False) + caveat,
        "protocol": v["measured"]["protocol"],
        "measured - vendor": gap_text(v["measured_minus_vendor"], v.get("gap_interval"), bool(v.get("too_few_to_tell")))
        + (" (subset)" if "--limit" in caveat else ""),
        "protocol differences": diffs,
    }


def unverified_figures(att: Attribution) -> list[str]:
    """Ids of the registry figures the report used that nobody read in their source."""
    ids = [
        m["source"]["id"]
        for m in att.measurements
        if m["source"].get("kind") == "registry" and not m["source"].get("verified")
    ]
    for b in att.benchmarks:
        ids += [
            r["entry"]["id"] for r in b["comparisons"] if r["kind"] == "reported_gap" and not r["entry"]["verified"]
        ]
        ids += [v["vendor"]["id"] for v in b["vendor"] if not v["vendor"]["verified"]]
    return sorted(set(ids))


def subset_line(benchmarks: list[dict[str, Any]], measurements: list[dict[str, Any]]) -> str | None:
    """One line naming the measurements of a subset (`--limit`, or fewer documents than the task holds: model,
    benchmark, documents scored) of an attribution's (or its JSON's) `benchmarks` and `measurements`; None when
    every measured run scored all its documents."""
    compared = {b["benchmark"] for b in benchmarks}
    subsets = [
        f"{m['role']} {m['model']} {m['benchmark']} "
        + (
            f"{m['n']}" + (f" of {m['n_total']}" if m.get("n_total") is not None else "") + " documents "
            if m["n"]
            else ""
        )
        + (f"(--limit {limit_text(m['limit'])})" if m.get("limit") is not None else "(no --limit recorded)")
        for m in measurements
        if m["benchmark"] in compared and (m.get("limit") is not None or _fewer(m["n"], m.get("n_total")))
    ]
    return "subset, not final: " + "; ".join(subsets) if subsets else None


def plot_title(att: Attribution) -> str:
    """The figure's title: what the bars are, and the subset caveat (`subset_line`) when a run used `--limit`."""
    title = "gap = candidate - reference (points), split into its parts"
    caveat = subset_line(att.benchmarks, att.measurements)
    return title + ("\n" + "\n".join(textwrap.wrap(caveat, 72)) if caveat else "")


def plot_rows(att: Attribution) -> list[dict[str, Any]]:
    """One bar per comparison with its parts, for plots.gap_parts, split as the report's table: a gap under another
    protocol is the baseline's split plus the protocol effect; the same weights are all protocol or all unexplained."""
    bars = []
    for b in att.benchmarks:
        pe = b["protocol_effect"]
        base_row = next(
            (
                r
                for r in b["comparisons"]
                if pe and r["protocol"] == pe["baseline"] and r["kind"] in ("same_protocol", "reported_gap")
            ),
            None,
        )
        for r in b["comparisons"]:
            parts = {"access": 0.0, "capacity": 0.0, "protocol": 0.0, "unsplit": 0.0, "unexplained": 0.0}
            own = r
            if r["kind"] in ("protocol_artefact", "unexplained"):
                parts["protocol" if r["kind"] == "protocol_artefact" else "unexplained"] = r["gap"]
                own = None
            elif r.get("protocol_part") is not None and base_row is not None:
                parts["protocol"] = r["protocol_part"]
                own = base_row
            if own is not None:
                if own["access"] is not None:
                    parts["access"], parts["capacity"] = own["access"], own["capacity"]
                else:
                    parts["unsplit"] = own["gap"]
            bars.append({"label": f"{b['benchmark']}\n{r['protocol']}", "gap": r["gap"], "parts": parts})
    return bars


# --- measurements of parsed runs and registry entries---------------------------------------------------


def _results_value(results: dict[str, Any], task: str, key: str, where: str) -> float:
    vals = results.get("results", {}).get(task) or {}
    if key not in vals:
        have = sorted(k for k in vals if "," in k and "_stderr" not in k)
        raise UserError(
            f"{where}: task {task!r} has no {key!r} in its results (has: {', '.join(have) or 'nothing'})",
            "pass a results file of that task, or set its metric keys in a --benchmarks file",
        )
    v = vals[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise UserError(f"{where}: {task} {key} is {v!r}, not a number", "pass a results file written by lm-eval")
    return 100.0 * float(v)


def _unknown_benchmark(task: str, results: dict[str, Any], benchmarks: dict[str, Benchmark]) -> Benchmark | None:
    """A task of no known family, scored by its first numeric metric and added to `benchmarks`; None without one."""
    keys = sorted(
        k
        for k, v in (results["results"].get(task) or {}).items()
        if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
    )
    if not keys:
        return None
    bench = Benchmark.model_construct(
        name=task,
        tasks=[task],
        construct_="unknown",  # no construct of CONSTRUCTS: built here, not read from a file
        strict=keys[0],
        why=f"not in benchmarks.yaml; scored by {keys[0]} (the first metric)",
    )
    benchmarks[task] = bench
    return bench


def run_measurements(
    results: dict[str, Any],
    fp: Any,
    info: dict[str, Any],
    source: dict[str, Any],
    samples: dict[str, Path],
    role: str,
    benchmarks: dict[str, Benchmark],
) -> list[Measurement]:
    """The measurements of one lm-eval run (one per task that belongs to a scored family); `benchmarks` gains the
    unknown tasks."""
    where = source["path"]
    named = match_protocol(fp)
    out = []
    for task in fp.tasks:
        bench = benchmark_of(task, benchmarks) or _unknown_benchmark(task, results, benchmarks)
        if bench is None or bench.construct == "diagnostic":
            continue
        strict = _results_value(results, task, bench.strict, where)
        lenient = _results_value(results, task, bench.lenient, where) if bench.lenient else None
        key = fp.harness_sha(tasks=(task,))
        counts = (fp.run.get("n_samples") or {}).get(task) or {}  # lm-eval's n-samples, as the fingerprint read it
        out.append(
            Measurement(
                role=role,
                model=info["display"],
                model_key=info["key"],
                benchmark=bench.name,
                task=task,
                strict=strict,
                lenient=lenient,
                protocol_key=f"run:{key}",
                protocol_label=named or f"custom-{fp.harness_sha()[:8]}",
                source=source,
                registry_model=info["registry_model"],
                samples=str(samples[task]) if task in samples else None,
                limit=fp.harness.get("limit"),
                n=counts.get("effective"),
                n_total=counts.get("original"),
                fingerprint=fp,
            )
        )
    if not out:
        raise UserError(
            f"{where}: no scored task in this run ({', '.join(fp.tasks)})",
            "pass a run of benchmark tasks (e.g. ifeval, gsm8k_cot)",
        )
    return out


def measurements_from_registry(
    arg: str, role: str, registry: Any
) -> tuple[list[Measurement], dict[str, Any], dict[str, Any]]:
    """`vendor:SCORE_ID` (one score) or `vendor:MODEL` (every score of that model, possibly none)."""
    ref = arg.split(":", 1)[1]
    scores = [s for s in registry.scores if s.id == ref]
    model = scores[0].model if scores else registry.model(ref).name
    if not scores:
        scores = registry.scores_of(model)
    entry = registry.models[model]
    info = {
        "key": f"registry:{model}",
        "names": sorted(entry.names()),
        "registry_model": model,
        "display": model,
        "parents": [(entry.parent.model, f"vendor registry ({entry.parent.source})")] if entry.parent else [],
    }
    out = [
        Measurement(
            role=role,
            model=model,
            model_key=info["key"],
            benchmark=s.benchmark,
            task=None,
            strict=s.value,
            lenient=None,
            protocol_key=f"registry:{s.protocol.id}",
            protocol_label=s.protocol.id,
            source={
                "kind": "registry",
                "id": s.id,
                "source": s.source.id,
                "source_kind": s.source.kind,
                **s.verification(),
            },
            registry_model=model,
            stated=s.protocol.stated,
        )
        for s in scores
    ]
    return out, info, {"kind": "registry", "arg": arg, "files": list(registry.files)}


def relabel(measurements: list[Measurement]) -> list[Measurement]:
    """Give distinct run protocols of one benchmark distinct labels (a named protocol under two limits gets a sha
    suffix)."""
    keys: dict[tuple[str, str], set[str]] = {}
    for m in measurements:
        if m.protocol_key.startswith("run:"):
            keys.setdefault((m.benchmark, m.protocol_label), set()).add(m.protocol_key)
    return [
        replace(m, protocol_label=f"{m.protocol_label}-{m.protocol_key[4:12]}")
        if m.protocol_key.startswith("run:") and len(keys[(m.benchmark, m.protocol_label)]) > 1
        else m
        for m in measurements
    ]
