"""vLLM's own start-up memory check, run before anything loads under `--model vllm` (one line, not a dead engine).

`cpu_refusal` and `kv_cache_refusal` decide on given numbers (pure); `check_engine_memory` gathers them with vLLM's
own functions on its CPU platform. Figures: docs/lm-eval.md ("vLLM on a CPU: its memory check first").
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lm_eval_sink.errors import UserError

KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache on vLLM's CPU backend; set, no share is reserved
GIB = 1 << 30
_HELD: contextvars.ContextVar[bool] = contextvars.ContextVar("lm_eval_sink_engine_held", default=False)


@contextlib.contextmanager
def engine_held() -> Iterator[None]:
    """Within the block lm-eval's vLLM model gets an engine that already runs (`engine_server.ResidentEngine`): no
    engine starts, so `check_engine_memory` asks nothing (the running engine's memory is not free, and needs not be)."""
    token = _HELD.set(True)
    try:
        yield
    finally:
        _HELD.reset(token)


@dataclass(frozen=True, slots=True)
class NodeMemory:
    """The memory of the NUMA node vLLM's CPU worker binds to, in bytes, as vLLM reads it."""

    node: int
    total: int
    available: int


def cpu_refusal(memory: NodeMemory, utilization: float) -> UserError | None:
    """The one-line error vLLM's CPU worker would end with, given the node's memory and `gpu_memory_utilization`
    (no KV cache size given: then vLLM skips this check, `kv_cache_refusal`); None when the engine would start."""
    requested = math.ceil(memory.total * utilization)
    if requested <= memory.available:
        return None
    fits = math.floor(100 * memory.available / memory.total) / 100 - 0.05  # a margin for what loads meanwhile
    share = f", or pass gpu_memory_utilization={fits:.2f} in --model_args (a share of the node's memory)"
    return UserError(
        f"--model vllm: vLLM's CPU engine would not start: with gpu_memory_utilization {utilization:g} it reserves "
        f"{requested / GIB:.2f} of NUMA node {memory.node}'s {memory.total / GIB:.2f} GiB, and "
        f"{memory.available / GIB:.2f} GiB are available",
        f"set {KV_CACHE_ENV}=N (GiB of KV cache instead of a share: e.g. 1 for a small model and short prompts, the "
        "weights come on top)" + (share if fits > 0 else ", or free memory"),
    )


def check_engine_memory(arguments: dict[str, Any]) -> None:
    """`simple_evaluate`'s `arguments` under `--model vllm` on vLLM's CPU platform: `cpu_refusal` on this machine's
    numbers, raised; otherwise nothing (another backend, an LM object, a GPU platform). An interpreter without vLLM
    is one line too (lm-eval's own import of vLLM ends in a traceback, after S was measured first)."""
    import importlib.util
    import sys

    if arguments.get("model") != "vllm" or _HELD.get():
        return
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            f"--model vllm: this interpreter ({sys.executable}) has no vLLM",
            "run lm_eval from an environment with vLLM (on a CPU: make venv-vllm, then .venv-vllm/bin/lm_eval; "
            "on a GPU: pip install vllm)",
        )
    from vllm.platforms import current_platform

    from lm_eval_sink.harness.model_args import parsed_model_args

    model_args = parsed_model_args(arguments.get("model_args"))
    if not current_platform.is_cpu():
        return
    memory, kv_cache = _node_memory(), _kv_cache_bytes(model_args)
    refusal = cpu_refusal(memory, _utilization(model_args)) if kv_cache is None else kv_cache_refusal(memory, kv_cache)
    if refusal is not None:
        raise refusal


def engine_refusal(model_args: dict[str, Any]) -> list[str] | None:
    """`check_engine_memory`'s refusal of `--model vllm` with `model_args` in this interpreter, as [what, fix]
    (JSON-safe, for `check_engine_start`'s probe); None when the engine would start, or where there is no vLLM to
    ask (a plan made here without it; another lm-eval interpreter without it is `runner.check_interpreter`'s)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        check_engine_memory({"model": "vllm", "model_args": model_args})
    except UserError as e:
        return [e.message, e.hint]
    return None


def check_engine_start(settings: Any) -> None:
    """The same start-up check as `lm_eval --model vllm`, asked where a sweep's or `eval`'s lm-eval will run
    (`settings`: runner.EvalSettings; its interpreter and environment), before any work: the one line, raised."""
    import sys

    from lm_eval_sink.harness.runner import ask, check_interpreter

    if settings.backend != "vllm":
        return
    if settings.interpreter() != sys.executable:
        check_interpreter(settings)  # the probe needs vLLM and this project there (its own probe, made once)
    refusal = ask(settings.interpreter(), f"{__name__}.engine_refusal", settings.model_args)
    if refusal:
        raise UserError(*refusal)


def kv_cache_refusal(memory: NodeMemory, kv_cache_bytes: int) -> UserError | None:
    """The one-line error for a KV cache size the node cannot hold even before the weights load (vLLM's CPU worker
    refuses it after loading them); None when it fits now."""
    if kv_cache_bytes <= memory.available:
        return None
    return UserError(
        f"--model vllm: vLLM's CPU engine would not start: its KV cache of {kv_cache_bytes / GIB:.2f} GiB "
        f"({KV_CACHE_ENV}, or kv_cache_memory_bytes) exceeds the {memory.available / GIB:.2f} GiB available on NUMA "
        f"node {memory.node}",
        f"set {KV_CACHE_ENV} to fewer GiB (1 holds about 46k tokens of SmolLM2-135M's cache; the weights come on "
        "top), or free memory",
    )


def _kv_cache_bytes(model_args: dict[str, Any]) -> int | None:
    """The KV cache size vLLM gets, in bytes: the environment variable (whole GiB) as its CPU platform reads it (set
    and not empty; it wins), else `kv_cache_memory_bytes` in the model arguments; None when neither is given."""
    env, arg = os.environ.get(KV_CACHE_ENV, ""), model_args.get("kv_cache_memory_bytes")
    given, what = (env, f"{KV_CACHE_ENV}={env}") if env != "" else (arg, f"kv_cache_memory_bytes={arg}")
    if given in (None, ""):
        return None
    try:
        return int(given) * (GIB if env != "" else 1)
    except ValueError:
        raise UserError(f"--model vllm: {what} is not a whole number", f"pass e.g. {KV_CACHE_ENV}=1 (GiB)") from None


def _utilization(model_args: dict[str, Any]) -> float:
    """`gpu_memory_utilization` as the engine gets it: the model argument, else vLLM's own default."""
    given = model_args.get("gpu_memory_utilization")
    if given not in (None, ""):
        try:
            return float(given)
        except ValueError:
            raise UserError(
                f"--model_args gpu_memory_utilization={given} is not a number", "pass a share such as 0.5"
            ) from None
    from vllm.config import CacheConfig

    return float(CacheConfig().gpu_memory_utilization)


def _node_memory() -> NodeMemory:
    """The memory of the node vLLM's CPU worker would bind to, read with vLLM's own functions."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info, get_visible_memory_node

    visible = get_visible_memory_node()
    node = get_allowed_cpu_list()[0].numa_node
    node = node if node in visible or not visible else visible[0]
    info = get_memory_node_info(node)
    return NodeMemory(node, int(info.total_memory), int(info.available_memory))
