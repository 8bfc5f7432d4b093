"""peft adapters under Sink Strength: how each method is measured, or refused in one line (docs/architectures.md,
'Adapters (peft)').
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter folder: its weights, and its base model named inside
VIRTUAL_ROWS = {"PROMPT_TUNING": True, "P_TUNING": True, "PREFIX_TUNING": False}  # method -> virtual tokens have rows
_ADAPTED_ATTENTION = ("AdaptedAttention", "AdaptedAttentionGPT")  # peft's adaption-prompt wrappers


@dataclass(frozen=True, slots=True)
class VirtualTokens:
    """A prompt-learning adapter's virtual tokens, put before every prompt by the adapter's forward."""

    method: str  # peft_type
    n: int  # virtual tokens before each prompt
    rows: bool  # True: input embeddings (query rows and keys); False: keys and values only (prefix tuning)

    def record(self) -> dict[str, Any]:
        """What a result says of them: which position is the sink's position 0 and which rows count."""
        return {
            "method": self.method,
            "n_virtual_tokens": self.n,
            "as": "input embeddings" if self.rows else "keys and values (past_key_values)",
            "position_0": "the first virtual token (sink positions count from it)",
            "rows": "the prompt's tokens 1..L-1, as without the adapter (virtual tokens' own rows not counted)",
            "keys": "the virtual tokens and the prompt's tokens up to the row",
        }


@dataclass(frozen=True, slots=True)
class Adapted:
    """How the capture runs a model: `module` is switched and read (a transformers model), `forward` runs the
    prompts (peft's model where it puts virtual tokens before them, else `module`)."""

    module: Any
    forward: Any
    virtual: VirtualTokens | None = None


def _refuse_adaption_prompt(where: str) -> UserError:
    return UserError(
        f"{where}: an adaption-prompt adapter (LLaMA-Adapter) adds a second, gated softmax over its own prompt "
        "to each adapted layer's attention, outside the attention Sink Strength is defined on",
        "measure the base model, or an adapter that changes weights (LoRA) or prepends virtual tokens "
        "(prompt tuning, p-tuning, prefix tuning)",
    )


def virtual_tokens(method: str, prompt_learning: bool, n: Any, where: str) -> VirtualTokens | None:
    """The virtual tokens of a peft method (None: a weight adapter); refuses what the capture cannot measure."""
    if method == "ADAPTION_PROMPT":
        raise _refuse_adaption_prompt(where)
    if not prompt_learning:
        return None
    if method not in VIRTUAL_ROWS:
        raise UserError(
            f"{where}: {method} adapters are not measured (prompt-learning methods measured: "
            f"{', '.join(VIRTUAL_ROWS)})",
            "measure the base model, or train a prompt-tuning, p-tuning, prefix-tuning or LoRA adapter",
        )
    return VirtualTokens(method, int(n), VIRTUAL_ROWS[method])


def config_virtual_tokens(config_path: Any, config: dict[str, Any]) -> VirtualTokens | None:
    """`virtual_tokens` of an adapter from its adapter_config.json (`config`, read from `config_path`)."""
    from peft.config import PromptLearningConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    method = str(config.get("peft_type"))
    cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(method)
    if cls is None:
        raise UserError(
            f"{config_path}: peft_type {method!r} is not a method of the installed peft",
            "save the adapter with peft (or upgrade peft to the version that wrote it)",
        )
    prompt_learning = issubclass(cls, PromptLearningConfig)
    return virtual_tokens(method, prompt_learning, config.get("num_virtual_tokens"), str(config_path))


def adapter_config(folder: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """A peft adapter folder's adapter_config.json and its object (None: not an adapter folder)."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        return None
    from lm_eval_sink.io import parse_json, read_text

    again = "save the adapter again with peft (save_pretrained), or copy the folder again"
    data = parse_json(read_text(path, ADAPTER_CONFIG), str(path), again)
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a peft adapter config (a JSON object is expected)", again)
    return path, data


def folder_virtual_tokens(folder: str | Path) -> VirtualTokens | None:
    """`config_virtual_tokens` of a model folder (None: not a peft adapter folder)."""
    found = adapter_config(folder)
    return None if found is None else config_virtual_tokens(*found)


def check_same_keys(folder: str | Path, role: str) -> None:
    """Refuse an adapter with virtual tokens where two models are compared at the same keys (`margin`)."""
    virtual = folder_virtual_tokens(folder)
    if virtual is not None:
        raise UserError(
            f"{role} {folder}: a {virtual.method} adapter puts {virtual.n} virtual tokens before every prompt, keys "
            "the other model does not have, so margins at the reference's sink keys are not defined",
            f"compare Sink Strength instead: lm-eval-sink strength BASE {folder}",
        )


def unwrap_parallel(model: Any) -> Any:
    """Strip DDP-style wrappers (`.module` on a module without a config)."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model


def adapted(model: Any) -> Adapted:
    """How the capture runs `model`: a transformers model as it is, a peft model through its adapted base or,
    with virtual tokens, through its own forward; refuses adaption prompts and unmeasured prompt learning."""
    model = unwrap_parallel(model)
    config = getattr(model, "active_peft_config", None) if hasattr(model, "get_base_model") else None
    if config is None:
        if any(type(m).__name__ in _ADAPTED_ATTENTION for m in model.modules()):
            raise _refuse_adaption_prompt(type(model).__name__)
        return Adapted(model, model)
    method = str(getattr(config.peft_type, "value", config.peft_type))
    where = f"{type(model).__name__} ({method})"
    virtual = virtual_tokens(method, config.is_prompt_learning, getattr(config, "num_virtual_tokens", 0), where)
    base = model.get_base_model()
    return Adapted(base, model if virtual else base, virtual)
