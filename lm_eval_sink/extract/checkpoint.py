"""Streaming safetensors I/O: headers only, shards read and written tensor by tensor (docs/extraction.md)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json
from lm_eval_sink.weights import Tensor, checkpoint_tensors

INDEX_FILE = "model.safetensors.index.json"
ST_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_DTYPES = {v: k for k, v in ST_CODES.items()}
Entry = tuple[str, torch.dtype, tuple[int, ...]]  # one tensor of an output shard: name, dtype, shape
Layout = tuple[tuple[str, tuple[Entry, ...]], ...]  # output shards in write order: file name, its tensors


def entry_bytes(entry: Entry) -> int:
    return math.prod(entry[2]) * entry[1].itemsize


def read_checkpoint(folder: Path) -> dict[str, Tensor]:
    """Names, dtypes and shapes of every tensor, from the safetensors headers only (`weights.checkpoint_tensors`)."""
    tensors = checkpoint_tensors(folder)
    if not tensors:
        raise UserError(
            f"{folder}: no *.safetensors weights (pytorch_model*.bin is not read: streaming needs safetensors)",
            "convert once: load the model and save_pretrained(folder) (safetensors is the default)",
        )
    unknown = sorted({t.dtype for t in tensors.values()} - set(ST_DTYPES))
    if unknown:
        raise UserError(
            f"{folder}: tensor dtype(s) {unknown} are not supported", "save the checkpoint in bf16/fp16/fp32"
        )
    return tensors


class Reader:
    """Reads source tensors with `safe_open`, keeping only the shards still needed open."""

    def __init__(self, folder: Path, tensors: dict[str, Tensor]) -> None:
        self.folder, self.tensors = folder, tensors
        self._open: dict[str, tuple[contextlib.ExitStack, Any]] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.tensors[name].file
        if file not in self._open:
            stack = contextlib.ExitStack()
            self._open[file] = (stack, stack.enter_context(safe_open(str(self.folder / file), framework="pt")))
        return self._open[file][1].get_tensor(name)

    def keep_only(self, files: set[str]) -> None:
        for file in [f for f in self._open if f not in files]:
            self._open.pop(file)[0].close()

    def close(self) -> None:
        self.keep_only(set())


class ShardWriter:
    """Writes one safetensors file tensor by tensor, in the order of its entries."""

    def __init__(self, path: Path, entries: tuple[Entry, ...], metadata: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for entry in entries:
            name, dtype, shape = entry
            header[name] = {
                "dtype": ST_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + entry_bytes(entry)],
            }
            offset += entry_bytes(entry)
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._order = entries
        self._next = 0
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, want_dtype, want_shape = self._order[self._next]
        if name != want_name or tensor.dtype != want_dtype or tuple(tensor.shape) != want_shape:
            raise RuntimeError(
                f"shard writer: got {name} {tensor.dtype} {tuple(tensor.shape)}, planned {want_name} "
                f"{want_dtype} {want_shape}"
            )
        data = tensor.detach().contiguous().reshape(-1)
        if data.numel():
            self._f.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(
                f"shard writer: {self.path.name} closed after {self._next} of {len(self._order)} tensors"
            )
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def layout_bytes(layout: Layout) -> int:
    return sum(entry_bytes(e) for _, entries in layout for e in entries)


def write_index(folder: Path, layout: Layout) -> None:
    """model.safetensors.index.json for a written layout (tensor -> shard file, total bytes)."""
    weight_map = {name: file for file, entries in layout for name, _, _ in entries}
    atomic_write_json(
        folder / INDEX_FILE,
        {"metadata": {"total_size": layout_bytes(layout)}, "weight_map": dict(sorted(weight_map.items()))},
    )
