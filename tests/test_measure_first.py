"""S under a backend without attention access, measured first with transformers (`harness/measure_first.py`).

lm-eval's `dummy` backend takes any model_args and has no attention, as vLLM: it runs the same path
in this venv in seconds (the real vLLM runs are in tests/test_backends.py).
"""

from __future__ import annotations

import json
import shutil

import pytest

from lm_eval_sink.errors import UserError

TASK = "sink_strength_n5"


def _evaluate(model: str, model_args: str, **kwargs):
    import lm_eval

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True, **kwargs)


@pytest.fixture(scope="module")
def task_manager():
    """One index of lm-eval's tasks shared where a call need not build its own (seconds each)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def test_a_backend_without_attention_gets_the_hf_results_measured_first(handset_llama_dir, task_manager):
    """Every metric, the layer x head matrix and each sample's rows equal `--model hf`'s; the task's metadata
    says how S was measured (a child process of transformers) and which backend arguments it left out."""
    hf = _evaluate("hf", f"pretrained={handset_llama_dir}", device="cpu", task_manager=task_manager)
    first = _evaluate("dummy", f"pretrained={handset_llama_dir},dtype=float32,tensor_parallel_size=2")
    assert first["results"][TASK] == hf["results"][TASK]
    assert first["results"][TASK]["sink_strength_layer_head,none"]["layers"] == [0, 1, 2]
    rows = {name: [s["sink_strength"] for s in res["samples"][TASK]] for name, res in (("hf", hf), ("first", first))}
    assert rows["first"] == rows["hf"] and len(rows["hf"]) == 5
    record = first["configs"][TASK]["metadata"]["capture"]
    assert record["capture_backend"] == "hf" and record["process"].startswith("a child process, before lm-eval")
    assert record["model_args_ignored"] == ["tensor_parallel_size"]
    assert record["captured_with"] == "sdpa" and record["device_map"] == "cpu" and record["dtype"] == "float32"
    own = hf["configs"][TASK]["metadata"]["capture"]
    assert own["process"] == "lm-eval's own, on the model it built" and own["adapter"] is None
    assert record["wall_seconds"] > 0
    assert {k: v for k, v in record.items() if k not in ("process", "model_args_ignored", "wall_seconds")} == {
        k: v for k, v in own.items() if k not in ("process", "adapter")
    }


@pytest.fixture(scope="module")
def unloadable(tmp_path_factory, handset_llama_dir):
    """Checkpoints transformers cannot load for S: a GGUF file, a vLLM-only quantization, a config of no causal LM,
    a class the capture refuses."""
    root = tmp_path_factory.mktemp("unloadable")
    (root / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    quant = root / "quantized"
    shutil.copytree(handset_llama_dir, quant)
    config = json.loads((quant / "config.json").read_text())
    (quant / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "vllm_only"}}))
    (root / "vit").mkdir()
    (root / "vit" / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (root / "bloom").mkdir()
    (root / "bloom" / "config.json").write_text(json.dumps({"model_type": "bloom", "n_layer": 2}))
    return root


@pytest.mark.parametrize(
    ("model_args", "needle"),
    [
        ("pretrained={root}/model.Q4_K_M.gguf", "is one file (GGUF?), which transformers cannot load to measure S"),
        ("pretrained={root}/quantized", "is quantized with vllm_only, which transformers cannot load"),
        ("pretrained={root}/vit", "model type 'vit' is not a causal LM transformers knows"),
        ("pretrained={root}/bloom", "BloomForCausalLM does not route attention through transformers'"),
        ("pretrained={root}/nope", "transformers cannot read its config"),
        ("pretrained={llama},dtype=fp8", "dtype=fp8 is not a dtype transformers loads for S"),
        ("pretrained={llama},lora_local_path={root}", "lora_local_path is a LoRA adapter that only the dummy engine"),
        ("max_length=16", "needs attention weights, which the dummy backend does not expose"),
    ],
)
def test_what_s_cannot_be_measured_on_is_one_line_before_anything_loads(
    unloadable, handset_llama_dir, task_manager, model_args, needle
):
    with pytest.raises(UserError) as e:
        _evaluate("dummy", model_args.format(root=unloadable, llama=handset_llama_dir), task_manager=task_manager)
    assert needle in e.value.line() and "\n" not in e.value.line()
    assert e.value.line().startswith(f"task {TASK} ")
