"""Sink Strength from a vLLM engine's own forward: a worker extension that reads each attention layer's query and key.

`SinkCaptureMixin` wraps each measured layer's `impl.forward` while armed and reduces the prefill's query and key
with capture.py's row math; `measure_on_engine` sends each prompt alone and checks each forward is one whole
prefill. How and why, and the figures: docs/sink-strength.md ("S inside a vLLM engine").
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from lm_eval_sink.calibration import DEFAULT_QUERY_CHUNK, EncodedPrompts
from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.engine_decision import READABLE_BACKENDS, SWITCH

CACHE_SALT = "lm_eval_sink-sink-strength"  # the measured prompts' KV blocks are reachable by no other request
# What the wrapper of `impl.forward` reads of vLLM's call, by position: an implementation whose parameters begin
# otherwise is refused (docs/footguns.md), since it would give statistics of the wrong tensors without an error.
FORWARD_PARAMETERS = ("layer", "query", "key", "value", "kv_cache", "attn_metadata")


class EngineCaptureRefused(UserError):
    """The engine cannot measure S exactly here; `reason` says why (the transformers child measures it instead)."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"S cannot be measured in the vLLM engine: {reason}",
            f"measure S with transformers: set {SWITCH}=0 (under --model vllm a child process measures it before the "
            "engine starts), or run lm-eval-sink strength on the checkpoint",
        )
        self.reason = reason


# --- in the workers ----------------------------------------------------------------------------------------------


def _pack(array: Any) -> dict[str, Any]:
    """A numpy array as msgpack-native values (vLLM's default serializer decodes no arrays in utility results)."""
    return {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}


def _unpack(packed: Mapping[str, Any]) -> Any:
    import numpy as np

    return np.frombuffer(packed["data"], dtype=np.dtype(packed["dtype"])).reshape(packed["shape"]).copy()


def forward_mismatch(impl: Any) -> str | None:
    """Why the class of an attention `impl` has no `forward(self, layer, query, key, value, kv_cache, attn_metadata,
    ...)` the wrapper was written for (None when it has: `patching.mismatch` on its parameters)."""
    from lm_eval_sink.harness.patching import mismatch

    why = mismatch(getattr(type(impl), "forward", None), ("self", *FORWARD_PARAMETERS))
    return None if why is None else f"{type(impl).__name__}.forward {why}"


def _layer_refusal(name: str, layer: Any) -> str | None:
    """Why an attention layer of the built engine is not one whose statistics the capture reproduces."""
    from vllm.model_executor.layers.attention import Attention

    impl = getattr(layer, "impl", None)
    if type(layer) is not Attention:
        return f"{name} is a {type(layer).__name__}, not vLLM's plain softmax Attention"
    signature, backend = forward_mismatch(impl), layer.attn_backend.get_name()
    checks = (
        (signature is not None, signature),
        (layer.attn_type != "decoder", f"{getattr(layer.attn_type, 'value', layer.attn_type)} attention"),
        (getattr(impl, "alibi_slopes", None) is not None, "ALiBi position biases"),
        (getattr(impl, "sinks", None) is not None, "learned attention sinks"),
        (layer.kv_sharing_target_layer_name is not None, "keys shared from another layer"),
        (str(layer.kv_cache_dtype) != "auto", f"a {layer.kv_cache_dtype} KV cache"),
        (
            backend not in READABLE_BACKENDS,
            f"vLLM's {backend} attention, whose metadata the capture cannot read",
        ),
        (not isinstance(getattr(impl, "scale", None), float), f"an implementation without a scale ({type(impl)})"),
    )
    found = [what for bad, what in checks if bad]
    return f"{name}: {found[0]}" if found else None


class _Armed:
    """One measurement's state in a worker: the wrapped layers and what their prefills gave."""

    def __init__(self, query_chunk: int) -> None:
        self.query_chunk = query_chunk
        self.restore: list[tuple[Any, Any]] = []  # (impl, its own `forward` instance attribute or None)
        self.records: dict[int, list[tuple[Any, ...]]] = {}  # layer -> per prefill (length, logodds, pos, mass, vis)
        self.errors: list[str] = []

    def record(self, index: int, layer: Any, query: Any, key: Any, metadata: Any) -> None:
        """Reduce one layer's prefill to per-row statistics; a forward that is no single whole prefill is an error."""
        starts, lengths = getattr(metadata, "query_start_loc", None), getattr(metadata, "seq_lens", None)
        if starts is None or lengths is None:
            self.errors.append(f"layer {index}: attention metadata {type(metadata).__name__} has no query_start_loc")
            return
        starts, lengths = [int(x) for x in starts.tolist()], [int(x) for x in lengths.tolist()]
        queries = [b - a for a, b in itertools.pairwise(starts)][: len(lengths)]
        if all(q == 1 and s > 1 for q, s in zip(queries, lengths, strict=False)):
            return  # decoding only: no prefill to measure
        if len(lengths) != 1 or queries[0] != lengths[0]:
            self.errors.append(
                f"layer {index}: a forward of {len(lengths)} request(s) with {queries} new of {lengths} tokens while "
                "measuring (the measured prompt must be one request's whole prefill)"
            )
            return
        self.records.setdefault(index, []).append(_prefill_stats(layer, query, key, starts, self.query_chunk))


def _prefill_stats(layer: Any, query: Any, key: Any, starts: list[int], chunk: int) -> tuple[Any, ...]:
    """(length, sink log-odds, sink key, pos0 mass, pos0 visible) of one whole prefill, rows 1..T-1, as capture.py
    computes them, in float32 on the data's device (numpy on the CPU out)."""
    import torch

    from lm_eval_sink.capture import _AttentionCall, _row_stats

    impl, rows = layer.impl, slice(starts[0], starts[1])
    q = query[rows].view(-1, layer.num_heads, layer.head_size).transpose(0, 1)[None]  # [1, heads, T, d]
    k = key[rows].view(-1, layer.num_kv_heads, layer.head_size).transpose(0, 1)[None]  # [1, kv heads, T, d]
    softcap = float(impl.logits_soft_cap) if getattr(impl, "logits_soft_cap", None) else None
    call = _AttentionCall(q, k, None, impl.scale, softcap, None, layer.sliding_window)
    first = torch.zeros(1, dtype=torch.long, device=q.device)
    logodds, pos, mass, _, visible = _row_stats(call, first, None, chunk)
    return (
        q.shape[2],
        logodds[0, :, 1:].numpy(),
        pos[0, :, 1:].numpy().astype("int32"),
        mass[0, :, 1:].numpy(),
        visible[0, 1:].numpy(),
    )


def _wrap(impl: Any, index: int, layer: Any, armed: _Armed) -> None:
    """Make `impl.forward` (an instance attribute shadowing the class's) record the layer's prefills after running
    the original, unchanged; `armed.restore` remembers what to put back."""
    original = impl.forward
    armed.restore.append((impl, impl.__dict__.get("forward")))

    def forward(layer_arg, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        out = original(layer_arg, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        if attn_metadata is not None:  # profiling and warm-up runs have no metadata
            try:
                armed.record(index, layer, query, key, attn_metadata)
            except Exception as e:  # the engine must go on: the driver refuses the measurement
                armed.errors.append(f"layer {index}: {type(e).__name__}: {e}")
        return out

    impl.forward = forward


class SinkCaptureMixin:
    """vLLM worker extension (`LLM(..., worker_extension_cls="lm_eval_sink.harness.engine_capture.SinkCaptureMixin")`)
    whose methods `measure_on_engine` calls by name through `LLM.collective_rpc`. `self` is vLLM's worker."""

    def sink_capture_layers(self) -> dict[str, Any]:
        """This rank's attention layers {index: query heads here}, why the capture refuses this engine (or None), and
        how many layers' `impl.forward` are wrapped now (0 outside a measurement)."""
        from vllm.config import CUDAGraphMode
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.models.utils import extract_layer_index

        found, refusal = {}, None
        for name, module in self.model_runner.get_model().named_modules():
            if isinstance(module, AttentionLayerBase):
                refusal = refusal or _layer_refusal(name, module)
                if refusal is None:
                    found[extract_layer_index(module.layer_name)] = (module, module.num_heads)
        mode = self.vllm_config.compilation_config.cudagraph_mode
        if refusal is None and mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
            refusal = "cudagraph_mode FULL replays prefill batches as CUDA graphs, where no layer's Python runs"
        self._sink_capture_found = {i: m for i, (m, _) in found.items()}
        heads = {str(i): h for i, (_, h) in found.items()}
        wrapped = sum("forward" in vars(m.impl) for m in self._sink_capture_found.values())
        rank = {"rank": int(self.rank), "tp_rank": get_tensor_model_parallel_rank()}
        return {**rank, "heads": heads, "refusal": refusal, "wrapped": wrapped}

    def sink_capture_arm(self, layers: list[int], query_chunk: int) -> dict[str, Any]:
        """Wrap the attention of `layers` (those this rank holds) for a measurement; returns `sink_capture_layers`."""
        self.sink_capture_disarm()
        info = self.sink_capture_layers()
        if info["refusal"] is None:
            armed = _Armed(int(query_chunk))
            self._sink_capture_armed = armed  # before any wrap: a wrap that fails half way is undone by disarm
            for index in layers:
                if index in self._sink_capture_found:
                    layer = self._sink_capture_found[index]
                    _wrap(layer.impl, int(index), layer, armed)
        return info

    def sink_capture_collect(self) -> dict[str, Any]:
        """What the armed layers recorded, packed: {"rank", "tp_rank", "errors", "layers": {index: [per prefill]}}."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        armed = getattr(self, "_sink_capture_armed", None)
        if armed is None:
            return {"rank": int(self.rank), "tp_rank": 0, "errors": ["no measurement was armed"], "layers": {}}
        layers = {
            str(i): [[n, *(_pack(a) for a in arrays)] for n, *arrays in prefills]
            for i, prefills in armed.records.items()
        }
        rank = {"rank": int(self.rank), "tp_rank": get_tensor_model_parallel_rank()}
        return {**rank, "errors": armed.errors, "layers": layers}

    def sink_capture_disarm(self) -> None:
        """Put every wrapped `impl.forward` back as it was and drop the recorded statistics."""
        armed = getattr(self, "_sink_capture_armed", None)
        self._sink_capture_armed = None
        for impl, own in reversed(armed.restore if armed else []):
            if own is None:
                impl.__dict__.pop("forward", None)
            else:
                impl.forward = own


# --- in the driver ----------------------------------------------------------------------------------------------


def _has_extension(llm: Any) -> bool:
    """Whether the engine's workers were built with SinkCaptureMixin (or a class inheriting it) as their extension."""
    import importlib

    name = llm.llm_engine.vllm_config.parallel_config.worker_extension_cls or ""
    module, _, attr = name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr) if module else None
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, SinkCaptureMixin)


def _check_prompts(llm: Any, encoded: EncodedPrompts, layers: Sequence[int]) -> None:
    """Refuse, before the engine runs anything, an engine without the extension, and prompts that chunked prefill
    would split or the context cannot hold."""
    if not layers:
        raise UserError("no layers to measure", "pass the indices of the attention layers to measure")
    if not _has_extension(llm):
        raise EngineCaptureRefused(
            "the engine was built without worker_extension_cls=lm_eval_sink.harness.engine_capture.SinkCaptureMixin "
            "(or a class inheriting it)"
        )
    config = llm.llm_engine.vllm_config
    batched, context = int(config.scheduler_config.max_num_batched_tokens), int(config.model_config.max_model_len)
    longest = max(len(ids) for ids in encoded.input_ids)
    if longest > batched:
        raise EngineCaptureRefused(
            f"a calibration prompt has {longest} tokens, more than the engine's max_num_batched_tokens {batched}: "
            "chunked prefill would split it, so no layer call would see its whole key"
        )
    if longest >= context:
        raise EngineCaptureRefused(f"a calibration prompt has {longest} tokens, the engine's max_model_len {context}")


def _run_prompts(llm: Any, encoded: EncodedPrompts, lora_request: Any) -> None:
    """Each prompt alone: one greedy token, no prefix-cache read, KV blocks under a salt of their own."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, skip_reading_prefix_cache=True, detokenize=False)
    for ids in encoded.input_ids:
        prompt = {"prompt_token_ids": list(ids), "cache_salt": CACHE_SALT}
        llm.generate([prompt], params, use_tqdm=False, lora_request=lora_request)


def _merge_heads(ranks: list[dict[str, Any]], layer: int, n_prompts: int) -> list[list[Any]]:
    """Per prompt, the layer's (logodds, pos, mass, visible) with every rank's heads concatenated in rank order."""
    import numpy as np

    parts = []
    for rank in sorted((r for r in ranks if str(layer) in r["layers"]), key=lambda r: r["tp_rank"]):
        prefills = rank["layers"][str(layer)]
        if len(prefills) != n_prompts:
            raise EngineCaptureRefused(
                f"rank {rank['rank']} recorded {len(prefills)} prefills of layer {layer} for {n_prompts} prompts"
            )
        parts.append([(n, *(_unpack(a) for a in arrays)) for n, *arrays in prefills])
    if not parts:
        raise EngineCaptureRefused(f"no rank recorded layer {layer}")
    merged = []
    for j in range(n_prompts):
        per_rank = [p[j] for p in parts]
        merged.append(
            [
                *(np.concatenate([r[f] for r in per_rank], axis=0) for f in (1, 2, 3)),
                per_rank[0][4],  # pos0 visibility is the layer's mask: the same on every rank
            ]
        )
    return merged


def _captures(ranks: list[dict[str, Any]], encoded: EncodedPrompts, layers: tuple[int, ...]) -> list[Any]:
    """capture.PromptCapture per prompt from the ranks' packed statistics."""
    import numpy as np

    from lm_eval_sink.capture import PromptCapture, _check_finite

    per_layer = [_merge_heads(ranks, x, len(encoded)) for x in layers]
    out = {}
    for j, ids in enumerate(encoded.input_ids):
        fields = [np.stack([per_layer[li][j][f] for li in range(len(layers))]) for f in range(4)]
        if fields[0].shape[-1] != len(ids) - 1:
            raise EngineCaptureRefused(f"prompt {j}: {fields[0].shape[-1] + 1} tokens captured for {len(ids)} sent")
        out[j] = PromptCapture(
            layers=layers,
            sink_logodds=fields[0].astype(np.float32),
            sink_pos=fields[1].astype(np.int64),
            pos0_mass=fields[2].astype(np.float32),
            content=np.asarray(encoded.content_mask[j][1:], dtype=bool),
            learned_sink_mass=None,
            pos0_visible=fields[3].astype(bool),
        )
    _check_finite(out, layers)
    return [out[j] for j in range(len(encoded))]


def _checked_heads(llm: Any, infos: list[dict[str, Any]], layers: tuple[int, ...]) -> None:
    """Refuse what a worker refused, a layer no rank holds, or heads that do not add up to the model's."""
    refusals = [i["refusal"] for i in infos if i["refusal"]]
    if refusals:
        raise EngineCaptureRefused(refusals[0])
    total = int(llm.llm_engine.vllm_config.model_config.hf_text_config.num_attention_heads)
    for x in layers:
        heads = {i["tp_rank"]: i["heads"][str(x)] for i in infos if str(x) in i["heads"]}
        if not heads:
            raise EngineCaptureRefused(f"layer {x} is no attention layer of the engine's model")
        if sum(heads.values()) != total:
            raise EngineCaptureRefused(f"layer {x}: the ranks hold {sorted(heads.items())} query heads of {total}")


def measure_on_engine(
    llm: Any,
    encoded: EncodedPrompts,
    layers: Sequence[int],
    query_chunk: int = DEFAULT_QUERY_CHUNK,
    lora_request: Any = None,
) -> list[Any]:
    """Per-prompt `capture.PromptCapture`s from the vLLM engine `llm` (built with SinkCaptureMixin as its worker
    extension): each prompt of `encoded` run alone through the engine's forward, the attention of `layers` captured.
    EngineCaptureRefused (a UserError) where the engine cannot measure S exactly; the engine is left as it was."""
    layers = tuple(sorted({int(x) for x in layers}))
    _check_prompts(llm, encoded, layers)
    try:
        infos = llm.collective_rpc("sink_capture_arm", args=(list(layers), int(query_chunk)))
        _checked_heads(llm, infos, layers)
        _run_prompts(llm, encoded, lora_request)
        ranks = llm.collective_rpc("sink_capture_collect")
    finally:
        llm.collective_rpc("sink_capture_disarm")
    errors = [e for r in ranks for e in r["errors"]]
    if errors:
        raise EngineCaptureRefused(errors[0])
    return _captures(ranks, encoded, layers)
