"""Shared test fixtures: the embedded default model, ../shared data, tiny tokenizers.

Real lm-eval runs of SmolLM2 happen ONCE per session in the fixtures below and are reused by
the harness, buckets and protocol tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("LM_EVAL_SINK_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or skip with the reason."""
    d = SHARED / "data"
    if not (d / "ifeval" / "input_data.jsonl").is_file():
        pytest.skip(f"benchmark data not found at {d} (set LM_EVAL_SINK_SHARED to the shared folder)")
    return d


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted once, then cached)."""
    from lm_eval_sink.models import default_model_dir

    return default_model_dir()


def make_tokenizer(vocab_size: int = 96):
    """A tiny word-level fast tokenizer with a chat template, trained locally (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = "the a an of to in and is it you that for on with as are this be at or by from write list explain answer give name three two four words using only letters title story json colors".split()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["<unk>", *specials])
    tok.train_from_iterator([" ".join(words)] * 3, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


def make_sink_llama(path: Path, gaps, tokenizer, rope_theta: float = 1e12) -> Path:
    """A tiny Llama whose attention logits are known in closed form; saved with `tokenizer`.

    `gaps[layer][head]` = c: for every query at position t >= 1 (counted from the first token,
    the BOS) the logit of key 0 is c and every other key's logit is 0, so the sink log-odds at
    key 0 are c - log(t). How: all non-BOS tokens share one embedding, BOS another; attention
    outputs and MLPs write nothing (o_proj, down_proj = 0), so each layer sees the embeddings;
    q and k live in one rotary pair whose frequency is rope_theta ** -0.5 (1e-6), so rotation
    changes the logits by < 1e-8; with hidden 8 and head_dim 4, c = 4 * W_q * W_k.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    n_layers, n_heads = len(gaps), len(gaps[0])
    hidden, head_dim = 8, 4
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=16, num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=512, rms_norm_eps=1e-12, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        emb = torch.zeros(len(tokenizer), hidden)
        emb[:, 1] = 1.0
        emb[tokenizer.bos_token_id] = torch.tensor([1.0] + [0.0] * (hidden - 1))
        model.model.embed_tokens.weight.copy_(emb)
        for li, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            attn.q_proj.weight.zero_()
            attn.k_proj.weight.zero_()
            attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            attn.k_proj.weight[1, 0] = 1.0  # k of BOS: sqrt(8) in dim 1 (rotary pair 1 <-> 3)
            for h in range(n_heads):
                attn.q_proj.weight[h * head_dim + 1, 1] = gaps[li][h] / 4.0  # q of other tokens
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
