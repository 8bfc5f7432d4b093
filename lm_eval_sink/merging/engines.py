"""Where a sweep's units run: `local` (one after the other in this process) or `ray` (a Ray cluster).

Under Ray each unit is one task calling the `run` it is given (`commands.units.run_unit`); an in-memory sweep, or a
resident vLLM engine, runs on a pool of actors instead. The `engine:` block, GPUs, environment and retries:
docs/scale.md ("A Ray cluster"); what to submit when is `scheduler.Scheduler`'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from lm_eval_sink.devices import DEFAULT_DEVICE
from lm_eval_sink.errors import UserError, one_line
from lm_eval_sink.schema import Strict

KINDS = ("local", "ray")
UNIT_KINDS = ("merge", "eval", "strength")  # in each checkpoint's run order
# Passed to every worker when set in the driver's environment.
# "0": Ray 2.60 keeps 127.0.0.1 as the node address and listens on it alone (otherwise it replaces
# 127.0.0.1 by the node's reachable address and listens on every interface).
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for a task with no GPUs (it would see them all); "1" hides them again.
ZERO_GPU_ENV = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"
ENV_VARS = (
    "HF_HUB_OFFLINE",
    "HF_HOME",
    "NLTK_DATA",
    "LM_EVAL_SINK_DATA",
    "TOKENIZERS_PARALLELISM",
    "LM_EVAL_SINK_CACHE",
)


class Resources(Strict):
    """One unit kind's resources per Ray task (`engine.resources.KIND`); a num_gpus not given follows the kind's
    device under Ray (`parse_engine`)."""

    what: ClassVar[str] = "the resources entry"
    num_cpus: float | None = Field(1, ge=0)  # null: the default, as not given
    num_gpus: float | None = Field(0, ge=0)
    memory: int | None = Field(None, ge=0)  # bytes

    def options(self) -> dict[str, Any]:
        """Ray's task options (`memory` only where given, and not 0)."""
        return {k: v for k, v in self.model_dump().items() if k != "memory" or v}


class EngineSpec(Strict):
    """A sweep's `engine:` section (never part of a unit key): as the file writes it, then with the CLI's --engine /
    --ray-address on top and every unit kind's resources decided (`parse_engine`)."""

    what: ClassVar[str] = "the engine section"
    kind: Literal[KINDS] | None = None  # None: local
    address: str | None = None
    max_pending_merges: int | None = Field(None, ge=1)  # None: the number of eval slots
    resources: dict[Literal[UNIT_KINDS], Resources | None] = Field(
        default_factory=lambda: {k: Resources() for k in UNIT_KINDS}
    )


def parse_engine(
    value: EngineSpec | None,
    src: str,
    kind: str | None = None,
    address: str | None = None,
    devices: dict[str, str | None] | None = None,
    eval_settings: Any = None,
) -> EngineSpec:
    """The validated `engine:` section with the CLI's --engine / --ray-address on top; under Ray each unit kind's
    GPUs follow its torch device in `devices` (`unit_gpus`), a vLLM eval's its tensor_parallel_size (`vllm_gpus`)."""
    value = value or EngineSpec()
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
        given = value.resources.get(k) or Resources()
        gpus = given.num_gpus if "num_gpus" in given.model_fields_set else None
        where = f"{src}: engine.resources.{k}.num_gpus"
        if chosen != "ray":
            gpus = gpus or 0
        elif k == "eval" and eval_settings is not None and eval_settings.backend == "vllm":
            gpus = vllm_gpus(gpus, eval_settings.model_args, src)
        else:
            gpus = unit_gpus(gpus, (devices or {}).get(k), where)
        cpus = 1 if given.num_cpus is None else given.num_cpus
        resources[k] = given.model_copy(update={"num_gpus": gpus, "num_cpus": cpus})
    return value.model_copy(update={"kind": chosen, "address": addr, "resources": resources})


def unit_gpus(given: float | None, device: str | None, where: str) -> float:
    """A Ray task's GPUs from its torch device: cuda takes `given` (default 1, at least 1), cpu takes none, auto
    takes `given` (default none: the task then sees no GPU and runs on the CPU).

    `where` names the setting in the one-line errors (e.g. "sweep.yaml: engine.resources.merge.num_gpus")."""
    kind, _, index = (device or "cpu").partition(":")
    if kind == "auto":
        return given or 0
    if kind != "cuda":
        if given:
            raise UserError(
                f"{where} = {given:g} but the device is {device or 'cpu'}: the task would hold GPUs it never uses",
                "set device: cuda, or drop num_gpus",
            )
        return 0
    if index:
        raise UserError(
            f"{where}: device {device} names a GPU, but under Ray the task's GPUs are the ones Ray assigned",
            "use device: cuda (Ray makes its GPUs the only ones the task sees)",
        )
    if given is None:
        return 1
    if given < 1:
        raise UserError(f"{where} = {given:g} with device cuda", "set num_gpus: 1 or more, or use device: cpu")
    return given


def vllm_gpus(given: float | None, model_args: dict[str, Any], src: str) -> float:
    """A vLLM eval task's GPUs: its tensor_parallel_size (the default), or 0 for vLLM's CPU build (lm-eval's own
    Ray actors for data_parallel_size > 1, or more tensor_parallel_size than GPUs, are refused)."""
    dp = int(model_args.get("data_parallel_size", 1))
    tp = int(model_args.get("tensor_parallel_size", 1))
    if dp != 1:
        raise UserError(
            f"{src}: eval.model_args.data_parallel_size = {dp} under the ray engine",
            "use data_parallel_size: 1; Ray already runs one eval task per checkpoint in parallel",
        )
    if given is None:
        return tp
    if given not in (0, tp):
        raise UserError(
            f"{src}: eval.model_args.tensor_parallel_size = {tp} but engine.resources.eval.num_gpus = {given:g}",
            f"set num_gpus: {tp} (vLLM on GPUs) or 0 (vLLM's CPU build)",
        )
    return given


def import_ray(local_only: bool = False) -> Any:
    """The ray module, or one line naming the extra that installs it; `local_only` (Ray started inside this process)
    keeps it on 127.0.0.1 (`LOOPBACK_ENV`, read at Ray's first import; a user's own setting wins)."""
    if local_only:
        os.environ.setdefault(LOOPBACK_ENV, "0")
    try:
        import ray
    except ImportError:
        raise UserError("the ray engine needs ray, which is not installed", "pip install 'lm-eval-sink[ray]'") from None
    return ray


def worker_env() -> dict[str, str]:
    """The environment every worker of this driver's job gets: the driver's data and cache variables, and
    Ray's pre-2.60 rule that a task with no GPUs sees none (`CUDA_VISIBLE_DEVICES=""`)."""
    return {ZERO_GPU_ENV: "1", **{k: os.environ[k] for k in ENV_VARS if k in os.environ}}


def _refused_for_token(e: BaseException) -> bool:
    """Whether Ray's connection error comes from the cluster refusing this driver's auth token (Ray 2.60 wraps its
    `AuthenticationError`, as text, in a RuntimeError and then a ConnectionError)."""
    from ray.exceptions import AuthenticationError

    chain: BaseException | None = e
    while chain is not None:
        if isinstance(chain, AuthenticationError) or "AuthenticationError" in str(chain):
            return True
        chain = chain.__cause__ or chain.__context__
    return False


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
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as e:
        where = address if address not in (None, "auto") else os.environ.get("RAY_ADDRESS", address)
        if _refused_for_token(e):
            raise UserError(
                f"the cluster at {where} refused this driver's Ray auth token",
                "give the driver the cluster's token: RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH (`ray get-auth-token` on the head node prints it); a stale ~/.ray/auth_token "
                "from an earlier Ray is not the cluster's",
            ) from None
        raise UserError(
            f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0][:200]}",
            "start one with `ray start --head`, pass --ray-address, or use --engine local",
        ) from None
    return ray


def check_fits(ray: Any, needs: dict[str, Resources], where: str) -> None:
    """Refuse, before any task is submitted, a task no node of the cluster can ever hold (Ray would wait forever)."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for what, res in needs.items():
        for name, amount in (("CPU", res.num_cpus), ("GPU", res.num_gpus)):
            most = max((n.get(name, 0) for n in nodes), default=0)
            if amount > most:
                raise UserError(
                    f"{what} asks for {amount:g} {name}(s) per task but no node of the Ray cluster at {where} has "
                    f"more than {most:g}",
                    f"lower {what}, or add a node with {amount:g} {name}(s)",
                )


def gpu_placement() -> dict[str, Any]:
    """On a worker: the GPU ids Ray assigned this task, checked to be exactly those CUDA_VISIBLE_DEVICES shows it;
    any other value fails the task in one line rather than run elsewhere."""
    import ray

    ids = [str(i) for i in ray.get_gpu_ids()]
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if seen is None or [x for x in seen.split(",") if x] != ids:
        raise UserError(
            f"worker {socket.gethostname()} sees CUDA_VISIBLE_DEVICES={seen!r} but Ray assigned GPUs {ids}",
            f"let Ray set CUDA_VISIBLE_DEVICES on its workers (and {ZERO_GPU_ENV}=1 for tasks with no GPU)",
        )
    return {"gpu_ids": ids, "CUDA_VISIBLE_DEVICES": seen, "node": socket.gethostname()}


_placement: dict[str, Any] | None = None  # the running task's, on a worker; None outside Ray tasks


def placement_fields() -> dict[str, Any]:
    """`{"placement": ...}` for a provenance block written inside a Ray task, `{}` elsewhere."""
    return {"placement": _placement} if _placement is not None else {}


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


# What a worker runs (any unit, a pool actor's jobs, a measurement): its project code is compared with the driver's
# (`worker_versions`), since a result's key holds the driver's hashes of it (`code_key`).
WORKER_CODE = ("lm_eval_sink.commands.units", "lm_eval_sink.commands.resident", "lm_eval_sink.strength")


def worker_versions() -> dict[str, Any]:
    """The installed packages' versions and the hashes of this project's code a worker runs (`WORKER_CODE`): what
    the driver sends with each task and the worker compares with its own (`run_task`)."""
    from lm_eval_sink.code_key import source_hashes
    from lm_eval_sink.provenance import package_versions

    return {**package_versions(), "code": source_hashes(WORKER_CODE)}


def run_task(
    fn: Callable[[], Any],
    driver_versions: dict[str, Any],
    must_see: Path | None,
    log_path: Path | None,
    what: str = "output folder",
) -> tuple[Any, str | None]:
    """A task's body on a worker: check versions and that `must_see` exists, run `fn` (into its log); (fn's value,
    None) or (None, one-line error), so a failed unit is reported as locally."""
    from lm_eval_sink.code_key import changed_files

    host = socket.gethostname()
    mine = worker_versions()
    differ = sorted(k for k in set(mine) | set(driver_versions) if mine.get(k) != driver_versions.get(k))
    if "code" in differ:
        return (
            None,
            f"worker {host} has other lm-eval-sink code than the driver "
            f"({changed_files(driver_versions.get('code') or {}, mine['code'])}): install the same on every node",
        )
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
        return None, one_line(e)


def _placed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` run with this task's GPU placement checked and kept for its provenance (`placement_fields`)."""

    def body() -> Any:
        global _placement
        _placement = gpu_placement()
        try:
            return fn()
        finally:
            _placement = None

    return body


def _remote_unit(
    unit: Any, run: Callable[[Any], None], driver_versions: dict[str, Any], output_root: str
) -> tuple[str, str | None]:
    log_path = Path(output_root) / "logs" / f"{unit.kind}-{unit.checkpoint}" / "task.log"
    _, error = run_task(_placed(lambda: run(unit)), driver_versions, Path(output_root), log_path)
    return unit.id, error


def eval_slots(ray: Any, engine: EngineSpec) -> int:
    """How many eval tasks the cluster can run at once (the default pending-merge bound)."""
    res, total = engine.resources["eval"], ray.cluster_resources()
    slots = [total.get("CPU", 1) / res.num_cpus] if res.num_cpus else []
    if res.num_gpus:
        slots.append(total.get("GPU", 0) / res.num_gpus)
    return max(1, int(min(slots)) if slots else 1)


def _task_result(ray: Any, ref: Any) -> tuple[Any, str | None]:
    """A finished task's (value, error line); a task Ray lost or killed is one line too."""
    try:
        return ray.get(ref)
    except Exception as e:
        cause = getattr(e, "cause", None) or e  # a RayTaskError's own first line names only the task
        return None, f"ray task failed: {one_line(cause)}"


def run_on_ray(
    units: list[Any],
    engine: EngineSpec,
    output_root: Path,
    record: Callable[[Any, str | None], None],
    run: Callable[[Any], None],
    progress: bool = True,
    pool: EvalPool | None = None,
) -> None:
    """Run `units` (in plan order) as Ray tasks calling the module-level `run(unit)`, or with `pool` the eval units on
    its actors; `record(unit, error)` gets each on the driver as it finishes or fails (or is not run)."""
    from tqdm.auto import tqdm

    from lm_eval_sink.merging.scheduler import Scheduler

    ray = connect(engine.address)
    kinds = sorted({u.kind for u in units})
    check_fits(ray, {f"engine.resources.{k}": engine.resources[k] for k in kinds}, engine.address or "this driver")
    versions = worker_versions()
    remote = ray.remote(max_retries=1, retry_exceptions=False)(_remote_unit)
    sched = Scheduler(units, engine.max_pending_merges or eval_slots(ray, engine))
    actors = _Pool(ray, engine, output_root, pool, versions) if pool is not None else None
    in_flight: dict[Any, Any] = {}
    bar = tqdm(total=len(units), desc="sweep steps (ray)", unit="step", disable=not progress)

    def done(u: Any, error: str | None) -> None:
        record(u, error)
        bar.update(1)
        for lost, line in sched.finish(u, error):
            record(lost, line)
            bar.update(1)

    try:
        while not sched.done:
            for u in sched.submit_next():
                if actors is not None and u.kind == "eval":
                    actors.queue(u)
                    continue
                opts = engine.resources[u.kind].options()
                in_flight[remote.options(**opts, name=u.id).remote(u, run, versions, str(output_root))] = u
            in_flight.update(actors.dispatch() if actors is not None else {})
            finished, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in finished:
                owned = actors is not None and ref in actors.running
                done(in_flight.pop(ref), actors.finished(ref)[1] if owned else _task_result(ray, ref)[1])
    finally:
        bar.close()
        for ref in in_flight:
            ray.cancel(ref, force=True)
        if actors is not None:
            actors.close()


@dataclass(frozen=True)
class EvalPool:
    """Eval units on actors that each keep one `worker_cls(*args)` (a resident vLLM engine) whose `run(unit)` runs one;
    `fields_of(unit)` is what the unit's engine fixes, for `engine_reuse.assign`."""

    worker_cls: type
    args: tuple
    fields_of: Callable[[Any], Any]


class _Pool:
    """The driver's side of an `EvalPool`: up to one actor per eval slot, what each one's engine holds, the units
    (an in-memory sweep's jobs) waiting for one. A lost actor is replaced by a new one."""

    def __init__(self, ray: Any, engine: EngineSpec, output_root: Path, pool: EvalPool, versions: Any) -> None:
        res = engine.resources["eval"]
        actor_cls = ray.remote(max_restarts=0, max_task_retries=0)(PoolActor)
        self.start = lambda: actor_cls.options(**res.options()).remote(
            pool.worker_cls, pool.args, versions, str(output_root)
        )
        self.ray, self.pool, self.slots = ray, pool, eval_slots(ray, engine)
        self.actors: list[list[Any]] = []  # [handle, the fields its engine holds or None, idle]
        self.waiting: list[tuple[Any, Any]] = []  # (unit, fields), plan order
        self.running: dict[Any, tuple[int, Any]] = {}  # ref -> (actor index, the unit's fields)

    def queue(self, unit: Any) -> None:
        try:
            fields = self.pool.fields_of(unit)
        except Exception:  # unreadable: no engine holds it; the actor reports the unit's error
            fields = None
        self.waiting.append((unit, fields))

    def dispatch(self) -> dict[Any, Any]:
        """Start actors up to the slots the waiting units need, give idle actors their units; {ref: unit}."""
        from lm_eval_sink.merging.engine_reuse import assign

        while len(self.actors) < self.slots and sum(a[2] for a in self.actors) < len(self.waiting):
            self.actors.append([self.start(), None, True])
        actors = [(str(i), held, idle) for i, (_, held, idle) in enumerate(self.actors)]
        refs = {}
        for actor, unit_id in assign(actors, [(u.id, fields) for u, fields in self.waiting]):
            i = int(actor)
            unit, fields = next(w for w in self.waiting if w[0].id == unit_id)
            self.waiting = [w for w in self.waiting if w[0].id != unit_id]
            ref = self.actors[i][0].run.remote(unit)
            self.actors[i][2] = False
            self.running[ref] = (i, fields)
            refs[ref] = unit
        return refs

    def finished(self, ref: Any) -> tuple[Any, str | None, str | None]:
        """The finished call's (value, error line, why its actor was lost); its actor is idle again, holding its
        engine, or a lost one is replaced by a new one."""
        i, fields = self.running.pop(ref)
        value, error, lost = _actor_result(self.ray, ref)
        if lost is not None:
            self.actors[i] = [self.start(), None, True]
            return None, f"ray actor lost: {lost}", lost
        self.actors[i][1:] = [fields if error is None else None, True]
        return value, error, None

    def close(self) -> None:
        for ref in self.running:
            self.ray.cancel(ref, force=True)
        for handle, _, _ in self.actors:
            self.ray.kill(handle)


class PoolActor:
    """A Ray actor that builds `worker_cls(*args)` once (its resident model) and runs one job per call, with the
    checks of a task (`run_task`: versions, shared folder, GPU placement) and its own log."""

    def __init__(self, worker_cls: type, args: tuple, driver_versions: dict[str, Any], output_root: str) -> None:
        self.make = lambda: worker_cls(*args)
        self.worker: Any = None
        self.versions, self.root = driver_versions, Path(output_root)

    def run(self, job: Any) -> tuple[Any, str | None]:
        def body() -> Any:
            self.worker = self.worker or self.make()
            return self.worker.run(job)

        log_path = self.root / "logs" / job.id.replace(":", "-") / "task.log"
        return run_task(_placed(body), self.versions, self.root, log_path)


def actor_resources(engine: EngineSpec) -> Resources:
    """One actor's resources: an eval slot's, with the GPUs of whichever of its merge, eval or S needs most."""
    return engine.resources["eval"].model_copy(update={"num_gpus": max(r.num_gpus for r in engine.resources.values())})


def _actor_result(ray: Any, ref: Any) -> tuple[Any, str | None, str | None]:
    """(value, error line, None) of a finished actor call, or (None, None, why) when its actor was lost."""
    try:
        value, error = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        return None, None, one_line(e)
    except Exception:
        value, error = _task_result(ray, ref)
    return value, error, None


def run_on_actors(
    jobs: list[Any],
    engine: EngineSpec,
    output_root: Path,
    record: Callable[[Any, Any, str | None], None],
    worker_cls: type,
    args: tuple,
    progress: bool = True,
) -> list[str]:
    """Run `jobs` (each with `id`) on a `_Pool` of actors each holding one `worker_cls(*args)`; `record(job, value,
    error)` gets what its `run(job)` returned. A job whose actor died runs once more on a new one (the notes say so)."""
    from tqdm.auto import tqdm

    ray, res = connect(engine.address), actor_resources(engine)
    check_fits(ray, {"engine.resources (one actor)": res}, engine.address or "this driver")
    one = engine.model_copy(update={"resources": {**engine.resources, "eval": res}})
    actors = _Pool(ray, one, output_root, EvalPool(worker_cls, args, lambda job: None), worker_versions())
    for job in jobs:
        actors.queue(job)
    running, notes = {}, []
    bar = tqdm(total=len(jobs), desc="checkpoints (ray actors)", unit="checkpoint", disable=not progress)
    try:
        while actors.waiting or actors.running:
            running.update(actors.dispatch())
            [ref], _ = ray.wait(list(running), num_returns=1)
            job = running.pop(ref)
            value, error, lost = actors.finished(ref)
            if lost is not None and not any(job.id in n for n in notes):
                notes.append(f"{job.id}: its actor was lost; a new actor redid the checkpoint")
                actors.waiting.insert(0, (job, None))
                continue
            record(job, value, f"ray actor lost twice: {lost}" if lost is not None else error)
            bar.update(1)
    finally:
        bar.close()
        actors.close()
    return notes


def _remote_measure(
    path: str, settings: Any, dtype: str, device: str, driver_versions: dict[str, Any]
) -> tuple[Any, str | None]:
    from lm_eval_sink.strength import measure_model

    def measure() -> Any:
        res = measure_model(path, settings, dtype=dtype, device=device, progress=False)
        return replace(res, provenance={**res.provenance, **placement_fields()})

    local = Path(path) if Path(path).is_absolute() else None  # a hub id needs no shared folder
    return run_task(_placed(measure), driver_versions, local, None, what="model folder")


def ray_measure_all(
    address: str | None, num_gpus: float | None = None, device: str = DEFAULT_DEVICE, progress: bool = True
) -> Callable[..., Iterator[tuple[str, Any, str | None]]]:
    """A `MeasureOptions(measure_all=...)` for `strength` and `screen`: each model in its own Ray task (its GPUs
    from `device`: `unit_gpus`), yielding (path, result, None) or (path, None, error line) as each finishes."""
    gpus = unit_gpus(num_gpus, device, "--num-gpus")

    def measure_all(paths: list[str], settings: Any, dtype: str, device: str) -> Iterator[tuple[str, Any, str | None]]:
        from tqdm.auto import tqdm

        ray = connect(address)
        check_fits(ray, {"--num-gpus/--device": Resources(num_gpus=gpus)}, address or "this driver")
        remote = ray.remote(max_retries=1, retry_exceptions=False)(_remote_measure)
        versions = worker_versions()
        refs = {
            remote.options(num_cpus=1, num_gpus=gpus, name=f"strength:{Path(p).name}").remote(
                p, settings, dtype, device, versions
            ): p
            for p in paths
        }
        waiting = list(refs)
        with tqdm(total=len(refs), desc="models (ray)", disable=not progress) as bar:
            try:
                while waiting:
                    ready, waiting = ray.wait(waiting, num_returns=1)
                    value, error = _task_result(ray, ready[0])
                    bar.update(1)
                    yield refs[ready[0]], value, error
            finally:
                for ref in waiting:
                    ray.cancel(ref, force=True)

    return measure_all
