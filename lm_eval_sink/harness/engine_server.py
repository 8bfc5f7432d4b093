"""The resident vLLM engine's process: lm-eval's vLLM model on one engine that takes each checkpoint's weights.

One JSON request per line on stdin (`eval`, `strength`, `close`), one answer line each on the stdout it was started
with; the `LLM(...)` lm-eval builds is the resident engine (`ResidentEngine.serving`). Protocol and checks:
docs/scale.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError, one_line
from lm_eval_sink.harness.engine_worker import WORKER_EXTENSION
from lm_eval_sink.harness.runner import EvalSettings, die_with_parent

# The LLM(...) arguments that say where a checkpoint comes from (lm-eval's `pretrained`, and the commits that
# measure-first pins for a hub id, none for a local folder): set per checkpoint, so left out of the comparison, as is
# the worker extension (this project's: a sweep with one of the user's is refused at plan time). What an engine fixes
# of its checkpoint is compared from the files (`merging.engine_reuse.engine_fields`).
NOT_FIXED = ("model", "revision", "tokenizer_revision", "worker_extension_cls")


@contextlib.contextmanager
def _output_to(path: str | None) -> Iterator[None]:
    """Within the block this process's stdout and stderr (file descriptors 1 and 2: every library's output, vLLM's
    log on stdout included) append to `path`."""
    if path is None:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(path, "a", encoding="utf-8") as log:
        for fd in saved:
            os.dup2(log.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


@contextlib.contextmanager
def _timed(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - start, 3)


# --- memory per unit ---------------------------------------------------------------------------


def _processes() -> list[Any]:
    """This process and its children (vLLM's engine-core and worker processes, where it runs them apart)."""
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def _reset_peak_rss(processes: list[Any]) -> None:
    for p in processes:
        with contextlib.suppress(OSError):
            Path(f"/proc/{p.pid}/clear_refs").write_text("5")  # Linux: VmHWM starts again from VmRSS


def _peak_rss(processes: list[Any]) -> int | None:
    """The peak resident memory of `processes` since `_reset_peak_rss`, summed (None where /proc has no VmHWM)."""
    total = 0
    for p in processes:
        try:
            status = Path(f"/proc/{p.pid}/status").read_text(encoding="utf-8")
        except OSError:
            continue
        line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
        if line is None:
            return None
        total += int(line.split()[1]) * 1024
    return total


# --- the engine --------------------------------------------------------------------------------


class ResidentEngine:
    """One vLLM `LLM` for every checkpoint, and what it was built from."""

    def __init__(self) -> None:
        self.llm: Any = None
        self.arguments: dict[str, Any] | None = None  # the LLM(...) arguments it was built with, less the model
        self.built_for: str | None = None
        self.units = 0  # units evaluated on this engine
        self.swap: str | None = None  # how the current unit's checkpoint got into the engine: built | reloaded
        self.storage: list[dict[str, Any]] | None = None  # each worker's `weight_storage` when built
        self.holds: str | None = None  # the weights folder it holds now (None: none, or half written)

    def shutdown(self) -> None:
        """Shut the engine down (vLLM's engine-core process and workers, where it runs them apart)."""
        if self.llm is not None:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            with contextlib.suppress(Exception):
                core.shutdown()
            self.llm = None

    @contextlib.contextmanager
    def serving(self, weights: str, timings: dict[str, float]) -> Iterator[None]:
        """Within the block, the `LLM(...)` that lm-eval's vLLM model builds is this engine, holding `weights`
        (`engine_strength.engine_builder`, checked first: `patching.engine_target_problem`)."""
        import lm_eval.models.vllm_causallms as lm_eval_vllm

        from lm_eval_sink.harness.engine_strength import engine_builder
        from lm_eval_sink.harness.patching import engine_target_problem
        from lm_eval_sink.harness.vllm_preflight import engine_held

        why = engine_target_problem(lm_eval_vllm)
        if why:
            from importlib.metadata import version

            raise UserError(
                f"lm-eval {version('lm_eval')}'s vllm_causallms {why}, so the resident engine cannot stand in for "
                "the engine it builds",
                "pass --fresh-engine (or set eval: {engine_reuse: false}) for one engine per checkpoint",
            )

        def resident(real: Any, **arguments: Any) -> Any:
            return self._engine(real, arguments, weights, timings)

        # an engine that runs already: no start-up, so vLLM's start-up memory check is not asked
        with engine_builder(resident), engine_held() if self.llm is not None else contextlib.nullcontext():
            yield

    def _engine(self, real: Any, arguments: dict[str, Any], weights: str, timings: dict[str, float]) -> Any:
        fixed = {k: v for k, v in arguments.items() if k not in NOT_FIXED}  # what the engine fixes
        if self.llm is None:
            with _timed(timings, "engine_build"):
                self.llm = real(**{**arguments, "worker_extension_cls": WORKER_EXTENSION})
                self.storage = self.llm.collective_rpc("weight_storage")
            self.arguments, self.built_for, self.swap = fixed, str(arguments["model"]), "built"
            self.holds = weights
            return self.llm
        if fixed != self.arguments:
            raise UserError(
                "lm-eval asked the resident vLLM engine for other engine arguments than it was built with",
                "pass --fresh-engine (one engine per checkpoint)",
            )
        self.holds = None  # until the reload is done and checked
        with _timed(timings, "swap"):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": weights})
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after the weights were reloaded")
            self.llm.collective_rpc("reseed")
        if self.llm.collective_rpc("weight_storage") != self.storage:
            raise RuntimeError(
                "vLLM's reload_weights did not write the weights in place (other model tensors, or at other "
                "addresses, than the engine was built with): compiled graphs would read the old ones"
            )
        self.swap, self.holds = "reloaded", weights
        return self.llm

    def record(self, why: str | None) -> dict[str, Any]:
        """The engine part of a unit's provenance."""
        return {
            "resident": True,
            "process": os.getpid(),
            "built_for": self.built_for,
            "unit_on_engine": self.units,
            "weights": self.swap,
            "built_because": why if self.swap == "built" else None,
            "weight_storage": self.storage,
        }


# --- requests ----------------------------------------------------------------------------------


class Server:
    """The state between requests: the sweep's eval settings, one TaskManager, the engine."""

    def __init__(self) -> None:
        self.engine = ResidentEngine()
        self.settings: EvalSettings | None = None
        self.manager: Any = None
        self.failed: str | None = None  # a unit that failed: its engine may hold half-written weights

    def evaluate(self, request: dict[str, Any]) -> dict[str, Any]:
        from lm_eval_sink.harness.inprocess import cli_config, evaluate_model, task_manager

        settings = EvalSettings(**{**request["settings"], "tasks": tuple(request["settings"]["tasks"])})
        timings: dict[str, float] = {}
        if self.settings is None:
            import psutil

            timings["process_start"] = round(time.time() - psutil.Process().create_time(), 3)
            with _timed(timings, "imports"):
                import lm_eval.models.vllm_causallms  # noqa: F401 (lm-eval, vLLM, transformers: timed apart)
                from lm_eval.utils import setup_logging
            setup_logging()  # lm-eval's log lines as its CLI writes them
            with _timed(timings, "task_index"):
                self.manager = task_manager(settings, request["model"])
            self.settings = settings
        elif settings != self.settings:
            raise UserError(
                "these eval settings differ from the ones the resident engine was started with",
                "start one engine process per sweep's eval settings",
            )
        if self.failed is not None:
            raise UserError(
                f"this engine process had a failed unit ({self.failed}): its weights may be half written",
                "start a new engine process (the sweep does)",
            )
        self.failed = request["model"]
        if self.engine.llm is not None:
            self.engine.llm.collective_rpc("reset_accelerator_peak")
        _reset_peak_rss(_processes())
        output_path = Path(request["output_path"])
        cfg = cli_config(settings, request["model"], output_path)
        with self.engine.serving(request["weights"], timings):
            run = evaluate_model("vllm", cfg, self.manager, output_path, timings)
        self.failed = None
        self.engine.units += 1
        timings["sink_strength"] = _s_seconds(run.results)
        peaks = {k: v for p in self.engine.llm.collective_rpc("accelerator_peak") for k, v in p.items()}
        return {
            "ok": True,
            "results": str(run.results),
            "samples": {t: str(p) for t, p in run.samples.items()},
            "engine": self.engine.record(request.get("new_engine")),
            "timings": timings,
            "peak_rss": _peak_rss(_processes()),
            "peak_accelerator_memory": peaks or None,
        }

    def strength(self, request: dict[str, Any]) -> dict[str, Any]:
        """A `strength:` unit measured on the checkpoint the engine holds (`engine_strength.measure_strength`)."""
        from lm_eval_sink.harness.engine_decision import built_refusal
        from lm_eval_sink.harness.engine_strength import measure_strength
        from lm_eval_sink.provenance import provenance
        from lm_eval_sink.strength import StrengthSettings

        engine = self.engine
        if engine.llm is None or self.failed is not None or engine.holds != request["weights"]:
            raise UserError(
                f"the resident vLLM engine does not hold {request['model']}'s weights now",
                "measure that strength: unit with transformers (the sweep does when the engine holds another)",
            )
        why = built_refusal(engine.llm, engine.arguments or {}, request["dtype"])
        if why is not None:
            raise UserError(f"S of {request['model']} is not measured on the resident vLLM engine: {why}", None)
        settings = StrengthSettings(**request["settings"])
        timings: dict[str, float] = {}
        _reset_peak_rss(_processes())
        with _timed(timings, "strength"):
            tokenizer = engine.llm.get_tokenizer()
            res = measure_strength(engine.llm, tokenizer, settings, provenance(model=request["info"]))
        return {"ok": True, "strength": res.to_json(), "timings": timings, "peak_rss": _peak_rss(_processes())}


def _s_seconds(results: Path) -> float:
    """The wall time S took in an eval unit (0 when the unit has no task of this project), from each task's capture
    record: on the engine each task measures its own prompts (`capture_backend` vllm: their sum); the child that
    measured them first records its one wall time in every task (their largest)."""
    configs = json.loads(results.read_text(encoding="utf-8")).get("configs", {})
    records = [(c.get("metadata") or {}).get("capture") or {} for c in configs.values()]
    timed = [
        (r.get("capture_backend"), r["wall_seconds"])
        for r in records
        if isinstance(r.get("wall_seconds"), (int, float))
    ]
    engine = sum(x for backend, x in timed if backend == "vllm")
    return round(engine + max([x for backend, x in timed if backend != "vllm"], default=0.0), 3)


def _answer(server: Server, request: dict[str, Any]) -> dict[str, Any]:
    """One request's answer; a failure is its one line (the traceback goes to the unit's log)."""
    import traceback

    ops = {"eval": server.evaluate, "strength": server.strength}
    if not isinstance(request.get("op"), str) or request["op"] not in ops:
        return {"ok": False, "error": f"unknown request {request.get('op')!r}", "hint": None}
    try:
        with _output_to(request.get("log")):
            try:
                return ops[request["op"]](request)
            except Exception:
                traceback.print_exc()
                raise
    except UserError as e:
        return {"ok": False, "error": e.message, "hint": e.hint}
    except Exception as e:
        return {"ok": False, "error": one_line(e), "hint": None}


def serve(requests: Any, answers: Any) -> None:
    """Answer each request line until `close` or the end of the input, then shut the engine down."""
    server = Server()
    for line in requests:
        request = json.loads(line)
        if request.get("op") == "close":
            break
        answers.write(json.dumps(_answer(server, request)) + "\n")
    server.engine.shutdown()


if __name__ == "__main__":
    answers = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")  # the stdout this process was started with
    os.dup2(2, 1)  # stdout itself then writes to stderr
    die_with_parent()
    serve(sys.stdin, answers)
