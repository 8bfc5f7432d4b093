"""Where a model runs: the `--device` value, the device map a model is loaded with, and what is refused.

`check_device` checks the value, `resolve_device` resolves it on this machine, `place` turns a config into the
`device_map` that loads the weights straight onto their devices (never offloaded: a model that does not fit is one
line). Importing this module loads no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lm_eval_sink.errors import UserError

DEFAULT_DEVICE = "auto"
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
DEVICE_HELP = "auto (every visible GPU, else the CPU), cuda, cuda:N or cpu"
_GIB = 2**30


def check_device(device: str) -> str:
    """`device` when it is one `--device` accepts, else the one-line error (no torch needed)."""
    if not isinstance(device, str) or re.match(DEVICE_PATTERN, device) is None:
        raise UserError(f"unknown device {device!r}", f"use {DEVICE_HELP}")
    return device


def resolve_device(device: str) -> tuple[str, ...]:
    """The devices `device` names on this machine (`auto`: every visible GPU, else the CPU; `cuda`: the current GPU)."""
    import torch

    check_device(device)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        return tuple(f"cuda:{i}" for i in range(n)) or ("cpu",)
    if device == "cpu":
        return ("cpu",)
    if n == 0:
        raise UserError(f"device {device}: no CUDA GPU is visible here", "use --device auto or cpu")
    index = int(device.partition(":")[2] or torch.cuda.current_device())
    if index >= n:
        raise UserError(f"device {device}: only {n} GPU(s) are visible (cuda:0 to cuda:{n - 1})", "pick one of them")
    return (f"cuda:{index}",)


def math_device(device: str) -> str:
    """The one torch device `device` names for a one-device computation (`auto`: the first GPU, else the CPU)."""
    return resolve_device(device)[0]


def lm_eval_device(device: str) -> tuple[str, dict[str, Any]]:
    """lm-eval's `--device` and the model_args it needs for `device`: `auto` over several GPUs is lm-eval's own
    `parallelize=True` (accelerate's device_map over every GPU), on one GPU or none that device."""
    if device != "auto":
        return device, {}
    devices = resolve_device(device)
    return ("cuda", {"parallelize": True}) if len(devices) > 1 else (devices[0], {})


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a model's weights go: the `device_map` it is loaded with, the weights' size, layers per device."""

    device_map: dict[str, Any]  # module name ("" = the whole model) -> device
    weight_bytes: int
    layers: dict[str, int]  # decoder layers per device, e.g. {"cuda:0": 14, "cuda:1": 14}

    def info(self) -> dict[str, Any]:
        """Provenance fields: the devices the weights are on, the decoder layers on each (`device_map`), their size."""
        return {
            "device": ",".join(sorted(set(self.device_map.values()))),
            "device_map": dict(self.layers),
            "weight_bytes": self.weight_bytes,
        }


def _device_name(d: Any) -> str:
    return f"cuda:{d}" if isinstance(d, int) else str(d)


def layers_per_device(model: Any, device_map: dict[str, Any]) -> dict[str, int]:
    """How many decoder layers (the model's `_no_split_modules` blocks) `device_map` puts on each device."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    out: dict[str, int] = {}
    for name, module in model.named_modules():
        if type(module).__name__ in blocks:
            owners = [k for k in device_map if k == "" or name == k or name.startswith(k + ".")]
            inside = [k for k in device_map if k.startswith(name + ".")]  # a block split further (a hand-made map)
            device = _device_name(device_map[max(owners, key=len)] if owners else device_map[inside[0]])
            out[device] = out.get(device, 0) + 1
    return out


def _memory(devices: tuple[str, ...], total: bool) -> dict[str, int]:
    """Bytes per device, touching only the devices named: `total`, the host's RAM or a GPU's whole memory (what
    vLLM's `gpu_memory_utilization` is a share of); else free, the available RAM or a GPU's free memory plus what
    torch's cache holds unused there (torch reuses it)."""
    import psutil
    import torch

    def size(d: str) -> int:
        if d == "cpu":
            ram = psutil.virtual_memory()
            return int(ram.total if total else ram.available)
        i = int(d.partition(":")[2])
        free, whole = torch.cuda.mem_get_info(i)
        return whole if total else free + torch.cuda.memory_reserved(i) - torch.cuda.memory_allocated(i)

    return {d: size(d) for d in devices}


def _total_memory(devices: tuple[str, ...]) -> dict[str, int]:
    return _memory(devices, total=True)


def empty_model(model_class: Any, config: Any, dtype: Any, **remote: Any) -> Any:
    """A `model_class` model of `config` in `dtype` on the meta device: its modules and sizes, no memory, no weight.
    `remote`: `trust_remote_code` and `revision` as the load gets them (else transformers asks on the terminal)."""
    import copy
    import functools

    import torch

    if getattr(model_class, "from_config", None) is not None:  # an Auto class
        trust = bool(remote.get("trust_remote_code"))
        code = {"code_revision": remote["revision"]} if trust and remote.get("revision") else {}
        build = functools.partial(model_class.from_config, trust_remote_code=trust, **code)
    else:
        build = model_class._from_config
    with torch.device("meta"):
        return build(copy.deepcopy(config), dtype=dtype)  # _from_config sets the dtype on the config it gets


def gpu_map(empty: Any, free: dict[str, int]) -> dict[str, str]:
    """accelerate's balanced device map of the meta model `empty` over the GPUs of `free` (free bytes each); what
    does not fit them is mapped to "disk"."""
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map

    budget = {int(d.partition(":")[2]): v for d, v in free.items()}
    split = empty._no_split_modules
    balanced = get_balanced_memory(empty, max_memory=budget, no_split_module_classes=split)
    return {k: _device_name(v) for k, v in infer_auto_device_map(empty, balanced, split).items()}


def place(model_class: Any, config: Any, dtype: Any, device: str, name: str, **remote: Any) -> Placement:
    """The placement of a `model_class` model of `config` in `dtype` on `device`, from the config alone (`empty_model`);
    one line when the weights do not fit the devices' free memory."""
    from transformers.integrations.accelerate import compute_module_sizes

    devices = resolve_device(device)
    empty = empty_model(model_class, config, dtype, **remote)
    size = int(compute_module_sizes(empty)[0][""])
    free = _memory(devices, total=False)
    device_map = gpu_map(empty, free) if len(devices) > 1 else {"": devices[0]}
    if len(set(device_map.values())) == 1:
        device_map = {"": next(iter(device_map.values()))}
    if size > sum(free.values()) or {"cpu", "disk"} & set(device_map.values()) - set(devices):
        raise UserError(
            f"{name}: its {size / _GIB:.1f} GiB of {str(dtype).removeprefix('torch.')} weights do not fit the free "
            f"memory of {', '.join(f'{d} {v / _GIB:.1f} GiB' for d, v in free.items())}",
            "free memory there, use other devices (--device, or device: in a sweep file), or load a smaller dtype "
            "(bfloat16 takes half of float32)",
        )
    return Placement(device_map=device_map, weight_bytes=size, layers=layers_per_device(empty, device_map))


DEFAULT_DTYPE = "auto"  # the dtype the model's config names
DTYPES = (DEFAULT_DTYPE, "float32", "bfloat16", "float16")


def check_dtype(name: str) -> str:
    """`name` when it is one of DTYPES, else the one-line refusal."""
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return name


def load_dtype(config: Any, dtype: Any) -> Any:
    """The torch dtype a model of `config` loads in: `dtype`, or for "auto" the config's own (float32 without one)."""
    import torch

    if dtype != "auto":
        return dtype
    own = getattr(config, "dtype", None)
    return own if isinstance(own, torch.dtype) else getattr(torch, str(own or "float32").removeprefix("torch."))


def check_not_tensor_parallel(model: Any) -> None:
    """Refuse, before any forward, a tensor-parallel model (each rank's attention holds only its share of heads)."""
    tp = getattr(model, "tp_size", None) or 1
    if tp > 1:
        raise UserError(
            f"Sink Strength cannot be measured on a tensor-parallel model (tp_size {tp}): each rank's attention "
            f"holds 1/{tp} of the heads, so S would cover only those",
            "load the model without tp_plan (device_map over the GPUs: --device auto, or lm-eval's "
            "parallelize=True), or measure a saved checkpoint with lm-eval-sink strength",
        )


def empty_cache() -> None:
    """Give the CUDA caching allocator's free blocks back, only where this process has used CUDA."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextmanager
def peak_memory() -> Iterator[dict[str, int]]:
    """A dict filled on exit with each GPU's peak memory allocated inside the block (empty without CUDA)."""
    import torch

    peaks: dict[str, int] = {}
    if torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(i)
    try:
        yield peaks
    finally:
        if torch.cuda.is_initialized():
            peaks.update({f"cuda:{i}": torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count())})
