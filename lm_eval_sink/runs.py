"""The one resolver for lm-eval runs, used by every command that reads saved runs (what it accepts: docs/buckets.md),
and the readers of their results and samples files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import json_lines, parse_json, read_text

# lm-eval: datetime.now().isoformat().replace(":", "-"), e.g. 2026-12-02T18-59-03.123456
_TS = r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(?:\.\d+)?"
_RESULTS_RE = re.compile(rf"^results_(?P<ts>{_TS})\.json$")
_SAMPLES_RE = re.compile(rf"^samples_(?P<task>.+)_(?P<ts>{_TS})\.jsonl$")


@dataclass(frozen=True, slots=True)
class RunFiles:
    """The files of one lm-eval run: its results JSON (if any) and samples per task."""

    folder: Path
    timestamp: str | None
    results: Path | None
    samples: dict[str, Path] = field(default_factory=dict)

    def samples_for(self, task: str | None) -> tuple[str, Path]:
        """The samples file of `task`, or of the only task when `task` is None."""
        if not self.samples:
            if self.results is not None:
                load_results(self)  # a file that is no lm-eval results JSON is refused as that, not for want of samples
            where = self.results or self.folder
            raise UserError(
                f"{where}: this run has no samples files",
                "re-run lm-eval with --log_samples (it writes samples_<task>_<time>.jsonl)",
            )
        if task is None:
            if len(self.samples) > 1:
                raise UserError(
                    f"{self.folder}: the run has samples of several tasks ({', '.join(sorted(self.samples))})",
                    "choose one with --task",
                )
            return next(iter(self.samples.items()))
        if task not in self.samples:
            raise UserError(
                f"{self.folder}: no samples for task {task!r}; the run has {', '.join(sorted(self.samples))}",
                "choose one of those with --task",
            )
        return task, self.samples[task]


def _run_at(folder: Path, ts: str, samples: dict[str, Path] | None = None) -> RunFiles:
    """The run of `folder` at time `ts`: its results file (if any) and `samples` (default: its samples files then)."""
    results = folder / f"results_{ts}.json"
    if samples is None:
        found = [(p, _SAMPLES_RE.match(p.name)) for p in sorted(folder.glob(f"samples_*_{ts}.jsonl"))]
        samples = {m["task"]: p for p, m in found if m and m["ts"] == ts}
    return RunFiles(folder, ts, results if results.is_file() else None, samples)


def _model_folder(folder: Path) -> RunFiles:
    """The newest run of a model folder: its newest results file, else its newest samples."""
    stamps = [m["ts"] for p in folder.iterdir() if (m := _RESULTS_RE.match(p.name))]
    stamps = stamps or [m["ts"] for p in folder.iterdir() if (m := _SAMPLES_RE.match(p.name))]
    if stamps:
        return _run_at(folder, max(stamps))
    raise UserError(
        f"{folder}: no lm-eval results_*.json or samples_*.jsonl here",
        "pass an lm-eval --output_path folder, a results JSON or a samples JSONL",
    )


def _holds_runs(folder: Path) -> bool:
    return any(_RESULTS_RE.match(p.name) or _SAMPLES_RE.match(p.name) for p in folder.iterdir())


def _sweep_eval_results(folder: Path) -> Path | None:
    """The results file a sweep's eval folder (`evals/<checkpoint>/`) names in its COMPLETE marker, else None."""
    from lm_eval_sink.outputs import read_complete

    results = (read_complete(folder) or {}).get("results")
    return folder / results if isinstance(results, str) and (folder / results).is_file() else None


def resolve_run(arg: str | Path) -> RunFiles:
    """Resolve a results file, a samples file or an lm-eval output folder to one run's files."""
    path = Path(arg)
    if not path.exists():
        raise UserError(
            f"{path}: no such file or folder", "pass an lm-eval results JSON, samples JSONL or --output_path folder"
        )
    if path.is_file():
        m = _RESULTS_RE.match(path.name)
        if m:
            return _run_at(path.parent, m["ts"])
        m = _SAMPLES_RE.match(path.name)
        if m:  # that run, with this task's samples only
            return _run_at(path.parent, m["ts"], {m["task"]: path})
        if path.suffix == ".json":  # a results file renamed by the user
            return RunFiles(folder=path.parent, timestamp=None, results=path, samples={})
        if path.suffix == ".jsonl":
            return RunFiles(folder=path.parent, timestamp=None, results=None, samples={path.stem: path})
        raise UserError(
            f"{path}: not an lm-eval results JSON or samples JSONL",
            "pass results_<time>.json, samples_<task>_<time>.jsonl or their folder",
        )
    unit = _sweep_eval_results(path)
    if unit is not None:
        return resolve_run(unit)
    if _holds_runs(path):
        return _model_folder(path)
    models = sorted(p for p in path.iterdir() if p.is_dir() and _holds_runs(p))
    if len(models) == 1:
        return _model_folder(models[0])
    if len(models) > 1:
        raise UserError(
            f"{path}: holds runs of several models ({', '.join(m.name for m in models)})",
            f"pass one of them, e.g. {models[0]}",
        )
    raise UserError(
        f"{path}: no lm-eval results_*.json or samples_*.jsonl here or one folder down",
        "pass an lm-eval --output_path folder, a results JSON, a samples JSONL or a sweep's evals/<checkpoint> folder",
    )


def load_results(run: RunFiles) -> dict[str, Any]:
    """The run's results JSON; a run without one, or a JSON that is not lm-eval's, is a UserError."""
    if run.results is None:
        named = next(iter(run.samples.values())) if len(run.samples) == 1 else run.folder.resolve()
        raise UserError(
            f"{named}: no results_<time>.json for this run",
            "pass the lm-eval output folder that holds the results file",
        )
    data = parse_json(
        read_text(run.results, "the results file"), str(run.results), "pass a results file written by lm-eval"
    )
    if not isinstance(data, dict) or "results" not in data or "config" not in data:
        what = "no 'results' and 'config' keys" if isinstance(data, dict) else f"a JSON {_kind(data)}, not an object"
        raise UserError(
            f"{run.results}: not an lm-eval results file ({what})",
            "pass a results_<time>.json written by lm-eval",
        )
    return data


def _kind(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages."""
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Parse an lm-eval samples JSONL; malformed or empty files name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such samples file", "check the path")
    hint = "pass a samples_<task>_<time>.jsonl written by lm-eval --log_samples"
    rows = []
    for n, row in json_lines(read_text(path, "the samples file"), str(path), hint):
        if not isinstance(row, dict) or "doc_id" not in row:
            raise UserError(f"{path}:{n}: not an lm-eval sample (no doc_id)", hint)
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: empty samples file", "re-run lm-eval with --log_samples; the file holds no samples")
    return rows
