"""Tiny causal LMs whose attention logits are known in closed form (random weights have no sink).

Construction (every family): all weights zero except
- embeddings: the BOS token is `c_bos * e[0]`, every other token is `e[1]` (identical);
- attention-output and MLP-output projections zero, so the residual stream stays the embedding
  in every layer;
- q_proj reads dim 1 into head-dim 1 of head h with weight alpha[l, h]; k_proj reads dim 0 into
  head-dim 1 of the KV head with weight beta[l]; all norm weights 1 (QK-norm weights set below).
- rope_theta is huge: head-dim pair (1, 3) rotates by position * theta^-1/2 ~ 1e-15 rad, i.e. not
  at all in float32, so RoPE leaves these logits unchanged.
Then every non-BOS key is the zero vector (logit 0) and the BOS key has logit g[l, h], known in
closed form per family (`expected_gap`). A row at query position q (>= 1) has logits
[g, 0, ..., 0] over q + 1 keys.
"""

from __future__ import annotations

import math

import numpy as np
import torch

H, D, N_HEADS, N_KV = 8, 4, 2, 1
C_BOS = 2.0
THETA = 1e30


def _config(family: str, n_layers: int, vocab: int, **sizes):
    """The family's config of a tiny model: these sizes, unless `sizes` gives others."""
    import transformers

    common = dict(
        vocab_size=vocab,
        hidden_size=H,
        intermediate_size=8,
        num_hidden_layers=n_layers,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV,
        head_dim=D,
        max_position_embeddings=512,
        rms_norm_eps=1e-12,
        tie_word_embeddings=False,
        rope_theta=THETA,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    classes = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "olmo2": "Olmo2Config"}
    return getattr(transformers, classes[family])(**{**common, **sizes})


def alphas(family: str, n_layers: int) -> np.ndarray:
    """alpha[l, h]: per-layer, per-head query weights (head 1 negative for qwen3: its sink moves)."""
    a = np.array([[0.5 + 0.5 * l + 0.25 * h for h in range(N_HEADS)] for l in range(n_layers)])
    if family == "qwen3":
        a[:, 1] *= -1.0
    return a


def betas(n_layers: int) -> np.ndarray:
    return np.array([1.0 + 0.1 * l for l in range(n_layers)])


def qk_norm_weights(n_layers: int) -> np.ndarray:
    """Per-layer scale on head-dim 1 of q_norm (Qwen3 per head; OLMo2 on every head's dim 1)."""
    return np.array([0.8 + 0.3 * l for l in range(n_layers)])


def _zero_with_bos_sink(model, bos_id: int):
    """Zero every weight, norms to 1, and the embedding that makes BOS the sink: dim 0 = C_BOS on BOS only, dim 1 = 1
    elsewhere."""
    for p in model.parameters():
        p.zero_()
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
    emb = model.model.embed_tokens.weight
    emb[:, 1] = 1.0
    emb[bos_id] = 0.0
    emb[bos_id, 0] = C_BOS
    return emb


def build(family: str, n_layers: int = 3, vocab: int = 96, bos_id: int = 1, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, n_layers, vocab), attn_implementation="sdpa")
    a, b, w = alphas(family, n_layers), betas(n_layers), qk_norm_weights(n_layers)
    with torch.no_grad():
        _zero_with_bos_sink(model, bos_id)
        for l, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for h in range(N_HEADS):
                attn.q_proj.weight[h * D + 1, 1] = a[l, h]
            attn.k_proj.weight[1, 0] = b[l]
            if family == "qwen3":
                attn.q_norm.weight[1] = w[l]
            if family == "olmo2":
                for h in range(N_HEADS):
                    attn.q_norm.weight[h * D + 1] = w[l]
    model.eval()
    return model.to(dtype)


def expected_gap(family: str, n_layers: int) -> np.ndarray:
    """g[l, h]: the BOS key's pre-softmax logit (scaled by D**-0.5), in closed form."""
    a, b, w = alphas(family, n_layers), betas(n_layers), qk_norm_weights(n_layers)
    scale = D**-0.5
    g = np.zeros((n_layers, N_HEADS))
    for l in range(n_layers):
        for h in range(N_HEADS):
            if family == "llama":  # pre-norm: normalized embeddings are sqrt(H) * e[j]
                q, k = a[l, h] * math.sqrt(H), b[l] * math.sqrt(H)
            elif family == "qwen3":  # per-head RMSNorm of (0, x, 0, 0) is sign(x) * sqrt(D)
                q, k = math.copysign(math.sqrt(D), a[l, h]) * w[l], math.sqrt(D)
            else:  # olmo2: no pre-norm; layerwise RMSNorm over all heads' dims together
                raw = a[l] * 1.0
                rms_q = math.sqrt(float(np.sum(raw**2)) / (N_HEADS * D))
                q = raw[h] / rms_q * w[l]
                k = math.sqrt(N_KV * D)  # one KV head: (0, beta*C_BOS, 0, 0) normalized over D dims
            g[l, h] = q * k * scale
    return g


def row_logodds(g: float, q: int) -> tuple[float, int]:
    """(sink log-odds, sink position) of a row with logits [g, 0 x q] (first max wins ties)."""
    logits = np.array([g] + [0.0] * q)
    s = int(np.argmax(logits))
    others = np.delete(logits, s)
    return float(logits[s] - np.log(np.sum(np.exp(others)))), s


def expected_strength(
    family: str, n_layers: int, lengths: list[int], last_k: int, statistic: str = "median"
) -> tuple[float, np.ndarray]:
    """S and the per-(layer, head) statistic for prompts of the given token lengths."""
    g = expected_gap(family, n_layers)
    layers = range(n_layers - min(last_k, n_layers), n_layers)
    reduce = np.median if statistic == "median" else np.mean
    allv, per = [], np.zeros((len(layers), N_HEADS))
    for i, l in enumerate(layers):
        for h in range(N_HEADS):
            vals = [row_logodds(g[l, h], q)[0] for n in lengths for q in range(1, n)]
            per[i, h] = reduce(vals)
            allv += vals
    return float(reduce(allv)), per


# ---------------------------------------------------------------------------- head-selective sinks
# For the training tests: 4 query heads on 2 KV heads (GQA), head_dim 8, ordinary RoPE (theta 1e4).
# Only KV head 0 (query heads 0 and 1) has a sink: q_proj reads dim 1 into head-dim 3 of heads 0, 1
# with weight alpha[l, h]; k_proj reads dim 0 into head-dim 3 of KV head 0 with weight beta[l].
# Head-dim 3 lies in the lowest-frequency rotary plane (3, 7) (0.001 rad a position), so a row at
# query position q has logits [g cos(0.001 q), 0, ..., 0]; heads 2, 3 have all logits 0 (no sink).
# `noise` adds seeded Gaussian weights to v_proj, o_proj and the MLP (none written to residual
# dim 0), to heads 2, 3's q_proj, KV head 1's k_proj and KV head 0's k_proj off the sink plane and
# reading only the tokens' own dims 9.. (random codes of the non-sink tokens), so gradients reach
# every head while the sink key stays on head-dim 3; heads 0, 1 keep their sink (not in closed form).

SEL_H, SEL_D, SEL_HEADS, SEL_KV, SEL_DIM, SEL_THETA = 16, 8, 4, 2, 3, 1e4
SINK_HEADS = (0, 1)
SEL_TOKEN_DIMS = 9  # with noise: dims 9.. carry each non-sink token's own random code


def build_selective(
    family: str = "llama",
    n_layers: int = 3,
    vocab: int = 96,
    bos_id: int = 1,
    noise: float = 0.0,
    bias: bool = False,
    tied: bool = False,
):
    from transformers import AutoModelForCausalLM

    config = _config(
        family,
        n_layers,
        vocab,
        hidden_size=SEL_H,
        intermediate_size=16,
        num_attention_heads=SEL_HEADS,
        num_key_value_heads=SEL_KV,
        head_dim=SEL_D,
        tie_word_embeddings=tied,
        rope_theta=SEL_THETA,
        bos_token_id=bos_id,
        **({"attention_bias": bias} if family == "llama" else {}),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        emb = _zero_with_bos_sink(model, bos_id)
        gen = torch.Generator().manual_seed(1)
        if noise:
            tokens = torch.arange(vocab) != bos_id
            emb[tokens, SEL_TOKEN_DIMS:] = 0.5 * torch.randn((int(tokens.sum()), SEL_H - SEL_TOKEN_DIMS), generator=gen)
        for l, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            for h in SINK_HEADS:
                attn.q_proj.weight[h * SEL_D + SEL_DIM, 1] = 0.5 + 0.5 * l + 0.25 * h
            attn.k_proj.weight[SEL_DIM, 0] = 1.0 + 0.1 * l
            if noise:
                for mod in (attn.v_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                    mod.weight.add_(noise * torch.randn(mod.weight.shape, generator=gen))
                # nothing is written to dim 0 (the sink's) or dims 9.. (tokens')
                for mod in (attn.o_proj, layer.mlp.down_proj):
                    mod.weight[0] = 0.0
                    mod.weight[SEL_TOKEN_DIMS:] = 0.0
                # OLMo2's post-norms: keep the writes small
                for name in ("post_attention_layernorm", "post_feedforward_layernorm"):
                    if family == "olmo2":
                        getattr(layer, name).weight.fill_(noise)
                attn.q_proj.weight[2 * SEL_D :] = noise * torch.randn((2 * SEL_D, SEL_H), generator=gen)  # heads 2, 3
                kw = attn.k_proj.weight
                kw[SEL_D:] = noise * torch.randn((SEL_D, SEL_H), generator=gen)  # KV head 1
                # KV head 0, off the sink plane and off dim 0
                block = noise * torch.randn((SEL_D, SEL_H), generator=gen)
                block[[SEL_DIM, SEL_DIM + SEL_D // 2]] = 0.0
                block[:, :SEL_TOKEN_DIMS] = 0.0  # reads the token dims only: the sink key stays on dim 3
                kw[:SEL_D] += block
    model.eval()
    return model
