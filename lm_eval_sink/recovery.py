"""Did a merging control recover what the candidate lost? The statistics of `recovery` on per-doc outcomes: per task
the gap, per control x task the comparisons with the candidate and the reference (buckets' `paired_stats`, power),
Holm within each family, the recovered share with Fieller's interval, and the verdict (docs/merging.md "Did a
control recover the gap?"). numpy/scipy only, no I/O: the command (commands/recovery.py) reads and writes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lm_eval_sink.buckets.compare import power_of
from lm_eval_sink.buckets.render import delta_text
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.buckets.stats import holm, paired_stats
from lm_eval_sink.power import MIN_N, too_few
from lm_eval_sink.tables import markdown_lines

ALL, PART, NONE, WORSE, TOO_FEW, NO_GAP, NO_LOSS = (
    "recovers all of the gap",
    "recovers part of it",
    "no evidence of recovery",
    "worse than the candidate",
    "too few docs to tell",
    "no detectable gap to recover",
    "the candidate lost nothing here",
)
ALL_FLOOR = 0.75  # "all of the gap" also needs the share's interval to rule out recovering less than this
FAMILIES = ("gap", "vs_candidate", "vs_reference")
SCHEMA_VERSION = 1
UNITS = (
    "deltas and intervals in the metric's own unit as lm-eval writes it (a share of docs, 0-1, for a 0/1 metric; "
    "recovery.md shows points, x100); recovered_share: 1 = all of the gap recovered, 0 = none, negative = farther "
    "from the reference than the candidate"
)
SMOOTHING = 0.25  # pseudo-docs per outcome pattern (r, k, c) of a 0/1 metric in Fieller's variances: 2 in all
SHARE_METHOD = (
    "Fieller's interval for the ratio of the paired mean differences (control - candidate) / (reference - candidate), "
    f"t quantile with n - 1 df; for a 0/1 metric the variances count {SMOOTHING:g} pseudo-doc in each of the 8 "
    "outcome patterns (Agresti-Min's add-to-every-cell, extended to three runs), so agreement on every doc never "
    "gives a zero-width interval"
)


@dataclass(frozen=True, slots=True)
class TaskOutcomes:
    """One task's per-doc outcomes: `values[name]` for every run (`reference`, `candidate` and each control's name),
    aligned with `ids`; `kind` binary (0/1) or continuous; `higher_is_better` the metric's direction (None: unknown,
    then a gap either way is one to recover)."""

    task: str
    metric: str
    kind: str
    ids: Sequence[int]
    values: Mapping[str, np.ndarray]
    higher_is_better: bool | None = None


def fieller_share(
    reference: np.ndarray, candidate: np.ndarray, control: np.ndarray, binary: bool, confidence: float
) -> tuple[float, float] | None:
    """Fieller's interval of mean(a) / mean(b), a = control - candidate, b = reference - candidate per doc: the
    shares theta with (mean a - theta mean b)^2 <= t^2 var(a - theta b) / n; None where it is unbounded (mean b not
    distinguishable from 0 by the same t test). docs/merging.md."""
    from scipy.stats import t as student

    a, b = np.asarray(control, float) - candidate, np.asarray(reference, float) - candidate
    n, weights = len(a), np.ones(len(a))
    if binary:  # the 8 patterns (r, k, c) as pseudo-docs, for the variances only
        patterns = np.array([(r - k, c - k) for r in (0, 1) for k in (0, 1) for c in (0, 1)], float)
        a, b = np.concatenate([a, patterns[:, 1]]), np.concatenate([b, patterns[:, 0]])
        weights = np.concatenate([weights, np.full(8, SMOOTHING)])
    cov = np.cov(np.stack([a, b]), aweights=weights, ddof=1) if n > 1 else np.zeros((2, 2))
    mean_a, mean_b = float(np.mean(a[:n])), float(np.mean(b[:n]))
    q = float(student.ppf((1 + confidence) / 2, max(n - 1, 1))) ** 2 / n
    qa, qb, qc = mean_b**2 - q * cov[1, 1], mean_a * mean_b - q * cov[0, 1], mean_a**2 - q * cov[0, 0]
    if qa <= 0:  # unbounded (the whole line, or all but an interval)
        return None
    root = math.sqrt(max(qb * qb - qa * qc, 0.0))
    return float((qb - root) / qa), float((qb + root) / qa)


def compare(first: np.ndarray, second: np.ndarray, kind: str, settings: BucketSettings) -> dict[str, Any]:
    """One paired comparison, `second` minus `first`: buckets' statistics, the test's p (exact McNemar for 0/1,
    Wilcoxon otherwise) and what it could have detected (power.py). `p_holm` is set by `adjust`."""
    ids = list(range(len(first)))
    s = paired_stats(ids, first, second, kind, settings)
    pw = power_of(kind, first, second, settings)
    return {
        "delta": s.delta,
        "delta_ci": None if s.delta_ci is None else list(s.delta_ci),
        "delta_ci_method": s.delta_ci_method,
        "test": pw["test"],
        "p": s.mcnemar_p if kind == "binary" else s.wilcoxon_p,
        "p_holm": None,
        "counts": s.counts,
        "mde": pw["mde"],
        "power": pw,
    }


def adjust(comparisons: Sequence[dict[str, Any]]) -> None:
    """Set each comparison's `p_holm`: Holm's step-down over the family (every comparison of one kind)."""
    for c, p in zip(comparisons, holm([c["p"] for c in comparisons]), strict=True):
        c["p_holm"] = p


def _could(c: Mapping[str, Any], binary: bool) -> str:
    """What a comparison could have detected, in words (power.py's MDE)."""
    pw = c["power"]
    if pw["mde"] is None:  # too few docs, no doc that differs, or no difference detectable at this n
        return (pw["too_few"] or "").removeprefix("too few to tell: ") or pw["not_detectable"]
    return "it could have detected " + (f"{100 * pw['mde']:.1f} points" if binary else f"{pw['mde']:.3g}")


def gained(gap: Mapping, higher_is_better: bool | None) -> str | None:
    """Why there is nothing to recover when the candidate is better than the reference (the metric's direction
    known), else None."""
    if higher_is_better is None or np.sign(gap["delta"]) != (1 if higher_is_better else -1):
        return None
    better = "higher" if higher_is_better else "lower"
    return f"the candidate is better than the reference ({better} is better, Holm p {gap['p_holm']:.3g}): no loss"


def _nothing_to_recover(t: TaskOutcomes, gap: Mapping, alpha: float) -> tuple[str, str] | None:
    """Why no control of task `t` has a share or a recovery to show (the verdict word and why; an undetectable gap's
    why ends where the verdict and the share each say what follows), else None."""
    if len(t.ids) < MIN_N:
        return TOO_FEW, too_few(len(t.ids))
    if gap["p_holm"] >= alpha:
        return NO_GAP, f"the gap is not detectable (Holm p {gap['p_holm']:.3g})"
    if gained(gap, t.higher_is_better):
        return NO_LOSS, gained(gap, t.higher_is_better) + " to recover"
    return None


def verdict(t: TaskOutcomes, gap: Mapping, cell: Mapping, alpha: float) -> tuple[str, str]:
    """The verdict word and its sentence, from the Holm-adjusted tests and the share's interval: never more than
    they show (`cell`: the control's two comparisons and its `share` on task `t`)."""
    vs_cand, vs_ref, binary = cell["vs_candidate"], cell["vs_reference"], t.kind == "binary"
    if stop := _nothing_to_recover(t, gap, alpha):
        return stop[0], stop[1] + (": nothing to recover" if stop[0] == NO_GAP else "")
    toward = np.sign(vs_cand["delta"]) == -np.sign(gap["delta"])
    if vs_cand["p_holm"] >= alpha:
        return NONE, f"no detectable change from the candidate (Holm p {vs_cand['p_holm']:.3g}); " + _could(
            vs_cand, binary
        )
    if not toward:
        return WORSE, f"farther from the reference than the candidate (Holm p {vs_cand['p_holm']:.3g})"
    short = np.sign(vs_ref["delta"]) == np.sign(gap["delta"])
    if vs_ref["p_holm"] < alpha and short:
        return PART, f"still short of the reference (Holm p {vs_ref['p_holm']:.3g})"
    if vs_ref["p_holm"] < alpha:
        return ALL, f"beyond the reference (Holm p {vs_ref['p_holm']:.3g})"
    same = f"no detectable difference from the reference (Holm p {vs_ref['p_holm']:.3g}; {_could(vs_ref, binary)})"
    ci = cell["recovered_share_ci"]
    if ci is None or ci[0] < ALL_FLOOR:  # not enough to say all: the share may be far below 1
        low = "is unbounded" if ci is None else f"reaches down to {ci[0]:.2f}"
        return PART, f"at least part of it: {same}, but the share's interval {low}"
    return ALL, f"{same}, and the share's interval is above {ALL_FLOOR:g}"


def share(t: TaskOutcomes, control: str, gap: Mapping, confidence: float) -> dict[str, Any]:
    """The recovered share of `control` on task `t`, its interval and why either is withheld (None): withheld where
    the gap is not detectable (Holm)."""
    ref, cand, ctrl = (np.asarray(t.values[k], float) for k in ("reference", "candidate", control))
    if stop := _nothing_to_recover(t, gap, 1 - confidence):
        why = stop[1] + {TOO_FEW: "", NO_GAP: ": no share of it"}.get(stop[0], ", no share of it")
        return {"recovered_share": None, "recovered_share_ci": None, "recovered_share_note": why}
    estimate = float(np.mean(ctrl - cand) / np.mean(ref - cand))
    ci = fieller_share(ref, cand, ctrl, t.kind == "binary", confidence)
    why = None if ci is not None else "interval unbounded: the gap is too uncertain for a bounded ratio (Fieller)"
    return {
        "recovered_share": estimate,
        "recovered_share_ci": None if ci is None else list(ci),
        "recovered_share_note": why,
    }


def prompt_lists(t: TaskOutcomes, control: str) -> dict[str, list[int]] | None:
    """The docs `control` recovered (candidate fails, control passes) and broke; None for a continuous metric."""
    if t.kind != "binary":
        return None
    cand, ctrl = np.asarray(t.values["candidate"]) >= 0.5, np.asarray(t.values[control]) >= 0.5
    ids = np.asarray(t.ids)
    return {"recovered": ids[~cand & ctrl].tolist(), "broke": ids[cand & ~ctrl].tolist()}


def recover(
    outcomes: Sequence[TaskOutcomes], controls: Sequence[str], settings: BucketSettings
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, dict[str, Any]]]]:
    """Every task's gap and every control x task cell (comparisons, share, verdict, prompt lists), as JSON records."""
    tasks = {
        t.task: {"metric": t.metric, "kind": t.kind, "higher_is_better": t.higher_is_better, "n": len(t.ids)}
        for t in outcomes
    }
    cells: dict[str, dict[str, dict[str, Any]]] = {c: {} for c in controls}
    for t in outcomes:
        ref, cand = (np.asarray(t.values[k], float) for k in ("reference", "candidate"))
        tasks[t.task]["gap"] = compare(ref, cand, t.kind, settings)
        for c in controls:
            ctrl = np.asarray(t.values[c], float)
            cells[c][t.task] = {
                "vs_candidate": compare(cand, ctrl, t.kind, settings),
                "vs_reference": compare(ref, ctrl, t.kind, settings),
            }
    adjust([tasks[t.task]["gap"] for t in outcomes])
    for family in FAMILIES[1:]:
        adjust([cells[c][t.task][family] for c in controls for t in outcomes])
    alpha = 1 - settings.confidence
    for t in outcomes:
        gap = tasks[t.task]["gap"]
        for c in controls:
            cell = cells[c][t.task]
            cell.update(share(t, c, gap, settings.confidence))
            word, why = verdict(t, gap, cell, alpha)
            cell.update(verdict=word, verdict_reason=why, prompts=prompt_lists(t, c))
    return tasks, cells


# --- text (recovery.md, the console, table.md) --------------------------------------------------------------------


def share_text(cell: Mapping[str, Any]) -> str:
    """A control's share with its interval, or why there is none."""
    if cell["recovered_share"] is None:  # why: recovered_share_note, and the verdict's reason
        return "no share"
    ci = cell["recovered_share_ci"]
    return f"{cell['recovered_share']:.2f} " + ("[unbounded]" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]")


def verdict_lines(data: Mapping[str, Any]) -> list[str]:
    """One line per control x task: the verdict, the share and why (the console's and table.md's last lines)."""
    return [
        f"recovery: {c} on {task}: {cell['verdict']}"
        + (f", share {share_text(cell)}" if cell["recovered_share"] is not None else "")
        + f"; {cell['verdict_reason']}"
        for c, tasks in data["controls"].items()
        for task, cell in tasks.items()
    ]


def _comparison_rows(data: Mapping[str, Any]) -> list[list[str]]:
    """The gap of each task, then each control's two comparisons on it: delta [CI], p, Holm p."""
    rows = []
    for task, t in data["tasks"].items():
        binary = t["kind"] == "binary"
        named = [("gap (candidate - reference)", t["gap"])]
        for c, cells in data["controls"].items():
            named += [(f"{c} - " + f.removeprefix("vs_"), cells[task][f]) for f in FAMILIES[1:]]
        for what, x in named:
            delta = delta_text(x["delta"], x["delta_ci"], binary, t["n"] < MIN_N)
            rows.append([task, what, delta, f"{x['p']:.3g}", f"{x['p_holm']:.3g}"])
    return rows


def summary_markdown(data: Mapping[str, Any]) -> str:
    """recovery.md: small samples first, the share table (controls x tasks), the comparisons, verdicts, notes."""
    conf = round(100 * data["confidence"])
    tasks = list(data["tasks"])
    lines = ["# Recovery: did a control recover what the candidate lost?", ""]
    few = [f"{task}: {t['too_few_to_tell']}" for task, t in data["tasks"].items() if t.get("too_few_to_tell")]
    if few:
        lines += [f"**Too few to tell: {'; '.join(few)}.** Those columns are no evidence either way.", ""]
    runs = data["runs"]
    lines += [f"- {name} ({r['role']})" for name, r in runs.items()] + [""]
    lines += [f"Recovered share [{conf}% CI] and verdict (1 = all of the gap, 0 = none):", ""]
    rows = [
        [c, *(f"{share_text(cells[t])}: {cells[t]['verdict']}" for t in tasks)] for c, cells in data["controls"].items()
    ]
    lines += [*markdown_lines(["control", *tasks], rows), ""]
    n = ", ".join(f"{task} {t['metric']} ({t['n']} docs)" for task, t in data["tasks"].items())
    lines += [
        f"Paired comparisons ({n}); deltas in points for a 0/1 metric [{conf}% CI]; p: exact McNemar (0/1) or "
        "Wilcoxon; Holm p: adjusted within each family (the gaps; every control x task vs the candidate; vs the "
        "reference):",
        "",
    ]
    lines += [*markdown_lines(["task", "comparison", "delta", "p", "Holm p"], _comparison_rows(data)), ""]
    lines += ["Verdicts:", "", *(f"- {v}" for v in verdict_lines(data)), ""]
    lines += [
        f"Share interval: {data['share_method']}; per comparison, not adjusted: the verdicts read the Holm p.",
        "",
    ]
    if data.get("notes"):
        lines += ["Notes:", "", *(f"- {x}" for x in data["notes"]), ""]
    return "\n".join(lines)
