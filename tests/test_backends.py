"""The vLLM backend: the exact lm-eval command line, its fingerprint, and the refusals (vllm cannot run here)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from constructed_runs import results_dict, write_run

from lm_eval_sink.cli import main
from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.runner import EvalSettings, run_lm_eval
from lm_eval_sink.protocols import diff, fingerprint, require_same_harness

VLLM_ARGS = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "max_model_len": 4096, "enable_thinking": False}
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_vllm_command_line_is_exact():
    s = EvalSettings(
        tasks=("ifeval", "gsm8k_cot_zeroshot"),
        backend="vllm",
        device=None,
        batch_size="auto",
        dtype="bfloat16",
        model_args=VLLM_ARGS,
        apply_chat_template=True,
        gen_kwargs={"max_gen_toks": 256},
        seed=3,
    )
    assert s.command("/m/ref", Path("/o")) == [
        "--model",
        "vllm",
        "--model_args",
        "pretrained=/m/ref,dtype=bfloat16,tensor_parallel_size=2,gpu_memory_utilization=0.9,max_model_len=4096,enable_thinking=False",
        "--tasks",
        "ifeval,gsm8k_cot_zeroshot",
        "--batch_size",
        "auto",
        "--seed",
        "3",
        "--output_path",
        "/o",
        "--log_samples",
        "--apply_chat_template",
        "--gen_kwargs",
        "max_gen_toks=256",
    ]
    hf = EvalSettings(tasks=("ifeval",), batch_size="auto").command("/m/ref", Path("/o"))
    assert (
        hf[:2] == ["--model", "hf"]
        and hf[hf.index("--device") + 1] == "cpu"
        and hf[hf.index("--batch_size") + 1] == "auto"
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (
            {"tasks": ("ifeval", "sink_strength"), "backend": "vllm", "device": None},
            "task sink_strength needs attention weights, which the vllm backend",
        ),
        ({"tasks": ("ifeval",), "backend": "vllm", "device": "cuda"}, "device 'cuda' is an HF-only setting"),
        ({"tasks": ("ifeval",), "backend": "sglang"}, "unknown backend 'sglang'"),
    ],
)
def test_refused_settings(kwargs, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        EvalSettings(**kwargs)


def _fp(model: str, model_args: dict) -> object:
    res = results_dict({"ifeval": {"prompt_level_strict_acc,none": 0.4}}, model_args=model_args)
    res["config"]["model"] = model
    return fingerprint(res)


def test_backend_is_a_harness_field_and_resource_args_are_never_compared():
    hf, vllm_a = _fp("hf", {}), _fp("vllm", {"tensor_parallel_size": 1, "max_model_len": 4096})
    vllm_b = _fp(
        "vllm",
        {
            "tensor_parallel_size": 8,
            "data_parallel_size": 2,
            "gpu_memory_utilization": 0.5,
            "max_num_seqs": 64,
            "enforce_eager": True,
            "distributed_executor_backend": "ray",
            "max_model_len": 4096,
        },
    )
    assert hf.harness["backend"] == "hf" and vllm_a.harness["backend"] == "vllm"
    assert _fp("HFLM", {}).harness["backend"] == "hf"  # a model object given to simple_evaluate
    assert [d.field for d in diff(hf, vllm_a) if d.part == "harness"] == ["backend", "model_args.max_model_len"]
    assert [d.field for d in diff(vllm_a, vllm_b)] == []
    vllm_c = _fp("vllm", {"max_model_len": 8192, "seed": 1, "enable_thinking": True})
    assert {d.field for d in diff(vllm_a, vllm_c)} == {
        "model_args.max_model_len",
        "model_args.seed",
        "model_args.enable_thinking",
    }
    with pytest.raises(UserError, match="backend"):
        require_same_harness({"hf": hf, "vllm": vllm_a})


def test_buckets_same_protocol_refuses_mixed_backends(tmp_path, capsys):
    outcomes = {"ifeval": ([1, 0, 1, 1], [1, 1, 1, 1])}
    write_run(tmp_path / "ref", outcomes)
    cand = write_run(tmp_path / "cand", outcomes)
    data = json.loads(cand.read_text())
    data["config"]["model"] = "vllm"
    cand.write_text(json.dumps(data))
    assert (
        main(
            [
                "buckets",
                str(tmp_path / "ref"),
                str(tmp_path / "cand"),
                "--same-protocol",
                "--output",
                str(tmp_path / "o"),
                "--quiet",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "differ in protocol" in err and "backend: 'hf' vs 'vllm'" in err and not (tmp_path / "o").exists()


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_without_vllm_asking_for_it_is_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    assert (
        main(
            [
                "eval",
                "default",
                "--protocol",
                "instruct",
                "--tasks",
                "ifeval",
                "--backend",
                "vllm",
                "--output",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm is not installed" in err[0] and not out.exists()
    with pytest.raises(UserError, match="vllm is not installed"):
        run_lm_eval("/m", EvalSettings(tasks=("ifeval",), backend="vllm", device=None), out)
    assert not out.exists()
    assert (
        main(
            [
                "eval",
                "default",
                "--protocol",
                "instruct",
                "--tasks",
                "ifeval",
                "--backend",
                "vllm",
                "--device",
                "cuda",
                "--output",
                str(out),
            ]
        )
        == 2
    )
    assert "--device is an HF-only flag" in capsys.readouterr().err


def _sweep(tmp_path: Path, trio: dict[str, Path], **extra) -> Path:
    data = {
        "output": "out",
        "models": {"reference": str(trio["reference"]), "candidate": str(trio["candidate"])},
        "configs": ["linear_95_5"],
        "eval": {"tasks": ["ifeval"]},
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            {"eval": {"tasks": ["ifeval", "sink_strength"], "backend": "vllm"}},
            "eval: task sink_strength needs attention weights",
        ),
        (
            {
                "eval": {"tasks": ["ifeval"], "backend": "vllm", "model_args": {"data_parallel_size": 2}},
                "engine": {"kind": "ray"},
            },
            "data_parallel_size = 2 under the ray engine",
        ),
        (
            {
                "eval": {"tasks": ["ifeval"], "backend": "vllm", "model_args": {"tensor_parallel_size": 2}},
                "engine": {"kind": "ray", "resources": {"eval": {"num_gpus": 1}}},
            },
            "tensor_parallel_size = 2 but engine.resources.eval.num_gpus = 1",
        ),
        ({"engine": {"kind": "ray", "workers": 2}}, "engine: the engine section has unknown key 'workers'"),
        (
            {"engine": {"kind": "ray", "resources": {"eval": {"gpus": 1}}}},
            "engine.resources.eval: the resources entry has unknown key 'gpus' (did you mean 'num_gpus'?)",
        ),
        ({"engine": {"kind": "slurm"}}, "engine.kind: expected one of 'local' or 'ray', got 'slurm'"),
        ({"eval": False, "strength": False}, "eval: false and strength: false leave nothing to do"),
        (
            {"engine": {"kind": "ray", "resources": {"eval": {"num_gpus": -1}}}},
            "engine.resources.eval.num_gpus: expected a value >= 0.0, got -1",
        ),
        ({"engine": {"max_pending_merges": 0}}, "engine.max_pending_merges: expected a value >= 1, got 0"),
        ({"merge": {"random_seed": "7"}}, "merge.random_seed: expected an integer, got '7'"),
    ],
)
def test_sweep_plan_time_refusals(tmp_path, tiny_trio, capsys, extra, needle):
    path = _sweep(tmp_path, tiny_trio, **extra)
    assert main(["sweep", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_sweep_vllm_eval_settings_under_ray(tmp_path, tiny_trio):
    from lm_eval_sink.commands.sweep import load_sweep

    path = _sweep(
        tmp_path,
        tiny_trio,
        eval={
            "tasks": ["ifeval"],
            "backend": "vllm",
            "batch_size": "auto",
            "model_args": {"tensor_parallel_size": 2, "max_model_len": 4096},
        },
        engine={"kind": "ray", "resources": {"eval": {"num_gpus": 2}}},
    )
    spec = load_sweep(path)
    assert spec.eval.backend == "vllm" and spec.eval.device is None and spec.engine.resources["eval"].num_gpus == 2
    assert spec.eval.command("/m", Path("/o"))[:2] == ["--model", "vllm"]


def test_ray_engine_without_ray_installed_is_one_line_naming_the_extra(tmp_path, tiny_trio, user_error, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as where it is not installed
    path = _sweep(tmp_path, tiny_trio, engine={"kind": "ray"})
    line = user_error(["sweep", path, "--quiet"], tmp_path / "out")
    assert "needs ray, which is not installed" in line and "lm-eval-sink[ray]" in line
    line = user_error(["sweep", _sweep(tmp_path, tiny_trio), "--engine", "ray", "--quiet"], tmp_path / "out")
    assert "lm-eval-sink[ray]" in line
    line = user_error(
        ["screen", tiny_trio["reference"], "--engine", "ray", "--n-prompts", "5", "--output", tmp_path / "screen"],
        tmp_path / "screen",
    )
    assert "lm-eval-sink[ray]" in line
