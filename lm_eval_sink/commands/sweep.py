"""`lm-eval-sink sweep`: read and check a sweep file, plan it, run its unfinished units, write the table.

A unit is finished only when its last manifest line and its COMPLETE marker carry its current key, so a rerun after
kill -9 redoes exactly the rest; a failed unit is reported at the end (docs/merging.md, "The sweep").
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.commands.units import run_unit
from lm_eval_sink.commands.engine_sweep import (
    check_reuse,
    check_room,
    engine_reuse,
    engine_strength_versions,
    local_runner,
    plan_notes,
    ray_pool,
)
from lm_eval_sink.comparability import setting_of
from lm_eval_sink.errors import UserError, one_line
from lm_eval_sink.harness.runner import EvalSettings, check_interpreter
from lm_eval_sink.harness.vllm_preflight import check_engine_start
from lm_eval_sink.identity import looks_like_hub_id
from lm_eval_sink.io import atomic_write_json, atomic_write_text, read_json, read_text
from lm_eval_sink.outputs import check_not_inputs, check_writable, clean_stale_all, read_complete
from lm_eval_sink.protocols import fingerprint_run
from lm_eval_sink.provenance import provenance
from lm_eval_sink.report.view import sweep_series
from lm_eval_sink.runs import load_results, resolve_run
from lm_eval_sink.yaml_input import parse_yaml
from lm_eval_sink.locks import hold
from lm_eval_sink.merging.configs import TOKENIZER_CHOICES, bundled_names, load_template, render
from lm_eval_sink.merging.engines import parse_engine, run_on_ray
from lm_eval_sink.merging.sweep import (
    ENDPOINTS,
    EvalIn,
    FolderState,
    Markers,
    Plan,
    Schedule,
    StrengthIn,
    SweepSpec,
    Unit,
    build_table,
    check_conflicts,
    comparability_lines,
    current,
    parse_sweep_data,
    plan_units,
    redo_units,
    schedule,
    table_text,
)
from lm_eval_sink.strength import StrengthSettings

MANIFEST = "manifest.jsonl"


# --- the sweep file ------------------------------------------------------------------------


def _eval_settings(ev: EvalIn, src: str, rel: Any, python: str | None) -> Any:
    """The `eval:` section as harness.runner.EvalSettings (backend vllm: no device; `python` overrides eval.python)."""
    given = ev.model_dump(exclude_none=True, exclude={"engine_reuse"})
    given["tasks"] = tuple(given["tasks"])
    if python or ev.python:
        given["python"] = python or rel(ev.python)
    if given.get("backend", "hf") != "hf":
        given.setdefault("device", None)
    if ev.include_path:
        given["include_path"] = rel(ev.include_path)
        if not Path(given["include_path"]).is_dir():
            raise UserError(
                f"{src}: eval.include_path: {given['include_path']} is not a folder",
                "lm-eval takes ONE folder of task YAMLs",
            )
    try:
        return EvalSettings(**given)
    except UserError as e:
        raise UserError(f"{src}: eval: {e.message}", e.hint) from None


def _check_eval(spec: SweepSpec) -> None:
    """What lm-eval would fail on only after the merges and every S (task names, generation lengths, a vLLM engine
    that cannot start), last of the sweep file's checks since it builds lm-eval's task index."""
    from lm_eval_sink.harness.checks import check_protocol

    if spec.eval is not None:
        try:
            if not spec.on_ray:  # a Ray actor's engine starts on its own node
                check_engine_start(spec.eval)
            check_protocol(spec.eval, list(spec.models.values()))
        except UserError as e:
            raise UserError(f"{spec.source}: eval: {e.message}", e.hint) from None


def _render(templates: list[Any], models: dict[str, str], tokenizer_source: str | None) -> tuple[Any, ...]:
    """Each merge control filled in for the sweep's models and validated (configs.Rendered)."""
    ref, cand = models["reference"], models["candidate"]
    return tuple(render(t, ref, cand, base=models.get("base"), tokenizer_source=tokenizer_source) for t in templates)


def load_sweep(
    path: str | Path,
    output: str | Path | None = None,
    delete_merged: bool | None = None,
    engine: str | None = None,
    ray_address: str | None = None,
    python: str | None = None,
    in_memory: bool | None = None,
    fresh_engine: bool = False,
) -> SweepSpec:
    """Read and check a sweep YAML once (no weights read), with the CLI's flags over the file's settings
    (`fresh_engine`: eval.engine_reuse off)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such sweep file", "pass a sweep YAML (see docs/merging.md)")
    src, here = str(path), path.resolve().parent
    written = parse_yaml(read_text(path, "the sweep file"), src) or {}
    sweep, skipped = parse_sweep_data(written, src)
    out = _output(output, sweep.output, src, here)
    models = _models(sweep, src, here)
    configs, templates = _templates(sweep, src, here)
    flags = {k: v for k, v in {"delete_merged": delete_merged, "in_memory": in_memory}.items() if v is not None}
    merge = sweep.merge.model_copy(update=flags)
    if merge.tokenizer_source is not None and merge.tokenizer_source not in TOKENIZER_CHOICES:  # a model folder
        merge = merge.model_copy(update={"tokenizer_source": _model_arg(here, merge.tokenizer_source)})
    eval_settings = None if "eval" in skipped else _eval_settings(sweep.eval, src, lambda p: _rel(here, p), python)
    strength, sdtype, sdevice = _strength(sweep.strength, "strength" in skipped, src, here)
    devices = {"merge": merge.device, "eval": eval_settings and eval_settings.device, "strength": sdevice}
    engine_spec = parse_engine(
        sweep.engine, src, kind=engine, address=ray_address, devices=devices, eval_settings=eval_settings
    )
    spec = SweepSpec(
        source=src,
        output=out.resolve(),
        models=models,
        configs=configs,
        merge=merge,
        eval=eval_settings,
        engine_reuse=engine_reuse(sweep.eval and sweep.eval.engine_reuse, eval_settings, fresh_engine, src),
        strength=strength,
        strength_dtype=sdtype,
        strength_device=sdevice,
        engine=engine_spec,
        merges=_render(templates, models, merge.tokenizer_source),
        written=written,
    )
    return _checked(spec)


def _checked(spec: SweepSpec) -> SweepSpec:
    """The checks of a whole spec: an in-memory sweep's, the resident vLLM engine's (vLLM's source read; the GPU
    memory its units need beside it), then lm-eval's protocol (its task index built)."""
    from lm_eval_sink.commands.resident import check_spec

    check_spec(spec)
    if spec.engine_reuse:
        check_reuse(spec)
        check_room(spec)
    _check_eval(spec)
    return spec


def _output(given: str | Path | None, written: str | None, src: str, here: Path) -> Path:
    """The output folder: --output, else the file's `output` (relative to its folder)."""
    out = Path(given) if given is not None else (Path(_rel(here, written)) if written else None)
    if out is None:
        raise UserError(f"{src}: output: missing", "add output: FOLDER to the sweep file, or pass --output")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: is a file, not a folder", "choose an output folder")
    check_writable(out, "output")
    return out


def _rel(here: Path, p: str) -> str:
    q = Path(p).expanduser()
    return str(q if q.is_absolute() else here / q)


def _model_arg(here: Path, name: str) -> str:
    """A folder relative to the sweep file, unless the name is a hub id (`org/name`) with no such folder there."""
    return name if looks_like_hub_id(name) and not Path(_rel(here, name)).exists() else _rel(here, name)


def _models(sweep: Any, src: str, here: Path) -> dict[str, str]:
    from lm_eval_sink.models import resolve_model

    models: dict[str, str] = {}
    for role, name in sweep.models.model_dump(exclude_none=True).items():
        try:
            models[role] = resolve_model(_model_arg(here, name), allow_adapter=False)
        except UserError as e:
            raise UserError(f"{src}: models.{role}: {e.message}", e.hint) from None
    return models


def _templates(sweep: Any, src: str, here: Path) -> tuple[tuple[str, ...], list[Any]]:
    """The `configs:` entries (bundled names, template paths made absolute) and their templates, each loaded once."""
    configs = (
        tuple(bundled_names())
        if sweep.configs is None
        else tuple(_rel(here, c) if c.endswith((".yaml", ".yml")) else c for c in sweep.configs)
    )
    templates = []
    for i, c in enumerate(configs):
        try:
            templates.append(load_template(c))  # unknown names fail here, with did-you-mean
        except UserError as e:
            raise UserError(f"{src}: configs[{i}]: {e.message}", e.hint) from None
    names = [t.name for t in templates]
    clash = next((n for n in names if names.count(n) > 1 or n in ENDPOINTS), None)
    if clash:
        raise UserError(
            f"{src}: configs: the checkpoint name {clash!r} is used twice (or is an endpoint's name)",
            "give each config file its own name",
        )
    return configs, templates


def _strength(section: Any, skipped: bool, src: str, here: Path) -> tuple[Any, str, str]:
    """The `strength:` section as (StrengthSettings or None when switched off, dtype, device)."""
    st = (section or StrengthIn()).model_dump(exclude_none=True)
    sdtype, sdevice = st.pop("dtype"), st.pop("device")
    if skipped:
        return None, sdtype, sdevice
    if st.get("prompts_file"):
        st["prompts_file"] = _rel(here, st["prompts_file"])
    try:
        return StrengthSettings(**st), sdtype, sdevice
    except UserError as e:
        raise UserError(f"{src}: strength: {e.message}", e.hint) from None


def plan_sweep(spec: SweepSpec) -> Plan:
    """Fingerprint the endpoints and derive each unit's key from the work it hands on (reads no weights)."""
    from lm_eval_sink.harness.runner import eval_versions
    from lm_eval_sink.models import model_fingerprint

    identities = {role: model_fingerprint(spec.models[role]) for role in ENDPOINTS}
    evals = eval_versions(spec.eval) if spec.eval is not None else {}
    on_engine = engine_strength_versions(spec, evals)
    engine = {"model_args": spec.eval.model_args, "dtype": spec.eval.dtype} if on_engine and spec.eval else None
    lm_eval = {f"lm-eval {k}": v for k, v in evals.items()}  # where lm-eval runs
    return plan_units(spec, identities, {"eval": lm_eval, "strength": on_engine, "engine": engine})


# --- manifest and recovery -----------------------------------------------------------------


class Manifest:
    """`manifest.jsonl`: one fsync'd JSON line per finished (or failed) unit; a torn last line is ignored."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def latest(self) -> dict[str, dict[str, Any]]:
        """Each unit's last done or failed line."""
        last: dict[str, dict[str, Any]] = {}
        for line in self.path.read_text(encoding="utf-8").splitlines() if self.path.is_file() else []:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by kill -9: that unit is simply not finished
            if isinstance(row, dict) and "unit" in row and row.get("status") in ("done", "failed"):
                last[row["unit"]] = row
        return last

    def append_row(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (
            json.dumps({**row, "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}, sort_keys=True)
            + "\n"
        )
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:  # a torn last line from kill -9 must not swallow this one
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())


# --- running ---------------------------------------------------------------------------------


def _redone(remerged: dict[str, tuple[str, ...]]) -> str:
    """' (merged again because ...: merge:X for strength:X)' for finished merges redone because their weights
    were deleted (`Schedule.remerged`), else ''."""
    again = "; ".join(f"{m} for {', '.join(need) or 'its weights'}" for m, need in remerged.items())
    return f" (merged again because their weights were deleted: {again})" if again else ""


@dataclass
class SweepReport:
    output: Path
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    table_files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    remerged: dict[str, tuple[str, ...]] = field(default_factory=dict)  # Schedule.remerged
    verdicts: list[str] = field(default_factory=list)  # recovery's verdict lines, the console's last
    times: str | None = None  # the console's last line (`times_line`)

    def plan_line(self, todo: int) -> str:
        """What the run is about to do, said before any step runs."""
        redone = _redone(self.remerged)
        return f"sweep {self.output}: plan: {todo} steps to run{redone}, {len(self.skipped)} already finished"

    def lines(self) -> list[str]:
        out = [
            f"sweep {self.output}: {len(self.ran)} steps run{_redone(self.remerged)}, {len(self.skipped)} already "
            f"finished, {len(self.failures)} failed"
        ]
        out += [f"note: {n}" for n in self.notes]
        if self.table_files:
            out.append("table -> " + ", ".join(str(p) for p in self.table_files))
        out += [f"failed: {u}: {e}" for u, e in self.failures.items()]
        return out + ([self.times] if self.times else []) + self.verdicts

    def raise_for_failures(self) -> None:
        if self.failures:
            first = next(iter(self.failures.items()))
            raise UserError(
                f"{len(self.failures)} sweep step(s) failed ({', '.join(self.failures)}); first: "
                f"{first[0]}: {first[1]}",
                f"see {self.output / MANIFEST}; fix the cause and rerun the same command: finished steps are kept",
            )


def _inputs(spec: SweepSpec) -> list[str | None]:
    """What a sweep reads: its file, models, config templates, tokenizer, include path and prompts."""
    ev, st = spec.eval, spec.strength
    paths = [spec.source, *spec.models.values(), *spec.configs, spec.merge.tokenizer_source]
    return [*paths, ev and ev.include_path, st and st.prompts_file]


def run_sweep(
    spec: SweepSpec,
    force: bool = False,
    progress: bool = True,
    redo: Sequence[str] = (),
    announce: Callable[[str], None] | None = None,
) -> SweepReport:
    """Plan, run every unfinished unit (all with `force`; also those `redo` names) on the spec's engine, then write
    the table, with the output folder locked; `announce` gets the plan's lines before the first step runs."""
    check_not_inputs([spec.output], inputs=_inputs(spec), option="output")
    if spec.eval is not None:
        check_interpreter(spec.eval)
    earlier = None if force else _earlier_record(spec.output)
    spec, notes = _with_earlier_configs(spec, earlier)
    plan = plan_sweep(spec)
    units = redo_units(plan, redo)
    with hold(spec.output):
        return _run_sweep_locked(plan, force, progress, units, earlier, notes, announce)


def _earlier_record(out: Path) -> dict[str, Any] | None:
    """The sweep.json an earlier run of this output folder wrote, or None."""
    try:
        data = json.loads((out / "sweep.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _with_earlier_configs(spec: SweepSpec, earlier: dict[str, Any] | None) -> tuple[SweepSpec, list[str]]:
    """The spec with the configs that earlier runs of its output folder had and its file no longer lists, so the
    table keeps every finished checkpoint; one that cannot be planned any more is left out with a note."""
    recorded = ((earlier or {}).get("sweep") or {}).get("configs") or []
    names, kept, merges, notes = {m.name for m in spec.merges}, [], [], []
    for config in (c for c in recorded if c not in spec.configs):
        try:
            (merge,) = _render([load_template(config)], spec.models, spec.merge.tokenizer_source)
        except UserError as e:
            notes.append(f"configs: {config} of an earlier run is left out ({e.message})")
            continue
        if merge.name not in names:
            names.add(merge.name)
            kept.append(config)
            merges.append(merge)
    if not kept:
        return spec, notes
    spec = dataclasses.replace(spec, configs=(*spec.configs, *kept), merges=(*spec.merges, *merges))
    if spec.merge.in_memory:
        from lm_eval_sink.commands.resident import check_spec

        check_spec(spec)
    notes.append(
        f"configs of earlier runs into {spec.output.name} stay in the sweep: {', '.join(kept)} "
        "(--force, or a new output folder, starts without them)"
    )
    return spec, notes


def _file_record(spec: SweepSpec) -> dict[str, Any]:
    """The sweep file as written, with the sha256 of its template files: what sweep.json keeps to tell whether a unit
    made from other inputs came from another file or from another release's defaults."""
    templates = {m.template.path: m.template.sha256 for m in spec.merges if m.template.path in spec.configs}
    return {"data": spec.written, "templates": templates}  # bundled templates are named, not given as paths


def _weights_present(unit: Unit, marker: dict[str, Any] | None) -> bool:
    files = (marker or {}).get("weight_files")
    return isinstance(files, dict) and all(
        (unit.output / n).is_file() and (unit.output / n).stat().st_size == size for n, size in files.items()
    )


def _read_state(plan: Plan, earlier: dict[str, Any] | None) -> FolderState:
    """Everything a run decides from, read once: each unit's marker, the manifest, which outputs and weights exist."""
    markers = {u.id: read_complete(u.output) for u in plan.units}
    return FolderState(
        markers=markers,
        latest=Manifest(plan.spec.output / MANIFEST).latest(),
        existing=frozenset(u.id for u in plan.units if u.output.exists()),
        weights=frozenset(u.id for u in plan.units if u.kind == "merge" and _weights_present(u, markers[u.id])),
        earlier_file=(earlier or {}).get("file"),
    )


def _start(
    plan: Plan, force: bool, redo: frozenset[str], earlier: dict[str, Any] | None, report: SweepReport
) -> tuple[FolderState, Schedule]:
    """Tidy what a killed run left, read the folder once, refuse or note units made from other inputs, record the
    sweep (sweep.json); return what was read and what to run."""
    out = plan.spec.output
    report.notes.extend(clean_stale_all({u.output: u.key for u in plan.units}))
    state = _read_state(plan, earlier)
    record = _file_record(plan.spec)
    if not force:
        report.notes.extend(check_conflicts(plan, state, redo, record))
    atomic_write_json(
        out / "sweep.json",
        {
            "schema_version": 1,
            "sweep": plan.spec.to_json(),
            "file": record,
            "lineage": plan.lineage,
            "units": {u.id: u.key for u in plan.units},
            "provenance": provenance(),
        },
    )
    return state, schedule(plan, state, force, redo)


def _run_sweep_locked(
    plan: Plan,
    force: bool,
    progress: bool,
    redo: frozenset[str],
    earlier: dict[str, Any] | None,
    notes: list[str],
    announce: Callable[[str], None] | None,
) -> SweepReport:
    spec, out = plan.spec, plan.spec.output
    report = SweepReport(output=out, notes=list(notes))
    state, plan_now = _start(plan, force, redo, earlier, report)
    markers, finished, manifest = dict(state.markers), set(plan_now.finished), Manifest(out / MANIFEST)
    todo = list(plan_now.todo)
    steps = StepCounter(len(todo), announce, progress)  # --quiet: a line per step, no bars

    def record(unit: Unit, error: str | None) -> None:
        """The driver's bookkeeping of one unit that ran (or could not run), whatever the engine."""
        steps.finished(unit.id, error)
        if error is not None:
            report.failures[unit.id] = error
            if not error.startswith("not run: "):
                manifest.append_row(
                    {"unit": unit.id, "key": unit.key, "status": "failed", "error": error, "output": str(unit.output)}
                )
            return
        manifest.append_row({"unit": unit.id, "key": unit.key, "status": "done", "output": str(unit.output)})
        markers[unit.id] = read_complete(unit.output)
        finished.add(unit.id)
        report.ran.append(unit.id)
        if spec.merge.delete_merged and (merge := plan.unit("merge", unit.checkpoint)) is not None:
            _maybe_delete_weights(plan, merge, finished, manifest, markers)

    engine_lines = plan_notes(plan, todo)
    report.notes.extend(engine_lines)
    report.skipped.extend(plan_now.skipped(plan))
    report.remerged.update(plan_now.remerged)
    for line in [report.plan_line(len(todo)), *engine_lines] if announce else ():
        announce(line)
    if plan_now.unwritten:
        report.notes.append(
            f"{len(plan_now.unwritten)} merged checkpoint(s) not written to disk (in memory; keep_weights: true "
            "writes them)"
        )
    if spec.merge.in_memory:
        from lm_eval_sink.commands.resident import run_in_memory

        report.notes.extend(run_in_memory(plan, todo, record, progress))
    elif spec.on_ray:
        run_on_ray(todo, spec.engine, out, record, run_unit, progress=progress, pool=ray_pool(spec))
    else:
        with local_runner(spec, report.notes) as run:
            _run_local(todo, record, report.failures, steps, run)
    if spec.merge.delete_merged:  # also checkpoints finished by an earlier run
        for unit in plan.units:
            if unit.kind == "merge":
                _maybe_delete_weights(plan, unit, finished, manifest, markers)
    _tabulate(plan, markers, report, steps.seconds)
    return report


def times_line(plan: Plan, markers: Markers, seconds: dict[str, float]) -> str | None:
    """This run's wall time per checkpoint (its units that ran here in turn), and a resident vLLM engine's build and
    weight swaps (its eval units' markers); None when no unit was timed."""
    per: dict[str, float] = {}
    for u in plan.units:
        if u.id in seconds:
            per[u.checkpoint] = per.get(u.checkpoint, 0.0) + seconds[u.id]
    ran = [(markers.get(u.id) or {}).get("timings") or {} for u in plan.units if u.kind == "eval" and u.id in seconds]
    build, swap = [t["engine_build"] for t in ran if "engine_build" in t], [t["swap"] for t in ran if "swap" in t]
    parts = [", ".join(f"{ck} {t:.1f} s" for ck, t in per.items())] if per else []
    parts += [f"engine build {sum(build):.1f} s"] if build else []
    parts += [f"weight swap {min(swap):.1f}-{max(swap):.1f} s"] if swap else []
    return "times of this run: " + "; ".join(parts) if parts else None


def _tabulate(plan: Plan, markers: Markers, report: SweepReport, seconds: dict[str, float]) -> None:
    """Build the table from the saved outputs and write it (table.json, .csv, .md, .png); the report's notes and
    last lines say what differs, the run's times and recovery's verdicts."""
    report.times = times_line(plan, markers, seconds)
    table = {
        **build_table(plan, report.failures, *_saved_outputs(plan, markers)),
        "provenance": provenance(sweep=plan.spec.source, units={u.id: u.key for u in plan.units}),
    }
    report.verdicts = sweep_recovery(plan, markers)
    report.table_files = write_table(table, plan.spec.output, report.verdicts)
    report.notes.extend([*table["protocol"]["model_differences"], *comparability_lines(table)])


def sweep_recovery(plan: Plan, markers: Markers) -> list[str]:
    """`recovery` over the sweep's evaluated runs (each merge a control) into `<output>/recovery/`, recomputed only
    when its key changed; the verdict lines (none without both endpoints and a control evaluated)."""
    from lm_eval_sink.buckets.settings import BucketSettings
    from lm_eval_sink.commands.recovery import NamedRun, compute, recovery_key, write_outputs
    from lm_eval_sink.recovery import verdict_lines

    runs = [  # plan order: the reference, the candidate, then the merges
        NamedRun(ck.name, "control" if ck.role == "merge" else ck.role, u.output)
        for ck in plan.checkpoints
        if (u := plan.unit("eval", ck.name)) is not None and current(u, markers) is not None
    ]
    if {r.role for r in runs} != {"reference", "candidate", "control"}:
        return []
    out, settings = plan.spec.output / "recovery", BucketSettings(failure_kinds=False)
    saved = read_json(out / "recovery.json") if (out / "recovery.json").is_file() else None
    if saved is None or saved.get("provenance", {}).get("key") != recovery_key(runs, settings).key:
        saved, table = compute(runs, settings, command="sweep")
        write_outputs(saved, table, out, force=True)
    return verdict_lines(saved)


@dataclass
class StepCounter:
    """`[3/10] eval:linear_95_5`: one line per step to `announce` as it starts (engines that run steps in turn) or
    ends (the others); none with `progress` (bars count the steps) or without `announce`."""

    total: int
    announce: Callable[[str], None] | None
    progress: bool = False
    counted: dict[str, int] = field(default_factory=dict)
    began: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each step that started here

    def started(self, unit_id: str) -> None:
        self.counted[unit_id] = len(self.counted) + 1
        self.began[unit_id] = time.perf_counter()
        self._say(f"[{self.counted[unit_id]}/{self.total}] {unit_id}")

    def finished(self, unit_id: str, error: str | None) -> None:
        """A step that ended: counted here when its start was not; said again only when it failed."""
        new = unit_id not in self.counted
        if unit_id in self.began:
            self.seconds[unit_id] = time.perf_counter() - self.began[unit_id]
        if new:
            self.counted[unit_id] = len(self.counted) + 1
        step = f"[{self.counted[unit_id]}/{self.total}] {unit_id}"
        if error is not None:
            self._say(f"{step}: failed: {error}")
        elif new:
            self._say(f"{step}: done")

    def _say(self, line: str) -> None:
        if self.announce is not None and not self.progress:
            self.announce(line)


def _run_local(units: list[Unit], record: Any, failures: dict[str, str], steps: StepCounter, run: Any) -> None:
    """The local engine: each unit in plan order, in this process (`run`: `run_unit`, or a resident vLLM engine's
    runner for eval units); a progress bar, or `steps`' line as each step starts."""
    from tqdm.auto import tqdm

    for unit in tqdm(units, desc="sweep steps", unit="step", disable=not steps.progress):
        merge_id = f"merge:{unit.checkpoint}"
        if unit.kind != "merge" and merge_id in failures:
            record(unit, f"not run: {merge_id} failed")
            continue
        steps.started(unit.id)
        try:
            run(unit)
        except Exception as e:  # one failed step must not stop the sweep (KeyboardInterrupt is no Exception)
            record(unit, one_line(e))
            continue
        record(unit, None)


def _maybe_delete_weights(
    plan: Plan, merge_unit: Unit, finished: set[str], manifest: Manifest, markers: Markers
) -> None:
    """Delete a merged checkpoint's weight files once its eval and strength units are finished."""
    complete = current(merge_unit, markers)
    if not all(d.id in finished for d in plan.downstream(merge_unit.checkpoint)) or complete is None:
        return
    present = [n for n in complete.get("weight_files", {}) if (merge_unit.output / n).exists()]
    if not present:
        return
    for name in present:
        (merge_unit.output / name).unlink()
    manifest.append_row(
        {"unit": merge_unit.id, "key": merge_unit.key, "status": "weights_deleted", "output": str(merge_unit.output)}
    )


# --- the table -------------------------------------------------------------------------------


def _saved_outputs(
    plan: Plan, markers: Markers
) -> tuple[dict[str, Any], dict[str, Any], dict[str, float], dict[str, Any]]:
    """Per checkpoint with a finished unit: its lm-eval results, their protocol fingerprint, its saved S and the
    setting S was measured in (`comparability.setting_of`)."""
    results, fingerprints, strengths, settings = {}, {}, {}, {}
    for ck in plan.checkpoints:
        ev = plan.unit("eval", ck.name)
        complete = current(ev, markers) if ev is not None else None
        if complete is not None:
            run = resolve_run(ev.output / complete["results"])
            results[ck.name] = load_results(run)
            fingerprints[ck.name] = fingerprint_run(run)
        st = plan.unit("strength", ck.name)
        if st is not None and current(st, markers) is not None:
            saved = json.loads((st.output / "strength.json").read_text(encoding="utf-8"))
            strengths[ck.name], settings[ck.name] = saved["sink_strength"], setting_of(saved)
    return results, fingerprints, strengths, settings


def write_table(table: dict[str, Any], out: Path, verdicts: Sequence[str] = ()) -> list[Path]:
    """table.json, table.csv, table.md (ending with the recovery `verdicts`) and table.png, each written atomically."""
    from lm_eval_sink.plots import sweep_chart

    md, csv = table_text(table)
    if verdicts:
        md += "\nRecovery (recovery/recovery.md):\n\n" + "".join(f"- {v}\n" for v in verdicts)
    paths = [
        atomic_write_json(out / "table.json", table),
        atomic_write_text(out / "table.csv", csv),
        atomic_write_text(out / "table.md", md),
    ]
    series = sweep_series(table)
    paths.append(
        sweep_chart(
            series["checkpoints"],
            series["drawn"],
            out / "table.png",
            note=series["note"],
            strength=series["s"],
            unit=series["unit"],
        )
    )
    return paths
