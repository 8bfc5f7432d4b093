"""Where a sweep's units run: `local` (one after the other in this process) or `ray` (a Ray cluster).

The sweep file's `engine:` block (all keys optional):

    engine:
      kind: ray                  # local (default) | ray
      address: auto              # null: start Ray inside the driver; auto: a running cluster; "ray://host:port"
      max_pending_merges: 2      # merged checkpoints waiting for evaluation (default: the eval slots)
      resources:                 # per unit kind; num_cpus default 1, num_gpus default 0, memory in bytes
        merge: {num_cpus: 2}
        eval: {num_gpus: 1}
        strength: {num_gpus: 1}

Under Ray each unit is one task (`max_retries=1` for a lost worker, `retry_exceptions=False`)
calling the `run` it is given (`commands.sweep.run_unit`, as the local engine); ordering and the
pending-merge bound are the only rules the driver adds, dispatch is `ray.wait`. The driver alone writes the manifest
and the table; a worker builds its unit's staged folder and its own log
`<out>/logs/<kind>-<checkpoint>/task.log`. Workers get the driver's data and cache variables
through `runtime_env={"env_vars": ...}` (no code upload: the package must be installed on every
node); each task compares its package versions with the driver's and checks that it sees the
output folder, failing its unit with one line otherwise. The engine is part of no unit key, so a
sweep started locally resumes under Ray and back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from lm_eval_sink.errors import UserError
from lm_eval_sink.schema import Strict

KINDS = ("local", "ray")
UNIT_KINDS = ("merge", "eval", "strength")
# Passed to every worker when set in the driver's environment.
# "0": Ray 2.60 keeps 127.0.0.1 as the node address and listens on it alone (otherwise it replaces
# 127.0.0.1 by the node's reachable address and listens on every interface).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
ENV_VARS = (
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "NLTK_DATA",
    "LM_EVAL_SINK_DATA",
    "TOKENIZERS_PARALLELISM",
    "LM_EVAL_SINK_CACHE",
)


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1
    num_gpus: float = 0
    memory: int | None = None  # bytes

    def options(self) -> dict[str, Any]:
        return {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            **({"memory": self.memory} if self.memory else {}),
        }


@dataclass(frozen=True)
class EngineSpec:
    """A sweep's engine settings (never part of a unit key)."""

    kind: str = "local"
    address: str | None = None
    max_pending_merges: int | None = None  # None: the number of eval slots
    resources: dict[str, Resources] = field(default_factory=lambda: {k: Resources() for k in UNIT_KINDS})


class ResourcesIn(Strict):
    what: ClassVar[str] = "the resources entry"
    num_cpus: float | None = Field(None, ge=0)
    num_gpus: float | None = Field(None, ge=0)
    memory: int | None = Field(None, ge=0)


class UnitResourcesIn(Strict):
    what: ClassVar[str] = "the resources section"
    merge: ResourcesIn | None = None
    eval: ResourcesIn | None = None
    strength: ResourcesIn | None = None


class EngineIn(Strict):
    """The sweep file's `engine:` section as written (the module docstring shows it)."""

    what: ClassVar[str] = "the engine section"
    kind: Literal[KINDS] | None = None
    address: str | None = None
    max_pending_merges: int | None = Field(None, ge=1)
    resources: UnitResourcesIn = UnitResourcesIn()


def parse_engine(value: EngineIn | None, src: str, kind: str | None = None, address: str | None = None) -> EngineSpec:
    """The validated `engine:` section with the CLI's --engine / --ray-address on top; defaults from Resources."""
    value = value or EngineIn()
    chosen = kind or value.kind or "local"
    addr = address if address is not None else value.address
    if chosen == "ray":
        import_ray(local_only=addr is None)  # fail before anything is planned or written
    if addr is not None and addr != "auto" and not addr.startswith("ray://") and ":" not in addr:
        raise UserError(
            f"{src}: engine.address: {addr!r} is not auto, ray://host:port or host:port",
            "use address: auto for a cluster started with `ray start --head`",
        )
    resources = {}
    for k in UNIT_KINDS:
        given = getattr(value.resources, k)
        resources[k] = Resources(**(given.model_dump(exclude_none=True) if given else {}))
    return EngineSpec(kind=chosen, address=addr, max_pending_merges=value.max_pending_merges, resources=resources)


def check_vllm_units(engine: EngineSpec, eval_settings: Any, src: str) -> None:
    """Under Ray, a vllm eval unit must fit its own task: lm-eval's vllm backend starts Ray actors
    of its own for data_parallel_size > 1 or when tensor_parallel_size exceeds the task's GPUs."""
    if engine.kind != "ray" or eval_settings is None or eval_settings.backend != "vllm":
        return
    margs = eval_settings.model_args
    dp = int(margs.get("data_parallel_size", 1))
    tp = int(margs.get("tensor_parallel_size", 1))
    gpus = engine.resources["eval"].num_gpus
    if dp != 1:
        raise UserError(
            f"{src}: eval.model_args.data_parallel_size = {dp} under the ray engine",
            "use data_parallel_size: 1; Ray already runs one eval task per checkpoint in parallel",
        )
    if tp != gpus:
        raise UserError(
            f"{src}: eval.model_args.tensor_parallel_size = {tp} but engine.resources.eval.num_gpus = {gpus:g}",
            f"set engine.resources.eval.num_gpus: {tp} (or tensor_parallel_size: {gpus:g})",
        )


def import_ray(local_only: bool = False) -> Any:
    """The ray module, or one line naming the extra that installs it.

    `local_only`: Ray will be started inside this process (no address), so it is kept on 127.0.0.1
    (Ray reads `LOOPBACK_ENV` when it is first imported; a user's own setting wins)."""
    if local_only:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise UserError("the ray engine needs ray, which is not installed", "pip install 'lm-eval-sink[ray]'") from None
    return ray


def worker_env() -> dict[str, str]:
    return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


def connect(address: str | None) -> Any:
    """ray.init for the driver: a local Ray (address None) or a running cluster; one line on failure."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray = import_ray(local_only=address is None)
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": worker_env()}, "log_to_driver": False}
    if address is None:  # Ray inside the driver: this machine only, on the loopback interface
        kwargs.update(include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UserError(
            f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0][:200]}",
            "start one with `ray start --head`, pass --ray-address, or use --engine local",
        ) from None
    return ray


@contextlib.contextmanager
def task_log(path: Path):
    """Everything a task prints or logs goes to its own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        handler = logging.StreamHandler(f)
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)


def run_task(
    fn: Callable[[], Any],
    driver_versions: dict[str, Any],
    must_see: Path | None,
    log_path: Path | None,
    what: str = "output folder",
) -> tuple[Any, str | None]:
    """A task's body on a worker: check versions and that `must_see` exists, run `fn` (into its log).

    Returns (fn's value, None) or (None, one-line error), so a failed unit is reported as locally.
    """
    from lm_eval_sink.io import package_versions

    host = socket.gethostname()
    mine = package_versions()
    differ = sorted(k for k in set(mine) | set(driver_versions) if mine.get(k) != driver_versions.get(k))
    if differ:
        k = differ[0]
        return (
            None,
            f"worker {host} has {k} {mine.get(k)}, the driver {driver_versions.get(k)} ({len(differ)} "
            "package(s) differ): install the same versions on every node",
        )
    if must_see is not None and not must_see.exists():
        return (
            None,
            f"worker {host} cannot see the {what} {must_see}: put it on a filesystem every node mounts "
            "at the same path",
        )
    try:
        with task_log(log_path) if log_path is not None else contextlib.nullcontext():
            return fn(), None
    except Exception as e:
        return None, e.line() if isinstance(e, UserError) else f"{type(e).__name__}: {e}"


def _remote_unit(
    unit: Any, run: Callable[[Any], None], driver_versions: dict[str, Any], output_root: str
) -> tuple[str, str | None]:
    log_path = Path(output_root) / "logs" / f"{unit.kind}-{unit.checkpoint}" / "task.log"
    _, error = run_task(lambda: run(unit), driver_versions, Path(output_root), log_path)
    return unit.id, error


def eval_slots(ray: Any, engine: EngineSpec) -> int:
    """How many eval tasks the cluster can run at once (the default pending-merge bound)."""
    res, total = engine.resources["eval"], ray.cluster_resources()
    slots = [total.get("CPU", 1) / res.num_cpus] if res.num_cpus else []
    if res.num_gpus:
        slots.append(total.get("GPU", 0) / res.num_gpus)
    return max(1, int(min(slots)) if slots else 1)


def run_on_ray(
    units: list[Any],
    engine: EngineSpec,
    output_root: Path,
    record: Callable[[Any, str | None], None],
    run: Callable[[Any], None],
    progress: bool = True,
) -> None:
    """Run `units` (in plan order) as Ray tasks calling `run(unit)`; `record(unit, error)` is called
    on the driver as each finishes (error None) or fails (a line; 'not run: ...' for units after a
    failed merge). `run` is a module-level function, which Ray sends by reference: this module
    imports no sweep code.

    An eval/strength unit of a checkpoint whose merge is among `units` starts after that merge;
    at most `max_pending_merges` merged checkpoints wait for their evaluation at any time.
    """
    from tqdm.auto import tqdm

    from lm_eval_sink.io import package_versions

    ray = connect(engine.address)
    versions = package_versions()
    remote = ray.remote(max_retries=1, retry_exceptions=False)(_remote_unit)
    bound = engine.max_pending_merges or eval_slots(ray, engine)
    merges = {u.checkpoint: u for u in units if u.kind == "merge"}
    downstream: dict[str, set[str]] = {
        c: {u.id for u in units if u.kind != "merge" and u.checkpoint == c} for c in merges
    }
    waiting = list(units)  # not yet submitted, plan order
    merged: set[str] = set()  # checkpoints whose merge finished
    pending: set[str] = set()  # checkpoints merging or merged with downstream units left
    in_flight: dict[Any, Any] = {}
    bar = tqdm(total=len(units), desc="sweep steps (ray)", unit="step", disable=not progress)

    def ready(u: Any) -> bool:
        if u.kind == "merge":
            return len(pending) < bound
        return u.checkpoint not in merges or u.checkpoint in merged

    def done(u: Any, error: str | None) -> None:
        record(u, error)
        bar.update(1)
        if u.kind == "merge":
            if error is None:
                merged.add(u.checkpoint)
                if not downstream[u.checkpoint]:
                    pending.discard(u.checkpoint)
            else:
                pending.discard(u.checkpoint)
                for d in [w for w in waiting if w.id in downstream[u.checkpoint]]:
                    waiting.remove(d)
                    done(d, f"not run: {u.id} failed")
        elif u.checkpoint in merges:
            downstream[u.checkpoint].discard(u.id)
            if not downstream[u.checkpoint] and u.checkpoint in merged:
                pending.discard(u.checkpoint)

    try:
        while waiting or in_flight:
            for u in [w for w in waiting if ready(w)]:
                if not ready(u):  # an earlier merge in this pass may have filled the bound
                    continue
                waiting.remove(u)
                if u.kind == "merge":
                    pending.add(u.checkpoint)
                opts = engine.resources[u.kind].options()
                in_flight[remote.options(**opts, name=u.id).remote(u, run, versions, str(output_root))] = u
            if not in_flight:
                raise RuntimeError(f"ray engine: {len(waiting)} unit(s) can never start")  # a bug, not an input error
            finished, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in finished:
                u = in_flight.pop(ref)
                try:
                    _, error = ray.get(ref)
                except Exception as e:
                    error = f"ray task failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                done(u, error)
    finally:
        bar.close()
        for ref in in_flight:
            ray.cancel(ref, force=True)


def _remote_measure(
    path: str, settings: Any, dtype: str, device: str, driver_versions: dict[str, Any]
) -> tuple[Any, str | None]:
    from lm_eval_sink.strength import measure_model

    local = Path(path) if Path(path).is_absolute() else None  # a hub id needs no shared folder
    return run_task(
        lambda: measure_model(path, settings, dtype=dtype, device=device, progress=False),
        driver_versions,
        local,
        None,
        what="model folder",
    )


def ray_measure_all(address: str | None, num_gpus: float = 0, progress: bool = True) -> Callable[..., list[Any]]:
    """A `strength.run_strength(measure_all=...)` that measures each model in its own Ray task."""

    def measure_all(paths: list[str], settings: Any, dtype: str, device: str) -> list[Any]:
        from tqdm.auto import tqdm

        from lm_eval_sink.io import package_versions

        ray = connect(address)
        remote = ray.remote(max_retries=1, retry_exceptions=False)(_remote_measure)
        versions = package_versions()
        refs = {
            remote.options(num_cpus=1, num_gpus=num_gpus, name=f"strength:{Path(p).name}").remote(
                p, settings, dtype, device, versions
            ): p
            for p in paths
        }
        results: dict[str, Any] = {}
        with tqdm(total=len(refs), desc="models (ray)", disable=not progress) as bar:
            waiting = list(refs)
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=1)
                value, error = ray.get(ready[0])
                if error is not None:
                    for ref in waiting:
                        ray.cancel(ref, force=True)
                    raise UserError(
                        f"{refs[ready[0]]}: {error}",
                        "fix the cause and rerun (results reused from --output are those written before this run)",
                    )
                results[refs[ready[0]]] = value
                bar.update(1)
        return [results[p] for p in paths]

    return measure_all
