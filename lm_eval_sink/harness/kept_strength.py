"""Sink Strength measured first is kept when the call fails after it, and the same call run again reuses it.

Kept under the key of what decides the rows (`KeptWork`), not the backend's own arguments; written by
`Kept.on_failure`, removed once a call that used it finishes. docs/lm-eval.md ("S is not lost to a later failure").
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.keys import MODEL, Work, key_of

KEPT_DIR = "measured_first"  # under the project cache (`cache.cache_dir`)


@dataclass(frozen=True, slots=True)
class KeptWork(Work):
    """What decides the rows measured first: the transformers load (revisions pinned; not the backend's own
    arguments), a local model's content, each task's settings and prompts; keyed with the child's load and
    measurement code (`measure_first`, the S code among what it imports) and the packages that compute S."""

    CODE = ("lm_eval_sink.harness.measure_first",)
    PACKAGES = ("torch", "transformers", "peft")

    load: dict[str, Any]
    model: str | None = field(metadata=MODEL)
    jobs: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Kept:
    """The rows measured first for a call (`task.Measured` per task) and where they are kept if it fails."""

    measured: dict[str, Any]
    path: Path

    @contextlib.contextmanager
    def on_failure(self) -> Iterator[None]:
        """Write the rows to `path` when the block fails (one line saying so), remove them when it finishes."""
        from lm_eval_sink.io import atomic_write_json

        try:
            yield
        except BaseException:
            atomic_write_json(self.path, {name: asdict(m) for name, m in self.measured.items()})
            _say(
                f"S of {', '.join(self.measured)} measured before this failure is kept in {self.path}; the same call "
                "run again reuses it (also with other engine arguments, such as gpu_memory_utilization)"
            )
            raise
        self.path.unlink(missing_ok=True)


def key(load: Any, jobs: dict[str, dict[str, Any]]) -> str:
    """The key of the rows of a measure-first `load` (`measure_first.HfLoad`) and its `jobs` (`KeptWork`)."""
    decided = {k: v for k, v in asdict(load).items() if k != "ignored"}  # the backend's own arguments do not
    return key_of(KeptWork(decided, load.pretrained if Path(load.pretrained).exists() else None, jobs)).key


def measured_or_kept(
    load: Any, jobs: dict[str, dict[str, Any]], backend: str, measure: Callable[..., dict[str, Any]]
) -> Kept:
    """The rows kept by an earlier call of the same inputs that failed (said in one line), else `measure(load, jobs,
    backend)`'s."""
    from lm_eval_sink.harness.task import Measured
    from lm_eval_sink.cache import cache_dir, read_private_text

    path = cache_dir() / KEPT_DIR / f"{key(load, jobs)}.json"
    try:
        data = json.loads(read_private_text(path))  # a file not this user's alone is read as absent
        measured = {
            name: Measured(
                m["settings"],
                {int(k): v for k, v in m["rows"].items()},
                {**m["record"], "model_args_ignored": list(load.ignored), "kept_from": str(path)},
            )
            for name, m in data.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none kept, unreadable, another's: measure
        return Kept(measure(load, jobs, backend), path)
    _say(f"S of {', '.join(measured)} reused from {path}, measured by an earlier call of the same model and settings")
    return Kept(measured, path)


def _say(line: str) -> None:
    print(f"lm-eval-sink: {line}", file=sys.stderr, flush=True)
