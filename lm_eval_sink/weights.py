"""The one reader of a checkpoint's safetensors headers, through the `safetensors` library (docs/development.md,
'Faults'): a file that is missing, cut short or not safetensors is one line naming it, before anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError

AGAIN = "copy or download the checkpoint's files again (compare their sizes and checksums with the source's)"
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")  # a token embedding's [vocab, hidden]


@dataclass(frozen=True, slots=True)
class Tensor:
    """A tensor as a safetensors header describes it, and the file (its name in the folder) that holds it."""

    file: str
    dtype: str  # the header's name: F32, BF16, I64, ...
    shape: tuple[int, ...]


def _why(error: Exception) -> str:
    """The safetensors library's complaint in words: a header longer than the file, or tensors past its end, is a file
    cut short; any other header that does not parse is not safetensors (or a damaged one)."""
    text = str(error).lower()
    if "length" in text or "incomplete" in text:
        return "is cut short (its header describes more bytes than it holds)"
    return "is not a safetensors file, or a damaged one (its header does not parse)"


def file_tensors(path: Path) -> dict[str, Tensor]:
    """Each tensor of one safetensors file, from its header; a missing, short or foreign file is one line."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: Tensor(path.name, s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except FileNotFoundError:
        raise UserError(f"{path}: missing", AGAIN) from None
    except SafetensorError as e:
        size = path.stat().st_size
        raise UserError(f"{path}: {_why(e)}; {size:,} bytes", AGAIN) from None
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e})", AGAIN) from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its `*.safetensors.index.json` names, else every
    `*.safetensors` in it."""
    from lm_eval_sink.io import parse_json, read_text

    index = sorted(folder.glob("*.safetensors.index.json"))
    if not index:
        return sorted(folder.glob("*.safetensors"))
    data = parse_json(read_text(index[0], index[0].name), str(index[0]), AGAIN)
    shards = data.get("weight_map") if isinstance(data, Mapping) else None
    if not isinstance(shards, Mapping) or not all(isinstance(v, str) for v in shards.values()):
        raise UserError(f"{index[0]}: no weight_map of tensor names to shard files", AGAIN)
    return [folder / name for name in sorted(set(shards.values()))]


def checkpoint_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder's safetensors files (`weight_files`); empty without any. A tensor in two
    files is refused (which one a loader takes is its own choice)."""
    tensors: dict[str, Tensor] = {}
    for path in weight_files(folder):
        for name, t in file_tensors(path).items():
            if name in tensors:
                raise UserError(f"{folder}: tensor {name} is in both {tensors[name].file} and {t.file}", AGAIN)
            tensors[name] = t
    return tensors


def check_weights(folder: Path, config: Mapping[str, Any] | None = None) -> None:
    """Refuse, before anything loads, a checkpoint whose safetensors files are missing, cut short or foreign, or
    whose config.json (`config`, parsed) gives vocab_size(s) that no token embedding of the weights has as rows."""
    tensors = checkpoint_tensors(folder)
    embeddings = {n: t.shape[0] for n, t in sorted(tensors.items()) if n.endswith(_EMBEDDINGS) and len(t.shape) == 2}
    sections = [config or {}, *(v for v in (config or {}).values() if isinstance(v, Mapping))]
    sizes = [s["vocab_size"] for s in sections if isinstance(s.get("vocab_size"), int)]
    if sizes and embeddings and not set(sizes) & set(embeddings.values()):
        name, rows = next(iter(embeddings.items()))
        raise UserError(
            f"{folder / 'config.json'}: vocab_size is {sizes[0]:,}, but the weights' {name} has {rows:,} rows",
            "restore the config.json the checkpoint was saved with (the weights' shapes fix vocab_size)",
        )
