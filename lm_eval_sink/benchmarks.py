"""Task knowledge as data: the one table of benchmark families that `buckets` and `attribute` read.

`data/benchmarks.yaml` holds, per family: its lm-eval tasks (names or fnmatch patterns), the
construct it probes, the results keys ("metric,filter") of its strict and lenient scores, and
what `buckets` needs besides (kind of metric, instruction-level metrics, the IFEval checker, the
hint for a document mismatch); plus the IFEval instruction -> failure-kind table. `buckets` takes
its default metric and filter from `strict` and its lenient twin filter from `lenient`;
`attribute` splits gaps into access and capacity with the same two keys.

`load_benchmarks(user_file)` returns the bundled families with those of a user YAML of the same
shape added or replacing them by name (`lm-eval-sink attribute --benchmarks FILE`);
`benchmark_of(task, benchmarks)` finds a task's family: the family listing it by name, else the
one with the longest matching pattern. `ifeval_instructions()` is the instruction table.
Standard library and PyYAML only.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError

CONSTRUCTS = ("knowledge", "procedure", "format", "diagnostic")
KINDS = ("binary", "continuous")
CHECKERS = ("ifeval",)
_BUNDLED = "lm_eval_sink/data/benchmarks.yaml"
_KEYS = {"tasks", "construct", "strict", "lenient", "why", "kind", "checker", "instruction_metrics", "doc_mismatch_hint"}


@dataclass(frozen=True, slots=True)
class Benchmark:
    """A benchmark family: its lm-eval tasks, construct, strict / lenient results keys ("metric,filter")
    and how `buckets` reads its samples (None / empty: decided from the samples)."""

    name: str
    tasks: tuple[str, ...]
    construct: str
    strict: str | None
    lenient: str | None
    why: str
    kind: str | None = None  # binary | continuous
    checker: str | None = None  # ifeval: failure kinds of regressions from lm-eval's IFEval checker
    instruction_metrics: dict[str, str] = field(default_factory=dict)  # prompt-level metric -> instruction-level list metric
    doc_mismatch_hint: str | None = None

    @property
    def metric(self) -> str | None:
        """The strict score's per-sample metric (buckets' default --metric)."""
        return self.strict.split(",", 1)[0] if self.strict else None

    @property
    def filter(self) -> str | None:
        """The strict score's filter (buckets' default --filter)."""
        return self.strict.split(",", 1)[1] if self.strict else None

    @property
    def lenient_filter(self) -> str | None:
        """The lenient key's filter when it scores the strict metric (GSM8K: flexible-extract), else None."""
        if not (self.strict and self.lenient):
            return None
        metric, filt = self.lenient.split(",", 1)
        return filt if metric == self.metric else None


def _parse_entry(name: str, body: Any, where: str) -> Benchmark:
    from lm_eval_sink.vendors import _unknown

    if not isinstance(body, dict):
        raise UserError(f"{where}: benchmark {name!r} must be a mapping", f"see {_BUNDLED}")
    _unknown(body, _KEYS, f"benchmark {name!r}", where)
    if body.get("construct") not in CONSTRUCTS:
        raise UserError(f"{where}: benchmark {name!r} has construct {body.get('construct')!r}", f"use one of {', '.join(CONSTRUCTS)}")
    tasks = body.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise UserError(f"{where}: benchmark {name!r} lists no tasks", "give `tasks: [lm-eval task names or patterns]`")
    for key in ("strict", "lenient"):
        v = body.get(key)
        if v is not None and (not isinstance(v, str) or "," not in v):
            raise UserError(f"{where}: benchmark {name!r} {key} key {v!r} is not 'metric,filter'", "use the results key, e.g. exact_match,strict-match")
    if body.get("construct") != "diagnostic" and not body.get("strict"):
        raise UserError(f"{where}: benchmark {name!r} lacks `strict`", "name the results key of its score, e.g. acc,none")
    for key, allowed in (("kind", KINDS), ("checker", CHECKERS)):
        if body.get(key) not in (None, *allowed):
            raise UserError(f"{where}: benchmark {name!r} has {key} {body[key]!r}", f"use one of {', '.join(allowed)}, or leave it out")
    if not isinstance(body.get("doc_mismatch_hint") or "", str):
        raise UserError(f"{where}: benchmark {name!r} doc_mismatch_hint is {body['doc_mismatch_hint']!r}, not a string", "write one line of advice")
    inst = body.get("instruction_metrics") or {}
    if not isinstance(inst, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in inst.items()):
        raise UserError(f"{where}: benchmark {name!r} instruction_metrics must map metric names to metric names",
                        "e.g. {prompt_level_strict_acc: inst_level_strict_acc}")
    return Benchmark(str(name), tuple(str(t) for t in tasks), body["construct"], body.get("strict"), body.get("lenient"), str(body.get("why") or ""),
                     kind=body.get("kind"), checker=body.get("checker"), instruction_metrics=dict(inst),
                     doc_mismatch_hint=body.get("doc_mismatch_hint"))


def _parse(text: str, where: str, top_keys: set[str]) -> dict[str, Any]:
    from lm_eval_sink.io import parse_yaml
    from lm_eval_sink.vendors import _unknown

    data = parse_yaml(text, where)
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), dict):
        raise UserError(f"{where}: expected a mapping with `benchmarks: {{NAME: {{tasks, construct, strict, lenient, why, ...}}}}`",
                        f"see {_BUNDLED} for the format")
    _unknown(data, top_keys, "the file", where)
    return data


@functools.cache
def _bundled() -> tuple[dict[str, Benchmark], dict[str, dict[str, str]]]:
    text = resources.files("lm_eval_sink").joinpath("data/benchmarks.yaml").read_text(encoding="utf-8")
    data = _parse(text, _BUNDLED, {"schema_version", "benchmarks", "ifeval_instructions"})
    return {str(n): _parse_entry(str(n), b, _BUNDLED) for n, b in data["benchmarks"].items()}, dict(data["ifeval_instructions"])


def load_benchmarks(user_file: str | Path | None = None) -> dict[str, Benchmark]:
    """Bundled benchmark families, with those of a user YAML added or replacing them by name (a new dict)."""
    out = dict(_bundled()[0])
    if user_file is not None:
        path = Path(user_file)
        if not path.is_file():
            raise UserError(f"{path}: no such benchmarks file", f"pass a YAML shaped like {_BUNDLED}")
        data = _parse(path.read_text(encoding="utf-8"), str(path), {"schema_version", "benchmarks"})
        out.update({str(n): _parse_entry(str(n), b, str(path)) for n, b in data["benchmarks"].items()})
    return out


def benchmark_of(task: str | None, benchmarks: dict[str, Benchmark]) -> Benchmark | None:
    """The family of an lm-eval task: an exact name first, else the longest matching pattern."""
    if task is None:
        return None
    for b in benchmarks.values():
        if task in b.tasks:
            return b
    best: tuple[int, Benchmark] | None = None
    for b in benchmarks.values():
        for pat in b.tasks:
            if fnmatch.fnmatchcase(task, pat) and (best is None or len(pat) > best[0]):
                best = (len(pat), b)
    return best[1] if best else None


def ifeval_instructions() -> dict[str, dict[str, str]]:
    """IFEval instruction id -> {kind: primary failure kind, truncation: always | never | at_least}."""
    return _bundled()[1]
