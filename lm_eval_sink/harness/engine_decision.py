"""Whether Sink Strength is measured on a vLLM engine: one table of what rules an engine out, one function.

Every caller asks `s_refusal` (lm-eval's `--model vllm` call, a resident sweep's eval and `strength:` units, the
built engine through `built_refusal`); None: S in the engine's forward, else the one-line reason and the named
fallback (transformers). `RULES`: vLLM 0.32's engine arguments that change the forward. Pure. docs/lm-eval.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SWITCH = "LM_EVAL_SINK_S_ON_ENGINE"  # 0: S with transformers wherever it would be measured on a vLLM engine
WORKER_EXTENSION = "lm_eval_sink.harness.engine_worker.EngineWorkerExtension"  # the capture, in every engine's workers
# The architectures whose engine statistics are tested equal to transformers' eager capture (docs/sink-strength.md).
VERIFIED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
# vLLM 0.32's attention backends whose metadata tells a whole prefill (`query_start_loc`, `seq_lens`; not FlashInfer,
# the default on compute capability 10.x): docs/sink-strength.md.
READABLE_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION")
_SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention")
_UNSET = ("", "none", "auto")
_ONE = ("", "none", "1")
_OFF = ("", "none", "0", "false")
_AS_STORED = (*_UNSET, "hf", "pt", "safetensors", "fastsafetensors", "npcache")  # load_format: the files as stored
_OTHER_WEIGHTS = "the engine runs other weights than the checkpoint's"
_SPECULATIVE = "speculative decoding: a draft model's forwards run between the checkpoint's"


@dataclass(frozen=True)
class Rule:
    """An engine argument that rules the engine out unless its value (as lowercase text) is one of `keeps`."""

    argument: str
    changes: str  # what the argument does to the forward, in words
    keeps: tuple[str, ...] = _UNSET
    units_only: bool = False  # only for S measured as `strength` measures it: the checkpoint's own tokenizer


RULES = (
    Rule("quantization", f"quantizes the weights as they load: {_OTHER_WEIGHTS}"),
    Rule("quantization_config", f"quantizes the weights as they load: {_OTHER_WEIGHTS}"),
    Rule("load_format", f"loads the weights otherwise than as stored: {_OTHER_WEIGHTS}", _AS_STORED),
    Rule("model_weights", f"loads weights from another path: {_OTHER_WEIGHTS}"),
    Rule("hf_overrides", "overrides the checkpoint's config.json: the engine runs another model"),
    Rule("hf_config_path", "reads another config.json than the checkpoint's: the engine runs another model"),
    Rule("model_class_overrides", "runs another model class than the checkpoint's"),
    Rule("model_impl", "runs another implementation than vLLM's own, not verified for the capture", (*_UNSET, "vllm")),
    Rule("convert", "converts the model for another task", (*_UNSET, "none")),
    Rule("kv_cache_dtype", "a quantized KV cache: the engine attends the cached keys, which differ from the layer's"),
    Rule("disable_sliding_window", "attends past the sliding windows the checkpoint's config sets", _OFF),
    *(Rule(a, _SPECULATIVE) for a in ("speculative_config", "spec_method", "spec_model")),
    Rule("worker_cls", "another worker class runs the forward"),
    Rule("data_parallel_size", "lm-eval runs the engines in Ray actors, not in its own process", _ONE),
    Rule("pipeline_parallel_size", "pipeline parallelism is not verified for the engine's capture", _ONE),
    Rule("prefill_context_parallel_size", "context parallelism splits each prompt's keys over ranks", _ONE),
    Rule("decode_context_parallel_size", "context parallelism splits each prompt's keys over ranks", _ONE),
    Rule("tokenizer", "the engine encodes with another tokenizer than the checkpoint's own", units_only=True),
    Rule("tokenizer_mode", "the engine encodes otherwise than the checkpoint's tokenizer", (*_UNSET, "hf"), True),
)


def _text(value: Any) -> str:
    """An argument's value as the rules compare it: lowercase text, "" for an empty one."""
    return "" if value is None or value == {} or value == [] else str(getattr(value, "name", value)).strip().lower()


def _as_dict(config: Any) -> dict[str, Any]:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _architecture_refusal(config: dict[str, Any]) -> str | None:
    """Why the checkpoint's architecture is not measured in the engine, from its config.json alone."""
    text = config.get("text_config")
    text = _as_dict(text) if text else config
    arch = (config.get("architectures") or [config.get("model_type", "unknown")])[0]
    if config.get("is_encoder_decoder"):
        return f"{arch} is an encoder-decoder model (its cross-attention has no causal sink)"
    if any(text.get(k) is not None for k in ("kv_lora_rank", "q_lora_rank")):
        return (
            f"{arch} uses multi-head latent attention (MLA): the engine's MLA layers attend a compressed latent, "
            "not per-head keys"
        )
    other = sorted(set(text.get("layer_types") or ()) - set(_SOFTMAX_LAYER_TYPES))
    if other:
        return (
            f"{arch} has layers of type {', '.join(other)}: linear attention, state-space or indexed layers, which "
            "are no full or sliding softmax attention"
        )
    if arch not in VERIFIED_ARCHITECTURES:
        return (
            f"{arch}: the engine's statistics are verified against transformers' eager capture for "
            f"{', '.join(VERIFIED_ARCHITECTURES)} only"
        )
    return None


def _rule_refusal(config: dict[str, Any], args: Mapping[str, Any], units: bool) -> str | None:
    """The first of `RULES` that `args` break (a `quantization=` naming the checkpoint's own method keeps it)."""
    own = _text((config.get("quantization_config") or {}).get("quant_method"))
    for rule in RULES:
        value = _text(args.get(rule.argument))
        kept = value in rule.keeps or (rule.argument == "quantization" and value == own)
        if not kept and (units or not rule.units_only):
            return f"model_args {rule.argument}={args[rule.argument]}: {rule.changes}"
    return None


def _full_graphs_for_prefills(args: Mapping[str, Any]) -> bool:
    """Whether `compilation_config` (a dict, a JSON string, or vLLM's object) asks for full CUDA graphs of prefill
    batches: `cudagraph_mode` FULL, or piecewise graphs with no splitting op (which vLLM turns into FULL)."""
    cc = args.get("compilation_config")
    if isinstance(cc, str) and cc.strip().startswith("{"):
        cc = json.loads(cc)
    field = cc.get if isinstance(cc, Mapping) else lambda name: getattr(cc, name, None)
    mode = field("cudagraph_mode")
    mode = None if mode is None else str(getattr(mode, "name", mode)).upper()
    return mode == "FULL" or (field("splitting_ops") == [] and mode in (None, "FULL_AND_PIECEWISE"))


def _engine_refusal(config: dict[str, Any], args: Mapping[str, Any], gpu: int | None) -> str | None:
    """What no one argument decides: the checkpoint's own quantized KV cache, full CUDA graphs (with `enforce_eager`),
    the attention backend (named, else vLLM's default on the GPU), a worker extension of the user's."""
    from lm_eval_sink.harness.model_args import model_arg_flag

    if (config.get("quantization_config") or {}).get("kv_cache_scheme"):
        return "a quantized KV cache (fp8 from the checkpoint's quantization_config): the engine attends cached keys"
    if _full_graphs_for_prefills(args) and not model_arg_flag(args.get("enforce_eager", False)):
        return (
            "cudagraph_mode FULL replays prefill batches as CUDA graphs, where the attention layer's Python never "
            "runs (vLLM's default FULL_AND_PIECEWISE with its splitting ops, or enforce_eager, runs them eagerly)"
        )
    given = args.get("attention_backend") or (args.get("attention_config") or {}).get("backend")
    given = None if given is None else str(getattr(given, "name", given)).upper()
    if given is not None and given not in READABLE_BACKENDS:
        return f"attention_backend {given}: its attention metadata holds no per-request query_start_loc and seq_lens"
    if given is None and gpu == 10:
        return (
            "on a compute capability 10.x GPU vLLM runs FlashInfer attention by default, whose metadata holds no "
            "per-request query_start_loc and seq_lens (attention_backend=FLASH_ATTN in the model_args keeps S on "
            "the engine)"
        )
    own = args.get("worker_extension_cls")
    if own not in (None, "", WORKER_EXTENSION):
        return (
            f"model_args worker_extension_cls={own} is your own, and vLLM takes one worker extension (this project's, "
            f"{WORKER_EXTENSION}, measures S)"
        )
    return None


def _dtype_refusal(engine: Any, unit: Any) -> str | None:
    """Why a `strength:` unit in dtype `unit` is not measured on an engine asked for dtype `engine`."""
    from lm_eval_sink.harness.measure_first import DTYPES

    engine, unit = (DTYPES.get(str(d or "auto"), str(d)) for d in (engine, unit))
    if unit == engine == "auto":
        return (
            "strength.dtype and the engine's dtype are both auto, which vLLM and transformers resolve differently "
            "(vLLM runs a float32 checkpoint in bfloat16)"
        )
    return None if unit == engine else f"strength.dtype {unit} is not the engine's dtype ({engine})"


def s_refusal(
    config: Any, model_args: Mapping[str, Any] | None, gpu: int | None = None, unit_dtype: str | None = None
) -> str | None:
    """Why S is not measured on the vLLM engine built with `model_args` (lm-eval's model arguments as parsed, or
    `LLM(...)`'s) for a checkpoint whose config.json is `config` (a dict or a transformers config; None: unreadable),
    on a GPU of compute capability major `gpu` (None: none, or not known); with `unit_dtype`, for a `strength:` unit
    in that dtype (measured as `strength` measures it). None where it is measured there."""
    if os.environ.get(SWITCH) == "0":
        return f"{SWITCH}=0 is set"
    if config is None:
        return "its config.json could not be read before the engine is built"
    config, args = _as_dict(config), model_args or {}
    return (
        _architecture_refusal(config)
        or _rule_refusal(config, args, unit_dtype is not None)
        or _engine_refusal(config, args, gpu)
        or (None if unit_dtype is None else _dtype_refusal(args.get("dtype"), unit_dtype))
    )


def workers_refusal(llm: Any) -> str | None:
    """What the built engine's workers refuse of its attention layers (`SinkCaptureMixin.sink_capture_layers`)."""
    return next((i["refusal"] for i in llm.collective_rpc("sink_capture_layers") if i["refusal"]), None)


def built_refusal(llm: Any, model_args: Mapping[str, Any], unit_dtype: str | None = None) -> str | None:
    """`s_refusal` on the built engine `llm` (its config and the dtype it runs), then its workers' own check."""
    config = llm.llm_engine.vllm_config.model_config
    dtype = str(config.dtype).removeprefix("torch.")
    return s_refusal(config.hf_config, {**model_args, "dtype": dtype}, None, unit_dtype) or workers_refusal(llm)
