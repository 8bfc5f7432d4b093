"""`lm-eval-sink protocol show` / `protocol diff`: fingerprint lm-eval runs, print them, optionally write the JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval_sink.io import atomic_write_json, canonical_json, sha256_file
from lm_eval_sink.outputs import new_files
from lm_eval_sink.protocols import (
    check_common_tasks,
    diff,
    diff_markdown,
    fingerprint_run,
    match_protocol,
    show_markdown,
)
from lm_eval_sink.provenance import provenance
from lm_eval_sink.runs import resolve_run


def _run_inputs(paths) -> list[dict]:
    return [{"path": str(p), "sha256": sha256_file(p)} for p in paths]


def _emit(doc: dict[str, Any], text: str, as_json: bool, output: Path | None) -> list[str]:
    """Write `doc` to `output` (when given) and return the lines to print: the JSON or the table, then where it went."""
    if output:
        atomic_write_json(output, doc)
    return [(canonical_json(doc) if as_json else text).removesuffix("\n")] + ([f"wrote {output}"] if output else [])


def run_protocol_show(run: str, as_json: bool = False, output: Path | None = None, *, force: bool = False) -> list[str]:
    """The `protocol show` command: the fingerprint of one run and the named protocol it matches."""
    with new_files([output] if output else [], force, inputs=[run]):
        files = resolve_run(run)
        fp = fingerprint_run(files)
        doc = {
            "schema_version": 1,
            "fingerprint": fp.to_json(),
            "named_protocol": match_protocol(fp),
            "provenance": provenance(command="protocol show", inputs=_run_inputs([files.results])),
        }
        return _emit(doc, show_markdown(fp), as_json, output)


def run_protocol_diff(
    run_a: str, run_b: str, as_json: bool = False, output: Path | None = None, *, force: bool = False
) -> list[str]:
    """The `protocol diff` command: only the fields that differ between two runs' protocols."""
    with new_files([output] if output else [], force, inputs=[run_a, run_b]):
        fa, fb = resolve_run(run_a), resolve_run(run_b)
        a, b = fingerprint_run(fa), fingerprint_run(fb)
        check_common_tasks(a, b)
        diffs = diff(a, b)
        doc = {
            "schema_version": 1,
            "a": str(fa.results),
            "b": str(fb.results),
            "differences": [d.to_json() for d in diffs],
            "identical": not diffs,
            "provenance": provenance(command="protocol diff", inputs=_run_inputs([fa.results, fb.results])),
        }
        return _emit(doc, diff_markdown(diffs, str(fa.results), str(fb.results)), as_json, output)
