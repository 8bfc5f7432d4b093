"""The merge-and-evaluate sweep's core: the sweep file's schema, the units and their keys, the table.

`plan_units` turns a spec into independent units (`merge:`, `eval:`, `strength:` per checkpoint), each keyed by the
work it hands on (`keys.key_of` of a `MergeWork`, `EvalWork` or `SweepStrengthWork`); `build_table` and `table_text`
make the table from the saved outputs. No file I/O: that is `commands/sweep.py`'s (docs/merging.md, "The sweep").
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, create_model

from lm_eval_sink.benchmarks import headline_columns, load_benchmarks
from lm_eval_sink.comparability import compare, setting_of_results
from lm_eval_sink.devices import DEFAULT_DEVICE, DEVICE_HELP, DEVICE_PATTERN
from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.runner import EvalSettings
from lm_eval_sink.identity import FINGERPRINT_RULE, check_same_identity
from lm_eval_sink.io import canonical_json
from lm_eval_sink.keys import UNKEYED, Work, key_of, keyed, version_change
from lm_eval_sink.merging.engines import UNIT_KINDS as KINDS, EngineSpec
from lm_eval_sink.power import MIN_N, too_few
from lm_eval_sink.protocols import diff, require_same_harness
from lm_eval_sink.report.view import fmt, named_columns
from lm_eval_sink.schema import Strict, did_you_mean, parse
from lm_eval_sink.strength import S_MEANING, StrengthSettings
from lm_eval_sink.tables import csv_text, first_few, markdown_table

ENDPOINTS = ("reference", "candidate")

# --- the sweep file ------------------------------------------------------------------------


# A device in the sweep file: devices.check_device's values, checked with the key path in the one-line error.
Device = Annotated[str, Field(pattern=DEVICE_PATTERN, description=f"is {DEVICE_HELP}")]


class MergeIn(Strict):
    """The merge section; in a SweepSpec, with `tokenizer_source` resolved and the CLI's flags on top."""

    what: ClassVar[str] = "the merge section"
    random_seed: int = 0
    device: Device = "cpu"  # mergekit's math device
    tokenizer_source: str | None = None
    delete_merged: bool = False
    in_memory: bool = False  # merge into one resident model, evaluate and measure it in-process (no unit key)
    keep_weights: bool = False  # in memory: also write each merged checkpoint (as the on-disk path does)


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep YAML with every path resolved; one source of truth for a sweep's settings."""

    source: str
    output: Path
    models: dict[str, str]  # reference, candidate (+ base)
    configs: tuple[str, ...]  # bundled names or template paths
    merge: MergeIn = field(default_factory=MergeIn)
    eval: Any = None  # harness.runner.EvalSettings, or None to skip evaluation
    engine_reuse: bool = False  # vllm: one resident engine takes every checkpoint (commands/engine_sweep.py; no key)
    strength: Any = None  # strength.StrengthSettings, or None to skip S
    strength_dtype: str = "auto"
    strength_device: str = DEFAULT_DEVICE
    engine: Any = None  # engines.EngineSpec; part of no unit key
    merges: tuple[Any, ...] = ()  # configs.Rendered per entry of `configs`: rendered and validated once, at load
    written: Any = None  # the sweep file's data as written (sweep.json keeps it: is the file the same?)

    @property
    def on_ray(self) -> bool:
        return self.engine is not None and self.engine.kind == "ray"

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": str(self.output),
            "models": self.models,
            "configs": list(self.configs),
            "merge": self.merge.model_dump(),
            "eval": None if self.eval is None else {**self.eval.to_json(), "engine_reuse": self.engine_reuse},
            "strength": None
            if self.strength is None
            else {**asdict(self.strength), "dtype": self.strength_dtype, "device": self.strength_device},
        }


class _ModelsIn(Strict):
    what: ClassVar[str] = "the models section"
    reference: str
    candidate: str
    base: str | None = None


class _EvalSection(Strict):
    what: ClassVar[str] = "the eval section"


# The eval section: EvalSettings' fields (its checks and defaults stay there), the backends a sweep runs and
# `engine_reuse` (vllm: one resident engine for every checkpoint, default true); `python` is relative to the file.
EvalIn = create_model(
    "EvalIn",
    __base__=_EvalSection,
    tasks=(list[str], Field(min_length=1)),
    backend=(Literal["hf", "vllm"] | None, None),
    device=(Device | None, None),
    engine_reuse=(bool | None, None),
    **{
        f.name: (typing.get_type_hints(EvalSettings)[f.name] | None, None)
        for f in dataclasses.fields(EvalSettings)
        if f.name not in ("tasks", "backend", "device", "log_samples")
    },
)


# The strength section: StrengthSettings' fields (its checks and defaults stay there) plus where S is measured.
StrengthIn = create_model(
    "StrengthIn",
    __base__=Strict,
    dtype=(str, "auto"),
    device=(Device, DEFAULT_DEVICE),
    **{
        f.name: (typing.get_type_hints(StrengthSettings)[f.name] | None, None)
        for f in dataclasses.fields(StrengthSettings)
    },
)
StrengthIn.what = "the strength section"


class SweepFileIn(Strict):
    """A sweep YAML as written; `eval: false` / `strength: false` are taken out before validation."""

    what: ClassVar[str] = "the sweep file"
    output: str | None = None
    models: _ModelsIn
    configs: list[str] | None = Field(None, min_length=1)
    merge: MergeIn = MergeIn()
    eval: EvalIn | None = None
    strength: StrengthIn | None = None
    engine: EngineSpec | None = None


def parse_sweep_data(data: Any, src: str) -> tuple[SweepFileIn, frozenset[str]]:
    """A sweep file's data as SweepFileIn, and which of eval / strength it switches off (`false`)."""
    skipped = frozenset(k for k in ("eval", "strength") if isinstance(data, dict) and data.get(k) is False)
    if skipped == {"eval", "strength"}:
        raise UserError(
            f"{src}: eval: false and strength: false leave nothing to do", "keep eval or strength (or both)"
        )
    if "eval" not in skipped and isinstance(data, dict) and data.get("eval") is None:
        data = {**data, "eval": {}}  # evaluation is on unless switched off: its tasks are required
    return parse(
        SweepFileIn, {k: v for k, v in data.items() if k not in skipped} if isinstance(data, dict) else data, src
    ), skipped


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as {dotted.key: value} (an empty one holds none); a list or scalar is one value."""
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): data}


def changed_inputs(units: Sequence[Unit], markers: Markers) -> list[str]:
    """What changed in each unit's work since its marker recorded it (`work`), as `kind field: old -> new`."""
    out = []
    for unit in units:
        old = (markers.get(unit.id) or {}).get("work")
        if not isinstance(old, dict):
            continue
        old, new = _flat(old), _flat(json.loads(canonical_json(keyed(unit.inputs))))
        for k in sorted(set(old) | set(new)):
            a, b = (repr(x[k]) if k in x else "unset" for x in (old, new))
            line = f"{_field_name(unit.kind, k)}: {a[:60]} -> {b[:60]}"
            if a != b and line not in out:
                out.append(line)
    return out


def _field_name(kind: str, key: str) -> str:
    """A changed field as the sweep file names it where it has one (an eval or strength unit's settings are its
    `eval:` / `strength:` section: `strength.last_k`), else the unit kind and the field (`merge random_seed`)."""
    if kind in ("eval", "strength") and key.startswith("settings."):
        return f"{kind}.{key.removeprefix('settings.')}"
    return f"{kind} {key}"


# --- units ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One independent job: its kind, checkpoint, key, output folder and the work it hands on (`inputs`, its key's
    declaration: `unit`)."""

    kind: str  # merge | eval | strength
    checkpoint: str
    key: str  # keys.key_of(inputs)
    output: Path
    inputs: Any = None
    inputs_key: str = ""
    versions: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.checkpoint}"


def unit(kind: str, checkpoint: str, output: Path, work: Work, versions: dict[str, Any] | None = None) -> Unit:
    """The unit that runs `work`, keyed by it (`keys.key_of`, with `versions` of code that runs elsewhere)."""
    key = key_of(work, versions)
    return Unit(kind, checkpoint, key.key, output, work, key.inputs_key, key.versions)


# The code that chooses a sweep unit's settings and hands them to the work: the sweep file's reading, the units.
CHOOSER = ("lm_eval_sink.commands.sweep", "lm_eval_sink.commands.units")


@dataclass(frozen=True, slots=True)
class EvalWork(Work):
    """What an eval unit hands to `run_lm_eval`: the checkpoint by its identity (`model`: where it lies), the settings
    and LM_EVAL_SINK_DATA's files by content; lm-eval's code is keyed where it runs (`eval_versions`)."""

    CODE = CHOOSER
    ENV = ("LM_EVAL_SINK_DATA",)

    model: str = field(metadata=UNKEYED)
    checkpoint: str
    settings: Any  # harness.runner.EvalSettings
    identity: dict[str, Any] | None = field(default=None, metadata=UNKEYED)  # the endpoint's, kept in the marker


@dataclass(frozen=True, slots=True)
class SweepStrengthWork(Work):
    """What a strength unit hands to the measurement: the checkpoint's identity, the settings, the dtype and, where
    the resident vLLM engine measures S, that engine's model_args and dtype (`engine`; None: transformers here)."""

    CODE = ("lm_eval_sink.strength", *CHOOSER, "lm_eval_sink.harness.inprocess", "lm_eval_sink.harness.engine_strength")
    PACKAGES = ("torch", "transformers", "peft")

    model: str = field(metadata=UNKEYED)
    checkpoint: str
    settings: StrengthSettings
    dtype: str
    engine: dict[str, Any] | None
    device: str | None = field(default=None, metadata=UNKEYED)
    identity: dict[str, Any] | None = field(default=None, metadata=UNKEYED)


@dataclass(frozen=True)
class Checkpoint:
    name: str
    role: str  # reference | candidate | merge
    path: str  # model folder (for merges: the merge unit's output)
    identity: str  # fingerprint (endpoints) or the merge's inputs key
    method: str | None = None
    setting: str | None = None
    versions: dict[str, Any] = field(default_factory=dict)  # a merge's versions, `merge `-prefixed


@dataclass(frozen=True)
class Plan:
    spec: SweepSpec
    checkpoints: tuple[Checkpoint, ...]
    units: tuple[Unit, ...]
    lineage: str

    def unit(self, kind: str, checkpoint: str) -> Unit | None:
        return next((u for u in self.units if u.kind == kind and u.checkpoint == checkpoint), None)

    def downstream(self, checkpoint: str) -> list[Unit]:
        """The eval and strength units of a checkpoint: what reads its merged weights."""
        return [u for u in self.units if u.kind != "merge" and u.checkpoint == checkpoint]


def redo_units(plan: Plan, redo: Sequence[str]) -> frozenset[str]:
    """The ids of the units `--redo` names: every unit of a kind (merge, eval, strength) or of a checkpoint."""
    names = [c.name for c in plan.checkpoints]
    for r in redo:
        if r not in KINDS and r not in names:
            raise UserError(
                f"--redo {r}: neither a unit kind ({', '.join(KINDS)}) nor a checkpoint of this sweep"
                f"{did_you_mean(r, [*KINDS, *names])}",
                f"pass --redo KIND or --redo NAME (repeatable); checkpoints: {', '.join(names)}",
            )
    return frozenset(u.id for u in plan.units if u.kind in redo or u.checkpoint in redo)


def plan_units(
    spec: SweepSpec,
    identities: dict[str, dict[str, Any]],
    versions: dict[str, dict[str, Any]],
) -> Plan:
    """Every unit with its key, in run order (merge -> eval -> strength per checkpoint, so `delete_merged` bounds the
    disk); `versions`: of code that runs elsewhere per kind, and `engine`: the resident engine's where it measures S."""
    from lm_eval_sink.merging.merge import MergeWork

    checkpoints = [Checkpoint(role, role, spec.models[role], identities[role]["fingerprint"]) for role in ENDPOINTS]
    units = [u for ck in checkpoints for u in _measure_units(spec, ck, identities.get(ck.name), versions)]
    for m in spec.merges:  # configs.Rendered, each checked once when the sweep file was loaded
        target = spec.output / "merges" / m.name
        work = MergeWork(m.validated, spec.merge.random_seed, spec.merge.device, m.template.path)
        merge = unit("merge", m.name, target, work)
        merged = {f"merge {k}": v for k, v in merge.versions.items()}
        setting = m.template.paper_setting
        ck = Checkpoint(m.name, "merge", str(target), merge.inputs_key, m.validated.method, setting, merged)
        units.append(merge)
        units += _measure_units(spec, ck, identities.get(ck.name), versions)
        checkpoints.append(ck)
    return Plan(
        spec=spec,
        checkpoints=tuple(checkpoints),
        units=tuple(units),
        lineage="siblings" if "base" in spec.models else "chain",
    )


def _measure_units(
    spec: SweepSpec, ck: Checkpoint, identity: dict[str, Any] | None, versions: dict[str, dict[str, Any]]
) -> list[Unit]:
    """The eval and strength units of one checkpoint (a merged one's also hold its merge's versions)."""
    units = []
    if spec.eval is not None:
        work = EvalWork(ck.path, ck.identity, spec.eval, identity)
        units.append(unit("eval", ck.name, spec.output / "evals" / ck.name, work, {**versions["eval"], **ck.versions}))
    if spec.strength is not None:
        work = SweepStrengthWork(
            ck.path,
            ck.identity,
            spec.strength,
            spec.strength_dtype,
            versions.get("engine"),
            spec.strength_device,
            identity,
        )
        folder = spec.output / "strength" / ck.name
        units.append(unit("strength", ck.name, folder, work, {**versions["strength"], **ck.versions}))
    return units


# --- the table -------------------------------------------------------------------------------


def _metrics(results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for task, values in sorted(results.get("results", {}).items()):
        for name, value in values.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if numeric and "_stderr" not in name and name not in ("alias", "name", "sample_len"):
                out[f"{task}/{name}"] = float(value)
    return out


def build_table(
    plan: Plan,
    failures: dict[str, str],
    results: dict[str, Any],
    fingerprints: dict[str, Any],
    strengths: dict[str, float],
    strength_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Rows = checkpoints, columns = each task metric, its delta vs the reference, S (the caller adds provenance);
    S of different settings (`strength_settings`, and the eval units' `task_strength`) are marked."""
    require_same_harness(fingerprints)
    ref_fp = fingerprints.get("reference")
    metrics = {name: _metrics(r) for name, r in results.items()}
    columns: list[str] = []
    for name in [c.name for c in plan.checkpoints]:
        columns += [m for m in metrics.get(name, {}) if m not in columns]
    rows = [_row(ck, _status(ck, failures), columns, metrics, strengths) for ck in plan.checkpoints]
    settings = strength_settings or {}
    comparison = compare(list(settings), list(settings.values())) if settings else None
    labels = {} if comparison is None else dict(zip(comparison.names, comparison.labels, strict=True))
    for r in rows:
        r["s_setting"] = labels.get(r["checkpoint"])
    tasks = task_strength(results, columns, rows)
    limit = plan.spec.eval.limit if plan.spec.eval is not None else None
    return {
        "schema_version": 1,
        "lineage": plan.lineage,
        "models": plan.spec.models,
        "columns": columns,
        "rows": rows,
        "final": limit is None,
        "final_note": None if limit is None else f"evaluated with limit={limit}: not final scores",
        "docs_per_task": docs_per_task(results),
        "units": "metrics and their deltas as lm-eval writes them (a share of docs, 0-1, for accuracy-like metrics); "
        "table.md and the report show shares of docs in points (x100)",
        "protocol": {
            "eval": None if plan.spec.eval is None else plan.spec.eval.to_json(),
            "harness_sha256": ref_fp.harness_sha() if ref_fp else None,
            "model_differences": _model_differences(fingerprints),
        },
        "strength_settings": None if plan.spec.strength is None else asdict(plan.spec.strength),
        "strength_comparability": None if comparison is None else comparison.to_json(),
        "task_strength_comparability": tasks,
    }


def task_strength(results: dict[str, Any], columns: list[str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The eval units' Sink Strength tasks through the strength units' comparability check, per task; where the
    settings differ, each row's `metric_settings` marks that task's columns with the row's setting letter."""
    sink = sorted(
        {t for r in results.values() for t, m in (r.get("results") or {}).items() if "sink_strength,none" in m}
    )
    out = {}
    for r in rows:
        r["metric_settings"] = {}
    for task in sink:
        names = [n for n in results if "sink_strength,none" in ((results[n].get("results") or {}).get(task) or {})]
        comparison = compare(names, [setting_of_results(results[n], task) for n in names])
        out[task] = comparison.to_json()
        if comparison.comparable:
            continue
        labels = dict(zip(comparison.names, comparison.labels, strict=True))
        for r in rows:
            if r["checkpoint"] in labels:
                mark = labels[r["checkpoint"]]
                r["metric_settings"].update({c: mark for c in columns if c.partition("/")[0] == task})
    return out


def comparability_lines(table: dict[str, Any]) -> list[str]:
    """What the console says of S measured in different settings in a sweep's table; nothing where S compares."""
    parts = [("S", table.get("strength_comparability"))]
    parts += sorted((table.get("task_strength_comparability") or {}).items())
    return [
        f"{name}: {line}"
        for name, comparison in parts
        if comparison and not comparison["comparable"]
        for line in comparison["notes"]
    ]


def _status(ck: Checkpoint, failures: dict[str, str]) -> str:
    """A checkpoint's status: each of its failed units with the error, else ok."""
    units = (f"{kind}:{ck.name}" for kind in KINDS)
    problems = [f"{u}: {failures[u]}" for u in units if u in failures]
    return "; ".join(problems) if problems else "ok"


def _model_differences(fingerprints: dict[str, Any]) -> list[str]:
    """A note per checkpoint whose model-owned protocol fields (chat template, special tokens, ...) differ from the
    reference's: allowed in one table, unlike the harness fields (`protocols.require_same_harness`)."""
    ref_fp = fingerprints.get("reference")
    lines = []
    for name, fp in fingerprints.items():
        if ref_fp is not None and name != "reference":
            fields = [d.field for d in diff(ref_fp, fp) if d.part == "model"]
            if fields:
                lines.append(f"{name} differs from the reference in model-owned protocol fields: {', '.join(fields)}")
    return lines


def _row(
    ck: Checkpoint, status: str, columns: list[str], metrics: dict[str, dict[str, float]], strengths: dict[str, float]
) -> dict[str, Any]:
    """One checkpoint's row: its metrics and S, and their deltas vs the reference's (None where either is missing)."""
    m, ref_m = metrics.get(ck.name, {}), metrics.get("reference", {})
    s, ref_s = strengths.get(ck.name), strengths.get("reference")
    return {
        "checkpoint": ck.name,
        "role": ck.role,
        "method": ck.method,
        "setting": ck.setting,
        "status": status,
        "metrics": {c: m.get(c) for c in columns},
        "delta_vs_reference": {c: (m[c] - ref_m[c]) if c in m and c in ref_m else None for c in columns},
        "sink_strength": s,
        "sink_strength_delta_vs_reference": (s - ref_s) if s is not None and ref_s is not None else None,
    }


def _fmt(x: float | None, signed: bool = False, scale: float = 1.0) -> str:
    """A cell: 4 decimals in lm-eval's unit, or 1 decimal in points (`scale` 100) for a share of docs."""
    return "n/a" if x is None else fmt(x, ("+" if signed else "") + ("pts" if scale != 1.0 else "f4"))


def _table_rows(table: dict[str, Any], cols: list[str], scales: list[float]) -> list[list[str]]:
    """One row per checkpoint: each metric of `cols` and its delta (scaled per column), S and its delta, the status;
    an S measured in another setting than others of its column carries that setting's letter."""
    comparable = (table.get("strength_comparability") or {}).get("comparable", True)

    def marked(text: str, label: str | None) -> str:
        return f"{text} ({label})" if label else text

    rows = []
    for r in table["rows"]:
        marks = r.get("metric_settings") or {}
        s_mark = r.get("s_setting") if not comparable else None
        cells = [
            marked(x, marks.get(c))
            for c, f in zip(cols, scales, strict=True)
            for x in (_fmt(r["metrics"][c], scale=f), _fmt(r["delta_vs_reference"][c], True, f))
        ]
        s_cells = [
            marked(_fmt(r["sink_strength"]), s_mark),
            marked(_fmt(r["sink_strength_delta_vs_reference"], True), s_mark),
        ]
        rows.append([r["checkpoint"], r["method"] or r["role"], *cells, *s_cells, r["status"]])
    return rows


def _units_line(labels: list[str], scales: list[float]) -> str:
    """Which columns are in points and which in their metric's own unit, said once above the table."""
    points = [f'"{lab}"' for lab, f in zip(labels, scales, strict=True) if f != 1.0]
    own = [f'"{lab}"' for lab, f in zip(labels, scales, strict=True) if f == 1.0]
    parts = [f"in points (x100 of lm-eval's share of docs): {', '.join(points)}"] if points else []
    parts += [f"in the metric's own unit: {', '.join(own)}"] if own else []
    return "Scores and deltas " + "; ".join(parts) + "; table.csv and table.json keep lm-eval's values.\n"


def _too_few_line(table: dict[str, Any]) -> str:
    """buckets' small-sample rule for a sweep whose smallest scored task ran on fewer than `power.MIN_N` documents
    (`docs_per_task`, else an integer `--limit`: a fractional one or a task smaller than the limit counts too)."""
    limit = ((table.get("protocol") or {}).get("eval") or {}).get("limit")
    docs = list((table.get("docs_per_task") or {}).values())
    fewest = min(docs) if docs else int(limit) if isinstance(limit, int | float) and limit >= 1 else None
    if fewest is None or fewest >= MIN_N:
        return ""
    what = too_few(fewest, f"{fewest} docs in its smallest task (at least {MIN_N} are needed)")
    return f"**{what[0].upper()}{what[1:]}.** Every delta below describes these docs only.\n"


def docs_per_task(results: dict[str, Any]) -> dict[str, int]:
    """The fewest documents each scored task ran on over the checkpoints (lm-eval's n-samples "effective"); the
    prompts of a Sink Strength task are not documents."""
    out: dict[str, int] = {}
    for r in results.values():
        for task, counts in (r.get("n-samples") or {}).items():
            n, values = (counts or {}).get("effective"), (r.get("results") or {}).get(task) or {}
            if isinstance(n, int) and not any(str(k).startswith("sink_strength") for k in values):
                out[task] = min(n, out.get(task, n))
    return out


def table_text(table: dict[str, Any]) -> tuple[str, str]:
    """The table as Markdown (notes first, each task's headline metric under its readable name, shares of docs in
    points, those unchanged in every checkpoint said once) and as CSV (every column as lm-eval names and writes it)."""
    named = named_columns(headline_columns(table["columns"], load_benchmarks()), table["rows"])
    cols, labels, scales = ([x[i] for x in named if not x[3]] for i in range(3))

    def head(names: list[str]) -> list[str]:
        return ["checkpoint", "method", *[x for c in names for x in (c, f"{c} delta")], "S", "S delta", "status"]

    md = f"Merging sweep ({table['lineage']} lineage); deltas vs the reference.\n"
    if not table["final"]:
        md += f"**Not final scores:** {table['final_note']}.\n" + _too_few_line(table)
    strength_notes = (table.get("strength_comparability") or {}).get("notes") or []
    md += f"S: {S_MEANING}.\n" + "".join(f"S, {line}\n" for line in strength_notes)
    for task, comparison in sorted((table.get("task_strength_comparability") or {}).items()):
        md += "".join(f"{task} (S of the eval units), {line}\n" for line in comparison["notes"])
    md += _units_line([x[1] for x in named], [x[2] for x in named]) if named else ""
    md += "Each task's headline metric; every metric is in table.csv.\n"
    said = [f"{label} {_fmt(table['rows'][0]['metrics'][c], scale=f)}" for c, label, f, same in named if same]
    md += f"Unchanged in every checkpoint, so left out below: {', '.join(said)}.\n" if said else ""
    everything = table["columns"]
    md_rows, csv_rows = _table_rows(table, cols, scales), _table_rows(table, everything, [1.0] * len(everything))
    return md + "\n" + markdown_table(head(labels), md_rows), csv_text(head(everything), csv_rows)


# --- what to run: decisions on the folder's state, read once by commands/sweep.py ----------------

Markers = dict[str, dict[str, Any] | None]  # unit id -> its COMPLETE marker as read (None: none there)


@dataclass(frozen=True)
class FolderState:
    """What a sweep's output folder held when the run started, read once under its lock (`commands.sweep`)."""

    markers: Markers  # each unit's COMPLETE marker
    latest: dict[str, dict[str, Any]]  # the manifest's last done / failed line of each unit
    existing: frozenset[str]  # units whose output folder exists
    weights: frozenset[str]  # merge units whose weight files are all there, at the sizes their marker records
    earlier_file: dict[str, Any] | None  # the sweep file as an earlier run recorded it in sweep.json


@dataclass(frozen=True)
class Schedule:
    """What a run does: the units finished with their current keys (less those to redo), the units to run, and
    the merges an in-memory sweep neither runs nor has on disk."""

    finished: frozenset[str]
    todo: tuple[Unit, ...]
    unwritten: tuple[str, ...]
    # finished merges run again because `delete_merged` removed their weights: merge id -> the units that need them
    remerged: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def skipped(self, plan: Plan) -> list[str]:
        return [u.id for u in plan.units if u not in self.todo and u.id not in self.unwritten]


def current(unit: Unit, markers: Markers) -> dict[str, Any] | None:
    """The unit's marker when it was made from the unit's inputs (its key), else None."""
    marker = markers.get(unit.id)
    return marker if marker is not None and marker.get("key") == unit.key else None


def unit_finished(unit: Unit, latest: dict[str, dict[str, Any]], markers: Markers) -> bool:
    """Finished = last manifest line done with this key AND the COMPLETE marker with this key."""
    row = latest.get(unit.id)
    return bool(
        row and row.get("status") == "done" and row.get("key") == unit.key and current(unit, markers) is not None
    )


def schedule(plan: Plan, state: FolderState, force: bool, redo: frozenset[str]) -> Schedule:
    """The units to run: unfinished ones (all with `force`, also those in `redo`); a merge only where its eval or S
    needs weights that are not there (in memory: only to keep them), never for weights `delete_merged` removed."""
    merge = plan.spec.merge
    latest = {} if force else state.latest
    finished = frozenset(u.id for u in plan.units if unit_finished(u, latest, state.markers) and u.id not in redo)

    def needed(unit: Unit) -> bool:
        if unit.kind != "merge":
            return unit.id not in finished
        if merge.in_memory:  # its eval and S read the resident model: weights only when asked for
            return merge.keep_weights and unit.id not in finished
        if all(d.id in finished for d in plan.downstream(unit.checkpoint)):
            return unit.id not in finished and not merge.delete_merged
        return unit.id not in finished or unit.id not in state.weights

    todo = tuple(u for u in plan.units if needed(u))
    unwritten = tuple(
        u.id for u in plan.units if merge.in_memory and u.kind == "merge" and u not in todo and u.id not in finished
    )
    remerged = {
        u.id: tuple(d.id for d in plan.downstream(u.checkpoint) if d in todo)
        for u in todo
        if u.kind == "merge" and u.id in finished
    }
    return Schedule(finished=finished, todo=todo, unwritten=unwritten, remerged=remerged)


def check_conflicts(plan: Plan, state: FolderState, redo: frozenset[str], now: dict[str, Any]) -> list[str]:
    """Refuse unit outputs made from other inputs (`changed_inputs`; those in `redo` are redone instead); one made by
    other versions, or from an unchanged sweep file (a release changed a default), is recomputed with a note."""
    notes, conflicts = [], []
    for unit in plan.units:
        if unit.id in redo or unit.id not in state.existing or current(unit, state.markers) is not None:
            continue
        complete = state.markers.get(unit.id) or {}
        if complete.get("fingerprint_rule") != FINGERPRINT_RULE:
            raise UserError(
                f"{unit.output}: made with an older fingerprint rule; rerun with --force",
                "pass --force to redo everything",
            )
        changed = version_change(complete, unit.inputs_key, unit.versions)
        if changed:
            notes.append(f"{unit.id}: recomputed: {changed}")
            continue
        identity = getattr(unit.inputs, "identity", None)
        if identity and complete.get("model_identity"):
            check_same_identity(complete["model_identity"], identity, unit.output)
        conflicts.append(unit)
    if conflicts and state.earlier_file == now:  # the sweep file as written is the same: a release changed a default
        same = "made under other defaults (the sweep file is the same)"
        return notes + [f"{u.id}: recomputed: {same}" for u in conflicts]
    if conflicts:
        raise _changed(plan.spec.source, conflicts, changed_inputs(conflicts, state.markers))
    return notes


def _changed(source: str, conflicts: list[Unit], fields: list[str] | None) -> UserError:
    """The one line for finished units made from other inputs: the changed inputs, the units, --redo."""
    ids = [u.id for u in conflicts]
    kinds = [k for k in KINDS if any(u.kind == k for u in conflicts)]
    return UserError(
        f"{source}: {'; '.join(fields or ['the sweep file or a model'])} changed since "
        f"{first_few(ids, 6)} "
        f"{'was' if len(ids) == 1 else 'were'} made",
        f"pass {' '.join(f'--redo {k}' for k in kinds)} to redo just those (the others are kept), --force to "
        "redo everything, or choose a new output folder",
    )
