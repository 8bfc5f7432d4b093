"""The noise floor of a comparison: a second run of the reference under the same protocol (`--repeat`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lm_eval_sink.buckets.compare import BucketReport, self_notes
from lm_eval_sink.buckets.paired import Paired, identical_samples, pair
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.errors import UserError


def with_noise_floor(
    report: BucketReport,
    reference_samples: Sequence[Mapping[str, Any]],
    repeat_samples: Sequence[Mapping[str, Any]],
    settings: BucketSettings,
    labels: tuple[str, str] = ("reference samples", "repeat samples"),
) -> BucketReport:
    """`report` with the noise floor of `--repeat`: the two reference runs paired as the comparison was; the docs
    whose pass/fail flips, the regressions noise alone gives, `noise_flip` on each regression (docs/buckets.md)."""
    if report.counts is None:
        raise UserError(
            "--repeat needs pass/fail outcomes, and the metric is continuous",
            "pass --threshold T to split docs into pass (score >= T) / fail, or drop --repeat",
        )
    fixed = replace(settings, metric=report.metric, filter=report.filter, failure_kinds=False)
    p = pair(reference_samples, repeat_samples, report.task, fixed, labels, ("reference", "repeat"))
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
        notes += self_notes(True, len(p.ids), "the reference and its repeat")
        notes.append(_identical_repeat_reason(p))
    return replace(report, rows=rows, noise_floor=floor, notes=notes)


NOISE_SOURCES = (
    "another batch size (padding and batched kernels change the numerics), another machine or GPU (other kernels), "
    "or sampling (do_sample with temperature > 0) under another seed"
)


def _decoding(p: Paired) -> str:
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


def _identical_repeat_reason(p: Paired) -> str:
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
