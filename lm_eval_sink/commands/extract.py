"""`lm-eval-sink extract` / `inject`: run the extraction pipeline (`extract.pipeline`), then say what it wrote; a
failed verification keeps the folder and becomes the one error line (`raise_for_failure`, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.outputs import COMPLETE, FAILED_FILE, REPORT_FILES


@dataclass(frozen=True, slots=True)
class ExtractOutcome:
    """The lines to print for one extract or inject run, and its failure (None when it passed or was not verified)."""

    lines: tuple[str, ...]
    failure: UserError | None

    def raise_for_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


def _outcome(report: Any) -> ExtractOutcome:
    """The lines of an extract/inject report; a failed verification becomes its failure."""
    what = "extracted" if report.operation == "extract" else "injected"
    head = "tied head" if report.tied_embeddings else "untied head"
    lines = [
        f"{what} {report.family} ({report.source_class}) <-> {report.target_class}: {report.tensors_written} tensors, "
        f"{report.bytes_written / 1e6:.1f} MB in {len(report.shards)} shard(s), {report.dtype}, {head}, "
        f"{report.seconds:.1f} s"
    ]
    if report.operation == "extract":
        lines.append(
            f"chat template: {report.chat_template_source or 'none found'}"
            + ("" if report.tokenizer else " (no tokenizer in the VLM folder)")
        )
    v = report.verification
    if v is None:
        lines.append("verification: skipped (--no-verify); structural checks only")
    elif v.passed:
        lines.append(
            f"verification: max |logit difference| {v.max_abs_diff:.3g} <= {v.tolerance:.3g} "
            f"({v.dtype}, {v.probe_tokens} probe tokens): passed"
        )
    marker = COMPLETE if report.ok else FAILED_FILE
    report_file = REPORT_FILES[report.operation]
    lines.append(f"wrote {report.output} ({report_file}, {marker})")
    if report.ok:
        return ExtractOutcome(lines=tuple(lines), failure=None)
    failure = UserError(
        f"verification failed: {v.reason}; the output is kept at {report.output} and marked failed "
        f"({FAILED_FILE}, no {COMPLETE})",
        f"see {report_file} for the tensor mapping; the architecture rules do not reproduce this VLM's text path",
    )
    return ExtractOutcome(lines=tuple(lines), failure=failure)


def run_extract(vlm_path: str | Path, out_dir: str | Path, **options: Any) -> ExtractOutcome:
    """The `extract` command: VLM_PATH's language backbone into OUT_DIR (`extract_backbone` and its options)."""
    from lm_eval_sink.extract import extract_backbone

    return _outcome(extract_backbone(vlm_path, out_dir, **options))


def run_inject(backbone: str | Path, vlm_path: str | Path, out_dir: str | Path, **options: Any) -> ExtractOutcome:
    """The `inject` command: a copy of VLM_PATH in OUT_DIR whose language model is BACKBONE (`inject_backbone`)."""
    from lm_eval_sink.extract import inject_backbone

    return _outcome(inject_backbone(backbone, vlm_path, out_dir, **options))
