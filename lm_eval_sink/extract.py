"""Extract a VLM's language backbone as a standalone causal LM, and inject one back.

One mechanism, configured per VLM family by `lm_eval_sink/architectures/<family>.json`:

- The family file names the VLM class, where its text config lives, the target causal-LM
  model type and how its config is derived from the text config (keys dropped, renamed, set),
  and an ordered list of tensor rules. A rule maps one or more checkpoint tensors (full-match
  regexes with named groups such as `(?P<layer>\\d+)`) to one or more target tensors (templates
  such as `model.layers.{layer}.self_attn.q_proj.weight`). Between the two: concatenate the
  sources along `dim`, transpose `transpose` when the source layout differs from the target's,
  slice per index along dim 0 (`per_index`, e.g. fused MoE experts), split along `dim` into the
  targets, and keep surplus rows out of the backbone (`drop_rest`, e.g. vision-token rows).
  The first rule whose pattern matches a tensor claims it; `ignore` patterns name the vision
  tower and projector. Anything else is an error that lists the unclaimed tensors.
- Tensor names are read from the checkpoint's safetensors headers, never assumed: a family's
  rules cover each on-disk layout transformers reads (legacy `model.layers.*` as well as
  `model.language_model.*`). The set of target tensors and their shapes must equal exactly
  what `save_pretrained` of the target class writes (computed on the meta device), so a
  missing, extra or mis-shaped tensor is reported before any data is read.
- Data streams tensor by tensor: each output shard's header is computed up front from the
  plan, then tensors are read from the source shards (`safe_open`), transformed and appended.
  Peak memory is about one rule's tensors, not a shard and never the model.
- `extract_backbone` builds the output in a `<out>.partial-<id>` sibling (`io.staged_dir`),
  verifies it (a fixed text-only probe through the VLM's own forward and through the extracted
  model: max absolute logit difference within a tolerance per dtype), and marks it with
  `COMPLETE.json`, or with `FAILED.json` when verification fails (the folder is kept for
  inspection). `inject_backbone` runs the same rules backwards into a copy of the VLM.

Verification memory: the VLM and the backbone are loaded one after the other (never together),
each in the output dtype, so its peak is about the size of the whole VLM in that dtype plus a
1 x ~40-token forward pass. `verify=False` skips it (the structural checks remain).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from lm_eval_sink.errors import UserError
from lm_eval_sink.schema import Strict, parse
from lm_eval_sink.io import SCHEMA_VERSION, atomic_write_json, atomic_write_text, check_output_dir, provenance, sha256_bytes, staged_dir

log = logging.getLogger(__name__)

DTYPE_CHOICES = ("keep", "bf16", "fp32")
DEFAULT_SHARD_BYTES = 5 * 1024**3
REPORT_FILE = "extraction.json"
INJECT_REPORT_FILE = "injection.json"
COMPLETE_FILE = "COMPLETE.json"
FAILED_FILE = "FAILED.json"
_MARKER_FILES = (COMPLETE_FILE, FAILED_FILE, REPORT_FILE, INJECT_REPORT_FILE)
INDEX_FILE = "model.safetensors.index.json"
# Verification tolerance on the max absolute logit difference: atol + rtol * max|reference logit|.
# fp32 comparisons of the same weights through the same operations come out at 0 or ~1e-6.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-5),
    "bfloat16": (2e-2, 1e-2),
    "float16": (2e-3, 1e-3),
}
PROBE_TEXT = (
    "The capital of France is Paris. Write a list of three colors as a JSON list, then explain "
    "in two sentences why the sky is blue, using only letters and words."
)
PROBE_MIN_TOKENS = 16
_ST_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ST_DTYPES = {v: k for k, v in _ST_CODES.items()}
_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_TOKENIZER_COPY = (*_TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.txt", "chat_template.jinja")


# ----------------------------------------------------------------------------------------------
# Architecture data
# ----------------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class TensorRule:
    """Checkpoint tensors (`sources`, full-match regexes) -> target tensors (`targets`, templates)."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    dim: int = 0
    transpose: tuple[int, int] | None = None
    per_index: str | None = None
    drop_rest: bool = False

    def patterns(self) -> tuple[re.Pattern[str], ...]:
        return tuple(re.compile(p) for p in self.sources)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"from": list(self.sources), "to": list(self.targets)}
        if self.dim:
            out["dim"] = self.dim
        if self.transpose:
            out["transpose"] = list(self.transpose)
        if self.per_index:
            out["per_index"] = self.per_index
        if self.drop_rest:
            out["drop_rest"] = True
        return out


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """How the causal-LM config is derived from the VLM's text config."""

    model_type: str | None  # None: the text config's own model type
    drop_config: tuple[str, ...] = ()  # dot paths, e.g. "rope_parameters.mrope_section"
    rename_config: tuple[tuple[str, str], ...] = ()
    set_config: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class Variant:
    """A family's configuration for text configs matching `when` (dot path -> value)."""

    name: str
    when: tuple[tuple[str, Any], ...]
    target: TargetSpec
    rules: tuple[TensorRule, ...]


@dataclass(frozen=True, slots=True)
class Family:
    """One VLM family, as read from its architectures/*.json file."""

    name: str
    description: str
    model_types: tuple[str, ...]
    vlm_class: str
    text_config: str
    variants: tuple[Variant, ...]
    ignore: tuple[str, ...]
    file: str
    sha256: str

    def ignore_patterns(self) -> tuple[re.Pattern[str], ...]:
        return tuple(re.compile(p) for p in self.ignore)


def _bad(file: str, what: str) -> UserError:
    return UserError(f"architecture file {file}: {what}", "see docs/extraction.md, 'Adding a VLM family', for the schema")


class _RuleIn(Strict):
    what: ClassVar[str] = "tensor rule"
    sources: str | list[str] = Field(alias="from")
    to: str | list[str]
    dim: int = 0
    transpose: list[int] | None = None
    per_index: str | None = None
    drop_rest: bool = False


class _TargetIn(Strict):
    what: ClassVar[str] = "target"
    model_type: str | None = None
    drop_config: list[str] = []
    rename_config: dict[str, str] = {}
    set_config: dict[str, Any] = {}


class _VariantIn(Strict):
    what: ClassVar[str] = "variant"
    name: str
    when: dict[str, Any]
    target: _TargetIn = _TargetIn()
    rules: list[_RuleIn] = []


class _FamilyIn(Strict):
    what: ClassVar[str] = "family"
    name: str
    description: str = ""
    model_types: list[str]
    vlm_class: str
    text_config: str
    target: _TargetIn
    rules: list[_RuleIn]
    ignore: list[str] = []
    variants: list[_VariantIn] = []


def _as_tuple(value: str | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _parse_rule(file: str, where: str, raw: _RuleIn) -> TensorRule:
    sources, targets = _as_tuple(raw.sources), _as_tuple(raw.to)
    if not sources or not targets:
        raise _bad(file, f"{where}: 'from' and 'to' must not be empty")
    groups: set[str] | None = None
    for pattern in sources:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise _bad(file, f"{where}: bad regex {pattern!r} ({e})") from None
        names = set(compiled.groupindex)
        if groups is not None and names != groups:
            raise _bad(file, f"{where}: all 'from' patterns must have the same named groups")
        groups = names
    per_index = raw.per_index
    transpose = tuple(raw.transpose) if raw.transpose is not None else None
    if per_index is not None and len(sources) != 1:
        raise _bad(file, f"{where}: per_index needs exactly one 'from' pattern")
    if transpose is not None and (len(transpose) != 2 or (per_index is not None and 0 in transpose)):
        raise _bad(file, f"{where}: transpose must be two dims (not dim 0 with per_index)")
    if raw.drop_rest and transpose is not None:
        raise _bad(file, f"{where}: drop_rest and transpose cannot be combined")
    known = (groups or set()) | ({per_index} if per_index else set())
    for template in targets:
        unknown = set(_PLACEHOLDER.findall(template)) - known
        if unknown:
            raise _bad(file, f"{where}: template {template!r} uses {sorted(unknown)}, not a group of its 'from' pattern")
    return TensorRule(sources=sources, targets=targets, dim=raw.dim, transpose=transpose, per_index=per_index, drop_rest=raw.drop_rest)


def _parse_target(raw: _TargetIn, base: TargetSpec | None = None) -> TargetSpec:
    base = base or TargetSpec(model_type=None)
    return TargetSpec(
        model_type=raw.model_type if "model_type" in raw.model_fields_set else base.model_type,
        drop_config=base.drop_config + tuple(raw.drop_config),
        rename_config=base.rename_config + tuple(sorted(raw.rename_config.items())),
        set_config=base.set_config + tuple(sorted(raw.set_config.items())),
    )


def parse_family(text: str, file: str) -> Family:
    """Parse and validate one architecture file (unknown keys, bad regexes, bad templates)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(file, f"not valid JSON ({e})") from None
    try:
        raw = parse(_FamilyIn, data, f"architecture file {file}")
    except UserError as e:
        raise UserError(e.message, _bad(file, "").hint) from None
    target = _parse_target(raw.target)
    rules = tuple(_parse_rule(file, f"rules[{i}]", r) for i, r in enumerate(raw.rules))
    variants = []
    for i, v in enumerate(raw.variants):
        v_rules = tuple(_parse_rule(file, f"variants[{i}].rules[{j}]", r) for j, r in enumerate(v.rules))
        variants.append(Variant(name=v.name, when=tuple(sorted(v.when.items())), target=_parse_target(v.target, target), rules=v_rules + rules))
    if not variants:
        variants.append(Variant(name="default", when=(), target=target, rules=rules))
    for pattern in raw.ignore:
        try:
            re.compile(pattern)
        except re.error as e:
            raise _bad(file, f"ignore: bad regex {pattern!r} ({e})") from None
    return Family(name=raw.name, description=raw.description, model_types=tuple(raw.model_types), vlm_class=raw.vlm_class, text_config=raw.text_config,
                  variants=tuple(variants), ignore=tuple(raw.ignore), file=file, sha256=sha256_bytes(text.encode("utf-8")))


def load_families() -> dict[str, Family]:
    """Every family shipped in lm_eval_sink/architectures/*.json, by name."""
    root = resources.files("lm_eval_sink.architectures")
    families: dict[str, Family] = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            fam = parse_family(entry.read_text(encoding="utf-8"), f"architectures/{entry.name}")
            if fam.name in families:
                raise _bad(fam.file, f"family name {fam.name!r} is defined twice")
            families[fam.name] = fam
    return families


def supported_model_types() -> list[str]:
    return sorted(mt for fam in load_families().values() for mt in fam.model_types)


def family_for(config: dict[str, Any], path: Path) -> Family:
    """The family of a VLM config.json, or a UserError that says what is supported."""
    model_type = config.get("model_type")
    for fam in load_families().values():
        if model_type in fam.model_types:
            return fam
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and "vision_config" not in config and "text_config" not in config:
        raise UserError(f"{path}: model type {model_type!r} is a text-only causal LM, not a VLM",
                        "evaluate or merge it as it is; extract takes a vision-language model")
    raise UserError(f"{path}: unsupported VLM architecture {model_type!r} (supported: {', '.join(supported_model_types())})",
                    "add an architectures/<family>.json for it (docs/extraction.md: 'Adding a VLM family')")


_MISSING = object()


def _dotget(d: dict[str, Any], path: str) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _dotdel(d: dict[str, Any], path: str) -> bool:
    *parents, last = path.split(".")
    cur: Any = d
    for part in parents:
        if not isinstance(cur, dict) or part not in cur:
            return False
        cur = cur[part]
    if isinstance(cur, dict) and last in cur:
        del cur[last]
        return True
    return False


def select_variant(family: Family, text_config: dict[str, Any], path: Path) -> Variant:
    """The first variant whose `when` conditions all hold on the text config."""
    for variant in family.variants:
        if all(_dotget(text_config, k) == v for k, v in variant.when):
            return variant
    wanted = "; ".join(f"{v.name}: " + ", ".join(f"{k}={val!r}" for k, val in v.when) for v in family.variants)
    keys = sorted({k for v in family.variants for k, _ in v.when})
    found = ", ".join(f"{k}={_dotget(text_config, k)!r}" for k in keys)
    raise UserError(f"{path}: this {family.name} text config ({found}) matches no supported variant ({wanted})",
                    f"extend architectures/{family.name}.json with a variant for it")


# ----------------------------------------------------------------------------------------------
# Checkpoint reading and shard writing
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors code: F32, BF16, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ST_DTYPES[self.dtype].itemsize


def _weight_files(folder: Path) -> list[str]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{index}: not a safetensors index ({e})", "re-save the model with save_pretrained") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise UserError(f"{folder}: the index names shards that are missing: {', '.join(missing[:3])}",
                            "copy the complete checkpoint (every model-*.safetensors shard)")
        return files
    return sorted(p.name for p in folder.glob("*.safetensors"))


_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def check_model_folder(path: str | Path, role: str) -> Path:
    """A folder with config.json and safetensors weights, or a UserError naming what is missing.

    A hub id (`owner/name`) that is not a local path is downloaded first (config, tokenizer,
    processor and safetensors files only) unless HF_HUB_OFFLINE is set.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        text = str(path)
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        from lm_eval_sink.identity import looks_like_hub_id

        if looks_like_hub_id(text) and not text.startswith((".", "/")) and not offline:
            from huggingface_hub import snapshot_download

            return check_model_folder(snapshot_download(repo_id=text, allow_patterns=_HUB_PATTERNS), role)
        raise UserError(f"{folder}: no such {role} folder" + (" (and the hub is offline: HF_HUB_OFFLINE=1)" if offline and "/" in text else ""),
                        "pass a local folder written by save_pretrained, or a hub id when online")
    if not folder.is_dir():
        raise UserError(f"{folder}: is a file, not a {role} folder", "pass the folder that holds config.json and the weights")
    from lm_eval_sink.identity import check_finished_folder

    check_finished_folder(folder)
    found = ", ".join(sorted(p.name for p in folder.iterdir())[:8]) or "nothing"
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder}: not a model folder (no config.json; found {found})", "pass a folder written by save_pretrained")
    if not _weight_files(folder):
        if any(folder.glob("pytorch_model*.bin")):
            raise UserError(f"{folder}: weights are pytorch_model*.bin; streaming needs safetensors",
                            "convert once: load the model and save_pretrained(folder) (safetensors is the default)")
        raise UserError(f"{folder}: no weights (*.safetensors) in the {role} folder (found {found})",
                        "pass the folder that holds the model-*.safetensors shards")
    return folder


def read_checkpoint(folder: Path) -> dict[str, TensorInfo]:
    """Names, dtypes and shapes of every tensor, from the safetensors headers only."""
    from safetensors import safe_open

    tensors: dict[str, TensorInfo] = {}
    for name in _weight_files(folder):
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    if key in tensors:
                        raise UserError(f"{folder}: tensor {key} is in both {tensors[key].file} and {name}", "re-save the checkpoint")
                    tensors[key] = TensorInfo(file=name, dtype=sl.get_dtype(), shape=tuple(sl.get_shape()))
        except UserError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise UserError(f"{folder / name}: not a readable safetensors file ({str(e).splitlines()[0]})",
                            "re-download or re-save the checkpoint") from None
    unknown = sorted({t.dtype for t in tensors.values()} - set(_ST_DTYPES))
    if unknown:
        raise UserError(f"{folder}: tensor dtype(s) {unknown} are not supported", "save the checkpoint in bf16/fp16/fp32")
    return tensors


class _Reader:
    """Reads source tensors with `safe_open`, keeping only the shards still needed open."""

    def __init__(self, folder: Path, tensors: dict[str, TensorInfo]) -> None:
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


class _ShardWriter:
    """Writes one safetensors file tensor by tensor: the header is known before any data."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> None:
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, dtype, shape in entries:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self.path, self.nbytes = path, offset
        self._order = [(n, d, s) for n, d, s in entries]
        self._next = 0
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, want_dtype, want_shape = self._order[self._next]
        if name != want_name or tensor.dtype != want_dtype or tuple(tensor.shape) != want_shape:
            raise RuntimeError(f"shard writer: got {name} {tensor.dtype} {tuple(tensor.shape)}, planned {want_name} {want_dtype} {want_shape}")
        data = tensor.detach().contiguous().reshape(-1)
        if data.numel():
            self._f.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            raise RuntimeError(f"shard writer: {self.path.name} closed after {self._next} of {len(self._order)} tensors")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Tensor rules: forward (VLM -> backbone) and inverse (backbone -> VLM)
# ----------------------------------------------------------------------------------------------

def _combined(shapes: list[tuple[int, ...]], dim: int) -> tuple[int, ...]:
    first = list(shapes[0])
    for s in shapes[1:]:
        if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != dim):
            raise ValueError(f"shapes {shapes} cannot be concatenated along dim {dim}")
    first[dim] = sum(s[dim] for s in shapes)
    return tuple(first)


def _fits(shape: tuple[int, ...], want: tuple[int, ...], dim: int, allow_more: bool) -> bool:
    if len(shape) != len(want):
        return False
    return all(a == b or (allow_more and i == dim and a > b) for i, (a, b) in enumerate(zip(shape, want)))


def forward_rule(rule: TensorRule, sources: list[torch.Tensor], target_shapes: list[tuple[int, ...]]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Apply a rule to source tensors: returns the target tensors and the dropped rest (or None).

    Works on meta tensors too, which is how whole plans are checked before any data is read.
    """
    x = sources[0] if len(sources) == 1 else torch.cat(sources, dim=rule.dim)
    k = len(rule.targets)
    if rule.per_index:
        n = x.shape[0]
        if len(target_shapes) != n * k:
            raise ValueError(f"{n} slices x {k} targets != {len(target_shapes)} planned targets")
        piece = _combined(target_shapes[:k], rule.dim)
        want = (n, *piece)
        dim = rule.dim + 1  # split dim inside the stacked tensor
    else:
        want = _combined(target_shapes, rule.dim)
        dim = rule.dim
    if rule.transpose and not _fits(tuple(x.shape), want, dim, rule.drop_rest):
        swapped = x.transpose(*rule.transpose)
        if _fits(tuple(swapped.shape), want, dim, rule.drop_rest):
            x = swapped
    if not _fits(tuple(x.shape), want, dim, rule.drop_rest):
        raise ValueError(f"source shape {tuple(x.shape)} does not give the target shape {want}")
    rest = None
    if x.shape[dim] > want[dim]:
        rest = x.narrow(dim, want[dim], x.shape[dim] - want[dim])
        x = x.narrow(dim, 0, want[dim])
    pieces = list(x.unbind(0)) if rule.per_index else [x]
    sizes = [s[rule.dim] for s in target_shapes[:k]]
    out: list[torch.Tensor] = []
    for p in pieces:
        out.extend(p.split(sizes, dim=rule.dim) if k > 1 else [p])
    return out, rest


def inverse_rule(rule: TensorRule, targets: list[torch.Tensor], source_shapes: list[tuple[int, ...]], rest: torch.Tensor | None) -> list[torch.Tensor]:
    """The inverse of `forward_rule`: rebuild the source tensors from the targets (and the rest)."""
    k = len(rule.targets)
    if rule.per_index:
        pieces = [torch.cat(targets[i:i + k], dim=rule.dim) if k > 1 else targets[i] for i in range(0, len(targets), k)]
        x = torch.stack(pieces, dim=0)
        dim = rule.dim + 1
    else:
        x = torch.cat(targets, dim=rule.dim) if k > 1 else targets[0]
        dim = rule.dim
    if rest is not None:
        x = torch.cat([x, rest.to(x.dtype)], dim=dim)
    want = _combined(source_shapes, rule.dim)
    if rule.transpose and tuple(x.shape) != want and tuple(x.transpose(*rule.transpose).shape) == want:
        x = x.transpose(*rule.transpose)
    if tuple(x.shape) != want:
        raise ValueError(f"backbone tensors give shape {tuple(x.shape)}, the VLM stores {want}")
    if len(source_shapes) == 1:
        return [x]
    return list(x.split([s[rule.dim] for s in source_shapes], dim=rule.dim))


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Unit:
    """One application of a rule: these checkpoint tensors become these backbone tensors."""

    rule: TensorRule
    sources: tuple[str, ...]
    targets: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything decided before data moves: target config, tensor map, tying."""

    family: Family
    variant: Variant
    target_config: Any  # transformers PretrainedConfig of the target causal LM
    target_class: str
    units: tuple[Unit, ...]
    expected: dict[str, tuple[int, ...]]  # target tensor -> shape, as save_pretrained writes them
    tied: bool  # the VLM ties its head and stores none: the backbone ties too
    vlm_ties: bool  # the VLM config ties the head to the embeddings
    head: str | None  # the output-head tensor name when the target class can tie it
    head_source: str | None  # the embedding it ties to
    ignored: tuple[str, ...]
    dropped_config_keys: tuple[str, ...]
    source_class: str


def _claim(tensors: dict[str, TensorInfo], rules: tuple[TensorRule, ...], ignore: tuple[re.Pattern[str], ...], path: Path) -> tuple[list[Unit], list[str]]:
    compiled = [r.patterns() for r in rules]
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
    ignored, leftover = [], []
    for name in sorted(tensors):
        for ri, pats in enumerate(compiled):
            hit = next(((pi, m) for pi, p in enumerate(pats) if (m := p.fullmatch(name))), None)
            if hit is not None:
                pi, m = hit
                slot = groups.setdefault((ri, tuple(sorted(m.groupdict().items()))), {})
                if pi in slot:
                    raise UserError(f"{path}: tensors {slot[pi]} and {name} both match one rule slot", "fix the architecture rules")
                slot[pi] = name
                break
        else:
            (ignored if any(p.fullmatch(name) for p in ignore) else leftover).append(name)
    if leftover:
        shown = ", ".join(leftover[:6]) + (f" and {len(leftover) - 6} more" if len(leftover) > 6 else "")
        raise UserError(f"{path}: {len(leftover)} tensor(s) are neither language-model nor ignored vision tensors: {shown}",
                        "the checkpoint layout is not covered by the family's architecture rules; extend its JSON")
    units = []
    for (ri, key), slot in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rule = rules[ri]
        if len(slot) != len(rule.sources):
            have = ", ".join(slot[i] for i in sorted(slot))
            missing = [rule.sources[i] for i in range(len(rule.sources)) if i not in slot]
            raise UserError(f"{path}: {have} found without its partner(s) matching {missing}", "the checkpoint is incomplete")
        sources = tuple(slot[i] for i in range(len(rule.sources)))
        values = dict(key)
        if rule.per_index:
            n = tensors[sources[0]].shape[0]
            targets = tuple(t.format(**values, **{rule.per_index: i}) for i in range(n) for t in rule.targets)
        else:
            targets = tuple(t.format(**values) for t in rule.targets)
        units.append(Unit(rule=rule, sources=sources, targets=targets))
    return units, ignored


def _target_config(family: Family, variant: Variant, text: dict[str, Any], tie: bool, path: Path) -> tuple[Any, str, list[str]]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    d = json.loads(json.dumps(text))  # deep copy
    model_type = variant.target.model_type or d.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{path}: target model type {model_type!r} has no causal-LM class in this transformers",
                        f"fix target.model_type in architectures/{family.name}.json")
    dropped = [p for p in variant.target.drop_config if _dotdel(d, p)]
    for old, new in variant.target.rename_config:
        if old in d:
            d[new] = d.pop(old)
    d.update(dict(variant.target.set_config))
    for key in ("model_type", "architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "auto_map", "tie_word_embeddings"):
        d.pop(key, None)
    # Keys the target class does not declare are kept: modeling code reads some of them with
    # getattr (Qwen3-MoE's head_dim), so only the family's drop_config removes keys.
    try:
        config = AutoConfig.for_model(model_type, tie_word_embeddings=tie, **d)
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: cannot build a {model_type} config from the VLM's text config ({str(e).splitlines()[0]})",
                        f"fix target in architectures/{family.name}.json") from None
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], dropped


def _expected_tensors(config: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Names and shapes `save_pretrained` writes for this config, and the tie map {head: embedding}."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = model.state_dict()
    tie_map = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    try:  # on-disk names and layouts (e.g. per-expert MoE tensors) differ from in-memory ones
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except ImportError:  # older transformers: in-memory names are the on-disk names
        pass
    return {k: tuple(v.shape) for k, v in state.items()}, tie_map


def _vlm_text_config(family: Family, vlm: Path) -> tuple[Any, dict[str, Any]]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(vlm)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{vlm}: cannot read the VLM config ({str(e).splitlines()[0]})", "pass a folder written by save_pretrained") from None
    text = getattr(config, family.text_config, None)
    if text is None:
        raise UserError(f"{vlm}: the {family.name} config has no {family.text_config!r}", "check that this is a complete VLM config")
    return config, text.to_dict()


def make_plan(vlm: Path, tensors: dict[str, TensorInfo], family: Family) -> Plan:
    """Match the checkpoint's tensors to the target class and decide tying, before any data moves."""
    vlm_config, text = _vlm_text_config(family, vlm)
    variant = select_variant(family, text, vlm)
    config, target_class, dropped = _target_config(family, variant, text, tie=True, path=vlm)
    expected, tie_map = _expected_tensors(config)
    units, ignored = _claim(tensors, variant.rules, family.ignore_patterns(), vlm)
    produced: dict[str, str] = {}
    for unit in units:
        for t in unit.targets:
            if t in produced:
                raise UserError(f"{vlm}: backbone tensor {t} is produced from both {produced[t]} and {unit.sources[0]}",
                                "the checkpoint mixes two layouts of the same weights; re-save it")
            produced[t] = unit.sources[0]
    head, head_source = next(iter(tie_map.items()), (None, None))
    vlm_ties = bool(getattr(vlm_config, "tie_word_embeddings", False))
    if head is not None and head not in produced:
        if not vlm_ties:
            raise UserError(f"{vlm}: the output head is missing ({head} has no source tensor) and the VLM does not tie it",
                            "the checkpoint is incomplete")
        tied = True
    else:
        tied = False  # decided later against the data when the VLM ties and stores its head too
    want = {k: v for k, v in expected.items() if not (tied and k == head)}
    missing = sorted(set(want) - set(produced))
    extra = sorted(set(produced) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)}: {', '.join(missing[:4])}")
        if extra:
            parts.append(f"unexpected {len(extra)}: {', '.join(extra[:4])}")
        raise UserError(f"{vlm}: the language tensors do not form a {target_class} ({'; '.join(parts)})",
                        f"the checkpoint does not match architectures/{family.name}.json; extend its rules")
    for unit in units:  # shapes, checked on meta tensors
        metas = [torch.empty(tensors[s].shape, device="meta") for s in unit.sources]
        try:
            outs, _ = forward_rule(unit.rule, metas, [expected[t] for t in unit.targets])
        except ValueError as e:
            raise UserError(f"{vlm}: {', '.join(unit.sources)}: {e}", "the text config and the tensors disagree") from None
        for t, o in zip(unit.targets, outs):
            if tuple(o.shape) != expected[t]:
                raise UserError(f"{vlm}: {t} would have shape {tuple(o.shape)}, {target_class} expects {expected[t]}",
                                "the text config and the tensors disagree")
    source_class = (vlm_config.architectures or [family.vlm_class])[0]
    return Plan(family=family, variant=variant, target_config=config, target_class=target_class, units=tuple(units),
                expected=expected, tied=tied, vlm_ties=vlm_ties, head=head, head_source=head_source,
                ignored=tuple(ignored), dropped_config_keys=tuple(dropped), source_class=source_class)


# ----------------------------------------------------------------------------------------------
# Tokenizer, probe and verification
# ----------------------------------------------------------------------------------------------

def _processor_chat_template(folder: Path) -> tuple[str | None, str | None]:
    for name in ("chat_template.json", "processor_config.json"):
        p = folder / name
        if p.is_file():
            try:
                template = json.loads(p.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, AttributeError):
                template = None
            if isinstance(template, str) and template:
                return template, name
    return None, None


def copy_tokenizer(src: Path, dst: Path) -> dict[str, Any]:
    """Copy the VLM's tokenizer files verbatim into `dst`; add the processor's chat template
    (as chat_template.jinja) when the tokenizer has none. The copy must load with AutoTokenizer."""
    present = [n for n in _TOKENIZER_COPY if (src / n).is_file()]
    if not any(n in present for n in _TOKENIZER_FILES):
        log.warning("%s has no tokenizer files; the backbone is written without a tokenizer", src)
        return {"tokenizer": False, "chat_template_source": None}
    for name in present:
        shutil.copy2(src / name, dst / name)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(dst)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{src}: its tokenizer does not load ({str(e).splitlines()[0]})", "check the tokenizer files") from None
    if tok.chat_template:
        return {"tokenizer": True, "chat_template_source": "tokenizer"}
    template, name = _processor_chat_template(src)
    if not template:
        return {"tokenizer": True, "chat_template_source": None}
    atomic_write_text(dst / "chat_template.jinja", template)
    return {"tokenizer": True, "chat_template_source": f"processor ({name})"}


def _multimodal_token_ids(vlm_config: Any) -> set[int]:
    ids: set[int] = set()
    for key, value in vlm_config.to_dict().items():
        if isinstance(value, int) and not isinstance(value, bool) and (key.endswith("_token_id") or key.endswith("_token_index")):
            if key not in ("bos_token_id", "eos_token_id", "pad_token_id"):
                ids.add(value)
    return ids


def probe_ids(tokenizer_dir: Path | None, vocab_size: int, banned: set[int]) -> list[int]:
    """The fixed text-only probe: PROBE_TEXT tokenized, minus multimodal ids, padded to 16 tokens."""
    ids: list[int] = []
    if tokenizer_dir is not None and any((tokenizer_dir / n).is_file() for n in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        ids = list(AutoTokenizer.from_pretrained(tokenizer_dir)(PROBE_TEXT)["input_ids"])
    ids = [i for i in ids if 0 <= i < vocab_size and i not in banned][:64]
    step = 0
    while len(ids) < PROBE_MIN_TOKENS:
        candidate = (7919 * step + 11) % vocab_size
        step += 1
        if candidate not in banned:
            ids.append(candidate)
    return ids


def _logits(load: Callable[[], Any], ids: list[int]) -> torch.Tensor:
    model = load()
    model.eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        return model(input_ids=x, attention_mask=torch.ones_like(x)).logits.float()


@dataclass(frozen=True, slots=True)
class Verification:
    """Round-trip logits of the VLM's text path vs the standalone backbone on the fixed probe."""

    passed: bool
    max_abs_diff: float | None
    tolerance: float | None
    dtype: str
    probe_tokens: int
    reason: str | None

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "max_abs_diff": self.max_abs_diff, "tolerance": self.tolerance, "dtype": self.dtype,
                "probe_tokens": self.probe_tokens, "reason": self.reason}


def verify_pair(vlm_dir: Path, vlm_class: str, backbone_dir: Path, dtype: torch.dtype, ids: list[int], quiet: bool = True) -> Verification:
    """Load the VLM, run the probe, free it; load the backbone, run the probe; compare."""
    import transformers
    from transformers import AutoModelForCausalLM

    name = str(dtype).removeprefix("torch.")
    atol, rtol = TOLERANCES.get(name, TOLERANCES["bfloat16"])
    bar = transformers.utils.logging.is_progress_bar_enabled()
    if quiet:
        transformers.utils.logging.disable_progress_bar()
    try:
        ref = _logits(lambda: getattr(transformers, vlm_class).from_pretrained(vlm_dir, dtype=dtype, attn_implementation="eager"), ids)
        gc.collect()  # the VLM is freed before the backbone loads: peak memory is one model, not two
        info: dict[str, Any] = {}

        def load_backbone() -> Any:
            model, loading = AutoModelForCausalLM.from_pretrained(backbone_dir, dtype=dtype, attn_implementation="eager", output_loading_info=True)
            info.update(loading)
            return model

        got = _logits(load_backbone, ids)
    finally:
        if quiet and bar:
            transformers.utils.logging.enable_progress_bar()
    problems = [f"{k}: {sorted(v)[:4]}" for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v]
    if problems:
        return Verification(False, None, None, name, len(ids), "backbone loads with " + "; ".join(problems))
    if ref.shape != got.shape:
        return Verification(False, None, None, name, len(ids), f"logit shapes differ: VLM {tuple(ref.shape)}, backbone {tuple(got.shape)}")
    if not (torch.isfinite(ref).all() and torch.isfinite(got).all()):
        return Verification(False, None, None, name, len(ids), "non-finite logits (NaN or inf)")
    diff = float((ref - got).abs().max())
    tol = atol + rtol * float(ref.abs().max())
    reason = None if diff <= tol else f"max |logit difference| {diff:.3g} exceeds the {name} tolerance {tol:.3g}"
    return Verification(diff <= tol, diff, tol, name, len(ids), reason)


# ----------------------------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ExtractionReport:
    """What an extract or inject run produced; written as extraction.json / injection.json."""

    operation: str  # "extract" | "inject"
    status: str  # "complete" | "unverified" | "failed"
    output: str
    vlm: dict[str, Any]  # path + fingerprint of the VLM read
    backbone: dict[str, Any] | None  # inject: path + fingerprint of the backbone read
    family: str
    variant: str
    architecture_file: str
    architecture_sha256: str
    source_class: str
    target_class: str
    target_model_type: str
    dtype: str
    tied_embeddings: bool
    tensors_written: int
    bytes_written: int
    shards: tuple[str, ...]
    tensors_ignored: int
    dropped_rows: dict[str, int]
    dropped_config_keys: tuple[str, ...]
    tokenizer: bool
    chat_template_source: str | None
    mapping: tuple[dict[str, Any], ...]
    verification: Verification | None
    seconds: float
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "verification"}
        out["verification"] = self.verification.to_json() if self.verification else None
        for k in ("shards", "dropped_config_keys", "mapping", "notes"):
            out[k] = list(out[k])
        out["provenance"] = provenance(tool=f"lm-eval-sink {self.operation}")
        return out


def _fingerprint(path: Path) -> dict[str, Any]:
    from lm_eval_sink.models import model_fingerprint

    return model_fingerprint(str(path.resolve()))


def _finish(tmp: Path, report: ExtractionReport, report_file: str) -> None:
    atomic_write_json(tmp / report_file, report.to_json())
    marker = {"schema_version": SCHEMA_VERSION, "operation": report.operation, "status": report.status,
              "verified": report.verification is not None and report.verification.passed, "report": report_file}
    if report.status == "failed":
        marker["reason"] = report.verification.reason if report.verification else None
        atomic_write_json(tmp / FAILED_FILE, marker)
    else:
        atomic_write_json(tmp / COMPLETE_FILE, marker)


def _status(verification: Verification | None) -> str:
    if verification is None:
        return "unverified"
    return "complete" if verification.passed else "failed"


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)


# ----------------------------------------------------------------------------------------------
# Extract
# ----------------------------------------------------------------------------------------------

def _out_dtype(dtype: str, tensors: dict[str, TensorInfo], units: tuple[Unit, ...]) -> torch.dtype:
    if dtype in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype]
    weight: dict[torch.dtype, int] = {}
    for unit in units:
        for s in unit.sources:
            d = _ST_DTYPES[tensors[s].dtype]
            if d.is_floating_point:
                weight[d] = weight.get(d, 0) + tensors[s].nbytes
    return max(weight, key=weight.get) if weight else torch.float32


def _cast(t: torch.Tensor, want: torch.dtype | None) -> torch.Tensor:
    return t.to(want) if want is not None and t.is_floating_point() and t.dtype != want else t


def _iter_units(plan: Plan, tensors: dict[str, TensorInfo], reader: _Reader) -> Iterator[tuple[Unit, list[torch.Tensor], torch.Tensor | None]]:
    """Units in source-shard order, each with its target tensors; shards closed once done."""
    order = sorted(plan.units, key=lambda u: (min(tensors[s].file for s in u.sources), u.sources))
    last_use: dict[str, int] = {}
    for i, unit in enumerate(order):
        for s in unit.sources:
            last_use[tensors[s].file] = i
    for i, unit in enumerate(order):
        reader.keep_only({f for f, last in last_use.items() if last >= i})
        outs, rest = forward_rule(unit.rule, [reader.get(s) for s in unit.sources], [plan.expected[t] for t in unit.targets])
        yield unit, outs, rest
        del outs, rest  # free this unit's tensors before the next one is read


def extract_backbone(vlm_path: str | Path, out_dir: str | Path, *, dtype: str = "keep", verify: bool = True, force: bool = False,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, family: Family | None = None, progress: bool = False) -> ExtractionReport:
    """Write the VLM's language model as a standalone causal-LM folder at `out_dir`.

    `dtype`: "keep" (each tensor as stored), "bf16" or "fp32". `family`: override the family
    found from config.json (tests and new families). The returned report's `status` is
    "complete" (verified), "unverified" (verify=False) or "failed" (verification failed: the
    folder is kept at `out_dir` with FAILED.json and no COMPLETE.json). Check `report.ok`.
    """
    start = time.perf_counter()
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_CHOICES)}")
    out = Path(out_dir).expanduser()
    check_output_dir(out, force, "OUT_DIR")
    vlm = check_model_folder(vlm_path, "VLM")
    raw_config = json.loads((vlm / "config.json").read_text(encoding="utf-8"))
    fam = family or family_for(raw_config, vlm)
    tensors = read_checkpoint(vlm)
    plan = make_plan(vlm, tensors, fam)
    out_dtype = _out_dtype(dtype, tensors, plan.units)
    want_cast = None if dtype == "keep" else out_dtype
    reader = _Reader(vlm, tensors)

    # Tying, when the VLM ties its head but also stores it: tie only if the data are equal.
    tied, skip = plan.tied, set()
    if not tied and plan.vlm_ties and plan.head is not None:
        head_unit = next(u for u in plan.units if plan.head in u.targets)
        embed_unit = next(u for u in plan.units if plan.head_source in u.targets)
        if head_unit.rule.per_index is None and len(head_unit.sources) == len(head_unit.targets) == 1 and len(embed_unit.sources) == 1 and embed_unit.rule.drop_rest is False:
            if torch.equal(reader.get(head_unit.sources[0]), reader.get(embed_unit.sources[0])):
                tied, skip = True, {plan.head}
        reader.close()
    config = plan.target_config
    config.tie_word_embeddings = tied
    config.dtype = str(out_dtype).removeprefix("torch.")

    # Output entries in production order, assigned to shards by size.
    order = sorted(plan.units, key=lambda u: (min(tensors[s].file for s in u.sources), u.sources))
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for unit in order:
        src_dtype = functools.reduce(torch.promote_types, [_ST_DTYPES[tensors[s].dtype] for s in unit.sources])
        d = out_dtype if (want_cast is not None and src_dtype.is_floating_point) else src_dtype
        entries.extend((t, d, plan.expected[t]) for t in unit.targets if t not in skip)
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for e in entries:
        nbytes = math.prod(e[2]) * e[1].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    names = _shard_names(len(shards))
    shard_of = {e[0]: i for i, shard in enumerate(shards) for e in shard}
    meta = {"format": "pt", "lm_eval_sink": "extract", "source_family": fam.name}

    with staged_dir(out, force=force) as tmp:
        writer: _ShardWriter | None = None
        current = -1
        dropped_rows: dict[str, int] = {}
        bar = _progress(len(entries), "extract", progress)
        try:
            for unit, outs, rest in _iter_units(plan, tensors, reader):
                if rest is not None:
                    dropped_rows[unit.targets[0]] = int(rest.shape[unit.rule.dim])
                for t, x in zip(unit.targets, outs):
                    if t in skip:
                        continue
                    if shard_of[t] != current:
                        if writer is not None:
                            writer.close()
                        current = shard_of[t]
                        writer = _ShardWriter(tmp / names[current], shards[current], meta)
                    writer.write(t, _cast(x, want_cast))
                    bar.update(1)
                outs = rest = x = None  # free this unit before the next is read
            if writer is not None:
                writer.close()
        finally:
            reader.close()
            bar.close()
        total = sum(math.prod(e[2]) * e[1].itemsize for e in entries)
        if len(names) > 1:
            atomic_write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": {e[0]: names[shard_of[e[0]]] for e in entries}})
        config.save_pretrained(tmp)
        if (vlm / "generation_config.json").is_file():
            shutil.copy2(vlm / "generation_config.json", tmp / "generation_config.json")
        tok = copy_tokenizer(vlm, tmp)
        verification = None
        if verify:
            vlm_config, _ = _vlm_text_config(fam, vlm)
            ids = probe_ids(tmp if tok["tokenizer"] else None, int(config.vocab_size), _multimodal_token_ids(vlm_config))
            verification = verify_pair(vlm, fam.vlm_class, tmp, out_dtype, ids, quiet=not progress)
        notes = [] if tok["chat_template_source"] else ["no chat template found in the VLM's tokenizer or processor files"]
        report = ExtractionReport(
            operation="extract", status=_status(verification), output=str(out.resolve()), vlm=_fingerprint(vlm), backbone=None,
            family=fam.name, variant=plan.variant.name, architecture_file=fam.file, architecture_sha256=fam.sha256,
            source_class=plan.source_class, target_class=plan.target_class, target_model_type=config.model_type,
            dtype=str(out_dtype).removeprefix("torch."), tied_embeddings=tied, tensors_written=len(entries), bytes_written=total,
            shards=tuple(names), tensors_ignored=len(plan.ignored), dropped_rows=dropped_rows,
            dropped_config_keys=plan.dropped_config_keys, tokenizer=tok["tokenizer"], chat_template_source=tok["chat_template_source"],
            mapping=tuple({"from": list(u.sources), "to": [t for t in u.targets if t not in skip]} for u in plan.units),
            verification=verification, seconds=round(time.perf_counter() - start, 3), notes=tuple(notes))
        _finish(tmp, report, REPORT_FILE)
    return report


# ----------------------------------------------------------------------------------------------
# Inject
# ----------------------------------------------------------------------------------------------

def _read_backbone(backbone: Path, plan: Plan, vlm: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Check the backbone against the plan; return its tensors and aliases {needed: stored}."""
    raw = json.loads((backbone / "config.json").read_text(encoding="utf-8"))
    want_type = plan.target_config.model_type
    if raw.get("model_type") != want_type:
        raise UserError(f"{backbone}: backbone model type {raw.get('model_type')!r} does not match the VLM's language model ({want_type!r})",
                        f"pass a {plan.target_class} backbone extracted from (or merged with) this VLM")
    tensors = read_checkpoint(backbone)
    needed = [t for u in plan.units for t in u.targets]
    alias: dict[str, str] = {}
    missing = []
    for t in needed:
        if t in tensors:
            continue
        if t == plan.head and raw.get("tie_word_embeddings") and plan.head_source in tensors:
            alias[t] = plan.head_source  # the backbone ties its head: the VLM's stored head is the embedding
        else:
            missing.append(t)
    extra = sorted(set(tensors) - set(needed))
    if plan.tied and extra == [plan.head]:
        extra = []  # checked against the embedding when written
    if missing or extra:
        parts = ([f"missing {len(missing)}: {', '.join(missing[:4])}"] if missing else []) + (
            [f"not in the VLM {len(extra)}: {', '.join(extra[:4])}"] if extra else [])
        raise UserError(f"{backbone}: backbone tensors do not match the VLM's language model ({'; '.join(parts)})",
                        f"pass a backbone with the architecture of {vlm}'s language model")
    for t in needed:
        have = tensors[alias.get(t, t)].shape
        if have != plan.expected[t]:
            raise UserError(f"{backbone}: {t} has shape {list(have)}, the VLM's language model has {list(plan.expected[t])}",
                            "pass a backbone of the same size (layers, hidden size, vocabulary) as the VLM's language model")
    return tensors, alias


def inject_backbone(backbone_path: str | Path, vlm_path: str | Path, out_dir: str | Path, *, verify: bool = True, force: bool = False,
                    family: Family | None = None, progress: bool = False) -> ExtractionReport:
    """Write a copy of the VLM at `out_dir` whose language model is the given backbone.

    Every VLM file except the weights is copied; the weights keep the VLM's shard layout,
    tensor names and dtypes (backbone tensors are cast to the VLM's dtype), and vision tensors
    are copied unchanged. Verified like `extract_backbone`: the new VLM's text path on the probe
    must give the backbone's logits.
    """
    start = time.perf_counter()
    out = Path(out_dir).expanduser()
    check_output_dir(out, force, "OUT_DIR")
    vlm = check_model_folder(vlm_path, "VLM")
    backbone = check_model_folder(backbone_path, "backbone")
    raw_config = json.loads((vlm / "config.json").read_text(encoding="utf-8"))
    fam = family or family_for(raw_config, vlm)
    tensors = read_checkpoint(vlm)
    plan = make_plan(vlm, tensors, fam)
    bb_tensors, alias = _read_backbone(backbone, plan, vlm)
    unit_of = {s: u for u in plan.units for s in u.sources}
    vlm_reader, bb_reader = _Reader(vlm, tensors), _Reader(backbone, bb_tensors)
    cache: dict[str, torch.Tensor] = {}

    def produce(name: str) -> torch.Tensor:
        if name not in unit_of:
            return vlm_reader.get(name)
        if name not in cache:
            unit = unit_of[name]
            targets = [bb_reader.get(alias.get(t, t)) for t in unit.targets]
            rest = None
            if unit.rule.drop_rest:
                _, rest = forward_rule(unit.rule, [vlm_reader.get(s) for s in unit.sources], [plan.expected[t] for t in unit.targets])
            rebuilt = inverse_rule(unit.rule, targets, [tensors[s].shape for s in unit.sources], rest)
            for s, x in zip(unit.sources, rebuilt):
                cache[s] = x.to(_ST_DTYPES[tensors[s].dtype]).contiguous()
        return cache.pop(name)

    if plan.tied and plan.head in bb_tensors:
        if not torch.equal(bb_reader.get(plan.head), bb_reader.get(plan.head_source)):
            raise UserError(f"{backbone}: the backbone's output head differs from its embeddings, but the VLM ties them",
                            "the VLM cannot store an untied head; merge with tied embeddings")
    files = sorted({t.file for t in tensors.values()})
    by_file = {f: sorted(n for n, t in tensors.items() if t.file == f) for f in files}
    with staged_dir(out, force=force) as tmp:
        for item in sorted(vlm.iterdir()):
            if item.name.endswith(".safetensors") or item.name in (INDEX_FILE, *_MARKER_FILES):
                continue
            if item.is_dir():
                shutil.copytree(item, tmp / item.name)
            else:
                shutil.copy2(item, tmp / item.name)
        bar = _progress(len(tensors), "inject", progress)
        meta = {"format": "pt", "lm_eval_sink": "inject", "source_family": fam.name}
        try:
            for f in files:
                entries = [(n, _ST_DTYPES[tensors[n].dtype], tensors[n].shape) for n in by_file[f]]
                writer = _ShardWriter(tmp / f, entries, meta)
                for n in by_file[f]:
                    writer.write(n, produce(n))
                    bar.update(1)
                writer.close()
                vlm_reader.keep_only(set())
        finally:
            vlm_reader.close()
            bb_reader.close()
            bar.close()
        total = sum(t.nbytes for t in tensors.values())
        if len(files) > 1 or (vlm / INDEX_FILE).is_file():
            atomic_write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": {n: t.file for n, t in sorted(tensors.items())}})
        vlm_dtype = _out_dtype("keep", tensors, plan.units)
        verification = None
        if verify:
            vlm_config, _ = _vlm_text_config(fam, vlm)
            ids = probe_ids(vlm, int(plan.target_config.vocab_size), _multimodal_token_ids(vlm_config))
            verification = verify_pair(tmp, fam.vlm_class, backbone, vlm_dtype, ids, quiet=not progress)
        report = ExtractionReport(
            operation="inject", status=_status(verification), output=str(out.resolve()), vlm=_fingerprint(vlm), backbone=_fingerprint(backbone),
            family=fam.name, variant=plan.variant.name, architecture_file=fam.file, architecture_sha256=fam.sha256,
            source_class=plan.source_class, target_class=plan.target_class, target_model_type=plan.target_config.model_type,
            dtype=str(vlm_dtype).removeprefix("torch."), tied_embeddings=plan.tied, tensors_written=len(tensors), bytes_written=total,
            shards=tuple(files), tensors_ignored=len(plan.ignored), dropped_rows={}, dropped_config_keys=plan.dropped_config_keys,
            tokenizer=any((vlm / n).is_file() for n in _TOKENIZER_FILES), chat_template_source=None,
            mapping=tuple({"from": list(u.targets), "to": list(u.sources)} for u in plan.units),
            verification=verification, seconds=round(time.perf_counter() - start, 3),
            notes=(f"language tensors from {backbone}, vision tensors and every other file from {vlm}",))
        _finish(tmp, report, INJECT_REPORT_FILE)
    return report
