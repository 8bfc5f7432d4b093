"""The merge-and-evaluate sweep: every checkpoint merged, evaluated with lm-eval and measured for S.

A sweep YAML names the models, the merge controls (default: all bundled ones), the lm-eval
protocol and Sink Strength settings (one set for every checkpoint) and an output folder:

    output: sweep_out                 # paths are relative to this YAML's folder
    models: {reference: REF, candidate: CAND}          # + base: BASE for the siblings lineage
    configs: [linear_95_5, tsv]       # bundled names or template files; default: all bundled
    merge: {random_seed: 0, device: cpu, tokenizer_source: null, delete_merged: false}
    eval: {tasks: [ifeval], apply_chat_template: true, num_fewshot: 0, gen_kwargs: {max_gen_toks: 256}, limit: 20}
    strength: {last_k: 10, dtype: float32}             # or `strength: false`
    engine: {kind: ray, address: auto}                 # where units run: see engines.py (default local)

`eval: {backend: vllm, model_args: {...}}` evaluates with vLLM; `eval: false` skips evaluation
(not together with `strength: false`).

`plan_sweep` turns it into independent units (`merge:<name>`, `eval:<checkpoint>`,
`strength:<checkpoint>`), each with a key = sha256 of its canonical inputs (config text, input
fingerprints, settings, versions) and its own output folder. `run_unit` runs one unit from its
arguments alone (no state shared between units), so a cluster engine can dispatch them.
A unit builds its output in `<out>.partial-<uuid>/`, writes COMPLETE.json with its key, renames,
then appends one fsync'd line to `manifest.jsonl`. A unit counts as finished only when its last
manifest line says done with the current key AND its COMPLETE.json has that key: after kill -9
at any point, a rerun skips finished units and redoes the rest; `force` redoes everything. A
failed unit is recorded and reported at the end; the others go on. The table (JSON, CSV,
Markdown, PNG) is rebuilt from the saved outputs after checking that every run used the same
harness protocol (`protocols.require_same_harness`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shutil
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, create_model

from lm_eval_sink.errors import UserError
from lm_eval_sink.identity import FINGERPRINT_RULE, check_same_identity, looks_like_hub_id, tree_files
from lm_eval_sink.io import atomic_write_json, atomic_write_text, canonical_json, package_versions, parse_yaml, provenance, sha256_file, sha256_text, staged_dir
from lm_eval_sink.locks import hold
from lm_eval_sink.merging.configs import TOKENIZER_CHOICES, bundled_names, load_template, render, validate_text
from lm_eval_sink.merging.engines import EngineIn, check_vllm_units, parse_engine, run_on_ray
from lm_eval_sink.schema import Strict, parse
from lm_eval_sink.strength import StrengthSettings

ENDPOINTS = ("reference", "candidate")
MANIFEST = "manifest.jsonl"
COMPLETE = "COMPLETE.json"
# --- the sweep file ------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep YAML with every path resolved; one source of truth for a sweep's settings."""

    source: str
    output: Path
    models: dict[str, str]  # reference, candidate (+ base)
    configs: tuple[str, ...]  # bundled names or template paths
    random_seed: int = 0
    merge_device: str = "cpu"
    tokenizer_source: str | None = None
    delete_merged: bool = False
    eval: Any = None  # harness.runner.EvalSettings, or None to skip evaluation
    strength: Any = None  # strength.StrengthSettings, or None to skip S
    strength_dtype: str = "auto"
    strength_device: str = "cpu"
    engine: Any = None  # engines.EngineSpec; part of no unit key

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source, "output": str(self.output), "models": self.models, "configs": list(self.configs),
            "merge": {"random_seed": self.random_seed, "device": self.merge_device, "tokenizer_source": self.tokenizer_source, "delete_merged": self.delete_merged},
            "eval": None if self.eval is None else self.eval.to_json(),
            "strength": None if self.strength is None else {**asdict(self.strength), "dtype": self.strength_dtype, "device": self.strength_device},
        }  # fmt: skip


class _ModelsIn(Strict):
    what: ClassVar[str] = "the models section"
    reference: str
    candidate: str
    base: str | None = None


class _MergeIn(Strict):
    what: ClassVar[str] = "the merge section"
    random_seed: int = 0
    device: str = "cpu"
    tokenizer_source: str | None = None
    delete_merged: bool = False


class _EvalIn(Strict):
    """The keys of harness.runner.EvalSettings; a key left out takes EvalSettings' default (its one source)."""

    what: ClassVar[str] = "the eval section"
    tasks: list[str] = Field(min_length=1)
    backend: Literal["hf", "vllm"] | None = None
    apply_chat_template: bool | None = None
    num_fewshot: int | None = None
    fewshot_as_multiturn: bool | None = None
    system_instruction: str | None = None
    gen_kwargs: dict[str, Any] | None = None
    limit: int | float | None = None
    seed: int | None = None
    batch_size: int | str | None = None
    device: str | None = None
    dtype: str | None = None
    include_path: str | None = None
    model_args: dict[str, Any] | None = None


# The strength section: StrengthSettings' fields (its checks and defaults stay there) plus where S is measured.
_StrengthIn = create_model(
    "_StrengthIn", __base__=Strict, dtype=(str, "auto"), device=(str, "cpu"),
    **{f.name: (typing.get_type_hints(StrengthSettings)[f.name] | None, None) for f in dataclasses.fields(StrengthSettings)},
)  # fmt: skip
_StrengthIn.what = "the strength section"


class SweepFileIn(Strict):
    """A sweep YAML as written; `eval: false` / `strength: false` are taken out before validation."""

    what: ClassVar[str] = "the sweep file"
    output: str | None = None
    models: _ModelsIn
    configs: list[str] | None = Field(None, min_length=1)
    merge: _MergeIn = _MergeIn()
    eval: _EvalIn | None = None
    strength: _StrengthIn | None = None
    engine: EngineIn | None = None


def _eval_settings(ev: _EvalIn, src: str, rel: Any) -> Any:
    """The `eval:` section as harness.runner.EvalSettings (backend vllm: no device)."""
    from lm_eval_sink.harness.runner import EvalSettings

    given = ev.model_dump(exclude_none=True)
    given["tasks"] = tuple(given["tasks"])
    if given.get("backend", "hf") != "hf":
        given.setdefault("device", None)
    if ev.include_path:
        given["include_path"] = rel(ev.include_path)
        if not Path(given["include_path"]).is_dir():
            raise UserError(f"{src}: eval.include_path: {given['include_path']} is not a folder", "lm-eval takes ONE folder of task YAMLs")
    try:
        return EvalSettings(**given)
    except UserError as e:
        raise UserError(f"{src}: eval: {e.message}", e.hint) from None


def load_sweep(path: str | Path, output: str | Path | None = None, delete_merged: bool | None = None, engine: str | None = None,
               ray_address: str | None = None) -> SweepSpec:
    """Parse and check a sweep YAML (the SweepFileIn schema, paths relative to its folder); no model is loaded.

    `engine` / `ray_address` override the file's engine.kind / engine.address (the CLI's flags).
    """
    from lm_eval_sink.models import resolve_model

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such sweep file", "pass a sweep YAML (see docs/merging.md)")
    src = str(path)
    data = parse_yaml(path.read_text(encoding="utf-8"), src) or {}
    skipped = {k for k in ("eval", "strength") if isinstance(data, dict) and data.get(k) is False}
    if skipped == {"eval", "strength"}:
        raise UserError(f"{src}: eval: false and strength: false leave nothing to do", "keep eval or strength (or both)")
    if "eval" not in skipped and isinstance(data, dict) and data.get("eval") is None:
        data = {**data, "eval": {}}  # evaluation is on unless switched off: its tasks are required
    sweep = parse(SweepFileIn, {k: v for k, v in data.items() if k not in skipped} if isinstance(data, dict) else data, src)
    here = path.resolve().parent

    def rel(p: str) -> str:
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else here / q)

    out = Path(output) if output is not None else (Path(rel(sweep.output)) if sweep.output else None)
    if out is None:
        raise UserError(f"{src}: output: missing", "add output: FOLDER to the sweep file, or pass --output")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: is a file, not a folder", "choose an output folder")

    def model(name: str) -> str:
        """A folder relative to the sweep file, unless the name is a hub id (`org/name`) with no such folder there."""
        return name if looks_like_hub_id(name) and not Path(rel(name)).exists() else rel(name)

    models: dict[str, str] = {}
    for role, name in sweep.models.model_dump(exclude_none=True).items():
        try:
            models[role] = resolve_model(model(name))
        except UserError as e:
            raise UserError(f"{src}: models.{role}: {e.message}", e.hint) from None

    configs = tuple(bundled_names()) if sweep.configs is None else tuple(rel(c) if c.endswith((".yaml", ".yml")) else c for c in sweep.configs)
    names = [load_template(c).name for c in configs]  # unknown names fail here, with did-you-mean
    clash = next((n for n in names if names.count(n) > 1 or n in ENDPOINTS), None)
    if clash:
        raise UserError(f"{src}: configs: the checkpoint name {clash!r} is used twice (or is an endpoint's name)", "give each config file its own name")

    merge = sweep.merge
    tokenizer_source = merge.tokenizer_source
    if tokenizer_source is not None and tokenizer_source not in TOKENIZER_CHOICES:
        tokenizer_source = model(tokenizer_source)
    eval_settings = None if "eval" in skipped else _eval_settings(sweep.eval, src, rel)
    strength = None
    st = (sweep.strength or _StrengthIn()).model_dump(exclude_none=True)
    sdtype, sdevice = st.pop("dtype"), st.pop("device")
    if "strength" not in skipped:
        if st.get("prompts_file"):
            st["prompts_file"] = rel(st["prompts_file"])
        try:
            strength = StrengthSettings(**st)
        except UserError as e:
            raise UserError(f"{src}: strength: {e.message}", e.hint) from None

    spec = parse_engine(sweep.engine, src, kind=engine, address=ray_address)
    check_vllm_units(spec, eval_settings, src)
    return SweepSpec(
        source=src,
        output=out.resolve(),
        models=models,
        configs=configs,
        random_seed=merge.random_seed,
        merge_device=merge.device,
        tokenizer_source=tokenizer_source,
        delete_merged=merge.delete_merged if delete_merged is None else delete_merged,
        eval=eval_settings,
        strength=strength,
        strength_dtype=sdtype,
        strength_device=sdevice,
        engine=spec,
    )


# --- units ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One independent job: its kind, checkpoint, key, output folder and what `run_unit` needs."""

    kind: str  # merge | eval | strength
    checkpoint: str
    key: str
    output: Path
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.checkpoint}"

    def run(self) -> None:
        """`run_unit(self)`: engines call units through this, so they need not import this module."""
        run_unit(self)


@dataclass(frozen=True)
class Checkpoint:
    name: str
    role: str  # reference | candidate | merge
    path: str  # model folder (for merges: the merge unit's output)
    identity: str  # fingerprint (endpoints) or merge key
    method: str | None = None
    setting: str | None = None


@dataclass(frozen=True)
class Plan:
    spec: SweepSpec
    checkpoints: tuple[Checkpoint, ...]
    units: tuple[Unit, ...]
    lineage: str


def _tree_sha(folder: str | None) -> str | None:
    if not folder:
        return None
    files = tree_files(Path(folder))
    return sha256_text("".join(f"{p.relative_to(folder)}:{sha256_file(p)}\n" for p in files))


def plan_sweep(spec: SweepSpec) -> Plan:
    """Render and validate every merge config and derive each unit's key (reads no weights)."""
    from lm_eval_sink.merging.merge import merge_key
    from lm_eval_sink.models import model_fingerprint

    out = spec.output
    versions = package_versions()
    include_sha = _tree_sha(spec.eval.include_path) if spec.eval is not None else None
    checkpoints: list[Checkpoint] = []
    units: list[Unit] = []

    def evaluate(ck: Checkpoint) -> None:
        if spec.eval is not None:
            ekey = sha256_text(canonical_json({"kind": "eval", "checkpoint": ck.identity, "settings": spec.eval.to_json(), "include_path_sha256": include_sha,
                                               "lm_eval": versions.get("lm_eval"), "transformers": versions.get("transformers")}))
            units.append(Unit("eval", ck.name, ekey, out / "evals" / ck.name, {"model": ck.path, "settings": spec.eval, "identity": identities.get(ck.name)}))
        if spec.strength is not None:
            skey = sha256_text(canonical_json({"kind": "strength", "checkpoint": ck.identity, "settings": asdict(spec.strength), "dtype": spec.strength_dtype,
                                               "device": spec.strength_device, "torch": versions.get("torch"), "transformers": versions.get("transformers")}))
            units.append(Unit("strength", ck.name, skey, out / "strength" / ck.name,
                              {"model": ck.path, "settings": spec.strength, "dtype": spec.strength_dtype, "device": spec.strength_device, "identity": identities.get(ck.name)}))
        checkpoints.append(ck)

    identities = {role: model_fingerprint(spec.models[role]) for role in ENDPOINTS}
    for role in ENDPOINTS:
        evaluate(Checkpoint(role, role, spec.models[role], identities[role]["fingerprint"]))
    for config in spec.configs:  # merge -> eval -> strength per checkpoint, so --delete-merged bounds the disk
        template = load_template(config)
        rendered = render(config, spec.models["reference"], spec.models["candidate"], base=spec.models.get("base"), tokenizer_source=spec.tokenizer_source)
        key = merge_key(validate_text(rendered.text, source=f"{template.name} ({rendered.lineage})"), spec.random_seed)
        target = out / "merges" / template.name
        units.append(Unit("merge", template.name, key, target, {"text": rendered.text, "random_seed": spec.random_seed, "device": spec.merge_device, "template": template.path}))
        evaluate(Checkpoint(template.name, "merge", str(target), key, method=str(rendered.config.get("merge_method")), setting=template.paper_setting))
    return Plan(spec=spec, checkpoints=tuple(checkpoints), units=tuple(units), lineage="siblings" if "base" in spec.models else "chain")


def _finish(tmp: Path, unit: Unit, **fields: Any) -> None:
    atomic_write_json(tmp / COMPLETE, {"schema_version": 1, "unit": unit.id, "key": unit.key, "fingerprint_rule": FINGERPRINT_RULE, "model_identity": unit.inputs.get("identity"),
                                       **fields, "provenance": provenance(unit=unit.id)})


def run_unit(unit: Unit) -> None:
    """Run one unit into its staged output folder (replacing an older one). No shared state."""
    if unit.kind == "merge":
        from lm_eval_sink.merging.merge import merge_config

        vc = validate_text(unit.inputs["text"], source=unit.id)
        merge_config(vc, unit.output, random_seed=unit.inputs["random_seed"], device=unit.inputs["device"], force=True, quiet=True, key=unit.key,
                     extra={"unit": unit.id, "template": unit.inputs["template"]})
    elif unit.kind == "eval":
        from lm_eval_sink.harness.runner import run_lm_eval

        with staged_dir(unit.output, force=True) as tmp:
            try:
                run = run_lm_eval(unit.inputs["model"], unit.inputs["settings"], tmp / "lm_eval")
            except UserError as e:  # keep lm-eval's log: the staged folder is about to be removed
                kept = unit.output.parent.parent / "logs" / f"{unit.kind}-{unit.checkpoint}"
                kept.mkdir(parents=True, exist_ok=True)
                for log in (tmp / "lm_eval" / "logs").glob("*.log"):
                    shutil.copy2(log, kept / log.name)
                raise UserError(e.message, f"see lm-eval's log in {kept}") from None
            rel = run.results.relative_to(tmp)
            _finish(tmp, unit, results=str(rel), samples={t: str(p.relative_to(tmp)) for t, p in run.samples.items()}, model=unit.inputs["model"])
    elif unit.kind == "strength":
        from lm_eval_sink.strength import measure_model

        res = measure_model(unit.inputs["model"], unit.inputs["settings"], dtype=unit.inputs["dtype"], device=unit.inputs["device"], progress=False)
        with staged_dir(unit.output, force=True) as tmp:
            atomic_write_json(tmp / "strength.json", {**res.to_json(), "provenance": {**res.provenance, "input_key": unit.key}})
            _finish(tmp, unit, sink_strength=res.sink_strength, model=unit.inputs["model"])
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")


# --- manifest ------------------------------------------------------------------------------


class Manifest:
    """`manifest.jsonl`: one fsync'd JSON line per finished (or failed) unit; a torn last line is ignored."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by kill -9: that unit is simply not finished
            if isinstance(row, dict) and "unit" in row:
                out.append(row)
        return out

    def latest(self) -> dict[str, dict[str, Any]]:
        last: dict[str, dict[str, Any]] = {}
        for row in self.entries():
            if row.get("status") in ("done", "failed"):
                last[row["unit"]] = row
        return last

    def append(self, row: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({**row, "time_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}, sort_keys=True) + "\n"
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:  # a torn last line from kill -9 must not swallow this one
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())


def _complete_key(folder: Path) -> str | None:
    try:
        return json.loads((folder / COMPLETE).read_text(encoding="utf-8")).get("key")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _weights_present(folder: Path) -> bool:
    try:
        files = json.loads((folder / COMPLETE).read_text(encoding="utf-8"))["weight_files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return False
    return all((folder / n).is_file() and (folder / n).stat().st_size == size for n, size in files.items())


def unit_finished(unit: Unit, latest: dict[str, dict[str, Any]]) -> bool:
    """Finished = last manifest line done with this key AND COMPLETE.json with this key."""
    row = latest.get(unit.id)
    return bool(row and row.get("status") == "done" and row.get("key") == unit.key and _complete_key(unit.output) == unit.key)


def _recover(out: Path, units: tuple[Unit, ...]) -> list[str]:
    """Tidy what an interrupted run left, never deleting the only complete copy of a unit's output.

    A kill between `staged_dir`'s two renames leaves no `<output>`, the previous copy as
    `<output>.old-*` and the finished new one as `<output>.partial-*`. Where `<output>` is missing,
    the `.partial-*` whose COMPLETE.json carries the unit's key is promoted, else the newest
    complete `.old-*` is restored; only then are the other staging folders deleted.
    """
    notes = []
    for unit in units:
        parent, name = unit.output.parent, unit.output.name
        if unit.output.exists() or not parent.is_dir():
            continue
        done = [p for p in parent.glob(f"{name}.partial-*") if _complete_key(p) == unit.key]
        olds = sorted((p for p in parent.glob(f"{name}.old-*") if (p / COMPLETE).is_file()), key=lambda p: (p / COMPLETE).stat().st_mtime_ns, reverse=True)
        keep = (done or olds or [None])[0]
        if keep is not None:
            os.replace(keep, unit.output)
            notes.append(f"{unit.id}: {'finished output promoted' if done else 'previous output restored'} from {keep.name}")
    for sub in ("merges", "evals", "strength"):
        for p in sorted((out / sub).glob("*.partial-*")) + sorted((out / sub).glob("*.old-*")):
            shutil.rmtree(p, ignore_errors=True)
            notes.append(f"removed {p.name}, left by an interrupted run")
    return notes


def _check_conflicts(plan: Plan) -> None:
    for unit in plan.units:
        if unit.output.exists():
            key = _complete_key(unit.output)
            if key != unit.key:
                from lm_eval_sink.io import read_complete

                complete = read_complete(unit.output) or {}
                if complete.get("fingerprint_rule") != FINGERPRINT_RULE:
                    raise UserError(f"{unit.output}: made with an older fingerprint rule; rerun with --force", "pass --force to redo everything")
                if unit.inputs.get("identity") and complete.get("model_identity"):
                    check_same_identity(complete["model_identity"], unit.inputs["identity"], unit.output)
                raise UserError(
                    f"{unit.output} holds a {unit.kind} made from other inputs than this sweep's (the sweep file, a model or a version changed)",
                    "pass --force to redo everything, or choose a new output folder",
                )


# --- running ---------------------------------------------------------------------------------


@dataclass
class SweepReport:
    output: Path
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    table_files: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"sweep {self.output}: {len(self.ran)} steps run, {len(self.skipped)} already finished, {len(self.failures)} failed"]
        out += [f"note: {n}" for n in self.notes]
        if self.table_files:
            out.append("table -> " + ", ".join(str(p) for p in self.table_files))
        out += [f"failed: {u}: {e}" for u, e in self.failures.items()]
        return out

    def raise_for_failures(self) -> None:
        if self.failures:
            first = next(iter(self.failures.items()))
            raise UserError(f"{len(self.failures)} sweep step(s) failed ({', '.join(self.failures)}); first: {first[0]}: {first[1]}",
                            f"see {self.output / MANIFEST}; fix the cause and rerun the same command: finished steps are kept")


def run_sweep(spec: SweepSpec, force: bool = False, progress: bool = True) -> SweepReport:
    """Plan, run every unfinished unit (all of them with `force`) on the spec's engine, then write the table; the output folder is locked meanwhile."""
    plan = plan_sweep(spec)
    with hold(spec.output):
        return _run_sweep_locked(plan, force, progress)


def _run_sweep_locked(plan: Plan, force: bool, progress: bool) -> SweepReport:
    spec = plan.spec
    out = spec.output
    report = SweepReport(output=out)
    report.notes.extend(_recover(out, plan.units))
    if not force:
        _check_conflicts(plan)
    atomic_write_json(out / "sweep.json", {"schema_version": 1, "sweep": spec.to_json(), "lineage": plan.lineage,
                                           "units": {u.id: u.key for u in plan.units}, "provenance": provenance()})
    manifest = Manifest(out / MANIFEST)
    latest = {} if force else manifest.latest()
    finished = {u.id for u in plan.units if unit_finished(u, latest)}
    by_id = {u.id: u for u in plan.units}

    def needed(unit: Unit) -> bool:
        if unit.kind != "merge":
            return unit.id not in finished
        downstream = [by_id[f"{k}:{unit.checkpoint}"] for k in ("eval", "strength") if f"{k}:{unit.checkpoint}" in by_id]
        if all(d.id in finished for d in downstream):
            return unit.id not in finished and not spec.delete_merged
        return unit.id not in finished or not _weights_present(unit.output)

    def record(unit: Unit, error: str | None) -> None:
        """The driver's bookkeeping of one unit that ran (or could not run), whatever the engine."""
        if error is not None:
            report.failures[unit.id] = error
            if not error.startswith("not run: "):
                manifest.append({"unit": unit.id, "key": unit.key, "status": "failed", "error": error, "output": str(unit.output)})
            return
        manifest.append({"unit": unit.id, "key": unit.key, "status": "done", "output": str(unit.output)})
        finished.add(unit.id)
        report.ran.append(unit.id)
        if spec.delete_merged and f"merge:{unit.checkpoint}" in by_id:
            _maybe_delete_weights(by_id[f"merge:{unit.checkpoint}"], by_id, finished, manifest)

    todo = [u for u in plan.units if needed(u)]
    report.skipped.extend(u.id for u in plan.units if u not in todo)
    if spec.engine is not None and spec.engine.kind == "ray":
        run_on_ray(todo, spec.engine, out, record, progress=progress)
    else:
        _run_local(todo, record, report.failures, progress)
    if spec.delete_merged:  # also checkpoints finished by an earlier run
        for unit in plan.units:
            if unit.kind == "merge":
                _maybe_delete_weights(unit, by_id, finished, manifest)
    table = build_table(plan, report.failures)
    report.table_files = write_table(table, out)
    report.notes.extend(table["protocol"]["model_differences"])
    return report


def _run_local(units: list[Unit], record: Any, failures: dict[str, str], progress: bool) -> None:
    """The local engine: each unit in plan order, in this process."""
    from tqdm.auto import tqdm

    for unit in tqdm(units, desc="sweep steps", unit="step", disable=not progress):
        merge_id = f"merge:{unit.checkpoint}"
        if unit.kind != "merge" and merge_id in failures:
            record(unit, f"not run: {merge_id} failed")
            continue
        try:
            run_unit(unit)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # one failed step must not stop the sweep
            record(unit, e.line() if isinstance(e, UserError) else f"{type(e).__name__}: {e}")
            continue
        record(unit, None)


def _maybe_delete_weights(merge_unit: Unit, by_id: dict[str, Unit], finished: set[str], manifest: Manifest) -> None:
    """Delete a merged checkpoint's weight files once its eval and strength units are finished."""
    downstream = [f"{k}:{merge_unit.checkpoint}" for k in ("eval", "strength") if f"{k}:{merge_unit.checkpoint}" in by_id]
    if not all(d in finished for d in downstream) or _complete_key(merge_unit.output) != merge_unit.key:
        return
    files = json.loads((merge_unit.output / COMPLETE).read_text(encoding="utf-8")).get("weight_files", {})
    present = [n for n in files if (merge_unit.output / n).exists()]
    if not present:
        return
    for name in present:
        (merge_unit.output / name).unlink()
    manifest.append({"unit": merge_unit.id, "key": merge_unit.key, "status": "weights_deleted", "output": str(merge_unit.output)})


# --- the table -------------------------------------------------------------------------------


def _metrics(results: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for task, values in sorted(results.get("results", {}).items()):
        for name, value in values.items():
            if "_stderr" in name or name in ("alias", "name", "sample_len") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[f"{task}/{name}"] = float(value)
    return out


def build_table(plan: Plan, failures: dict[str, str]) -> dict[str, Any]:
    """Rows = checkpoints, columns = each task metric, its delta vs the reference, S (from saved outputs)."""
    from lm_eval_sink.protocols import diff, fingerprint_run, require_same_harness
    from lm_eval_sink.runs import load_results, resolve_run

    by_id = {u.id: u for u in plan.units}
    results, fingerprints, strengths, status = {}, {}, {}, {}
    for ck in plan.checkpoints:
        problems = [f"{u}: {failures[u]}" for u in (f"merge:{ck.name}", f"eval:{ck.name}", f"strength:{ck.name}") if u in failures]
        status[ck.name] = "; ".join(problems) if problems else "ok"
        ev = by_id.get(f"eval:{ck.name}")
        if ev is not None and _complete_key(ev.output) == ev.key:
            complete = json.loads((ev.output / COMPLETE).read_text(encoding="utf-8"))
            run = resolve_run(ev.output / complete["results"])
            results[ck.name] = load_results(run)
            fingerprints[ck.name] = fingerprint_run(run)
        st = by_id.get(f"strength:{ck.name}")
        if st is not None and _complete_key(st.output) == st.key:
            strengths[ck.name] = json.loads((st.output / "strength.json").read_text(encoding="utf-8"))["sink_strength"]
    require_same_harness(fingerprints)
    ref_fp = fingerprints.get("reference")
    model_diffs = []
    for name, fp in fingerprints.items():
        if ref_fp is not None and name != "reference":
            fields = [d.field for d in diff(ref_fp, fp) if d.part == "model"]
            if fields:
                model_diffs.append(f"{name} differs from the reference in model-owned protocol fields: {', '.join(fields)}")
    metrics = {name: _metrics(r) for name, r in results.items()}
    columns: list[str] = []
    for name in [c.name for c in plan.checkpoints]:
        columns += [m for m in metrics.get(name, {}) if m not in columns]
    ref_m, ref_s = metrics.get("reference", {}), strengths.get("reference")
    rows = []
    for ck in plan.checkpoints:
        m = metrics.get(ck.name, {})
        s = strengths.get(ck.name)
        rows.append({
            "checkpoint": ck.name, "role": ck.role, "method": ck.method, "setting": ck.setting, "status": status[ck.name],
            "metrics": {c: m.get(c) for c in columns},
            "delta_vs_reference": {c: (m[c] - ref_m[c]) if c in m and c in ref_m else None for c in columns},
            "sink_strength": s,
            "sink_strength_delta_vs_reference": (s - ref_s) if s is not None and ref_s is not None else None,
        })  # fmt: skip
    limit = plan.spec.eval.limit if plan.spec.eval is not None else None
    return {
        "schema_version": 1,
        "lineage": plan.lineage,
        "models": plan.spec.models,
        "columns": columns,
        "rows": rows,
        "final": limit is None,
        "final_note": None if limit is None else f"evaluated with limit={limit}: not final scores",
        "protocol": {"eval": None if plan.spec.eval is None else plan.spec.eval.to_json(), "harness_sha256": ref_fp.harness_sha() if ref_fp else None, "model_differences": model_diffs},
        "strength_settings": None if plan.spec.strength is None else asdict(plan.spec.strength),
        "provenance": provenance(sweep=plan.spec.source, units={u.id: u.key for u in plan.units}),
    }


def _fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.4f}" if signed else f"{x:.4f}"


def write_table(table: dict[str, Any], out: Path) -> list[Path]:
    """table.json, table.csv, table.md and table.png, each written atomically."""
    from lm_eval_sink.plots import sweep_chart

    cols = table["columns"]
    head = ["checkpoint", "method", *[x for c in cols for x in (c, f"{c} delta")], "S", "S delta", "status"]
    rows = [[r["checkpoint"], r["method"] or r["role"], *[x for c in cols for x in (_fmt(r["metrics"][c]), _fmt(r["delta_vs_reference"][c], True))],
             _fmt(r["sink_strength"]), _fmt(r["sink_strength_delta_vs_reference"], True), r["status"]] for r in table["rows"]]
    md = f"Merging sweep ({table['lineage']} lineage); deltas vs the reference.\n"
    if not table["final"]:
        md += f"**Not final scores:** {table['final_note']}.\n"
    md += "\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n" + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    import csv
    import io as _io

    buf = _io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(rows)
    paths = [atomic_write_json(out / "table.json", table), atomic_write_text(out / "table.csv", buf.getvalue()), atomic_write_text(out / "table.md", md)]
    series = {c: [r["metrics"][c] for r in table["rows"]] for c in cols}
    series["S (Sink Strength)"] = [r["sink_strength"] for r in table["rows"]]
    paths.append(sweep_chart([r["checkpoint"] for r in table["rows"]], series, out / "table.png", note=table["final_note"]))
    return paths

