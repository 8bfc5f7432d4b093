"""Tiny random models of the families the vLLM engine capture claims, with a head size vLLM's CPU attention takes.

Each family is built from its transformers config (hidden 128, 2 layers, 4 query heads on 2 KV heads: GQA, head
size 32), seeded, with query and key weights scaled up so that rows are peaked and Gemma 2's logit soft-capping
bites without saturating every logit; windowed families get a window of 6 keys, shorter than every calibration
prompt, and Gemma 2/3 a `query_pre_attn_scalar` other than the head size, so the layer's own scale matters.
Used by tests/test_engine_capture.py and tests/engine_capture_all.py through tests/drivers/engine_capture.py.
"""

from __future__ import annotations

import re
from pathlib import Path

WINDOW = 6
QK_SCALE = 6.0
TIED = {"tie_word_embeddings": True}  # vLLM's Gemma 2 has no lm_head of its own
SOFTCAP = 4.0
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"sliding_window": WINDOW, "attn_logit_softcapping": SOFTCAP, "query_pre_attn_scalar": 24, **TIED},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24},
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}


def build(family: str, folder: Path, dtype: str = "float32", overrides: dict | None = None) -> Path:
    """Save the family's tiny model (eager attention recorded in its config) with the tiny tokenizer in `folder`;
    `overrides` replace config fields (e.g. one KV head)."""
    import inspect

    import torch
    import transformers
    from helpers import make_tokenizer

    cfg_name, model_name, extra = FAMILIES[family]
    tok = make_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    accepted = set(inspect.signature(cfg_cls.__init__).parameters)
    config = cfg_cls(
        **{
            k: v
            for k, v in {"tie_word_embeddings": False, **common, **extra, **(overrides or {})}.items()
            if k in accepted
        }
    )
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"self_attn\.(q_proj|k_proj)\.weight$", name):
                p.mul_(QK_SCALE)
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


DRIVER = Path(__file__).resolve().parent / "drivers" / "engine_capture.py"
DRIVER_FIELDS = ("sink_logodds", "sink_pos", "pos0_mass", "pos0_visible", "content")
# what decides the engine's process layout: each job sets its own (the caches' variables pass through)
ENGINE_MODE_VARIABLES = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_SIM_MULTI_NUMA")


def start_job(job: dict, root: Path, env: dict[str, str]):
    """Popen of the driver on `job` (its folder and outputs under `root`), its output in root/<name>.log."""
    import json
    import os
    import subprocess

    from helpers import VLLM_PY

    name = job["name"]
    job = {**job, "folder": str(root / name), "out": str(root / f"{name}_out")}
    (root / f"{name}.json").write_text(json.dumps(job))
    full_env = {k: v for k, v in os.environ.items() if k not in ENGINE_MODE_VARIABLES} | env
    with open(root / f"{name}.log", "w") as log:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [str(VLLM_PY), str(DRIVER), str(root / f"{name}.json")], env=full_env, stdout=log, stderr=subprocess.STDOUT
        )


def finish_job(proc, root: Path, name: str, timeout: float = 600) -> dict:
    """Wait for the job; its captures (`hf`, `engine`, `again`, and with a LoRA `lora_hf`, `lora_engine`,
    `after_lora`) as capture.PromptCapture lists and its JSON record (only the record when the engine refused the
    measurement)."""
    import json

    import numpy as np

    from lm_eval_sink.capture import PromptCapture

    rc = proc.wait(timeout=timeout)
    assert rc == 0, (root / f"{name}.log").read_text()[-4000:]
    meta = json.loads((root / f"{name}_out.json").read_text())
    if "refused" in meta:
        return meta
    data = np.load(root / f"{name}_out.npz")
    sides = {}
    for side in meta["sides"]:
        sides[side] = [
            PromptCapture(layers=(0, 1), **{f: data[f"{side}_{j}_{f}"] for f in DRIVER_FIELDS})
            for j in range(meta["n_prompts"])
        ]
    return {**meta, **sides}


def largest_differences(a: list, b: list) -> dict[str, float]:
    """The largest |a - b| of each per-row statistic over every prompt, layer, head and row; for the sink key and
    pos0 visibility, the number of rows that differ; the rows' count."""
    import numpy as np

    out = {"rows": sum(x.sink_logodds.size for x in a)}
    for f in ("sink_logodds", "pos0_mass"):
        out[f] = max(float(np.abs(getattr(x, f) - getattr(y, f)).max()) for x, y in zip(a, b, strict=True))
    for f in ("sink_pos", "pos0_visible"):
        out[f] = sum(int((getattr(x, f) != getattr(y, f)).sum()) for x, y in zip(a, b, strict=True))
    return out
