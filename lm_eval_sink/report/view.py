"""The report's view model, built from already-loaded outputs: pure, no I/O. Every number shown is a `Num` with the
file and JSON pointer it was read from; a section exists only when its input was given; S from the strength files
wins over margin.json's (a mismatch is noted); the headline is the IFEval buckets output, else the first
(docs/reports.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

S_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class Doc:
    """One loaded JSON input: `rel` is its path relative to the report, `data` its content."""

    rel: str
    data: Any
    sha256: str


@dataclass(frozen=True, slots=True)
class Num:
    """A number as shown (`text`) and where it came from (`src`: "<rel path>#<JSON pointer>"); `scale`: shown/stored."""

    text: str
    src: str
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class PromptText:
    """Prompt and both responses of one doc, from the two samples files buckets.json names."""

    prompt: str
    reference: str
    candidate: str
    failed_instructions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BucketsInput:
    doc: Doc
    texts: Mapping[int, PromptText]  # doc_id -> texts
    samples: Mapping[str, tuple[str, str]]  # role -> (path as shown, sha256)


@dataclass(frozen=True, slots=True)
class ReportInputs:
    """Everything the report reads, already loaded and checked by the loader."""

    title: str | None = None
    strength: tuple[Doc, Doc] | None = None
    margin: Doc | None = None
    buckets: tuple[BucketsInput, ...] = ()
    attribution: Doc | None = None
    sweep: Doc | None = None
    recovery: Doc | None = None
    identities: Mapping[str, str] = field(default_factory=dict)  # role -> what both models are, as shown
    versions: Mapping[str, str | None] = field(default_factory=dict)
    created_utc: str = ""


def pointer(*parts: Any) -> str:
    """An RFC 6901 JSON pointer from path parts (`~` -> `~0`, `/` -> `~1`)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def get(data: Any, *parts: Any) -> Any:
    """The value at `parts` (keys and list indices), None when absent."""
    for p in parts:
        if isinstance(data, Mapping):
            data = data.get(p)
        elif isinstance(data, list) and isinstance(p, int) and 0 <= p < len(data):
            data = data[p]
        else:
            return None
    return data


_SPECS = {"f4": ".4f", "+f4": "+.4f", "f2": ".2f", "pts": ".1f", "+pts": "+.1f"}


def fmt(value: float | int, style: str) -> str:
    """Text of a number: `f4` 4 decimals, `+f4` signed, `pts`/`+pts` points (1 decimal), `int`, `p` p-value."""
    if style == "int":
        return str(int(value))
    if style == "p":
        return f"{value:.2e}" if 0 < value < 1e-3 else f"{value:.4f}"
    return format(100 * value if style.endswith("pts") else value, _SPECS[style])


def num(doc: Doc, parts: Sequence[Any], style: str = "f4") -> Num | None:
    """The number at `parts` of `doc`, or None (shown as n/a) when absent or not a number."""
    value = get(doc.data, *parts)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return Num(fmt(value, style), f"{doc.rel}#{pointer(*parts)}", 100.0 if style.endswith("pts") else 1.0)


_STRENGTH_FIGURES = {
    "s": "sink_strength",
    "content": "sink_strength_content_rows",
    "template": "sink_strength_template_rows",
    "pos0": "pos0_argmax_fraction",
}


def sink_tasks(data: Any) -> list[str]:
    """The tasks of an lm-eval results JSON that measured Sink Strength (a `sink_strength,none` value), sorted."""
    results = data.get("results") if isinstance(data, Mapping) else None
    return sorted(t for t, m in (results or {}).items() if isinstance(m, Mapping) and "sink_strength,none" in m)


def strength_pointers(data: Any) -> dict[str, list[Any] | None]:
    """Where each figure of the strength table sits in a strength input: the top level of a strength JSON, or the
    `sink_strength` task (else the only Sink Strength task) of an lm-eval results JSON (None: not recorded there)."""
    if isinstance(data, Mapping) and "sink_strength" in data:
        return {k: [v] for k, v in _STRENGTH_FIGURES.items()} | {"last_k": ["last_k"], "n_layers": ["n_layers"]}
    tasks = sink_tasks(data)
    task = "sink_strength" if "sink_strength" in tasks else tasks[0]
    figures = {k: ["results", task, f"{v},none"] for k, v in _STRENGTH_FIGURES.items()}
    return figures | {"last_k": ["configs", task, "metadata", "last_k"], "n_layers": None}


def _strength_row(d: Doc, parts: Mapping[str, list[Any] | None]) -> dict[str, Any]:
    from lm_eval_sink.strength import absent_sink_note

    row = {
        k: None if p is None else num(d, p, "pts" if k == "pos0" else "int" if k in ("last_k", "n_layers") else "f4")
        for k, p in parts.items()
    }
    s, pos0 = get(d.data, *parts["s"]), get(d.data, *parts["pos0"])
    ok = all(isinstance(x, (int, float)) for x in (s, pos0))
    return {**row, "source": d.rel, "note": absent_sink_note(s, pos0) if ok else None}


def _strength(inputs: ReportInputs) -> tuple[dict[str, Any] | None, list[str]]:
    """The strength table, from the strength files when given, else from margin.json; each S's setting compared."""
    from lm_eval_sink.comparability import compare, setting_of, setting_of_margin, setting_of_results

    notes: list[str] = []
    rows: dict[str, Any] = {}
    settings = []
    margin = inputs.margin
    for i, role in enumerate(("reference", "candidate")):
        if inputs.strength is not None:
            d = inputs.strength[i]
            parts = strength_pointers(d.data)
            rows[role] = _strength_row(d, parts)
            sink = "sink_strength" in d.data
            settings.append(setting_of(d.data) if sink else setting_of_results(d.data, parts["s"][1]))
            if margin is not None:
                ms, ss = get(margin.data, f"{role}_sink_strength"), get(d.data, *parts["s"])
                if isinstance(ms, (int, float)) and isinstance(ss, (int, float)) and abs(ms - ss) > S_TOLERANCE:
                    notes.append(
                        f"{role}: S in {d.rel} ({ss:.4f}) differs from margin.json's ({ms:.4f}); the strength file's "
                        "value is shown (the two were measured with different settings or weights)"
                    )
        elif margin is not None:
            prov = ["provenance", f"{role}_sink_strength"]
            parts = {k: [*prov, v] for k, v in _STRENGTH_FIGURES.items()}
            parts |= {"s": [f"{role}_sink_strength"], "last_k": [*prov, "last_k"], "n_layers": [*prov, "n_layers"]}
            rows[role] = _strength_row(margin, parts)
            settings.append(setting_of_margin(margin.data, role))
    notes += [f"{role}: {r['note']}" for role, r in rows.items() if r["note"]]
    if not rows:
        return None, notes
    comparison = compare(list(rows), settings)
    for role, label, s in zip(comparison.names, comparison.labels, comparison.settings, strict=True):
        share = None if s.k_share is None else f"{s.k_share:.0%}"
        rows[role] |= {"setting": label, "attention_layers": s.attention_layers, "k_share": share}
    if not comparison.comparable:
        notes += [line for line in comparison.lines() if not line.startswith("setting ")]
    return {"rows": rows, "settings": comparison.lines(), "comparable": comparison.comparable}, notes


def _regression_rows(b: BucketsInput) -> list[dict[str, Any]]:
    """One row per regression (a continuous metric: also per doc that got worse), with its prompt and both responses."""
    d, data = b.doc, b.doc.data
    binary = data.get("kind") == "binary"
    table = []
    for i, row in enumerate(data.get("rows") or []):
        if row.get("bucket") != "regression" and not (not binary and (row.get("difference") or 0) < 0):
            continue
        text = b.texts.get(int(row["doc_id"]))
        table.append(
            {
                "doc_id": num(d, ["rows", i, "doc_id"], "int"),
                "reference": num(d, ["rows", i, "reference"]),
                "candidate": num(d, ["rows", i, "candidate"]),
                "kind": row.get("failure_kind") or "",
                "detail": row.get("failure_detail") or "",
                "failed": list(text.failed_instructions) if text else [],
                "prompt": text.prompt if text else "",
                "reference_response": text.reference if text else "",
                "candidate_response": text.candidate if text else "",
                "truncated": row.get("truncated"),
            }
        )
    return table


def _instruction_type_rows(d: Doc) -> list[dict[str, Any]]:
    """One row per IFEval instruction type, in buckets.json's order (most regressions first)."""
    return [
        {
            "id": t["instruction_id"],
            "n": num(d, ["instruction_types", i, "n"], "int"),
            "regression": num(d, ["instruction_types", i, "regression"], "int"),
            "recovered": num(d, ["instruction_types", i, "recovered"], "int"),
            "delta": num(d, ["instruction_types", i, "delta"], "+pts"),
            "p": num(d, ["instruction_types", i, "mcnemar_p"], "p"),
            "holm": num(d, ["instruction_types", i, "holm_p"], "p"),
            "too_few": bool(t.get("too_few_to_test")),
        }
        for i, t in enumerate(d.data.get("instruction_types") or [])
    ]


def _beside_the_interval(d: Doc, binary: bool) -> dict[str, Any]:
    """The test the delta's interval sits beside (the exact McNemar test for a 0/1 metric, whose answer the
    interval's side of 0 is; Wilcoxon for a continuous one), and the pass rate under --threshold with its exact
    interval and its McNemar p (None without a threshold)."""
    pr = d.data.get("pass_rate")
    rate = None
    if isinstance(pr, Mapping):
        rate = {
            "threshold": pr.get("threshold"),
            "reference": num(d, ["pass_rate", "reference"], "pts"),
            "candidate": num(d, ["pass_rate", "candidate"], "pts"),
            "delta": num(d, ["pass_rate", "delta"], "+pts"),
            "delta_lo": num(d, ["pass_rate", "delta_ci", 0], "+pts"),
            "delta_hi": num(d, ["pass_rate", "delta_ci", 1], "+pts"),
            "ci_method": pr.get("delta_ci_method"),
            "mcnemar_p": num(d, ["mcnemar_p"], "p"),
        }
    test = ("McNemar", "mcnemar_p") if binary else ("Wilcoxon", "wilcoxon_p")
    return {"test": test[0], "test_p": num(d, [test[1]], "p"), "pass_rate": rate}


def _power(d: Doc) -> dict[str, Any] | None:
    """What the comparison could have detected (buckets.json `power`), in points for a 0/1 outcome."""
    pw = d.data.get("power")
    if not isinstance(pw, Mapping) or not pw:
        return None
    binary = pw.get("discordant_share") is not None  # a 0/1 outcome: the metric, or pass/fail under --threshold
    style = "pts" if binary else "f4"
    return {
        "too_few": pw.get("too_few"),
        "method": pw.get("method"),
        "test": pw.get("test"),
        "unit": "points" if binary else f"{d.data.get('metric')} units",
        "alpha": num(d, ["power", "alpha"], "f2"),
        "target": num(d, ["power", "target_power"], "f2"),
        "mde": num(d, ["power", "mde"], style),
        "not_detectable": pw.get("not_detectable"),
        "effect": num(d, ["power", "effect"], style),
        "effect_source": pw.get("effect_source"),
        "effect_impossible": pw.get("effect_impossible"),
        "power": num(d, ["power", "power_at_effect"], "pts"),
        "exact": num(d, ["power", "power_at_effect_exact"], "pts"),
        "n_for_effect": num(d, ["power", "n_for_effect"], "int"),
    }


def _buckets_section(b: BucketsInput) -> dict[str, Any]:
    """The section of one buckets.json."""
    from lm_eval_sink.buckets.render import figure_title, notes

    d = b.doc
    data = d.data
    binary = data.get("kind") == "binary"
    style = "pts" if binary else "f4"
    counts = data.get("counts") or {}
    kinds = get(data, "failure_kinds", "counts") or {}
    runs = data.get("runs") or {}
    return {
        "task": data.get("task"),
        "metric": data.get("metric"),
        "filter": data.get("filter"),
        "source": d.rel,
        "binary": binary,
        "n": num(d, ["n"], "int"),
        "reference_score": num(d, ["reference_score"], style),
        "candidate_score": num(d, ["candidate_score"], style),
        "delta": num(d, ["delta"], "+" + style),
        "delta_lo": num(d, ["delta_ci", 0], "+" + style),
        "delta_hi": num(d, ["delta_ci", 1], "+" + style),
        "ci_method": data.get("delta_ci_method"),
        "too_few": data.get("too_few_to_tell"),
        "confidence": num(d, ["settings", "confidence"], "pts"),
        "mcnemar_p": num(d, ["mcnemar_p"], "p") if binary else None,  # a continuous metric's is its pass rate's
        "wilcoxon_p": num(d, ["wilcoxon_p"], "p"),
        **_beside_the_interval(d, binary),
        "counts": [
            {"bucket": k, "n": num(d, ["counts", k], "int")}
            for k in ("both_pass", "regression", "recovered", "both_fail")
            if k in counts
        ],
        "counts_raw": dict(counts),
        "figure_title": figure_title(data),
        "kinds_raw": dict(kinds),
        "kinds": [{"kind": k, "n": num(d, ["failure_kinds", "counts", k], "int")} for k, v in kinds.items() if v],
        "main_kind": max((k for k, v in kinds.items() if v), key=lambda k: (kinds[k], k), default=None),
        "regressions": num(d, ["counts", "regression"], "int"),
        "table": _regression_rows(b),
        "types": _instruction_type_rows(d),
        "power": _power(d),
        "notes": notes(data),
        "protocol_differences": [
            {
                "field": k,
                "reference": v.get("reference"),
                "candidate": v.get("candidate"),
                "affects": v.get("affects_scores"),
            }
            for k, v in (data.get("protocol_differences") or {}).items()
        ],
        "runs": {role: {"model": r.get("model")} for role, r in runs.items()},
    }


def _margin_section(d: Doc) -> dict[str, Any]:
    data = d.data
    s = ["summary"]
    heads = [
        {
            "layer": num(d, ["negative_margin_heads", i, "layer"], "int"),
            "head": num(d, ["negative_margin_heads", i, "head"], "int"),
            "g_base": num(d, ["negative_margin_heads", i, "g_base_median"]),
            "b_gap": num(d, ["negative_margin_heads", i, "b_gap"]),
            "margin": num(d, ["negative_margin_heads", i, "margin"], "+f4"),
            "mass": num(d, ["negative_margin_heads", i, "measured_nonsink_mass_median"], "pts"),
            "has_sink": h.get("reference_has_sink"),
        }
        for i, h in enumerate(data.get("negative_margin_heads") or [])
    ]
    return {
        "source": d.rel,
        "n_negative": num(d, [*s, "n_negative_margin"], "int"),
        "n_total": num(d, [*s, "n_heads_total"], "int"),
        "n_collapse": num(d, [*s, "n_sink_collapse"], "int"),
        "n_no_sink": num(d, [*s, "n_no_sink_in_reference"], "int"),
        "margin_median": num(d, [*s, "margin_median"], "+f4"),
        "margin_min": num(d, [*s, "margin_min"], "+f4"),
        "quantile": num(d, ["quantile"], "f2"),
        "n_negative_quantile": num(d, [*s, "n_negative_margin_quantile"], "int"),
        "heads": heads,
        "matrix": data.get("margin"),
        "layers": data.get("layers"),
    }


def _subset_line(data: Mapping[str, Any]) -> str | None:
    """attribute's subset caveat (`attribution.subset_line`) from attribution.json; None when it cannot be read."""
    from lm_eval_sink.attribution import subset_line

    try:
        return subset_line(data.get("benchmarks") or [], data.get("measurements") or [])
    except (KeyError, TypeError, AttributeError, ValueError):  # an attribution.json of another schema: no caveat
        return None


def _attribution_section(d: Doc) -> dict[str, Any]:
    data = d.data
    benches = []
    for bi, b in enumerate(data.get("benchmarks") or []):
        rows = []
        for ci, c in enumerate(b.get("comparisons") or []):
            p = ["benchmarks", bi, "comparisons", ci]
            rows.append(
                {
                    "protocol": c.get("protocol"),
                    "kind": (c.get("kind") or "") + _figure_state(c),
                    "split_from": c.get("split_from"),
                    "non_final": c.get("non_final"),
                    "reference": num(d, [*p, "reference", "strict"], "f2"),
                    "candidate": num(d, [*p, "candidate", "strict"], "f2"),
                    "gap": num(d, [*p, "gap"], "f2"),
                    "too_few": bool(c.get("too_few_to_tell")),
                    "interval": ", ".join(f"{x:+.2f}" for x in c["gap_interval"]) if c.get("gap_interval") else None,
                    "protocol_part": num(d, [*p, "protocol_part"], "f2"),
                    "unexplained": num(d, [*p, "unexplained"], "f2"),
                    "access": num(d, [*p, "access"], "f2"),
                    "capacity": num(d, [*p, "capacity"], "f2"),
                    "fields": [f.get("field") for f in c.get("differing_fields") or []],
                }
            )
        benches.append(
            {
                "benchmark": b.get("benchmark"),
                "construct": b.get("construct"),
                "rows": rows,
                "explanations": [c["explanation"] for c in b.get("comparisons") or [] if c.get("explanation")],
                "not_compared": [
                    str(x.get("reason") or x) if isinstance(x, Mapping) else str(x) for x in b.get("not_compared") or []
                ],
            }
        )
    return {
        "source": d.rel,
        "benchmarks": benches,
        "subset": _subset_line(data),
        "intervals": data.get("intervals"),
        "lineage": [dict(x) for x in data.get("lineage") or []],
        "mixture": get(data, "mixture", "note"),
    }


def _figure_state(c: Mapping[str, Any]) -> str:
    """Whether the registry figures a comparison uses were read in their source (vendors' verification()), in words."""
    entries = [c.get("entry") or {}] if c.get("kind") == "reported_gap" else []
    entries += [get(c, side, "source") or {} for side in ("reference", "candidate")]
    used = [e for e in entries if e.get("kind") == "registry" or "unverified" in e]
    if not used:
        return ""
    return (
        " (registry figure UNVERIFIED)" if any(not e.get("verified") for e in used) else " (registry figures verified)"
    )


def named_columns(columns: list[str], rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, float, bool]]:
    """Each of a sweep's table columns as (column, readable label told apart within `columns`, scale: 100 for a
    share of docs shown in points, whether it is unchanged in every checkpoint); table.md and the figure ask it."""
    from lm_eval_sink.benchmarks import load_benchmarks, metric_in_points, metric_labels

    benchmarks = load_benchmarks()
    values = {c: {(r.get("metrics") or {}).get(c) for r in rows} for c in columns}  # unchanged: one measured value
    same = {c for c in columns if len(rows) > 1 and len(values[c]) == 1 and None not in values[c]}
    return [
        (c, label, 100.0 if metric_in_points(c, benchmarks) else 1.0, c in same)
        for c, label in zip(columns, metric_labels(columns, benchmarks), strict=True)
    ]


def sweep_series(table: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep figure's data from a table.json: each metric's values under its readable name (points for shares
    of docs), S per checkpoint, the axis's unit, `drawn` (each task's headline metric in that one unit, where it
    changes) and the title's `note` (not final; the unchanged ones, said once)."""
    from lm_eval_sink.benchmarks import headline_columns, load_benchmarks

    cols, rows = list(table.get("columns") or []), table.get("rows") or []
    named = named_columns(cols, rows)
    values = {
        label: [None if get(r, "metrics", c) is None else get(r, "metrics", c) * f for r in rows]
        for c, label, f, _ in named
    }
    headline = set(headline_columns(cols, load_benchmarks()))
    tasks_s = [c for c in cols if c in headline and c.endswith("/sink_strength,none")]
    s = [r.get("sink_strength") for r in rows]
    if all(v is None for v in s) and tasks_s:
        s = [get(r, "metrics", tasks_s[0]) for r in rows]
    points = any(f == 100 for c, _, f, _ in named if c in headline and c not in tasks_s)
    axis = [label for c, label, f, _ in named if c in headline and c not in tasks_s and (f == 100) == points]
    unchanged = [label for _, label, _, same in named if label in axis and same]
    said = [table.get("final_note"), f"unchanged in every checkpoint: {', '.join(unchanged)}" if unchanged else None]
    return {
        "checkpoints": [r.get("checkpoint") for r in rows],
        "values": values,
        "drawn": {label: values[label] for label in axis if label not in unchanged},
        "note": "; ".join(x for x in said if x) or None,
        "s": s,
        "unit": "points" if points else "the metric's own unit",
        "labels": list(values),
        "scales": [x[2] for x in named],
    }


def _sweep_section(d: Doc) -> dict[str, Any]:
    """The sweep's table: a column per metric under its readable name (the results key on hover), each cell
    the value (in points for shares of docs) with its change vs the reference under it; and the figure's series."""
    data = d.data
    cols = list(data.get("columns") or [])
    series = sweep_series(data)
    styles = ["pts" if f == 100 else "f4" for f in series["scales"]]
    mixed_s = get(data, "strength_comparability", "comparable") is False  # S of different settings: mark each row
    rows = []
    for i, r in enumerate(data.get("rows") or []):
        rows.append(
            {
                "checkpoint": r.get("checkpoint"),
                "method": r.get("method") or r.get("role"),
                "setting": r.get("setting"),
                "status": r.get("status"),
                "cells": [  # (value, delta, the setting letter of an eval unit's S measured in another setting)
                    (
                        num(d, ["rows", i, "metrics", c], st),
                        num(d, ["rows", i, "delta_vs_reference", c], "+" + st),
                        (r.get("metric_settings") or {}).get(c),
                    )
                    for c, st in zip(cols, styles, strict=True)
                ],
                "s": num(d, ["rows", i, "sink_strength"]),
                "s_delta": num(d, ["rows", i, "sink_strength_delta_vs_reference"], "+f4"),
                "s_setting": r.get("s_setting") if mixed_s else None,
            }
        )
    return {
        "source": d.rel,
        "metrics": [{"key": c, "label": label} for c, label in zip(cols, series["labels"], strict=True)],
        "unit": series["unit"],
        "rows": rows,
        "lineage": data.get("lineage"),
        "final_note": data.get("final_note"),
        "model_differences": list(get(data, "protocol", "model_differences") or []),
        "strength_notes": list(get(data, "strength_comparability", "notes") or [])
        + [
            f"{task} (the eval units' S): {line}"
            for task, comparison in sorted((data.get("task_strength_comparability") or {}).items())
            for line in comparison.get("notes") or []
        ],
        "series": series,
    }


def _recovery_cell(d: Doc, control: str, task: str) -> dict[str, Any]:
    """One control x task of recovery.json: the share with its interval (or why none), the verdict, the Holm p."""
    cell, at = d.data["controls"][control][task], ["controls", control, task]
    return {
        "share": num(d, [*at, "recovered_share"], "f2"),
        "lo": num(d, [*at, "recovered_share_ci", 0], "f2"),
        "hi": num(d, [*at, "recovered_share_ci", 1], "f2"),
        "note": cell.get("recovered_share_note"),
        "verdict": cell.get("verdict"),
        "reason": cell.get("verdict_reason"),
        "p_candidate": num(d, [*at, "vs_candidate", "p_holm"], "p"),
        "p_reference": num(d, [*at, "vs_reference", "p_holm"], "p"),
    }


def _recovery_section(d: Doc) -> dict[str, Any]:
    """recovery.json: small samples first, a row per control (a cell per task), the forest plot's data, and each
    control's recovered and broken prompts with both responses."""
    data = d.data
    tasks = list(data.get("tasks") or {})
    controls = data.get("controls") or {}
    prompts = [
        {"control": c, "task": t, "what": what, "doc_id": x["doc_id"], **x}
        for c, cells in controls.items()
        for t, cell in cells.items()
        for what, items in (cell.get("prompts") or {}).items()
        for x in items
    ]
    return {
        "source": d.rel,
        "too_few": [f"{t}: {x['too_few_to_tell']}" for t, x in data["tasks"].items() if x.get("too_few_to_tell")],
        "tasks": tasks,
        "rows": [{"control": c, "cells": [_recovery_cell(d, c, t) for t in tasks]} for c in controls],
        "prompts": prompts,
        "confidence": round(100 * data.get("confidence", 0.95)),
        "share_method": data.get("share_method"),
        "notes": list(data.get("notes") or []),
        "data": data,  # the forest plot's
    }


def _lineage(inputs: ReportInputs) -> dict[str, Any] | None:
    first = None if inputs.attribution is None else get(inputs.attribution.data, "lineage", 0)
    if not isinstance(first, Mapping):
        return None
    return {"status": first.get("status"), "flagged": bool(first.get("flagged")), "how": first.get("how")}


def _input_row(what: str, d: Doc) -> dict[str, Any]:
    return {"what": what, "path": d.rel, "sha256": d.sha256, "versions": get(d.data, "provenance", "versions") or {}}


def _inputs_table(inputs: ReportInputs) -> list[dict[str, Any]]:
    strength = zip(("reference", "candidate"), inputs.strength, strict=True) if inputs.strength else ()
    rows = [_input_row(f"strength ({role})", d) for role, d in strength]
    docs = (("margin", inputs.margin), ("attribution", inputs.attribution), ("sweep", inputs.sweep))
    rows += [_input_row(what, d) for what, d in (*docs, ("recovery", inputs.recovery)) if d is not None]
    for b in inputs.buckets:
        task = b.doc.data.get("task")
        rows.append(_input_row(f"buckets ({task})", b.doc))
        rows += [
            {"what": f"samples ({role}, {task})", "path": path, "sha256": sha, "versions": {}}
            for role, (path, sha) in b.samples.items()
        ]
    return rows


def build_view(inputs: ReportInputs) -> dict[str, Any]:
    """The template's context: header, one entry per section given, provenance, notes."""
    strength, notes = _strength(inputs)
    buckets = [_buckets_section(b) for b in inputs.buckets]
    ifeval = [b for b in buckets if str(b["task"]).startswith("ifeval")]  # the headline: the IFEval one, else the first
    title = inputs.title or "lm-eval-sink report: " + " vs ".join(
        inputs.identities.get(r, r) for r in ("reference", "candidate")
    )
    from lm_eval_sink.strength import S_MEANING

    return {
        "title": title,
        "identities": dict(inputs.identities),
        "strength": strength,
        "s_meaning": S_MEANING,
        "headline": (ifeval + buckets)[0] if buckets else None,
        "buckets": buckets,
        "margin": _margin_section(inputs.margin) if inputs.margin is not None else None,
        "attribution": _attribution_section(inputs.attribution) if inputs.attribution is not None else None,
        "sweep": _sweep_section(inputs.sweep) if inputs.sweep is not None else None,
        "recovery": _recovery_section(inputs.recovery) if inputs.recovery is not None else None,
        "lineage": _lineage(inputs),
        "notes": notes,
        "inputs": _inputs_table(inputs),
        "versions": dict(inputs.versions),
        "created_utc": inputs.created_utc,
    }
