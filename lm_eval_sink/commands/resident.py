"""The in-memory sweep (`merge: {in_memory: true}`): one resident model takes each checkpoint in turn.

A job is one checkpoint's unfinished units, run on the resident with the on-disk path's units, keys and outputs;
locally one worker, under Ray a pool of actors (docs/merging.md, "In-memory sweeps").
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lm_eval_sink.commands.units import finish_eval, run_unit, save_strength
from lm_eval_sink.devices import empty_cache, peak_memory
from lm_eval_sink.errors import UserError, one_line
from lm_eval_sink.harness.inprocess import PLACEMENT_ARGS, evaluate, load_resident, measure_strength, resident_device
from lm_eval_sink.merging.configs import stored_dtype
from lm_eval_sink.merging.engines import run_on_actors
from lm_eval_sink.merging.sweep import Checkpoint, Plan, SweepSpec, Unit
from lm_eval_sink.outputs import staged_dir
from lm_eval_sink.provenance import provenance

FIX = "set merge: {in_memory: false} (or pass --on-disk)"


# --- plan-time checks ----------------------------------------------------------------------


def check_spec(spec: SweepSpec) -> None:
    """Refuse, in one line, an in-memory sweep that one resident model cannot run as the on-disk path would."""
    src = spec.source
    if not spec.merge.in_memory:
        if spec.merge.keep_weights:
            raise UserError(
                f"{src}: merge.keep_weights is an in-memory setting (on disk the merged weights are kept anyway)",
                "drop keep_weights, or set merge: {in_memory: true}",
            )
        return
    ev = spec.eval
    if spec.merge.delete_merged:
        raise UserError(
            f"{src}: merge.delete_merged has no meaning in memory: no merged weights are written",
            "drop delete_merged (or --delete-merged), or " + FIX,
        )
    if ev is not None and ev.backend != "hf":
        raise UserError(
            f"{src}: merge.in_memory with eval.backend {ev.backend}: vLLM loads its own weights from disk", FIX
        )
    if ev is not None and os.path.abspath(ev.interpreter()) != os.path.abspath(sys.executable):
        raise UserError(
            f"{src}: eval.python {ev.python} is another interpreter, but an in-memory sweep evaluates in this one",
            "drop eval.python (and --lm-eval-python), or " + FIX,
        )
    if ev is not None:
        _check_placement_args(src, ev.model_args)
    device = resident_device(ev, spec.strength_device)
    if ev is not None and spec.strength is not None and device != spec.strength_device:
        raise UserError(
            f"{src}: eval.device {device} and strength.device {spec.strength_device} differ, but one resident model "
            "serves both",
            "give eval and strength the same device, or " + FIX,
        )
    resident_dtype(spec)
    _check_controls(spec)


def _check_placement_args(src: str, model_args: dict[str, Any]) -> None:
    """Refuse model_args that would place the resident otherwise than eval.device (a tensor-parallel plan, lm-eval's
    offload and map settings; docs/merging.md); `parallelize=True` is kept: every GPU (`auto`)."""
    if "tp_plan" in model_args:
        raise UserError(
            f"{src}: eval.model_args.tp_plan: a tensor-parallel resident would give each rank a share of the heads",
            "drop tp_plan: eval.device auto spreads the resident over every GPU",
        )
    given = sorted((PLACEMENT_ARGS - {"parallelize"}) & set(model_args))
    if given:
        raise UserError(
            f"{src}: eval.model_args.{given[0]}: the resident model is placed by eval.device, never offloaded to the "
            "CPU or the disk (each merge is copied into its parameters in place)",
            f"drop {given[0]} (eval.device auto spreads it over every GPU), or " + FIX,
        )


def resident_dtype(spec: SweepSpec) -> str:
    """The one dtype the on-disk path's eval and strength units load every checkpoint in (the resident's): a kind's
    own, or for `auto` each checkpoint's (a merge's `out_dtype`, else `dtype`, else the reference's)."""
    ref = stored_dtype(spec.models["reference"])
    own = {"reference": ref, "candidate": stored_dtype(spec.models["candidate"])}
    own |= {r.name: r.validated.data.get("out_dtype") or r.validated.data.get("dtype") or ref for r in spec.merges}
    kinds = {}
    if spec.eval is not None:
        kinds["eval"] = spec.eval.dtype
    if spec.strength is not None:
        kinds["strength"] = spec.strength_dtype
    loads = {
        (kind, name): (given if given not in (None, "auto") else dtype)
        for kind, given in kinds.items()
        for name, dtype in own.items()
    }
    ((k1, n1), d1), *rest = loads.items()
    other = next((x for x in rest if x[1] != d1), None)
    if other is not None:
        (k2, n2), d2 = other
        raise UserError(
            f"{spec.source}: one resident model serves every checkpoint, but the on-disk path would load {n1} in "
            f"{d1} for {k1} and {n2} in {d2} for {k2}",
            "set eval.dtype and strength.dtype to one dtype, or " + FIX,
        )
    return d1


def _check_controls(spec: SweepSpec) -> None:
    """Plan every control against the reference's model class on the meta device (configs only, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lm_eval_sink.merging.inmemory import check_plan

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.models["reference"]))
    for r in spec.merges:
        try:
            check_plan(model, r.validated.text, r.name)
        except UserError as e:
            raise UserError(f"{spec.source}: {e.message}", e.hint) from None


# --- jobs and the worker -------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One checkpoint's unfinished units (plan order; its merge unit only with keep_weights)."""

    checkpoint: Checkpoint
    merge: Unit | None  # the checkpoint's merge unit, run or not (None for an endpoint)
    units: tuple[Unit, ...]

    @property
    def id(self) -> str:
        return f"checkpoint:{self.checkpoint.name}"


def jobs_of(plan: Plan, todo: list[Unit]) -> list[Job]:
    """The jobs of the checkpoints with units to run, in plan order."""
    jobs = []
    for ck in plan.checkpoints:
        units = tuple(u for u in todo if u.checkpoint == ck.name)
        if units:
            jobs.append(Job(ck, plan.unit("merge", ck.name), units))
    return jobs


Outcome = tuple[str, str | None]  # (unit id, None when done or a one-line error)


def _attempt(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as e:  # one failed unit must not stop the sweep
        return one_line(e)
    return None


class ResidentWorker:
    """One resident model (loaded at the first job) for every job it is given; no state but the model."""

    def __init__(self, spec: SweepSpec) -> None:
        self.spec = spec
        self.resident: Any = None
        self.holds: str | None = None  # the checkpoint the resident parameters hold now

    def run(self, job: Job, done: Callable[[Unit, str | None], None] | None = None) -> list[Outcome]:
        """Run `job`'s units; each outcome to `done` as it is known (the local manifest) and in the returned list."""
        out: list[Outcome] = []

        def report(unit: Unit, error: str | None) -> None:
            out.append((unit.id, error))
            if done is not None:
                done(unit, error)

        rest, error = [u for u in job.units if u is not job.merge], None  # error: what each of `rest` reports
        if job.merge in job.units:  # keep_weights: the on-disk merge unit writes the checkpoint
            error = _attempt(lambda: run_unit(job.merge))
            report(job.merge, error)
            error = None if error is None else f"not run: {job.merge.id} failed"
        if error is None and rest:
            error = _attempt(lambda: self._copy_in(job))
            if error is not None and job.merge is not None and job.merge not in job.units:  # the in-memory merge
                report(job.merge, error)
                error = f"not run: {job.merge.id} failed"
        for u in rest:
            report(u, error if error is not None else _attempt(lambda u=u: self._run_unit(u, job.checkpoint)))
        return out

    def _copy_in(self, job: Job) -> None:
        """Load the resident model at the first job, then make its parameters the job's checkpoint."""
        from lm_eval_sink.merging.inmemory import endpoint_text, merge_into

        spec, ck = self.spec, job.checkpoint
        if self.resident is None:  # with eval settings they give dtype and device (check_spec: S's are the same)
            s_only = {} if spec.eval is not None else {"dtype": resident_dtype(spec), "device": spec.strength_device}
            self.resident = load_resident(spec.models["reference"], spec.eval, **s_only)
            self.holds = "reference"
        if self.holds == ck.name:
            return
        self.holds = None  # a failed copy leaves the parameters half written
        try:
            if job.merge is None:
                merge_into(self.resident.model, endpoint_text(ck.path), ck.name)
            else:
                work = job.merge.inputs  # merging.merge.MergeWork
                merge_into(
                    self.resident.model, work.config.text, ck.name, random_seed=work.random_seed, device=work.device
                )
        finally:
            empty_cache()  # mergekit's working tensors are gone: their cached blocks go back before the units run
        self.holds = ck.name

    def _run_unit(self, unit: Unit, ck: Checkpoint) -> None:
        work = unit.inputs  # an EvalWork or SweepStrengthWork
        if unit.kind == "eval":
            with staged_dir(unit.output, force=True, key=unit.key) as tmp:
                with peak_memory() as peak:
                    run = evaluate(self.resident, work.settings, tmp / "lm_eval", work.model)
                finish_eval(tmp, unit, run, in_memory=True, peak_accelerator_memory=peak or None)
        elif unit.kind == "strength":
            info = {
                "path": work.model,
                **(work.identity or {"merge_inputs_key": ck.identity}),
                "in_memory": True,
                "architecture": type(self.resident.model).__name__,
                "dtype": self.resident.dtype,
                **self.resident.placement.info(),
            }
            with peak_memory() as peak:
                res = measure_strength(self.resident, work.settings, work.dtype, provenance=provenance(model=info))
            save_strength(unit, res, in_memory=True, peak_accelerator_memory=peak or None)
        else:
            raise ValueError(f"unit kind {unit.kind!r} does not run on a resident model")


# --- engines -------------------------------------------------------------------------------


def run_in_memory(
    plan: Plan, todo: list[Unit], record: Callable[[Unit, str | None], None], progress: bool
) -> list[str]:
    """Run `todo` as jobs on the local worker or on Ray actors; `record` is the driver's bookkeeping. Notes back."""
    from tqdm.auto import tqdm

    spec = plan.spec
    jobs = jobs_of(plan, todo)
    by_id = {u.id: u for u in plan.units}
    if spec.on_ray:

        def record_job(job: Job, outcomes: list[Outcome] | None, error: str | None) -> None:
            if outcomes is None:  # the whole job failed (versions, shared folder, a lost actor)
                outcomes = [(u.id, error) for u in job.units]
            for uid, line in outcomes:
                record(by_id[uid], line)

        return run_on_actors(jobs, spec.engine, spec.output, record_job, ResidentWorker, (spec,), progress)
    worker = ResidentWorker(spec)
    for job in tqdm(jobs, desc="checkpoints (in memory)", unit="checkpoint", disable=not progress):
        worker.run(job, done=record)
    return []
