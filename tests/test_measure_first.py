"""S under a backend without attention access, measured first with transformers (`harness/measure_first.py`).

lm-eval's `dummy` backend takes any model_args and has no attention, as vLLM: it runs the same path
in this venv in seconds (the real vLLM runs are in tests/test_backends.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import VLLM_PY, vllm_missing_reason
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
    assert record["revision"] is None and record["tokenizer_revision"] is None  # a local folder: no commit to pin
    child_only = ("process", "model_args_ignored", "wall_seconds", "revision", "tokenizer_revision")
    assert {k: v for k, v in record.items() if k not in child_only} == {
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
    _remote_code_folder(handset_llama_dir, root / "remote")
    return root


REMOTE_CODE = """from transformers import LlamaConfig, LlamaForCausalLM


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def _remote_code_folder(llama: Path, folder: Path) -> Path:
    """The hand-set Llama as a model type only its own code (modeling_tiny_remote.py, named by auto_map) loads."""
    shutil.copytree(llama, folder)
    (folder / "modeling_tiny_remote.py").write_text(REMOTE_CODE)
    config = json.loads((folder / "config.json").read_text())
    auto_map = {
        "AutoConfig": "modeling_tiny_remote.TinyRemoteConfig",
        "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
    }
    config |= {"model_type": "tiny_remote", "architectures": ["TinyRemoteForCausalLM"], "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("model_args", "needle"),
    [
        ("pretrained={root}/model.Q4_K_M.gguf", "is one file (GGUF?), which transformers cannot load to measure S"),
        ("pretrained={root}/quantized", "is quantized with vllm_only, which transformers cannot load"),
        ("pretrained={root}/vit", "model type 'vit' is not a causal LM transformers knows"),
        ("pretrained={root}/bloom", "BloomForCausalLM does not route attention through transformers'"),
        ("pretrained={root}/nope", "transformers cannot read its config"),
        ("pretrained={root}/remote", "the code in its own folder (config.json auto_map: AutoConfig, AutoModelForCausa"),
        ("pretrained={root}/remote,trust_remote_code=False", "which transformers runs only with trust_remote_code"),
        ("pretrained={llama},dtype=fp8", "dtype=fp8 is not a dtype transformers loads for S"),
        ("pretrained={llama},lora_local_path={root}", "lora_local_path is a LoRA adapter that only the dummy engine"),
    ],
)
def test_what_s_cannot_be_measured_on_is_one_line_before_anything_loads(
    unloadable, handset_llama_dir, task_manager, model_args, needle
):
    with pytest.raises(UserError) as e:
        _evaluate("dummy", model_args.format(root=unloadable, llama=handset_llama_dir), task_manager=task_manager)
    assert needle in e.value.line() and "\n" not in e.value.line()
    assert e.value.line().startswith(f"task {TASK} ")


SHA_MODEL, SHA_TOKENIZER = "1" * 40, "2" * 40


def test_remote_code_from_a_pinned_hub_revision_is_measured_as_the_engine_loads_it(
    handset_llama_dir, tiny_tokenizer, tmp_path
):
    """A remote-code model at a hub tag, its tokenizer in another repo, in an offline HF cache: the child loads the
    model's own class with trust_remote_code, the weights at the tag's commit and the tokenizer at its default
    branch (lm-eval's vLLM model never applies `revision` to the tokenizer); both commits are resolved once, handed
    to the engine in its model_args and named in the capture record; S is the closed form."""
    import subprocess
    import sys

    import sinkmodels as sm
    from helpers import hf_cache_snapshot
    from lm_eval_sink.calibration import builtin_prompts, encode_prompts

    remote = _remote_code_folder(handset_llama_dir, tmp_path / "remote")
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in handset_llama_dir.iterdir():  # a tokenizer repo: its files and a config (AutoTokenizer reads one)
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "config")):
            shutil.copy(f, tok / f.name)
    hub = tmp_path / "hf" / "hub"
    hf_cache_snapshot(hub, "org/remote", remote, SHA_MODEL, refs=("v1",))
    hf_cache_snapshot(hub, "org/tok", tok, SHA_TOKENIZER)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    model_args = "pretrained=org/remote,revision=v1,tokenizer=org/tok,trust_remote_code=True"
    code = (
        "import json, lm_eval; "
        f"r = lm_eval.simple_evaluate(model='dummy', model_args={model_args!r}, tasks=[{TASK!r}]); "
        f"print(json.dumps({{'s': r['results'][{TASK!r}]['sink_strength,none'], "
        f"'model_args': r['config']['model_args'], 'capture': r['configs'][{TASK!r}]['metadata']['capture']}}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    engine = dict(kv.split("=", 1) for kv in got["model_args"].split(","))
    assert engine["revision"] == SHA_MODEL and engine["tokenizer_revision"] == SHA_TOKENIZER
    assert got["capture"]["revision"] == SHA_MODEL and got["capture"]["tokenizer_revision"] == SHA_TOKENIZER
    assert list((tmp_path / "hf" / "modules" / "transformers_modules").rglob("modeling_tiny_remote.py"))
    lengths = [len(x) for x in encode_prompts(tiny_tokenizer, builtin_prompts()[:5]).input_ids]
    assert got["s"] == pytest.approx(sm.expected_strength("llama", 3, lengths, last_k=10)[0], abs=1e-5)


@pytest.mark.skipif(not VLLM_PY.exists(), reason=vllm_missing_reason())
def test_the_child_loads_a_soft_capped_model_eager_under_the_vllm_venvs_transformers(tiny_tokenizer, tmp_path):
    """vLLM pins a transformers (5.19) that still loads Gemma 2 with sdpa, whose kernel drops attention
    soft-capping: the measure-first child, run there, loads it eager and computes the model's own logits."""
    import subprocess

    from test_architectures import _build

    folder = tmp_path / "gemma2"
    _build("gemma2", len(tiny_tokenizer), tiny_tokenizer.pad_token_id).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    code = (
        "import sys, torch, transformers\n"
        "from lm_eval_sink.harness.measure_first import HfLoad, _load\n"
        "model, _ = _load(HfLoad(pretrained=sys.argv[1], dtype='float32'))\n"
        "eager = transformers.Gemma2ForCausalLM.from_pretrained(sys.argv[1], attn_implementation='eager')\n"
        "ids = torch.tensor([[1, 5, 7, 9, 11, 13, 15]])\n"
        "with torch.no_grad():\n"
        "    diff = (model(ids).logits - eager(ids).logits).abs().max().item()\n"
        "print(model.config._attn_implementation, diff)\n"
    )
    proc = subprocess.run(
        [str(VLLM_PY), "-c", code, str(folder)], capture_output=True, text=True, timeout=300, env=os.environ.copy()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    impl, diff = proc.stdout.split()[-2:]
    assert impl == "eager" and float(diff) < 1e-6, proc.stdout


FLAGS = {"1": True, "yes": True, "True": True, "true": True, "0": False, "false": False, "False": False, "": False}


def test_every_reader_of_a_boolean_model_argument_reads_it_as_lm_eval_hands_it_the_model_class(
    handset_llama_dir, tmp_path
):
    """ "1", "yes" and "True" are on, "0", "false" and "" off, as lm-eval's parse of `--model_args` and the truthiness
    the model classes apply make them ("no" is a non-empty string to lm-eval: on); the S child's load, the
    resident's placement and the protocol check's config read agree on each value."""
    from lm_eval.utils import handle_arg_string

    from lm_eval_sink.harness.checks import _max_length
    from lm_eval_sink.harness.inprocess import resident_device
    from lm_eval_sink.harness.measure_first import hf_load_args
    from lm_eval_sink.harness.model_args import model_arg_flag
    from lm_eval_sink.harness.runner import EvalSettings

    table = {**FLAGS, "no": True, "none": False, "0.0": False, "'0'": True, " TRUE ": True}
    assert {v: model_arg_flag(v) for v in table} == table == {v: bool(handle_arg_string(v)) for v in table}
    assert model_arg_flag(True) and not model_arg_flag(0) and model_arg_flag(1)

    remote = str(_remote_code_folder(handset_llama_dir, tmp_path / "remote"))

    def max_length(value: str) -> bool:
        try:
            return _max_length(remote, EvalSettings(tasks=(TASK,), model_args={"trust_remote_code": value})) > 0
        except UserError:
            return False  # the remote config is read only with trust_remote_code on

    got = {
        v: (
            hf_load_args({"pretrained": remote, "trust_remote_code": v}, TASK, "vllm").trust_remote_code,
            resident_device(EvalSettings(tasks=(TASK,), device="cpu", model_args={"parallelize": v}), "cpu") == "auto",
            max_length(v),
        )
        for v in FLAGS
    }
    assert got == {v: (on, on, on) for v, on in FLAGS.items()}
