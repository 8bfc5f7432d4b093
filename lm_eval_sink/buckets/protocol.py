"""Both runs' model and protocol records (from protocols.py fingerprints) and their differences, attached to a
report with the notes they imply (`with_runs`: protocols that differ, a repeat's protocol, --limit runs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from lm_eval_sink.buckets.compare import BucketReport
from lm_eval_sink.protocols import max_gen_toks_in

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
    """Model and protocol of one run for `task` (buckets.json `runs.<side>`, less the file hashes)."""
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
    """The generation limit a run used for `task`: its generation kwargs, else model_args, else lm-eval's default."""
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


def by_effect(diffs: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The fields of `protocol_differences` that can change the task's scores, and those that cannot."""
    can = [k for k, d in diffs.items() if not isinstance(d, Mapping) or d.get("affects_scores") is not False]
    return can, [k for k in diffs if k not in can]


def with_runs(
    report: BucketReport, runs: dict[str, Any], diffs: dict[str, Any], provenance: dict[str, Any]
) -> BucketReport:
    """`report` with both runs' records, their protocol differences and the notes they imply."""
    notes = list(report.notes)
    can, cannot = by_effect(diffs)
    if can:
        notes.append("protocols differ in " + ", ".join(can) + ": the delta mixes model and protocol effects")
    if cannot:
        notes.append("the protocols also differ in " if can else "the protocols differ only in ")
        notes[-1] += ", ".join(cannot) + ", which cannot change this task's scores"
    can, _ = by_effect((runs.get("repeat") or {}).get("protocol_differences_from_reference") or {})
    if can:
        notes.append(
            "the repeat's protocol differs from the reference's in "
            + ", ".join(can)
            + ": its flips mix run-to-run noise and those differences"
        )
    notes += limit_notes(runs)
    return replace(report, runs=runs, protocol_differences=diffs, notes=notes, provenance=provenance)


def limit_notes(runs: Mapping[str, Any]) -> list[str]:
    """The non-final note of the runs (records with their `protocol`) made with --limit, if any."""
    limits = {k: (r.get("protocol") or {}).get("limit") for k, r in runs.items()}
    shown = ", ".join(f"{k} {v:g}" for k, v in limits.items() if v is not None)
    return [f"non-final: run with --limit ({shown}); these are not full-benchmark scores"] if shown else []
