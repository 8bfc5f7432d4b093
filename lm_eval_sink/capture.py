"""Capture attention-sink statistics through transformers' attention interface.

One model-agnostic mechanism: a custom attention function registered with
`transformers.AttentionInterface` (and the matching mask function with `AttentionMaskInterface`)
and switched on with `model.set_attn_implementation` for the duration of `sink_capture(...)`.
Every architecture whose attention layers call `ALL_ATTENTION_FUNCTIONS` (Llama, Mistral, Qwen2,
Qwen3 with per-head q_norm/k_norm, OLMo2 with layerwise QK-norm, Gemma 2/3, ...) works with no
per-model code: the function receives query and key AFTER rotary embeddings and QK-norm.

For each selected layer it computes, in float32 from the pre-softmax logits (scaling, optional
soft-capping, causal/padding/sliding-window mask, GQA expanded), then reduces at once, so only
per-row numbers are kept (never a [query, key] matrix per layer). Then it hands the untouched
inputs to the model's previous implementation (sdpa or eager), so outputs are unchanged.

Captured quantities, per prompt (positions counted from the prompt's first real token, so left
padding never shifts "position 0"; the `query` axis holds positions 1..L-1, position 0 has no
other key and is excluded):
    sink_logodds[layer, head, query]  float32  logit(sink key) - logsumexp(logits of other keys)
                                               = log(a_sink / (1 - a_sink)), never saturated
    sink_pos[layer, head, query]      int64    the sink key = argmax key of the row, or the fixed key
                                               given in `capture_prompts(sink_keys=...)`
    pos0_mass[layer, head, query]     float32  attention probability on position 0
    content[query]                    bool     the row's token is the user message's text
`layer` indexes `PromptCapture.layers` (model layer indices, ascending).
With `sink_keys` (one int array [layer, head, query] per prompt, positions counted from the first
real token, e.g. another model's `sink_pos`), each row's sink key is that fixed key instead of
the argmax, so `sink_logodds` is the aggregate logit gap at the given key (used by margin.py to
measure a candidate model at its reference's sink keys). Without it nothing changes.
Footgun: rows whose position 0 lies outside a sliding window have pos0_mass 0; keep calibration
prompts shorter than the window (they are: ~50 tokens).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lm_eval_sink.calibration import EncodedPrompts
from lm_eval_sink.errors import UserError

IMPL_PREFIX = "lm_eval_sink"
_DELEGATES = ("sdpa", "eager")
_ACTIVE: contextvars.ContextVar[_Collector | None] = contextvars.ContextVar("lm_eval_sink_capture", default=None)


@dataclass(frozen=True, slots=True)
class PromptCapture:
    """Sink statistics of one prompt; see the module docstring for names and shapes."""

    layers: tuple[int, ...]
    sink_logodds: np.ndarray  # [layer, head, query]
    sink_pos: np.ndarray  # [layer, head, query]
    pos0_mass: np.ndarray  # [layer, head, query]
    content: np.ndarray  # [query]


class _Collector:
    """Per-batch store that the attention function fills, one layer at a time."""

    def __init__(self, layers: set[int]) -> None:
        self.layers = layers
        self.first_real: torch.Tensor | None = None  # [batch] index of each row's first real token
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.fixed_keys: dict[int, torch.Tensor] | None = None  # layer -> [batch, head, query] key index, -1 = argmax


def _allowed_keys(attention_mask: Any, bsz: int, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Bool [batch or 1, heads or 1, query, key]: True where the key may be attended."""
    if attention_mask is None:  # sdpa skipped the mask: purely causal, no padding
        q = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        return (torch.arange(k_len, device=device)[None, :] <= q)[None, None]
    mask = attention_mask[..., -k_len:] if attention_mask.shape[-1] != k_len else attention_mask
    if mask.dtype == torch.bool:
        return mask
    # Additive float mask (eager): masked entries hold the dtype's minimum, a finite number.
    return mask > torch.finfo(mask.dtype).min / 2


def _row_stats(module: Any, query: torch.Tensor, key: torch.Tensor, attention_mask: Any, scaling: float | None, softcap: float | None, first_real: torch.Tensor, fixed_keys: torch.Tensor | None = None):
    bsz, n_heads, q_len, head_dim = query.shape
    k_len = key.shape[-2]
    q = query.detach().float()
    k = key.detach().float()
    if k.shape[1] != n_heads:  # grouped-query attention: each KV head serves n_heads // kv heads
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
    scale = scaling if scaling is not None else head_dim**-0.5
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    allowed = _allowed_keys(attention_mask, bsz, q_len, k_len, logits.device)
    logits = logits.masked_fill(~allowed, float("-inf"))
    sink_pos = logits.argmax(dim=-1)
    if fixed_keys is not None:
        fixed_keys = fixed_keys.to(logits.device)
        sink_pos = torch.where(fixed_keys >= 0, fixed_keys, sink_pos)
    sink_logit = logits.gather(-1, sink_pos[..., None]).squeeze(-1)
    others = logits.scatter(-1, sink_pos[..., None], float("-inf"))
    sink_logodds = sink_logit - torch.logsumexp(others, dim=-1)
    pos0 = first_real.to(logits.device)[:, None, None, None].expand(bsz, n_heads, q_len, 1)
    pos0_mass = torch.exp(logits.gather(-1, pos0).squeeze(-1) - torch.logsumexp(logits, dim=-1))
    return sink_logodds.cpu(), sink_pos.cpu(), pos0_mass.cpu()


def _delegate_fn(module: Any, name: str):
    from transformers import AttentionInterface

    if name == "eager":  # the model's own eager function (it knows softcap, sinks, ...)
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is not None:
            return fn
    return AttentionInterface._global_mapping[name] if name in AttentionInterface._global_mapping else AttentionInterface._global_mapping["sdpa"]


def _make_attention(delegate: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        collector = _ACTIVE.get()
        layer = getattr(module, "layer_idx", None)
        if collector is not None and layer in collector.layers and collector.first_real is not None:
            fixed = collector.fixed_keys[layer] if collector.fixed_keys is not None else None
            collector.records[layer] = _row_stats(module, query, key, attention_mask, scaling, kwargs.get("softcap"), collector.first_real, fixed)
        return _delegate_fn(module, delegate)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    attention.__name__ = f"{IMPL_PREFIX}_{delegate}_attention"
    return attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for d in _DELEGATES:
        name = f"{IMPL_PREFIX}_{d}"
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, _make_attention(d))
            AttentionMaskInterface.register(name, masks[d])


def _attn_config(model: Any) -> Any:
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def n_layers_of(model: Any) -> int:
    return int(_attn_config(model).num_hidden_layers)


def check_supported_class(cls: type) -> None:
    """Refuse model classes whose attention does not go through transformers' attention interface."""
    if not getattr(cls, "_supports_attention_backend", False):
        raise UserError(
            f"{cls.__name__} does not route attention through transformers' AttentionInterface, so Sink Strength cannot be captured",
            "use a model whose class sets _supports_attention_backend (Llama, Mistral, Qwen2, Qwen3, OLMo2, Gemma 2/3, Phi-3, ...)",
        )


def check_supported(model: Any) -> None:
    check_supported_class(type(model))


@contextlib.contextmanager
def sink_capture(model: Any, layers: Sequence[int]) -> Iterator[_Collector]:
    """Switch `model` to the capturing attention for the block; restore its implementation after."""
    check_supported(model)
    _register()
    previous = _attn_config(model)._attn_implementation or "sdpa"
    delegate = "eager" if previous == "eager" else "sdpa"
    collector = _Collector(set(layers))
    token = _ACTIVE.set(collector)
    model.set_attn_implementation(f"{IMPL_PREFIX}_{delegate}")
    try:
        yield collector
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)


def _batch(input_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """Left-pad a batch; position ids count from each row's first real token."""
    width = max(len(x) for x in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for i, x in enumerate(input_ids):
        ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        mask[i, width - len(x) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    first_real = width - torch.tensor([len(x) for x in input_ids])
    return ids.to(device), mask.to(device), position_ids.to(device), first_real


def _check_sink_keys(sink_keys: Sequence[np.ndarray], encoded: EncodedPrompts, n_layers: int, n_heads: int) -> None:
    if len(sink_keys) != len(encoded):
        raise UserError(f"sink_keys has {len(sink_keys)} entries for {len(encoded)} prompts", "pass one [layer, head, query] array per prompt")
    for j, (keys, ids) in enumerate(zip(sink_keys, encoded.input_ids)):
        keys = np.asarray(keys)
        want = (n_layers, n_heads, len(ids) - 1)
        if keys.shape != want:
            raise UserError(f"sink_keys of prompt {j} have shape {keys.shape}, expected {want} [layer, head, query]", "capture both models with the same layers, heads and token ids")
        query_pos = np.arange(1, len(ids))
        if keys.size and ((keys < 0).any() or (keys > query_pos).any()):
            raise UserError(f"sink_keys of prompt {j} hold a key outside 0..query position", "pass key positions counted from the prompt's first token, at most the query's own position")


def _fixed_key_batch(keys: Sequence[np.ndarray], layers: tuple[int, ...], first_real: torch.Tensor, width: int) -> dict[int, torch.Tensor]:
    """Per layer, [batch, head, query] absolute key index of each padded row (-1: no fixed key)."""
    n_heads = np.asarray(keys[0]).shape[1]
    out = {x: torch.full((len(keys), n_heads, width), -1, dtype=torch.long) for x in layers}
    for i, k in enumerate(keys):
        p = int(first_real[i])
        k = torch.as_tensor(np.asarray(k, dtype=np.int64)) + p
        for li, x in enumerate(layers):
            out[x][i, :, p + 1 : p + 1 + k.shape[-1]] = k[li]
    return out


def capture_prompts(
    model: Any,
    encoded: EncodedPrompts,
    layers: Sequence[int],
    batch_size: int = 1,
    progress: bool = True,
    desc: str = "sink capture",
    sink_keys: Sequence[np.ndarray] | None = None,
) -> list[PromptCapture]:
    """Run the prompts through `model` under `sink_capture` and return per-prompt statistics.

    `sink_keys`: optional fixed sink key per row (one [layer, head, query] int array per prompt,
    positions from the first real token); see the module docstring.
    """
    from tqdm.auto import tqdm

    if batch_size <= 0:
        raise UserError(f"batch size must be positive, got {batch_size}", "use --batch-size 1 or more")
    layers = tuple(sorted(set(int(x) for x in layers)))
    depth = n_layers_of(model)
    bad = [x for x in layers if not 0 <= x < depth]
    if bad:
        raise UserError(f"layer(s) {bad} out of range for a {depth}-layer model", f"use layers 0..{depth - 1}")
    max_pos = getattr(_attn_config(model), "max_position_embeddings", None)
    longest = max(len(x) for x in encoded.input_ids)
    if max_pos and longest > max_pos:
        raise UserError(f"a calibration prompt has {longest} tokens, more than the model's {max_pos} positions", "use shorter prompts")
    if sink_keys is not None:
        _check_sink_keys(sink_keys, encoded, len(layers), int(_attn_config(model).num_attention_heads))
    pad_id = next((t for t in (getattr(model.config, "pad_token_id", None), 0) if t is not None), 0)
    device = next(model.parameters()).device
    out: list[PromptCapture] = []
    starts = range(0, len(encoded), batch_size)
    with sink_capture(model, layers) as collector, torch.inference_mode():
        for start in tqdm(starts, desc=desc, disable=not progress, leave=False):
            chunk = encoded.input_ids[start : start + batch_size]
            ids, mask, position_ids, first_real = _batch(chunk, int(pad_id), device)
            collector.first_real = first_real
            collector.records = {}
            if sink_keys is not None:
                collector.fixed_keys = _fixed_key_batch(sink_keys[start : start + batch_size], layers, first_real, ids.shape[1])
            model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
            missing = [x for x in layers if x not in collector.records]
            if missing:
                raise UserError(
                    f"{type(model).__name__}: attention of layer(s) {missing[:5]} never reached the capture function",
                    "this architecture bypasses transformers' attention interface for those layers; it is not supported",
                )
            for i, x in enumerate(chunk):
                p, length = int(first_real[i]), len(x)
                rows = slice(p + 1, p + length)  # positions 1..L-1 of this prompt

                def take(t: torch.Tensor, i: int = i, rows: slice = rows) -> np.ndarray:
                    return t[i, :, rows].numpy()

                out.append(
                    PromptCapture(
                        layers=layers,
                        sink_logodds=np.stack([take(collector.records[x][0]) for x in layers]).astype(np.float32),
                        sink_pos=np.stack([take(collector.records[x][1]) for x in layers]).astype(np.int64) - p,
                        pos0_mass=np.stack([take(collector.records[x][2]) for x in layers]).astype(np.float32),
                        content=np.asarray(encoded.content_mask[start + i][1:], dtype=bool),
                    )
                )
            collector.first_real = None
            collector.fixed_keys = None
    bad_rows = [(j, li) for j, c in enumerate(out) for li in range(len(layers)) if not np.isfinite(c.sink_logodds[li]).all()]
    if bad_rows:
        j, li = bad_rows[0]
        raise UserError(f"non-finite sink log-odds at prompt {j}, layer {layers[li]}", "load the model in float32 (--dtype float32)")
    return out
