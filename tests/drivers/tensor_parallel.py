"""A tensor-parallel tiny Llama in torchrun processes on CPU (gloo); used by test_loading.py.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 tensor_parallel.py MODEL OUT
MODEL (4 attention heads) is loaded with tp_plan="auto". Each rank records the model's tp_size and
the heads its attention sees in one forward (the query's head axis), then asks each caller that
measures Sink Strength to measure it: `strength.measure` (the `strength` command), the callback's
`measure_in_training` and the lm-eval task's request method on an HFLM of the model. Each must refuse
in one line before any forward. Each rank writes OUT/rank<r>.json.
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM, AutoTokenizer

import lm_eval_sink.harness.task  # noqa: F401  (gives HFLM its sink_strength request method)
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings, measure
from lm_eval_sink.training.callback import measure_in_training

model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(model_dir)
settings = StrengthSettings(n_prompts=5)

heads: list[int] = []  # q_proj's output on this rank, in heads: the query's head axis its attention sees
attn = model.model.layers[0].self_attn
hook = attn.q_proj.register_forward_hook(lambda module, args, output: heads.append(output.shape[-1] // attn.head_dim))
with torch.no_grad():
    model(input_ids=torch.tensor([[tok.bos_token_id, 7, 8, 9]]))
hook.remove()

forwards: list[int] = []
model.register_forward_pre_hook(lambda module, args: forwards.append(1))


def refusal(call) -> dict:
    try:
        call()
    except UserError as e:
        return {"line": e.line(), "forwards": len(forwards)}
    return {"line": None, "forwards": len(forwards)}


request = Instance(
    request_type="sink_strength",
    doc={"prompt_id": 0, "prompt": "write a list"},
    arguments=("write a list", {"task": "sink_strength", "settings": asdict(settings)}),
    idx=0,
)
lm = HFLM(pretrained=model, tokenizer=tok, batch_size=1)
record = {
    "world_size": dist.get_world_size(),
    "tp_size": model.tp_size,
    "config_heads": model.config.num_attention_heads,
    "heads_seen": heads,
    "strength": refusal(lambda: measure(model, tok, settings, progress=False)),
    "callback": refusal(lambda: measure_in_training(model, tok, settings)),
    "task": refusal(lambda: lm.sink_strength([request])),
}
(out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
dist.barrier()
dist.destroy_process_group()
