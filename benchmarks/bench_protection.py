"""SinkProtection's cost per optimizer step: `project_` on 400 protected heads, against a training step (CPU).

A random-init Llama with SmolLM2's tokenizer and head_dim 64 (hidden 640, the width 40 heads divide), with 10
layers of 40 query heads and 8 KV heads. Its plan protects every head of every layer (the threshold and
the position-0 share are waived), so each `project_` applies Rule K to 80 KV heads and Rule Q to 400
query heads. Prints the median wall time of one `project_` (after the first call, which binds) and of
one AdamW training step (forward, backward and step on 2 x 64 tokens) in the same process, and their
ratio: the share of a training step the protection adds.

    python benchmarks/bench_protection.py [--layers 10] [--heads 40] [--repeats 20]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def model_of(tokenizer, layers: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=640,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the shared CI box: one thread gives stable ratios

    from transformers import AutoTokenizer

    from lm_eval_sink.models import default_model_dir
    from lm_eval_sink.strength import StrengthSettings
    from lm_eval_sink.training import ProtectSettings, SinkProtection, select_sink_heads

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    model = model_of(tokenizer, args.layers, args.heads, args.kv_heads)
    settings = StrengthSettings(last_k=args.layers, n_prompts=5)
    plan = select_sink_heads(
        model, tokenizer, settings, ProtectSettings(threshold=-math.inf, min_pos0_fraction=0.0), progress=False
    )
    protection = SinkProtection(plan)
    protection.freeze(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, len(tokenizer), (2, 64), generator=torch.Generator().manual_seed(0))

    def train_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    train_step()
    protection.project_(model)  # the first call binds
    project = median_seconds(lambda: protection.project_(model), args.repeats)
    step = median_seconds(train_step, 3)
    n_q = sum(len(lp.heads) for lp in plan.layers)
    n_kv = sum(len(lp.kv_heads) for lp in plan.layers)
    print(
        f"model: {args.layers} layers x {args.heads} heads ({args.kv_heads} KV), head_dim 64, hidden 640; "
        f"protected: {n_q} query heads, {n_kv} KV heads; {torch.get_num_threads()} thread"
    )
    print(
        f"project_: {1e3 * project:.1f} ms per step (median of {args.repeats}); AdamW step on 2 x 64 tokens: "
        f"{1e3 * step:.0f} ms (median of 3); project_ / step = {project / step:.3f}"
    )


if __name__ == "__main__":
    main()
