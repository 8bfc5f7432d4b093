"""Sink margins on real weights: SmolLM2-135M-Instruct vs a copy whose late W_q, W_k are perturbed.

No VLM backbone can be had offline, so the candidate is made here: in the last K layers each
q_proj and k_proj weight W gets W + eps * ||W||_2 * N / ||N||_2 (N Gaussian, seeded), an update
of operator norm eps * ||W||_2, the kind of perturbation Theorem 1 bounds. Prints the margin
summary, the per-layer table, the Lemma 1 synthetic case and the cost of `margin` relative to
one Sink Strength measurement in the same run (ratio, not seconds, is the figure to quote).

    python benchmarks/bench_margin.py [--eps 0.5] [--last-k 10] [--n-prompts 15]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def perturbed_copy(src: Path, dst: Path, eps: float, last_k: int, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    layers = model.model.layers
    with torch.no_grad():
        for layer in layers[len(layers) - last_k :]:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                w = proj.weight
                noise = torch.randn(w.shape, generator=gen)
                w += eps * torch.linalg.matrix_norm(w, ord=2) * noise / torch.linalg.matrix_norm(noise, ord=2)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=float, default=0.1)
    ap.add_argument("--last-k", type=int, default=10)
    ap.add_argument("--n-prompts", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the shared CI box: one thread gives stable ratios

    from lm_eval_sink.commands.margin import measure_margin
    from lm_eval_sink.margin import MarginSettings, lemma1_synthetic, margin_table_markdown
    from lm_eval_sink.models import default_model_dir, load_model
    from lm_eval_sink.options import MeasureOptions
    from lm_eval_sink.strength import StrengthSettings, measure

    ref = default_model_dir()
    st = StrengthSettings(n_prompts=args.n_prompts)
    with tempfile.TemporaryDirectory() as tmp:
        cand = perturbed_copy(ref, Path(tmp) / "perturbed", args.eps, args.last_k)
        loaded = load_model(str(ref), dtype="float32")
        t0, c0 = time.perf_counter(), time.process_time()
        measure(loaded.model, loaded.tokenizer, st, progress=False)
        t_strength, c_strength = time.perf_counter() - t0, time.process_time() - c0
        del loaded
        t0, c0 = time.perf_counter(), time.process_time()
        options = MeasureOptions(dtype="float32", progress=False)
        result, _ = measure_margin(str(ref), str(cand), MarginSettings(strength=st), options)
        t_margin, c_margin = time.perf_counter() - t0, time.process_time() - c0
    case = lemma1_synthetic()
    print(
        f"candidate: SmolLM2-135M-Instruct with W_q, W_k of the last {args.last_k} layers perturbed "
        f"(operator norm eps = {args.eps} x ||W||_2)"
    )
    print(margin_table_markdown(result, heads=False))
    s = result.summary
    print(
        f"summary: negative margin {s['n_negative_margin']}/{s['n_heads_total']} heads "
        f"({s['n_sink_collapse']} with G_base > 0); median margin {s['margin_median']:.3f}; "
        f"median B_gap {s['b_gap_median']:.3f}, max {s['b_gap_max']:.3f}; S reference "
        f"{result.reference_sink_strength:.4f}, candidate {result.candidate_sink_strength:.4f}"
    )
    print(
        f"Lemma 1 synthetic (G = 3.0, B_gap = 0.4, N = 64): non-sink mass {case.non_sink_mass:.4f}, "
        f"bound {case.bound:.4f}, ratio {case.ratio:.2f}"
    )
    print(
        "cost: margin (2 loads, 2 all-layer captures, 2 S measurements) = "
        f"{c_margin / c_strength:.1f}x CPU time of one Sink Strength measurement "
        f"({c_margin:.1f} s vs {c_strength:.1f} s CPU; wall {t_margin:.1f} s vs {t_strength:.1f} s)"
    )


if __name__ == "__main__":
    main()
