"""Capture attention-sink statistics through transformers' attention interface, one model-agnostic mechanism.

A capturing attention function, registered as `lm_eval_sink_<impl>`, reduces each selected layer's pre-softmax
logits to per-row numbers in float32 (`PromptCapture`), then calls the model's own `<impl>`, so outputs are
bit-identical. Fields, flash/flex masks, learned sinks, adapters: docs/sink-strength.md, docs/architectures.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lm_eval_sink.adapters import Adapted, adapted
from lm_eval_sink.calibration import DEFAULT_QUERY_CHUNK, Batching, EncodedPrompts
from lm_eval_sink.errors import UserError

IMPL_PREFIX = "lm_eval_sink"
VIRTUAL_KEY = -1  # sink_pos of a row whose sink is the learned (virtual) sink key
_NO_FIXED_KEY = -2
_ACTIVE: contextvars.ContextVar[_Collector | None] = contextvars.ContextVar("lm_eval_sink_capture", default=None)


@dataclass(frozen=True, slots=True)
class PromptCapture:
    """Sink statistics of one prompt (fields and shapes: docs/sink-strength.md, "What the capture keeps")."""

    layers: tuple[int, ...]
    sink_logodds: np.ndarray  # [layer, head, query]
    sink_pos: np.ndarray  # [layer, head, query]
    pos0_mass: np.ndarray  # [layer, head, query]
    content: np.ndarray  # [query]
    learned_sink_mass: np.ndarray | None = None  # [layer, head, query]
    pos0_visible: np.ndarray | None = None  # [layer, query]; None: not recorded (older payloads)


@dataclass(slots=True)
class _Collector:
    """Per-batch store that the attention function fills, one layer at a time."""

    layers: set[int]
    first_real: torch.Tensor | None = None  # [batch] index of each row's first real token
    query_chunk: int = DEFAULT_QUERY_CHUNK
    records: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    fixed_keys: dict[int, torch.Tensor] | None = None  # layer -> [batch, head, query] key index, -2 = argmax
    reached: set[int] = field(default_factory=set)  # layers whose attention called the capture


def _allowed_keys(
    attention_mask: Any,
    first_real: torch.Tensor,
    q_len: int,
    k_len: int,
    sliding_window: int | None,
    device: torch.device,
    rows: slice = slice(None),
) -> torch.Tensor:
    """Bool [batch or 1, heads or 1, query rows, key]: True where the key may be attended; a mask that is not 4-D is
    built (docs/architectures.md, "The mask")."""
    if not (isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 4):
        q = torch.arange(q_len, device=device)[rows, None] + (k_len - q_len)
        k = torch.arange(k_len, device=device)[None, :]
        allowed = k <= q
        if sliding_window is not None:
            allowed = allowed & (k > q - int(sliding_window))
        return allowed[None, None] & (k >= first_real.to(device)[:, None, None, None])
    mask = attention_mask[..., -k_len:] if attention_mask.shape[-1] != k_len else attention_mask
    mask = mask[..., rows, :] if mask.shape[-2] != 1 else mask
    if mask.dtype == torch.bool:
        return mask
    # Additive float mask (eager): masked entries hold the dtype's minimum, a finite number.
    return mask > torch.finfo(mask.dtype).min / 2


def _pos0_visible(allowed: torch.Tensor, first_real: torch.Tensor, q_len: int) -> torch.Tensor:
    """Bool [batch, query]: whether each row may attend its prompt's position 0 (first head's mask)."""
    mask = allowed[:, 0].expand(len(first_real), q_len, allowed.shape[-1])
    index = first_real.to(mask.device)[:, None, None].expand(len(first_real), q_len, 1)
    return mask.gather(-1, index).squeeze(-1)


@dataclass(frozen=True, slots=True)
class _AttentionCall:
    """What one layer's attention call hands the capture (None where the layer has none)."""

    query: torch.Tensor
    key: torch.Tensor
    attention_mask: Any
    scaling: float | None
    softcap: float | None
    s_aux: Any
    sliding_window: int | None


def _row_stats(
    call: _AttentionCall, first_real: torch.Tensor, fixed_keys: torch.Tensor | None, chunk: int
) -> tuple[torch.Tensor | None, ...]:
    """Per-row (sink log-odds, sink key: from the first real token or VIRTUAL_KEY, pos0 mass, virtual-key mass or
    None, pos0 visible) on the CPU, each [batch, head, query] ([batch, query] for the last), `chunk` rows at a time;
    `fixed_keys` [batch, head, query]: the sink key of each row where given (else its argmax)."""
    query, key, s_aux = call.query, call.key, call.s_aux
    _, n_heads, q_len, head_dim = query.shape
    k_len, device = key.shape[-2], query.device
    k = key.detach().float()
    if k.shape[1] != n_heads:  # grouped-query attention: each KV head serves n_heads // kv heads
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
    k = k.transpose(-1, -2)
    scale = call.scaling if call.scaling is not None else head_dim**-0.5
    virtual = None
    if s_aux is not None:  # learned sink: a virtual key after the real ones, logit s_aux[h], unmasked and unscaled
        if s_aux.numel() != n_heads:
            raise UserError(
                f"learned sink logits (s_aux) have {s_aux.numel()} values for {n_heads} heads",
                "only one learned sink logit per query head is supported",
            )
        virtual = s_aux.detach().float().to(device).reshape(1, n_heads, 1, 1)
    if fixed_keys is not None and s_aux is None and (fixed_keys == VIRTUAL_KEY).any():
        raise UserError(
            "the reference's sink is its learned (virtual) sink key in "
            f"{int((fixed_keys == VIRTUAL_KEY).sum())} rows, but this model has no learned sinks",
            "compare two models that both have learned attention sinks (e.g. two gpt-oss checkpoints)",
        )
    first = first_real.to(device)
    parts = []
    for begin in range(0, q_len, chunk):
        rows = slice(begin, min(begin + chunk, q_len))
        allowed = _allowed_keys(call.attention_mask, first, q_len, k_len, call.sliding_window, device, rows)
        visible = _pos0_visible(allowed, first, rows.stop - rows.start)
        reach = allowed.flatten(0, -2).any(0).nonzero()  # keys any of these rows may attend: causal, up to the last row
        keys = int(reach.max()) + 1 if len(reach) else 1
        logits = torch.matmul(query[:, :, rows].detach().float(), k[..., :keys]).mul_(scale)
        if call.softcap is not None:
            logits = logits.div_(call.softcap).tanh_().mul_(call.softcap)
        logits.masked_fill_(~allowed[..., :keys], float("-inf"))
        fixed = None if fixed_keys is None else fixed_keys[..., rows].to(device)
        parts.append((*_chunk_stats(logits, virtual, first, fixed), visible))
    return tuple(None if p[0] is None else torch.cat(p, dim=-1).cpu() for p in zip(*parts, strict=True))


def _chunk_stats(
    logits: torch.Tensor, virtual: torch.Tensor | None, first: torch.Tensor, fixed: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """(sink log-odds, sink key, pos0 mass, virtual-key mass or None) of masked logits [batch, head, rows, key],
    which it overwrites: the sink key is masked in place for the logsumexp of the other keys."""
    bsz, n_heads, n_rows, k_len = logits.shape
    if virtual is not None:
        logits = torch.cat([logits, virtual.expand(bsz, n_heads, n_rows, 1)], dim=-1)
    sink_pos = logits.argmax(dim=-1)
    start = first[:, None, None]
    if fixed is not None:
        absolute = torch.where(fixed == VIRTUAL_KEY, k_len, fixed + start)
        sink_pos = torch.where(fixed != _NO_FIXED_KEY, absolute, sink_pos)
    sink_logit = logits.gather(-1, sink_pos[..., None]).squeeze(-1)
    pos0 = start.clamp(max=k_len - 1)[..., None].expand(bsz, n_heads, n_rows, 1)  # clamped: rows of padding only
    pos0_logit = logits.gather(-1, pos0).squeeze(-1)
    others = torch.logsumexp(logits.scatter_(-1, sink_pos[..., None], float("-inf")), dim=-1)
    denominator = torch.logaddexp(sink_logit, others)  # real keys and the virtual one
    virtual_mass = None if virtual is None else torch.exp(virtual[..., 0] - denominator)
    relative = torch.where(sink_pos == k_len, VIRTUAL_KEY, sink_pos - start)  # k_len: the virtual key's index
    return sink_logit - others, relative, torch.exp(pos0_logit - denominator), virtual_mass


def _delegate_fn(module: Any, impl: str):
    """What the model would call itself: its modeling module's interface, eager = its own eager function."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mod = sys.modules[type(module).__module__]
    eager = getattr(mod, "eager_attention_forward", None)
    if impl == "eager" and eager is None:
        raise UserError(
            f"{type(module).__name__}: {mod.__name__} has no eager_attention_forward to delegate to",
            "load the model with attn_implementation='sdpa'",
        )
    return getattr(mod, "ALL_ATTENTION_FUNCTIONS", ALL_ATTENTION_FUNCTIONS).get_interface(impl, eager)


def _make_attention(impl: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        collector = _ACTIVE.get()
        layer = getattr(module, "layer_idx", None)
        if collector is not None:
            collector.reached.add(layer)
            if layer in collector.layers and collector.first_real is not None:
                fixed = collector.fixed_keys[layer] if collector.fixed_keys is not None else None
                window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
                call = _AttentionCall(
                    query, key, attention_mask, scaling, kwargs.get("softcap"), kwargs.get("s_aux"), window
                )
                collector.records[layer] = _row_stats(call, collector.first_real, fixed, collector.query_chunk)
        return _delegate_fn(module, impl)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )

    attention.__name__ = f"{IMPL_PREFIX}_{impl}_attention"
    return attention


def _transformers_changed(what: str) -> UserError:
    import transformers

    return UserError(
        f"transformers {transformers.__version__}: {what}, which the sink capture needs",
        "install the transformers of constraints.txt, the version this project is tested with",
    )


def _register(impl: str) -> str:
    """Register the capture for delegate `impl` (and its mask function) under one name, through transformers'
    registry API (never `_global_mapping`)."""
    from collections.abc import Mapping

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for interface in (AttentionInterface, AttentionMaskInterface):  # checked before anything is registered
        if not (callable(getattr(interface, "register", None)) and isinstance(interface(), Mapping)):
            raise _transformers_changed(f"{interface.__name__} is not a mapping with register()")
    name = f"{IMPL_PREFIX}_{re.sub(r'[^A-Za-z0-9_]', '_', impl)}"  # keeps "sdpa" / "flex_attention" in the name
    if name not in AttentionInterface():
        masks = AttentionMaskInterface()
        AttentionInterface.register(name, _make_attention(impl))
        if impl in masks:  # else the model builds no mask, as for `impl` itself
            AttentionMaskInterface.register(name, masks[impl])
    return name


def text_config_of(config: Any) -> Any:
    """The language model's part of a transformers config (a VLM's text config; any other config itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def n_layers_of(model: Any) -> int:
    return int(text_config_of(model.config).num_hidden_layers)


SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
NON_ATTENTION_LAYER_TYPES = ("conv", "linear_attention", "mamba", "moe")  # no softmax over keys, so no sink


def attention_layers_from_config(config: Any) -> tuple[int, ...] | None:
    """Softmax-attention layer indices from `config.layer_types` (None when it has none): conv / linear-attention /
    Mamba layers are skipped, other types (sparse, indexed, parallel attention+SSM) refused."""
    cfg = text_config_of(config)
    types = getattr(cfg, "layer_types", None)
    if not types:
        return None
    other = sorted({t for t in types if t not in SOFTMAX_LAYER_TYPES + NON_ATTENTION_LAYER_TYPES})
    if other:
        raise UserError(
            f"{cfg.model_type}: layer type(s) {', '.join(other)} are not plain softmax attention, so "
            "Sink Strength is not defined for them",
            "use a model whose attention layers are full, sliding-window or chunked (conv and "
            "linear-attention layers are skipped)",
        )
    layers = tuple(i for i, t in enumerate(types) if t in SOFTMAX_LAYER_TYPES)
    if not layers:
        raise UserError(
            f"{cfg.model_type}: no softmax attention layer (layer types: {', '.join(sorted(set(types)))})",
            "Sink Strength needs attention layers",
        )
    return layers


def attention_layers(model: Any, probe_ids: Sequence[int]) -> tuple[int, ...]:
    """The model's (a peft model's base's) attention layers: from its config, else those a short probe reaches."""
    model = adapted(model).module
    from_config = attention_layers_from_config(model.config)
    if from_config is not None:
        return from_config
    ids = torch.tensor([list(probe_ids)], dtype=torch.long, device=next(model.parameters()).device)
    with sink_capture(model, ()) as collector, _last_position_head(model), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    layers = tuple(sorted(x for x in collector.reached if isinstance(x, int)))
    if not layers:
        raise UserError(
            f"{type(model).__name__}: no layer's attention reached the capture function",
            "this architecture bypasses transformers' attention interface; it is not supported",
        )
    return layers


def check_supported_class(cls: type) -> None:
    """Refuse model classes whose attention does not go through transformers' attention interface."""
    if not getattr(cls, "_supports_attention_backend", False):
        raise UserError(
            f"{cls.__name__} does not route attention through transformers' AttentionInterface, so Sink "
            "Strength cannot be captured",
            "use a model whose class sets _supports_attention_backend (Llama, Mistral, Qwen2, Qwen3, "
            "OLMo2, Gemma 2/3, Phi-3, gpt-oss, ...)",
        )


def attn_implementation_for(cls: type, config: Any = None) -> str:
    """The attention implementation to load `cls` with for Sink Strength: sdpa where the class supports it and
    `config` does not soft-cap attention logits (sdpa's kernel drops soft-capping), else eager."""
    if getattr(text_config_of(config), "attn_logit_softcapping", None) is not None:
        return "eager"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def capture_delegate(impl: str, model: Any) -> str:
    """The implementation the capture hands a model's attention to: its own, or for flash `attn_implementation_for`
    (docs/architectures.md, "Flash attention")."""
    return attn_implementation_for(type(model), model.config) if "flash" in impl else impl


def captured_with(model: Any) -> str:
    """How the capture runs `model`'s attention, for records: `sdpa`, or `sdpa (model: flash_attention_2)`."""
    impl = text_config_of(model.config)._attn_implementation or "eager"
    delegate = capture_delegate(impl, model)
    return impl if delegate == impl else f"{delegate} (model: {impl})"


@contextlib.contextmanager
def sink_capture(model: Any, layers: Sequence[int]) -> Iterator[_Collector]:
    """Switch `model` to the capturing attention of its current implementation for the block; every config's is set
    back directly after, also on a raise (`set_attn_implementation` would load the flash kernel again)."""
    from transformers import PreTrainedModel

    check_supported_class(type(model))
    previous = text_config_of(model.config)._attn_implementation
    impl = previous if previous is not None else "eager"
    if impl.startswith(IMPL_PREFIX):
        raise UserError(
            f"{type(model).__name__} is already inside a sink capture ({impl})", "do not nest sink captures"
        )
    configs = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    for c in configs:  # and their sub-configs at any depth (the list grows while it is walked)
        configs += [getattr(c, k) for k in c.sub_configs if getattr(c, k, None) is not None]
    configs = list({id(c): c for c in configs}.values())
    if not all(hasattr(c, "_attn_implementation_internal") for c in configs):  # what the restore sets back
        raise _transformers_changed("a config without _attn_implementation_internal")
    name = _register(capture_delegate(impl, model))
    saved = [(c, c._attn_implementation_internal) for c in configs]
    collector = _Collector(set(layers))
    token = _ACTIVE.set(collector)
    try:
        model.set_attn_implementation(name)
        yield collector
    finally:
        for config, value in saved:
            config._attn_implementation_internal = value
        _ACTIVE.reset(token)


@contextlib.contextmanager
def _last_position_head(model: Any) -> Iterator[None]:
    """For the block, the output head sees the last position only (docs/architectures.md, "Positions")."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module):
        yield
        return

    def last_position(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if args and isinstance(args[0], torch.Tensor) and args[0].ndim == 3:
            return (args[0][:, -1:], *args[1:]), kwargs
        return None

    handle = head.register_forward_pre_hook(last_position, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _batch(input_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """Left-pad a batch, built on `device`; position ids count from each row's first real token."""
    width = max(len(x) for x in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long, device=device)
    for i, x in enumerate(input_ids):
        ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long, device=device)
        mask[i, width - len(x) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    first_real = torch.tensor([width - len(x) for x in input_ids], dtype=torch.long, device=device)
    return ids, mask, position_ids, first_real


def _check_sink_keys(sink_keys: Sequence[np.ndarray], encoded: EncodedPrompts, n_layers: int, n_heads: int) -> None:
    if len(sink_keys) != len(encoded):
        raise UserError(
            f"sink_keys has {len(sink_keys)} entries for {len(encoded)} prompts",
            "pass one [layer, head, query] array per prompt",
        )
    for j, (keys, ids) in enumerate(zip(sink_keys, encoded.input_ids, strict=True)):
        keys = np.asarray(keys)
        want = (n_layers, n_heads, len(ids) - 1)
        if keys.shape != want:
            raise UserError(
                f"sink_keys of prompt {j} have shape {keys.shape}, expected {want} [layer, head, query]",
                "capture both models with the same layers, heads and token ids",
            )
        query_pos = np.arange(1, len(ids))
        if keys.size and ((keys < VIRTUAL_KEY).any() or (keys > query_pos).any()):
            raise UserError(
                f"sink_keys of prompt {j} hold a key outside 0..query position (or -1, the learned sink key)",
                "pass key positions counted from the prompt's first token, at most the query's own position",
            )


def _fixed_key_batch(
    keys: Sequence[np.ndarray], layers: tuple[int, ...], starts: Sequence[int], width: int, device: torch.device
) -> dict[int, torch.Tensor]:
    """Per layer, [batch, head, query] key of each padded row, from the row's first real token (`starts`), on
    `device` (VIRTUAL_KEY: the learned sink key; _NO_FIXED_KEY: none, take the argmax)."""
    n_heads = np.asarray(keys[0]).shape[1]
    out = {x: torch.full((len(keys), n_heads, width), _NO_FIXED_KEY, dtype=torch.long, device=device) for x in layers}
    for i, k in enumerate(keys):
        k = torch.as_tensor(np.asarray(k, dtype=np.int64), device=device)
        for li, x in enumerate(layers):
            out[x][i, :, starts[i] + 1 : starts[i] + 1 + k.shape[-1]] = k[li]
    return out


def _checked_layers(model: Adapted, encoded: EncodedPrompts, layers: Sequence[int]) -> tuple[int, ...]:
    """The layers, sorted; one out of range, or a prompt longer than the model's positions, is refused."""
    layers = tuple(sorted(set(int(x) for x in layers)))
    depth = n_layers_of(model.module)
    bad = [x for x in layers if not 0 <= x < depth]
    if bad:
        raise UserError(f"layer(s) {bad} out of range for a {depth}-layer model", f"use layers 0..{depth - 1}")
    max_pos = getattr(text_config_of(model.module.config), "max_position_embeddings", None)
    virtual = model.virtual.n if model.virtual else 0
    i = max(range(len(encoded)), key=lambda j: len(encoded.input_ids[j]))
    longest = len(encoded.input_ids[i]) + virtual
    if max_pos and longest > max_pos:
        raise UserError(
            (f"{encoded.where[i]}: " if encoded.where else "") + f"a calibration prompt has {longest} tokens"
            f"{f' (with {virtual} virtual tokens)' if virtual else ''}, more than the model's {max_pos} positions",
            "use shorter prompts",
        )
    return layers


def _check_finite(out: dict[int, PromptCapture], layers: tuple[int, ...], model: Any = None) -> None:
    """Refuse non-finite sink log-odds, naming their cause; `model` None: a vLLM engine's statistics."""
    bad_rows = [
        (j, li) for j in sorted(out) for li in range(len(layers)) if not np.isfinite(out[j].sink_logodds[li]).all()
    ]
    if not bad_rows:
        return
    j, li = bad_rows[0]
    where = f"non-finite sink log-odds at prompt {j}, layer {layers[li]}"
    if model is None:
        raise UserError(
            f"{where} in the vLLM engine's forward: its weights or activations hold NaN or inf",
            "run `lm-eval-sink strength` on the checkpoint: transformers names the tensor at fault",
        )
    source = getattr(getattr(model, "config", None), "_name_or_path", None) or "the model"
    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise UserError(
                f"{where}: the checkpoint's weights hold NaN or inf (tensor {name} of {source})",
                "the weights are at fault, not the dtype: use a checkpoint whose weights are finite (re-save or "
                "download it again, or fix the run that wrote them)",
            )
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if dtype == "float16":
        raise UserError(
            f"{where}: float16's range overflows in {source} (its weights are finite)",
            "load float16 weights in bfloat16 (--dtype bfloat16: the same memory, float32's range), or any in "
            "float32 (--dtype float32: twice the memory of 16-bit weights)",
        )
    raise UserError(
        f"{where}: {source}'s activations leave {dtype}'s range although its weights are finite",
        "check the checkpoint's weights for values far outside what training gives (a damaged or edited file)",
    )


def capture_prompts(
    model: Any,
    encoded: EncodedPrompts,
    layers: Sequence[int],
    batching: Batching = Batching(),
    progress: bool = True,
    desc: str = "sink capture",
    sink_keys: Sequence[np.ndarray] | None = None,
) -> list[PromptCapture]:
    """Per-prompt statistics of `model` under `sink_capture`, in the prompts' order; `batching` changes none of them.
    `sink_keys`: a fixed sink key per row (one [layer, head, query] int array per prompt, from its first real token)."""
    from tqdm.auto import tqdm

    run = adapted(model)
    layers = _checked_layers(run, encoded, layers)
    if sink_keys is not None and run.virtual is not None:
        raise UserError(
            f"fixed sink keys for a {run.virtual.method} adapter: its {run.virtual.n} virtual tokens are keys "
            "that the other model does not have",
            "compare the adapter's Sink Strength (`lm-eval-sink strength`) with its base's instead",
        )
    if sink_keys is not None:
        _check_sink_keys(sink_keys, encoded, len(layers), int(text_config_of(run.module.config).num_attention_heads))
    pad_id = getattr(run.module.config, "pad_token_id", None) or 0
    out: dict[int, PromptCapture] = {}
    lengths = [len(x) for x in encoded.input_ids]
    batches = batching.batches(lengths) if run.virtual is None else [[i] for i in range(len(lengths))]
    with (
        sink_capture(run.module, layers) as collector,
        _last_position_head(run.module),
        torch.no_grad(),  # not inference_mode: FSDP2 reuses its buffers
    ):
        collector.query_chunk = batching.query_chunk
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            keys = None if sink_keys is None else [sink_keys[i] for i in batch]
            captured = _capture_batch(run, collector, encoded, batch, layers, int(pad_id), keys)
            out.update(zip(batch, captured, strict=True))
    _check_finite(out, layers, run.forward)
    return [out[j] for j in range(len(encoded))]


def _capture_batch(
    model: Adapted,
    collector: _Collector,
    encoded: EncodedPrompts,
    batch: list[int],
    layers: tuple[int, ...],
    pad_id: int,
    sink_keys: list[np.ndarray] | None,
) -> list[PromptCapture]:
    """One left-padded forward of the prompts `batch` (indices into `encoded`) under the capture; with virtual
    tokens one unpadded prompt through the adapter's forward (peft adds the virtual tokens and their mask)."""
    chunk = [encoded.input_ids[i] for i in batch]
    ids, mask, position_ids, first_real = _batch(chunk, pad_id, next(model.module.parameters()).device)
    starts = [ids.shape[1] - len(x) for x in chunk]
    collector.first_real, collector.records = first_real, {}
    if sink_keys is not None:
        collector.fixed_keys = _fixed_key_batch(sink_keys, layers, starts, ids.shape[1], ids.device)
    inputs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    try:
        model.forward(**inputs, **({} if model.virtual else {"position_ids": position_ids}))
    finally:
        collector.first_real, collector.fixed_keys = None, None
    missing = [x for x in layers if x not in collector.records]
    if missing:
        raise UserError(
            f"{type(model.module).__name__}: attention of layer(s) {missing[:5]} never reached the capture function",
            "this architecture bypasses transformers' attention interface for those layers; it is not supported",
        )
    if model.virtual is not None and model.virtual.rows:  # the virtual tokens' rows come first: skip them
        starts = [model.virtual.n]
    return [
        _prompt_capture(collector.records, layers, row, starts[row], len(chunk[row]), encoded.content_mask[i])
        for row, i in enumerate(batch)
    ]


def _prompt_capture(
    records: dict[int, tuple[torch.Tensor | None, ...]],
    layers: tuple[int, ...],
    row: int,
    start: int,
    length: int,
    content: Sequence[bool],
) -> PromptCapture:
    """One prompt's statistics from its batch's records: batch row `row`, positions 1..length-1 after `start`."""
    rows = slice(start + 1, start + length)

    def stack(field: int, dtype: type) -> np.ndarray:
        return np.stack([records[x][field][row, ..., rows].numpy() for x in layers]).astype(dtype)

    learned = any(records[x][3] is not None for x in layers)
    if learned:  # a layer without a learned sink has virtual-key mass 0
        records = {x: r if r[3] is not None else (*r[:3], torch.zeros_like(r[2]), r[4]) for x, r in records.items()}
    return PromptCapture(
        layers=layers,
        sink_logodds=stack(0, np.float32),
        sink_pos=stack(1, np.int64),
        pos0_mass=stack(2, np.float32),
        content=np.asarray(content[1:], dtype=bool),
        learned_sink_mass=stack(3, np.float32) if learned else None,
        pos0_visible=stack(4, bool),
    )
