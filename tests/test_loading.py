"""Models loaded where they run (`devices.place`, `--device auto`), and what is refused: a model that does not fit,
a tensor-parallel model, offloaded weights under an in-memory sweep. CPU only; the GPU paths are planned here
on fake GPU budgets (accelerate's map works on the meta device) and run by the GPU check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from helpers import CHILD_ENV
from lm_eval_sink.devices import DEFAULT_DEVICE, check_device, empty_model, gpu_map, layers_per_device, resolve_device
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what auto and cuda mean without a GPU")
TASKS = Path(__file__).parent / "data" / "merging_task"
SETTINGS = StrengthSettings(n_prompts=5, last_k=2)
# The closed-form Llama on the CPU but layer 1 on the disk: accelerate's hooks bring its weights in at each forward.
OFFLOAD_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def offloaded(handset_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("offload")
    model = AutoModelForCausalLM.from_pretrained(
        handset_llama_dir, dtype=torch.float32, device_map=OFFLOAD_MAP, offload_folder=str(folder)
    )
    return model.eval()


def test_device_values_are_checked_once_in_one_line(tmp_path, user_error, tiny_trio):
    assert [check_device(d) for d in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    for bad in ("gpu", "cuda:", "cuda:x", "CPU"):
        with pytest.raises(UserError, match="unknown device"):
            check_device(bad)
    out = tmp_path / "out"
    assert "unknown device 'gpu'" in user_error(["strength", "default", "--device", "gpu", "--output", out], out)
    sweep = tmp_path / "sweep.yaml"
    models = {"reference": str(tiny_trio["reference"]), "candidate": str(tiny_trio["candidate"])}
    sweep.write_text(yaml.safe_dump({"models": models, "eval": False, "strength": {"device": "gpu"}}))
    line = user_error(["sweep", sweep], tmp_path / "out")
    assert "strength.device: device is auto (every visible GPU, else the CPU), cuda, cuda:N or cpu" in line, line


@CPU_ONLY
def test_auto_is_the_default_and_is_the_cpu_without_a_gpu():
    from lm_eval_sink.cli import cli
    from lm_eval_sink.harness.runner import EvalSettings

    for name in ("strength", "screen", "margin", "protect-plan"):
        device = next(p for p in cli.commands[name].params if p.name == "device")
        assert device.default == DEFAULT_DEVICE == "auto", name
    assert resolve_device("auto") == ("cpu",)
    with pytest.raises(UserError, match="device cuda: no CUDA GPU is visible here"):
        resolve_device("cuda")
    settings = EvalSettings(tasks=("t",))
    assert settings.device == "auto" and "--device cpu" in " ".join(settings.command("m", Path("o")))


def test_load_model_places_the_weights_and_records_layers_per_device(handset_llama_dir):
    """The provenance names the devices and the decoder layers on each."""
    from lm_eval_sink.models import load_model
    from lm_eval_sink.strength import measure_model

    loaded = load_model(handset_llama_dir, dtype="float32", device="cpu")
    assert {p.device.type for p in loaded.model.parameters()} == {"cpu"}
    assert loaded.info["device"] == "cpu" and loaded.info["device_map"] == {"cpu": 3}
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    assert loaded.info["weight_bytes"] == sum(t.numel() * t.element_size() for t in tensors)  # from the config
    prov = measure_model(str(handset_llama_dir), SETTINGS, dtype="float32", device="cpu", progress=False).provenance
    assert prov["model"]["device_map"] == {"cpu": 3}


def test_a_model_that_does_not_fit_is_one_line_before_any_weight_is_read(tmp_path, user_error):
    """A 405B-shaped Llama config beside a small whole weights file: the size comes from the config."""
    from transformers import LlamaConfig

    big = tmp_path / "big"
    LlamaConfig(
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128, vocab_size=128256
    ).save_pretrained(big)
    save_file({"x": torch.zeros(1)}, big / "model.safetensors")  # whole, its tensors never read
    out = tmp_path / "out"
    line = user_error(["strength", big, "--dtype", "float32", "--device", "cpu", "--output", out])
    assert "GiB of float32 weights do not fit the free memory of cpu" in line, line
    assert "smaller dtype" in line and not list(out.glob("*.json"))


def test_several_gpus_share_the_layers_and_a_model_too_large_is_mapped_off_them():
    """accelerate's balanced map over two GPUs' free memory (planned on the meta device, as `place` does)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.accelerate import compute_module_sizes

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4, vocab_size=256
    )
    empty = empty_model(AutoModelForCausalLM, config, torch.bfloat16)
    size = compute_module_sizes(empty)[0][""]
    spread = gpu_map(empty, {"cuda:0": size, "cuda:1": size})
    layers = layers_per_device(empty, spread)
    assert set(layers) == {"cuda:0", "cuda:1"} and sum(layers.values()) == 8, layers
    assert set(spread.values()) == {"cuda:0", "cuda:1"}
    assert "disk" in gpu_map(empty, {"cuda:0": size // 4, "cuda:1": size // 4}).values()


def test_s_is_unchanged_through_accelerates_offload_hooks(handset_llama_dir, offloaded):
    """The capture follows each layer's device: layer 1 lives on the disk and comes in through a hook."""
    from lm_eval_sink.models import load_model
    from lm_eval_sink.strength import measure

    layer1 = offloaded.model.layers[1]
    assert hasattr(layer1, "_hf_hook") and all(p.is_meta for p in layer1.parameters())
    plain = load_model(handset_llama_dir, dtype="float32", device="cpu")
    got = measure(offloaded, plain.tokenizer, SETTINGS, progress=False).to_json()
    want = measure(plain.model, plain.tokenizer, SETTINGS, progress=False).to_json()
    got.pop("provenance"), want.pop("provenance")
    assert got == want and got["n_heads"] == 2 and got["layers"] == [1, 2]


def test_a_merge_into_offloaded_weights_is_refused(handset_llama_dir, offloaded):
    from lm_eval_sink.merging.inmemory import endpoint_text, merge_into

    with pytest.raises(UserError, match=r"'model\.layers\.1\..*' \(and \d+ more\) is offloaded"):
        merge_into(offloaded, endpoint_text(str(handset_llama_dir)), "reference")


def test_tensor_parallel_model_is_refused_before_any_forward(tiny_trio, tmp_path):
    """Two torchrun processes over gloo: tp_plan="auto" gives tp_size 2 and 2 of the 4 heads per rank; the
    strength measurement, the training callback and the lm-eval task each refuse it in one line, no forward run."""
    driver = Path(__file__).parent / "drivers" / "tensor_parallel.py"
    env = {**os.environ, **CHILD_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(driver), str(tiny_trio["reference"]), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (r["world_size"], r["tp_size"], r["config_heads"], r["heads_seen"]) == (2, 2, 4, [2])
        for caller in ("strength", "callback", "task"):
            line, forwards = r[caller]["line"], r[caller]["forwards"]
            assert line and "tensor-parallel model (tp_size 2)" in line and "\n" not in line, (caller, line)
            assert forwards == 0, caller


def _in_memory_sweep(folder: Path, trio: dict[str, Path], model_args: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "output": "out",
        "models": {"reference": str(trio["reference"]), "candidate": str(trio["candidate"])},
        "configs": ["linear_95_5"],
        "merge": {"in_memory": True},
        "eval": {"tasks": ["lm_eval_sink_tiny_choice"], "include_path": str(TASKS), "model_args": model_args},
        "strength": {"n_prompts": 5, "last_k": 2},
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("model_args", "needle"),
    [
        ({"tp_plan": "auto"}, "eval.model_args.tp_plan: a tensor-parallel resident"),
        ({"offload_folder": "off"}, "eval.model_args.offload_folder: the resident model is placed by eval.device"),
        ({"device_map": "auto"}, "eval.model_args.device_map: the resident model is placed by eval.device"),
    ],
)
def test_in_memory_sweeps_refuse_a_placement_of_their_own(tmp_path, tiny_trio, user_error, model_args, needle):
    line = user_error(["sweep", _in_memory_sweep(tmp_path, tiny_trio, model_args), "--quiet"], tmp_path / "out")
    assert needle in line, line


@CPU_ONLY
def test_parallelize_places_the_in_memory_resident_on_every_gpu(tmp_path, tiny_trio):
    """lm-eval's parallelize=True is the resident's device `auto` (here: the CPU), and the in-process evaluation
    runs (lm-eval refuses parallelize=True together with a loaded model)."""
    from lm_eval_sink.commands.sweep import load_sweep
    from lm_eval_sink.harness.inprocess import evaluate, load_resident

    spec = load_sweep(_in_memory_sweep(tmp_path, tiny_trio, {"parallelize": True}))
    resident = load_resident(spec.models["reference"], spec.eval)
    assert resident.placement.device_map == {"": "cpu"} and resident.placement.layers == {"cpu": 2}
    run = evaluate(resident, spec.eval, tmp_path / "run", spec.models["reference"])
    assert json.loads(run.results.read_text())["results"]["lm_eval_sink_tiny_choice"]["acc,none"] >= 0
