"""The resident vLLM engine's decisions, without vLLM (`merging.engine_reuse`), and the sweep options around it."""

from __future__ import annotations

import json
import struct

import pytest
import yaml

from lm_eval_sink.commands.engine_sweep import EngineS
from lm_eval_sink.merging.engine_reuse import (
    WEIGHTS,
    assign,
    differences,
    engine_fields,
    engine_starts,
    new_engine_reason,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 96, "dtype": "float32"}


def _facts(**config) -> dict:
    return {
        "config": {**CONFIG, "_name_or_path": "/a", "transformers_version": "5.24.0", **config},
        "generation_config": {"eos_token_id": 2, "transformers_version": "5.24.0"},
        "tokenizer_config": {"eos_token": "</s>", "is_local": True},
        "files": {"tokenizer.json": "aa", "chat_template.jinja": "bb"},
        "tensors": {"embed.weight": [96, 64]},
    }


def test_fields_keep_what_an_engine_fixes_and_drop_where_a_file_came_from():
    fields = engine_fields(_facts(), "auto")
    assert fields["config.json hidden_size"] == 64 and fields["config.json dtype"] == "float32"
    assert fields["generation_config.json eos_token_id"] == 2 and fields["tokenizer_config.json eos_token"] == "</s>"
    assert fields["tokenizer file chat_template.jinja"] == "bb" and WEIGHTS in fields
    assert not [k for k in fields if "_name_or_path" in k or "transformers_version" in k or "is_local" in k]
    # a copy elsewhere, written by another transformers, loaded another way: the same engine
    other = _facts(_name_or_path="/b", transformers_version="5.19.0")
    other["tokenizer_config"]["is_local"] = False
    assert engine_fields(other, "auto") == fields


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"config": {**CONFIG, "vocab_size": 128}}, "config.json vocab_size"),
        ({"files": {"tokenizer.json": "aa", "chat_template.jinja": "cc"}}, "tokenizer file chat_template.jinja"),
        ({"generation_config": {"eos_token_id": 7}}, "generation_config.json eos_token_id"),
        ({"tokenizer_config": {"eos_token": "<|im_end|>"}}, "tokenizer_config.json eos_token"),
        ({"tensors": {"embed.weight": [128, 64]}}, WEIGHTS),
    ],
)
def test_each_fixed_setting_that_differs_is_named(change, field):
    assert differences(engine_fields(_facts(), None), engine_fields({**_facts(), **change}, None)) == [field]


def test_a_dtype_the_settings_fix_makes_the_checkpoints_dtype_irrelevant():
    bf16 = _facts(dtype="bfloat16")
    assert differences(engine_fields(_facts(), "auto"), engine_fields(bf16, "auto")) == ["config.json dtype"]
    assert engine_fields(_facts(), "float32") == engine_fields(
        {**bf16, "config": {**CONFIG, "torch_dtype": "x"}}, "float32"
    )


def test_engine_starts_in_run_order():
    a, b = engine_fields(_facts(), None), engine_fields(_facts(vocab_size=128), None)
    starts = engine_starts(["ref", "cand", "m1", "m2", "m3"], {"ref": a, "cand": b, "m1": b, "m2": None, "m3": a})
    assert starts == [
        ("ref", "the first checkpoint"),
        ("cand", "cand differs from ref in config.json vocab_size"),
        ("m1", None),  # the candidate's engine takes it
        ("m2", None),  # not merged yet: decided when it runs
        ("m3", "m3 differs from cand in config.json vocab_size"),
    ]


def test_a_running_sweep_starts_a_new_engine_first_after_a_failure_then_for_a_fixed_setting_that_differs():
    a, b = engine_fields(_facts(), None), engine_fields(_facts(vocab_size=128), None)
    assert new_engine_reason(None, None, "ref", a) == "the first checkpoint"
    assert new_engine_reason(("ref", a), None, "m1", a) is None  # the running engine takes its weights
    assert new_engine_reason(("ref", a), None, "cand", b) == "cand differs from ref in config.json vocab_size"
    # a failed unit rules its engine out, even for a checkpoint it holds (the weights may be half written)
    assert new_engine_reason(("ref", a), "eval:m1", "m2", a) == "the previous unit (eval:m1) failed"
    assert new_engine_reason(None, "eval:m1", "cand", b) == "the previous unit (eval:m1) failed"


def test_assign_prefers_the_actor_whose_engine_holds_the_unit():
    a, b = {"x": 1}, {"x": 2}
    actors = [("p", a, True), ("q", b, True)]
    assert assign(actors, [("u1", b), ("u2", a)]) == [("p", "u2"), ("q", "u1")]
    # one idle actor holding a, units of b first in plan order: it still takes its own engine's unit
    assert assign([("p", a, True), ("q", b, False)], [("u1", b), ("u2", a)]) == [("p", "u2")]


def test_assign_leaves_a_unit_to_the_busy_actor_that_holds_its_engine_unless_nothing_else_is_left():
    a, b, c = {"x": 1}, {"x": 2}, {"x": 3}
    # p (no engine) skips u1, which busy q's engine holds, and takes u2
    assert assign([("p", None, True), ("q", b, False)], [("u1", b), ("u2", c)]) == [("p", "u2")]
    # only units of q's engine are left: p takes the first rather than sit idle
    assert assign([("p", a, True), ("q", b, False)], [("u1", b), ("u2", b)]) == [("p", "u1")]
    assert assign([("p", a, False)], [("u1", a)]) == []  # no idle actor
    assert assign([("p", None, True), ("q", None, True)], [("u1", a)]) == [("p", "u1")]  # more actors than units


# --- the options, the plan note and the refusal, without an engine --------------------------------------------


def _vllm_sweep(tmp_path, trio, strength=False, **evals):
    """A tiny vLLM sweep file (the tiny choice task; `python` unset: this interpreter, whose task index is cached)."""
    from helpers import TINY_SWEEP_TASK, TINY_SWEEP_TASKS, write_tiny_sweep

    vllm = {"tasks": [TINY_SWEEP_TASK], "include_path": str(TINY_SWEEP_TASKS), "backend": "vllm", **evals}
    return write_tiny_sweep(tmp_path, trio, configs=["linear_95_5"], eval=vllm, strength=strength)


def test_engine_reuse_is_the_vllm_default_and_fresh_engine_turns_it_off(tmp_path, tiny_trio, user_error):
    from lm_eval_sink.commands.sweep import load_sweep

    path = _vllm_sweep(tmp_path, tiny_trio)
    assert load_sweep(path).engine_reuse is True
    assert load_sweep(path, fresh_engine=True).engine_reuse is False
    assert load_sweep(_vllm_sweep(tmp_path / "off", tiny_trio, engine_reuse=False)).engine_reuse is False
    hf = _vllm_sweep(tmp_path / "hf", tiny_trio, backend="hf", engine_reuse=True)
    line = user_error(["sweep", hf, "--quiet"], tmp_path / "hf" / "out")
    assert "eval.engine_reuse is a vLLM setting, but eval.backend is hf" in line
    parallel = _vllm_sweep(tmp_path / "dp", tiny_trio, model_args={"data_parallel_size": 2})
    line = user_error(["sweep", parallel, "--quiet"], tmp_path / "dp" / "out")
    assert "eval.engine_reuse with model_args.data_parallel_size 2" in line and "--fresh-engine" in line
    assert load_sweep(parallel, fresh_engine=True).engine_reuse is False
    # the engine calls its workers through its own worker extension: a user's is refused, kept with --fresh-engine
    own = _vllm_sweep(tmp_path / "ext", tiny_trio, model_args={"worker_extension_cls": "my_rl.Extension"})
    line = user_error(["sweep", own, "--quiet"], tmp_path / "ext" / "out")
    assert "eval.model_args.worker_extension_cls my_rl.Extension" in line and "--fresh-engine" in line, line
    assert load_sweep(own, fresh_engine=True).engine_reuse is False
    # an interpreter without vLLM is check_interpreter's to refuse, not the resident engine's
    assert "engine_reuse" not in user_error(["sweep", path, "--quiet"], tmp_path / "out")


def test_the_plan_note_names_a_checkpoint_that_gets_an_engine_of_its_own(tmp_path, tiny_trio):
    import shutil

    from lm_eval_sink.commands.sweep import load_sweep, plan_sweep
    from lm_eval_sink.commands.engine_sweep import plan_notes

    cand = tmp_path / "cand"
    shutil.copytree(tiny_trio["candidate"], cand)
    config = json.loads((cand / "config.json").read_text())
    (cand / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    path = _vllm_sweep(tmp_path, {**tiny_trio, "candidate": cand})
    plan = plan_sweep(load_sweep(path))
    assert plan_notes(plan, list(plan.units)) == [
        "vllm engine: one resident engine for the sweep, each checkpoint's weights swapped into it in place "
        "(--fresh-engine: one engine per checkpoint)",
        "vllm engine: candidate gets an engine of its own: candidate differs from reference in config.json "
        "max_position_embeddings",
    ]
    fresh = plan_sweep(load_sweep(path, fresh_engine=True))
    assert plan_notes(fresh, list(fresh.units)) == [
        "vllm engine: one per checkpoint (--fresh-engine / eval.engine_reuse: false)"
    ]


def _older_vllm(root, version="0.6.3"):
    """An overlay that makes the vLLM of .venv-vllm look like an older one to an interpreter that puts `root` first
    on its path: the package's files linked, but a gpu_worker.py whose Worker has no reload_weights, and a `vllm`
    distribution of `version`."""
    import subprocess
    from pathlib import Path

    from helpers import VLLM_PY

    real = Path(
        subprocess.run(
            [str(VLLM_PY), "-c", "import importlib.util as u; print(u.find_spec('vllm').origin)"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    ).parent

    def link(src, dst, keep):
        dst.mkdir(parents=True)
        for entry in src.iterdir():
            if entry.name != keep:
                (dst / entry.name).symlink_to(entry)

    link(real, root / "vllm", "v1")
    link(real / "v1", root / "vllm" / "v1", "worker")
    link(real / "v1" / "worker", root / "vllm" / "v1" / "worker", "gpu_worker.py")
    source = (real / "v1" / "worker" / "gpu_worker.py").read_text()
    (root / "vllm" / "v1" / "worker" / "gpu_worker.py").write_text(source.replace("def reload_weights(", "def _gone("))
    meta = root / f"vllm-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def test_a_vllm_without_reload_weights_is_refused_in_one_line_naming_its_version(
    tmp_path, tiny_trio, user_error, monkeypatch
):
    from helpers import VLLM_PY

    from lm_eval_sink.harness.engine_client import reload_support

    assert reload_support(str(VLLM_PY)) == {
        "vllm": "0.32.0+cpu",
        "vllm_module": True,
        "reload_weights": True,
        "collective_rpc": True,
        "reset_prefix_cache": True,
    }
    monkeypatch.setenv("PYTHONPATH", str(_older_vllm(tmp_path / "old")))
    path = _vllm_sweep(tmp_path, tiny_trio, python=str(VLLM_PY))
    line = user_error(["sweep", path, "--quiet"], tmp_path / "out")
    assert f"eval.engine_reuse: vLLM 0.6.3 in {VLLM_PY} has no reload_weights" in line and "--fresh-engine" in line
    assert not (tmp_path / "out").exists()


def test_safetensors_header_shapes(tmp_path):
    from lm_eval_sink.weights import Tensor, file_tensors

    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {}})
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(24))
    assert file_tensors(tmp_path / "w.safetensors") == {"a": Tensor("w.safetensors", "F32", (2, 3))}


# --- the engine's LLM(...) arguments, with a stand-in for vLLM's LLM (no engine starts) --------------------------


def test_a_hub_reference_and_a_local_merge_share_the_resident_engine(tmp_path, tiny_trio):
    """lm-eval's own vLLM model (in .venv-vllm) asks the resident engine for each checkpoint with the model_args
    measure-first hands it: a hub id's revisions pinned to its commit (offline HF cache), none for a local folder.
    The per-checkpoint arguments do not count, so the local merge after the hub reference, and the reference again,
    get the engine's weights swapped in; every call into the workers names a method of the worker extension the
    engine is built with; lm-eval's own engine (no resident) gets the worker extension where it is built. The same
    process decides, for lm-eval's own VLLM class, where S is measured: on the engine for a Llama, else (quantization=,
    an architecture the capture is not verified on, an unreadable config) with the transformers child, and why."""
    import os
    import subprocess

    from helpers import REPO, VLLM_PY, hf_cache_snapshot

    from lm_eval_sink.harness.engine_worker import WORKER_EXTENSION

    if not VLLM_PY.is_file():
        pytest.skip("needs .venv-vllm")
    sha = "5e1f" * 10  # a commit id (all digits would be parsed as a number by lm-eval's model_args parser)
    hf_cache_snapshot(tmp_path / "hf" / "hub", "org/tiny", tiny_trio["reference"], sha)
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / sha
    local = tiny_trio["candidate"]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    units = [f"org/tiny={snapshot}", f"{local}={local}", f"org/tiny={snapshot}"]
    other = tmp_path / "phi3"  # an architecture the engine's capture is not verified on: its config.json suffices
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}))
    driver = REPO / "tests" / "drivers" / "resident_arguments.py"
    argv = [str(VLLM_PY), str(driver), *units, "--decide", str(local), str(other), str(tmp_path / "none")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["errors"] == [None, None, None, None], got["errors"]
    # vLLM's start-up memory check (vllm_preflight) is asked where an engine starts, not where the running engine
    # takes the checkpoint: it counted the engine's own memory against a start that never comes (review of issue 43:
    # a CPU sweep whose share fits once was refused from its second unit on)
    first, *swapped = got["preflight"]
    assert first.startswith("--model vllm: vLLM's CPU engine would not start") and swapped == [None, None], first
    (build, arguments), storage, *swaps = got["calls"]
    assert build == "build" and arguments["model"] == "org/tiny" and arguments["tokenizer_revision"] == sha
    assert arguments["revision"] == sha and arguments["worker_extension_cls"] == WORKER_EXTENSION
    assert storage == ["collective_rpc", "weight_storage", None]

    def swap(weights):
        reload = ["collective_rpc", "reload_weights", {"weights_path": weights}]
        return [reload, ["reset_prefix_cache"], ["collective_rpc", "reseed", None], storage]

    assert swaps == [*swap(str(local)), *swap(str(snapshot))]
    # lm_eval --model vllm alone: the hook's one change to the engine lm-eval builds is its worker extension, given
    # where lm-eval calls vLLM's LLM (review of issue 47: it was also injected into the model_args)
    ((build, arguments),) = got["alone"]
    assert (
        build == "build" and arguments["model"] == str(local) and arguments["worker_extension_cls"] == WORKER_EXTENSION
    )
    # where the start-up hook measures S under lm-eval's own VLLM class, decided before any engine is built
    assert got["methods"] == ["vllm_sink_strength", "_model_info"]  # VLLM got this project's methods (add_method)
    decided = got["decisions"]
    assert decided[str(local)]["plain"] is None  # a Llama: S on the engine lm-eval builds
    quantized = "model_args quantization=fp8: quantizes the weights as they load: the engine runs other weights"
    assert decided[str(local)]["quantization"].startswith(quantized)
    assert decided[str(other)]["plain"].startswith("Phi3ForCausalLM: the engine's statistics are verified against")
    assert decided[str(tmp_path / "none")]["plain"] == "its config.json could not be read before the engine is built"
    # the hook itself (discovery.measure_first_request) under --model vllm: the model_args as given and nothing said;
    # where the engine cannot measure S, one line says why and the child's capture record keeps it (review of issue
    # 43: the line's text and the decision were tested, not that the hook says it)
    from lm_eval_sink.harness.engine_strength import fallback_line

    hook = got["hook"]
    assert hook["engine"] == {"model_args": f"pretrained={local}", "said": "", "record": None}
    why = decided[str(local)]["quantization"]
    assert hook["quantization"]["said"] == fallback_line(["sink_strength"], why) + "\n"
    assert hook["quantization"]["record"]["not_on_engine"] == why


# --- accelerator memory beside the engine, at plan time -----------------------------------------------------------

GIB = 2**30


def test_room_beside_the_engine_is_the_devices_total_less_the_engines_share():
    """Four 80 GiB GPUs, an engine on the first two at vLLM's 0.92: a child over all four has the two others whole
    plus 8% of the engine's; a unit on cuda:0 alone has 6.4 GiB, and the fix names the share that leaves it room."""
    from lm_eval_sink.merging.engine_reuse import Need, room_refusal

    total = {f"cuda:{i}": 80 * GIB for i in range(4)}
    child = Need("the child", 140 * GIB, tuple(total))
    assert room_refusal(total, ("cuda:0", "cuda:1"), 0.92, [child]) is None
    strength = Need("the strength: units", 14 * GIB, ("cuda:0",))
    message, fix = room_refusal(total, ("cuda:0", "cuda:1"), 0.92, [child, strength])
    assert message == (
        "the resident vLLM engine takes 0.92 of cuda:0, cuda:1 (147.2 GiB of 160.0 GiB), which leaves 6.4 GiB of "
        "cuda:0 for the strength: units: 14.0 GiB"
    )
    assert fix.startswith("set eval.model_args.gpu_memory_utilization to 0.82 or lower, or pass --fresh-engine")
    assert room_refusal(total, ("cuda:0", "cuda:1"), 0.82, [strength]) is None
    # weights larger than the devices themselves: no share would do
    _, fix = room_refusal(total, ("cuda:0",), 0.92, [Need("x", 81 * GIB, ("cuda:0",))])
    assert fix.startswith("pass --fresh-engine")


def _weights_bytes(folder, itemsize=4):
    """The parameters of a safetensors checkpoint (read with safetensors), times `itemsize`."""
    import math

    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()) * itemsize


def test_a_resident_sweep_whose_units_need_the_engines_gpu_memory_is_refused_at_plan_time(
    tmp_path, tiny_trio, user_error, monkeypatch
):
    """One GPU (through the devices seams: visible GPUs, total memory) of 5 x the tiny checkpoint's float32 weights:
    vLLM's default 0.92 leaves 0.4 x for the child that measures sink_strength first, or for strength: units. S from
    the engine (a Llama, strength: in the engine's dtype) needs no second copy, so the same sweeps fit; where the
    engine cannot measure S (quantization=fp8; strength: in another dtype) the line says so."""
    from helpers import TINY_SWEEP_TASK

    from lm_eval_sink import devices
    from lm_eval_sink.commands.engine_sweep import engine_s
    from lm_eval_sink.commands.sweep import load_sweep

    need = _weights_bytes(tiny_trio["reference"])
    monkeypatch.setattr(devices, "resolve_device", lambda device: ("cuda:0",))
    monkeypatch.setattr(devices, "_total_memory", lambda found: {d: 5 * need for d in found})
    tasks = [TINY_SWEEP_TASK, "sink_strength"]
    fp8 = {"quantization": "fp8"}  # the engine would run other weights: S with the child, beside the engine
    path = _vllm_sweep(tmp_path, tiny_trio, tasks=tasks, dtype="float32", model_args=fp8)
    line = user_error(["sweep", path, "--quiet"], tmp_path / "out")
    assert "the resident vLLM engine takes 0.92 of cuda:0" in line, line
    assert "for the child that measures S first in each eval unit (reference's weights in float32)" in line
    assert "gpu_memory_utilization to 0.80 or lower" in line and "--fresh-engine" in line
    assert "(S from the engine is not possible here: model_args quantization=fp8: quantizes the weights as" in line
    on_engine = load_sweep(_vllm_sweep(tmp_path / "engine", tiny_trio, tasks=tasks, dtype="float32"))  # fits
    assert engine_s(on_engine) == EngineS(None, None)
    fits = _vllm_sweep(
        tmp_path / "fits", tiny_trio, tasks=tasks, dtype="float32", model_args={**fp8, "gpu_memory_utilization": 0.8}
    )
    load_sweep(fits)  # 0.2 x 5 leaves the weights' room
    load_sweep(path, fresh_engine=True)  # S measured before each engine starts
    strength = {"n_prompts": 5, "dtype": "float32"}
    units = _vllm_sweep(tmp_path / "strength", tiny_trio, strength=strength)  # the engine's dtype: auto
    line = user_error(["sweep", units, "--quiet"], tmp_path / "strength" / "out")
    assert "for the strength: units (reference's weights in float32)" in line, line
    assert line.endswith("or give strength.dtype the engine's dtype (eval dtype), so S is measured on the engine)")
    same = load_sweep(_vllm_sweep(tmp_path / "same", tiny_trio, strength=strength, dtype="float32"))
    assert engine_s(same) == EngineS(None, None)  # strength: units on the engine, in its dtype
    load_sweep(_vllm_sweep(tmp_path / "cpu", tiny_trio, strength={**strength, "device": "cpu"}))


def _stored_as(folder, dtype: str, out):
    """A copy of a float32 checkpoint stored in `dtype` (weights and config.json's dtype)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    weights = load_file(folder / "model.safetensors")
    save_file({k: v.to(getattr(torch, dtype)) for k, v in weights.items()}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": dtype, "torch_dtype": dtype}))
    return out


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_merges_on_the_engines_gpu_need_each_models_largest_tensor_beside_it(
    tmp_path, tiny_trio, user_error, monkeypatch, stored
):
    """merge.device cuda beside the resident engine: mergekit holds one tensor of each input at a time on the GPU, in
    the merge's dtype (float32 in the bundled templates, whatever the checkpoints are stored in: bf16 ones were
    counted at half), so the room left by the engine's share must hold the largest tensor of each of the merge's two
    inputs in float32 (read here with safetensors itself): one byte short is refused with merge.device: cpu in the
    fix; exactly that much fits."""
    from safetensors import safe_open

    from lm_eval_sink import devices
    from lm_eval_sink.commands.sweep import load_sweep

    with safe_open(str(tiny_trio["reference"] / "model.safetensors"), "pt") as f:
        largest = max(f.get_tensor(k).float().nbytes for k in f.keys())
    trio = {k: _stored_as(tiny_trio[k], stored, tmp_path / k) for k in ("reference", "candidate")}
    path = _vllm_sweep(tmp_path, trio, model_args={"gpu_memory_utilization": 0.5})
    data = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**data, "merge": {"device": "cuda"}}, sort_keys=False))
    monkeypatch.setattr(devices, "resolve_device", lambda device: ("cuda:0",))
    monkeypatch.setattr(devices, "_total_memory", lambda found: {d: 4 * largest - 2 for d in found})
    line = user_error(["sweep", path, "--quiet"], tmp_path / "out")
    assert "for the merges (mergekit on cuda: the largest tensor of each of linear_95_5's 2 inputs)" in line, line
    assert line.endswith("or set merge.device: cpu (mergekit's math on the CPU))")
    monkeypatch.setattr(devices, "_total_memory", lambda found: {d: 4 * largest for d in found})
    assert load_sweep(path).merge.device == "cuda"  # room 2 x largest: fits


def test_a_strength_unit_measured_on_the_resident_engine_is_keyed_by_the_engines_vllm_and_code(
    tmp_path, tiny_trio, monkeypatch
):
    """Where the plan sends the strength: units to the resident engine (their dtype the engine's), S comes from the
    engine process's vLLM forward, torch, transformers and code: another vLLM there measures them again (review of
    issue 43: their key held this interpreter's torch and transformers and code alone, so a resumed sweep reused S
    after vLLM changed). Measured with transformers here, their key does not hold the engine's."""
    from dataclasses import replace

    from lm_eval_sink.commands.sweep import load_sweep, plan_sweep
    from lm_eval_sink.harness import runner

    strength = {"n_prompts": 5, "dtype": "float32"}
    on_engine = load_sweep(_vllm_sweep(tmp_path / "engine", tiny_trio, strength=strength, dtype="float32"))
    here = load_sweep(_vllm_sweep(tmp_path / "here", tiny_trio, strength={**strength, "dtype": "bfloat16"}))
    real = runner.eval_versions

    def keys(spec, vllm):
        monkeypatch.setattr(runner, "eval_versions", lambda settings: {**real(settings), "vllm": vllm})
        return {u.id: u.key for u in plan_sweep(spec).units if u.kind == "strength"}

    before, after = keys(on_engine, "0.32.0"), keys(on_engine, "0.33.0")
    assert len(before) == 3 and all(before[n] != after[n] for n in before)  # reference, candidate, the merge
    unit = next(u for u in plan_sweep(on_engine).units if u.kind == "strength")
    assert unit.versions["engine vllm"] == "0.33.0" and "engine code" in unit.versions
    assert keys(here, "0.32.0") == keys(here, "0.33.0")
    assert unit.inputs.engine == {"model_args": on_engine.eval.model_args, "dtype": on_engine.eval.dtype}
    longer = replace(on_engine.eval, model_args={**on_engine.eval.model_args, "max_model_len": 512})
    other = keys(replace(on_engine, eval=longer), "0.33.0")  # the engine's model_args: in S's key there
    assert all(other[n] != after[n] for n in after)


def test_an_eval_units_s_time_adds_the_engines_tasks_and_counts_the_childs_once(tmp_path):
    """The resident marker's `timings.sink_strength`: on the engine each Sink Strength task measures its own prompts,
    so two tasks cost the sum (review of issue 43: the largest was taken, half of two equal tasks' time); the child
    records its one wall time in every task it measured, counted once; a unit without S: 0."""
    from lm_eval_sink.harness.engine_server import _s_seconds

    def results(*records):
        tasks = {f"t{i}": {"metadata": {"capture": r}} for i, r in enumerate(records)}
        path = tmp_path / f"results_{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"configs": {**tasks, "ifeval": {"metadata": {"version": 4}}}}))
        return path

    engine = {"capture_backend": "vllm"}
    assert _s_seconds(results({**engine, "wall_seconds": 1.25}, {**engine, "wall_seconds": 2.5})) == 3.75
    child = {"capture_backend": "hf", "wall_seconds": 8.3}
    assert _s_seconds(results(child, child)) == 8.3
    assert _s_seconds(results()) == 0.0


@pytest.mark.parametrize("given", ["quantization", "tokenizer"])
def test_a_resident_sweep_whose_engine_runs_other_weights_measures_s_with_transformers(tmp_path, tiny_trio, given):
    """`quantization: fp8` in a resident sweep's model_args (review of issue 47: each strength.json held the fp8
    engine's S under the checkpoint's name; vLLM's CPU build runs no online quantization, so the plan and the sweep's
    runner are tested): no S from the engine, the plan says why, and a strength: unit is measured with transformers,
    its marker saying why and where, with which versions. Another tokenizer rules out the strength: units alone."""
    from lm_eval_sink.commands.engine_sweep import engine_s, local_runner, plan_notes
    from lm_eval_sink.commands.sweep import load_sweep, plan_sweep
    from lm_eval_sink.harness.engine_decision import RULES

    model_args = {"quantization": "fp8"} if given == "quantization" else {"tokenizer": str(tiny_trio["reference"])}
    strength = {"n_prompts": 5, "dtype": "float32", "last_k": 1}
    spec = load_sweep(_vllm_sweep(tmp_path, tiny_trio, strength=strength, dtype="float32", model_args=model_args))
    rule = next(r for r in RULES if r.argument == given)
    why = f"model_args {given}={model_args[given]}: {rule.changes}"
    assert engine_s(spec) == EngineS(None if rule.units_only else why, why)
    if rule.units_only:
        return  # the strength: units' path below is the same
    plan = plan_sweep(spec)
    assert f"vllm engine: the strength: units measured with transformers: {why}" in plan_notes(plan, list(plan.units))
    unit = next(u for u in plan.units if u.kind == "strength" and u.checkpoint == "reference")
    notes: list[str] = []
    with local_runner(spec, notes) as run:
        run(unit)
    marker = json.loads((unit.output / "COMPLETE.json").read_text())
    saved = json.loads((unit.output / "strength.json").read_text())
    assert marker["not_on_engine"] == why and marker["sink_strength"] == saved["sink_strength"]
    import torch
    import transformers

    assert marker["measured_with"] == {
        "capture_backend": "hf",
        "process": "the unit's own, with transformers",
        "dtype": "float32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
