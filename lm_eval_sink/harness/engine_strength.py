"""Sink Strength on the vLLM engine that lm-eval builds: decided before it is built, measured by its request method.

`decide` asks the one decision (`engine_decision.s_refusal`); where it allows, lm-eval's `VLLM` gets the request
method and its engine this project's worker extension (`engine_builder`), else the child measures S first
(`measure_first.py`). docs/lm-eval.md. Importing this module imports neither torch, vLLM nor lm-eval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from lm_eval_sink.harness.engine_decision import s_refusal, workers_refusal
from lm_eval_sink.harness.engine_worker import WORKER_EXTENSION

CAPTURED_WITH = "vLLM's attention layers: query and key as each layer receives them (harness/engine_capture.py)"
REQUEST_READS = ("model", "tokenizer", "lora_request")  # what `vllm_sink_strength` reads, set in VLLM.__init__
_RECORDS: dict[str, dict[str, Any]] = {}  # task name -> its capture record in the task's metadata (this call's)


def is_lm_eval_vllm(cls: type | None) -> bool:
    """Whether `cls` is lm-eval's `--model vllm` class itself (not a subclass such as vllm-vlm)."""
    return cls is not None and cls.__module__ == "lm_eval.models.vllm_causallms" and cls.__name__ == "VLLM"


def gpu_major() -> int | None:
    """The compute capability major of the first visible GPU, which decides vLLM's default attention backend; None
    without one. vLLM's platform reads it through NVML (no CUDA context before the engine starts); without vLLM
    (the sweep's interpreter), torch's."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        import torch

        return int(torch.cuda.get_device_capability(0)[0]) if torch.cuda.is_available() else None
    capability = current_platform.get_device_capability() if current_platform.is_cuda() else None
    return None if capability is None else int(capability.major)


def read_config(model_args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config.json of `pretrained` at `revision` (a folder, or a hub repo through the HF cache), read without
    running any code of the model's; None where it cannot be read."""
    from transformers import PretrainedConfig

    revision = model_args.get("revision") or None
    try:
        config, _ = PretrainedConfig.get_config_dict(str(model_args["pretrained"]), revision=revision)
    except (OSError, ValueError, KeyError):
        return None
    return config


def decide(model_class: type | None, model_args: Mapping[str, Any]) -> str | None:
    """None where S is measured on the engine lm-eval will build for `model_args` (`engine_decision.s_refusal`),
    lm-eval's `VLLM` then carrying the request method; else why not."""
    if not is_lm_eval_vllm(model_class):
        return "the engine path is lm-eval's --model vllm's only"
    import lm_eval.models.vllm_causallms as module

    from lm_eval_sink.harness.patching import add_method, engine_target_problem
    from lm_eval_sink.harness.task import REQUEST_TYPE, _instance_mismatch

    if getattr(model_class, "get_model_info", _model_info) is _model_info:
        add_method(model_class, "get_model_info", _model_info)
    target = engine_target_problem(module, REQUEST_READS)
    why = s_refusal(read_config(model_args), model_args, gpu_major())
    why = why or (None if target is None else f"lm-eval's vllm_causallms {target}")
    if why is None and not add_method(model_class, REQUEST_TYPE, vllm_sink_strength, more=_instance_mismatch):
        return "lm-eval's vLLM model class was left as installed (see the lm-eval-sink warning above)"
    return why


@contextlib.contextmanager
def engine_builder(build: Callable[..., Any] | None = None) -> Iterator[None]:
    """Within the block lm-eval's vLLM model builds its engine as `build(LLM, **arguments)` (default: `LLM` with this
    project's worker extension): docs/footguns.md. Inside another builder's block (the resident engine's) it stays."""
    import lm_eval.models.vllm_causallms as module

    real = module.LLM
    if getattr(real, "_lm_eval_sink_builder", False):
        yield
        return

    def builder(**arguments: Any) -> Any:
        if build is not None:
            return build(real, **arguments)
        return real(**{**arguments, "worker_extension_cls": WORKER_EXTENSION})

    builder._lm_eval_sink_builder = True  # type: ignore[attr-defined]
    module.LLM = builder
    try:
        yield
    finally:
        module.LLM = real


def fallback_line(tasks: Sequence[str], why: str) -> str:
    """The one line of a `--model vllm` call whose S is measured by the transformers child instead of the engine."""
    return (
        f"lm-eval-sink: S of {', '.join(tasks)} is measured with transformers in a child process before the vLLM "
        f"engine starts, not on the engine: {why}"
    )


# --- on the built engine --------------------------------------------------------------------------------------------


def engine_captures(
    llm: Any, encoded: Any, settings: Any, lora_request: Any = None
) -> tuple[list[Any], int, tuple[int, ...]]:
    """(`capture.PromptCapture` per prompt, depth, attention layers): the `calibration.EncodedPrompts` measured on the
    engine `llm` over the settings' last K attention layers (depth and layers read as `strength.measure` reads them)."""
    from lm_eval_sink.capture import attention_layers_from_config
    from lm_eval_sink.harness.engine_capture import measure_on_engine

    config = llm.llm_engine.vllm_config.model_config.hf_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = int(text.num_hidden_layers)
    att = attention_layers_from_config(config) or tuple(range(depth))
    return measure_on_engine(llm, encoded, settings.layers_for(att), settings.query_chunk, lora_request), depth, att


def engine_record(llm: Any, lora_request: Any = None) -> dict[str, Any]:
    """How S is measured on the engine `llm`, for a task's metadata or a strength unit's provenance."""
    from importlib.metadata import version

    import torch
    import transformers

    config = llm.llm_engine.vllm_config
    return {
        "capture_backend": "vllm",
        "process": "lm-eval's vLLM engine, in its own forward",
        "vllm": version("vllm"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "quantization": config.model_config.quantization,
        "kv_cache_dtype": str(config.cache_config.cache_dtype),
        "lora": getattr(lora_request, "lora_path", None),
        "tensor_parallel_size": int(config.parallel_config.tensor_parallel_size),
        "weights": (
            "the engine's S is that of the weights the engine runs: its dtype, a quantized checkpoint's own "
            "quantization and its LoRA, as lm-eval's requests run them"
        ),
        "captured_with": CAPTURED_WITH,
    }


def engine_records(lm: Any, tasks: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each task's capture record on lm-eval's vLLM model `lm`, checked before any request runs: an engine without
    the capture, or one whose workers refuse it, is one line."""
    from lm_eval_sink.harness.backends import backend_label, unsupported
    from lm_eval_sink.harness.engine_capture import EngineCaptureRefused, _has_extension

    llm = getattr(lm, "model", None)
    if not is_lm_eval_vllm(type(lm)) or llm is None or not _has_extension(llm):
        raise unsupported(tasks[0], backend_label(type(lm)))
    refused = workers_refusal(llm)
    if refused:
        raise EngineCaptureRefused(refused)
    record = engine_record(llm, getattr(lm, "lora_request", None))
    _RECORDS.update({name: {**record, "wall_seconds": 0.0} for name in tasks})
    return {name: _RECORDS[name] for name in tasks}


def vllm_sink_strength(self: Any, requests: list[Any]) -> list[Any]:
    """lm-eval's VLLM method for `sink_strength` requests: the rows measured first where the child measured them,
    else each task's prompts measured on the engine (a copy of a request, as lm-eval pads, measured once)."""
    from lm_eval_sink.harness.task import PromptRows, _by_task, _measured_sink_strength, measured_task, rows_per_task

    if all(measured_task(task) is not None for task in _by_task(requests)):
        return _measured_sink_strength(self, requests)

    def measure(task: str, settings: Any, prompts: list[tuple[int, str]]) -> list[Any]:
        from lm_eval_sink.calibration import encode_prompts

        start = time.perf_counter()
        texts = [p for _, p in prompts]
        encoded = encode_prompts(self.tokenizer, texts, settings.use_chat_template, settings.system_prompt)
        captures, depth, att = engine_captures(self.model, encoded, settings, self.lora_request)
        record = _RECORDS.get(task)
        if record is not None:
            record["wall_seconds"] = round(record["wall_seconds"] + time.perf_counter() - start, 3)
        applied, template = encoded.chat_template_applied, encoded.chat_template_sha256
        return [
            PromptRows.build(pid, c, settings, depth, att, applied, template)
            for (pid, _), c in zip(prompts, captures, strict=True)
        ]

    return rows_per_task(requests, measure)


def _model_info(self: Any) -> dict[str, Any]:
    """lm-eval's VLLM `get_model_info` where it has none: the results' `config.model_dtype` names the dtype its engine
    ran in, as `--model hf`'s does (`protocols` reads it: vLLM runs a float32 checkpoint in bfloat16)."""
    llm = getattr(self, "model", None)
    return {} if llm is None else {"model_dtype": str(llm.llm_engine.vllm_config.model_config.dtype)}


def measure_strength(llm: Any, tokenizer: Any, settings: Any, provenance: dict[str, Any]) -> Any:
    """`strength.measure` on the engine `llm` (the resident engine's strength: units): the settings' calibration
    prompts, captured in the engine's forward, reduced as `strength.measure` reduces them."""
    from dataclasses import replace

    from lm_eval_sink.calibration import encoded_prompts
    from lm_eval_sink.strength import measured_provenance, reduce_captures, warn_beyond_window

    prompt_set, encoded = encoded_prompts(tokenizer, settings)
    captures, depth, att = engine_captures(llm, encoded, settings)
    result = reduce_captures(captures, settings, depth, att)
    warn_beyond_window(result)
    record = engine_record(llm)
    fields = {"dtype": record["dtype"], "captured_with": CAPTURED_WITH, "capture": record}
    return replace(result, provenance=measured_provenance(settings, prompt_set, encoded, provenance, fields))
