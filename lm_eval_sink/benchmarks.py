"""Task knowledge as data: the one table of benchmark families (`data/benchmarks.yaml`) that `buckets`, `attribute`
and the sweep's tables read (`load_benchmarks`, `benchmark_of`, the IFEval instruction table, readable metric names;
docs/buckets.md "Tasks are data"). Standard library and PyYAML only.
"""

from __future__ import annotations

import fnmatch
import functools
from importlib import resources
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from lm_eval_sink.errors import UserError
from lm_eval_sink.schema import Strict, parse

CONSTRUCTS = ("knowledge", "procedure", "format", "diagnostic")
_BUNDLED = "lm_eval_sink/data/benchmarks.yaml"


class _BenchmarkIn(Strict):
    what: ClassVar[str] = "benchmark"
    tasks: list[str] = Field(min_length=1, description="must list lm-eval task names or patterns")
    construct_: Literal[CONSTRUCTS] = Field(alias="construct")  # `construct` is a BaseModel method
    strict: str | None = None
    lenient: str | None = None
    why: str = ""
    kind: Literal["binary", "continuous"] | None = None
    checker: Literal["ifeval"] | None = None  # ifeval: failure kinds of regressions from lm-eval's IFEval checker
    instruction_metrics: dict[str, str] = Field(  # prompt-level metric -> instruction-level list metric
        {}, description="must map metric names to metric names, e.g. {prompt_level_strict_acc: inst_level_strict_acc}"
    )
    doc_mismatch_hint: str | None = None
    score_range: list[float] | None = Field(  # a continuous metric's nominal range (buckets' default effect)
        None,
        min_length=2,
        max_length=2,
        description="must be [low, high], the continuous metric's nominal range, e.g. [0, 100]",
    )


class Benchmark(_BenchmarkIn):
    """A benchmark family: its lm-eval tasks, construct, strict / lenient results keys ("metric,filter")
    and how `buckets` reads its samples (None / empty: decided from the samples)."""

    name: str

    @property
    def construct(self) -> str:  # type: ignore[override]
        """What it measures (one of CONSTRUCTS, or "unknown" for a task in no family)."""
        return self.construct_

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


class _UserFileIn(Strict):
    what: ClassVar[str] = "the file"
    schema_version: int | None = None
    benchmarks: dict[str, _BenchmarkIn]


class _BundledIn(_UserFileIn):
    ifeval_instructions: dict[str, dict[str, str]]


def _entry(name: str, b: _BenchmarkIn, where: str) -> Benchmark:
    for key in ("strict", "lenient"):
        v = getattr(b, key)
        if v is not None and "," not in v:
            raise UserError(
                f"{where}: benchmark {name!r} {key} key {v!r} is not 'metric,filter'",
                "use the results key, e.g. exact_match,strict-match",
            )
    if b.score_range is not None and not b.score_range[0] < b.score_range[1]:
        raise UserError(
            f"{where}: benchmark {name!r} score_range {b.score_range} is not [low, high]", "use e.g. [0, 100]"
        )
    if b.construct_ != "diagnostic" and not b.strict:
        raise UserError(
            f"{where}: benchmark {name!r} lacks `strict`", "name the results key of its score, e.g. acc,none"
        )
    return Benchmark(name=name, **b.model_dump(by_alias=True))  # score_range: floats, as the schema made them


def _parse(text: str, where: str, schema: type[_UserFileIn]) -> _UserFileIn:
    from lm_eval_sink.yaml_input import parse_yaml

    data = parse_yaml(text, where)
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), dict):
        raise UserError(
            f"{where}: expected a mapping with `benchmarks: {{NAME: {{tasks, construct, strict, lenient, why, ...}}}}`",
            f"see {_BUNDLED} for the format",
        )
    return parse(schema, data, where)


@functools.cache
def _bundled() -> tuple[dict[str, Benchmark], dict[str, dict[str, str]]]:
    text = resources.files("lm_eval_sink").joinpath("data/benchmarks.yaml").read_text(encoding="utf-8")
    data = _parse(text, _BUNDLED, _BundledIn)
    return {n: _entry(n, b, _BUNDLED) for n, b in data.benchmarks.items()}, dict(data.ifeval_instructions)


def load_benchmarks(user_file: str | Path | None = None) -> dict[str, Benchmark]:
    """Bundled benchmark families, with those of a user YAML added or replacing them by name (a new dict)."""
    out = dict(_bundled()[0])
    if user_file is not None:
        path = Path(user_file)
        if not path.is_file():
            raise UserError(f"{path}: no such benchmarks file", f"pass a YAML shaped like {_BUNDLED}")
        from lm_eval_sink.io import read_text

        data = _parse(read_text(path, "the benchmarks file"), str(path), _UserFileIn)
        out.update({n: _entry(n, b, str(path)) for n, b in data.benchmarks.items()})
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


def metric_label(column: str, benchmarks: dict[str, Benchmark]) -> str:
    """A readable name for a results column `task/metric,filter`, one way for every metric of a family: its name for
    the strict score ("IFEval"), then ", lenient", ", per instruction" (an instruction-level twin of either) or ", "
    and the metric (and a filter other than none); a task in no family keeps its task and metric names."""
    task, _, key = column.partition("/")
    family = benchmark_of(task, benchmarks)
    metric, _, filt = key.partition(",")
    plain = metric + (f" ({filt})" if filt and filt != "none" else "")
    if family is None:
        return f"{task} {plain}" if key else column
    twins = {f"{inst},{filt}": f"{prompt},{filt}" for prompt, inst in family.instruction_metrics.items()}
    level = ", per instruction" if key in twins else ""
    key = twins.get(key, key)
    if key == family.strict:
        return family.name + level
    if key == family.lenient:
        return f"{family.name}, lenient{level}"
    return f"{family.name}, {plain}"


def metric_in_points(column: str, benchmarks: dict[str, Benchmark]) -> bool:
    """Whether a results column `task/metric,filter` is a share of docs, shown in points (x 100): a metric of a
    binary family, or lm-eval's accuracy and exact-match metrics."""
    task, _, key = column.partition("/")
    family = benchmark_of(task, benchmarks)
    metric = key.partition(",")[0]
    return (family is not None and family.kind == "binary") or metric in ("acc", "acc_norm", "exact_match")


def headline_columns(columns: list[str], benchmarks: dict[str, Benchmark]) -> list[str]:
    """Each task's headline among a sweep's results columns (`task/metric,filter`): its family's strict score, S
    for a Sink Strength task, else the task's first column (table.md and table.png show these; table.csv all)."""
    by_task: dict[str, list[str]] = {}
    for c in columns:
        by_task.setdefault(c.partition("/")[0], []).append(c)
    out = []
    for task, cols in by_task.items():
        family = benchmark_of(task, benchmarks)
        wanted = [f"{task}/{family.strict}" if family and family.strict else "", f"{task}/sink_strength,none"]
        out.append(next((w for w in wanted if w in cols), cols[0]))
    return out


def metric_labels(columns: list[str], benchmarks: dict[str, Benchmark]) -> list[str]:
    """`metric_label` of each column; columns that would share a label keep their task name in it."""
    labels = [metric_label(c, benchmarks) for c in columns]
    return [
        f"{label} ({c.partition('/')[0]})" if labels.count(label) > 1 else label
        for c, label in zip(columns, labels, strict=True)
    ]
