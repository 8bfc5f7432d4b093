"""The resident vLLM engine's decisions, without vLLM (`merging.engine_reuse`), and the sweep options around it."""

from __future__ import annotations

import json
import struct

import pytest
import yaml

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
        ("cand", "differs from ref in config.json vocab_size"),
        ("m1", None),  # the candidate's engine takes it
        ("m2", None),  # not merged yet: decided when it runs
        ("m3", "differs from cand in config.json vocab_size"),
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


def _vllm_sweep(tmp_path, trio, **evals):
    """A tiny vLLM sweep file (the tiny choice task; `python` unset: this interpreter, whose task index is cached)."""
    from helpers import TINY_SWEEP_TASK, TINY_SWEEP_TASKS

    data = {
        "output": "out",
        "models": {"reference": str(trio["reference"]), "candidate": str(trio["candidate"])},
        "configs": ["linear_95_5"],
        "eval": {"tasks": [TINY_SWEEP_TASK], "include_path": str(TINY_SWEEP_TASKS), "backend": "vllm", **evals},
        "strength": False,
    }
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


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
        "vllm engine: candidate gets an engine of its own: it differs from reference in config.json "
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
    from lm_eval_sink.harness.engine_client import safetensors_shapes

    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}, "__metadata__": {}})
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(24))
    assert safetensors_shapes(tmp_path / "w.safetensors") == {"a": [2, 3]}
