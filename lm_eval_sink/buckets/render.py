"""A saved report (buckets.json) as text: the Markdown summary, the figure's title and prompts.csv."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

from lm_eval_sink.buckets.stats import BUCKETS
from lm_eval_sink.power import MAX_N, MIN_N
from lm_eval_sink.tables import csv_text, markdown_lines


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


def delta_text(delta: float, ci: Sequence[float] | None, pct: bool, too_few: bool) -> str:
    """A delta with its interval ("withheld" when there is none), "too few to tell" first below MIN_N docs."""
    interval = f"[{_fmt(ci[0], pct)}, {_fmt(ci[1], pct)}]" if ci is not None else "[interval withheld]"
    return ("too few to tell: " if too_few else "") + f"{_fmt(delta, pct)} {interval}"


def _score_lines(report: Mapping[str, Any]) -> list[str]:
    """One score table: the metric, and the instruction-level accuracy (IFEval) or pass rate (threshold) if any;
    then how each interval was computed."""
    r, pct, few = report, report["kind"] == "binary", bool(report.get("too_few_to_tell"))
    mcnemar = _fmt(r["mcnemar_p"])
    delta = delta_text(r["delta"], r["delta_ci"], pct, few)
    tests = [mcnemar if pct else "n/a", _fmt(r["wilcoxon_p"])]  # a continuous metric's McNemar is its pass rate's
    rows = [[r["metric"], _fmt(r["reference_score"], pct), _fmt(r["candidate_score"], pct), delta, *tests]]
    methods = [f"{r['metric']}: {r.get('delta_ci_method') or 'paired bootstrap over docs'}"]
    il = r.get("instruction_level")
    if il:
        what = f"{il['metric']} ({il['n_instructions']} instructions)"
        delta = delta_text(il["delta"], il["delta_ci"], True, few)
        rows.append([what, _fmt(il["reference_score"], True), _fmt(il["candidate_score"], True), delta, "n/a", "n/a"])
        methods.append(f"{il['metric']}: {il['method']}")
    pr = r.get("pass_rate")
    if pr:
        what = f"pass rate (score >= {pr['threshold']:g})"
        delta = delta_text(pr["delta"], pr["delta_ci"], True, few)
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


def rows_csv(report: Mapping[str, Any]) -> str:
    """One CSV row per paired doc of a saved report, its columns the fields of the doc's record (`rows.doc_rows`)."""
    columns = list(report["rows"][0])
    return csv_text(columns, (["" if row.get(c) is None else row[c] for c in columns] for row in report["rows"]))
