"""One resident vLLM engine per sweep: checkpoints' weights swapped in place, against an evaluation per checkpoint.

`resident`: the suite's SmolLM2 sweep (conftest `smollm2_sweep`, HF, float32) run again with `backend: vllm` on the
resident engine in vLLM's default process mode, killed inside its first eval unit and resumed: one engine takes the
reference, the candidate and a near-reference merge, S measured on it, against the HF sweep. `edge`: one engine
runner (in-process engine) over the reference, a copy whose config differs (a new engine) and a copy of that with
truncated weights (refused before the engine is asked). Their CI time: docs/scale.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from helpers import VLLM_PY, engine_core_pids, vllm_missing_reason

from lm_eval_sink.merging.sweep import EvalWork, Unit

pytestmark = [pytest.mark.skipif(not VLLM_PY.is_file(), reason=vllm_missing_reason())]
CHECKPOINTS = ("reference", "candidate", "near_reference")


def _marker(out: Path, name: str) -> dict:
    return json.loads((out / "evals" / name / "COMPLETE.json").read_text())


def _samples(unit_folder: Path, task: str = "sink_strength") -> list[dict]:
    """Each sample of a task, in document order, from an eval unit's folder."""
    (path,) = unit_folder.glob(f"lm_eval/*/samples_{task}_*.jsonl")
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def _responses(unit_folder: Path, task: str = "ifeval") -> list:
    return [s["resps"] for s in _samples(unit_folder, task)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _engine_pids(parent: int) -> list[int]:
    """The resident engine processes whose parent is `parent`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if proc.name.isdigit() and ppid == parent and b"engine_server" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _kill_inside_first_eval(sweep: Path, timeout: float = 900) -> dict:
    """Run `sweep` in a forked driver and SIGKILL the driver alone inside its first eval unit (its staged folder
    and its engine process there); then whether the engine process died with it (no process of the test outlives
    it: the driver's group is killed after)."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    evals = sweep.parent / "out" / "evals"
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            run_sweep(load_sweep(sweep), progress=False)
        finally:
            os._exit(0)
    deadline, engines = time.time() + timeout, []
    while time.time() < deadline and not (engines and list(evals.glob("reference.partial-*"))):
        engines = _engine_pids(pid)
        assert os.waitpid(pid, os.WNOHANG)[0] == 0, "the sweep ended before its first eval unit"
        time.sleep(0.1)
    time.sleep(2)  # the engine process is importing vLLM
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    end = time.time() + 30
    while any(_alive(p) for p in engines) and time.time() < end:
        time.sleep(0.2)
    survived = [p for p in engines if _alive(p)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return {"engines": engines, "survived": survived, "partial": [p.name for p in evals.glob("*.partial-*")]}


@pytest.fixture(scope="module")
def resident(smollm2_sweep, tmp_path_factory, vllm_env) -> dict:
    """The HF sweep's folder copied, its eval and strength units removed and run again under vLLM on the resident
    engine, in vLLM's default process mode: killed inside the first, then resumed in this process."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    hf = smollm2_sweep.parent
    root = tmp_path_factory.mktemp("resident") / "vllm"
    shutil.copytree(hf, root, symlinks=True)
    shutil.rmtree(root / "out" / "evals")
    shutil.rmtree(root / "out" / "strength")
    data = yaml.safe_load((root / "sweep.yaml").read_text())
    data["eval"] |= {"backend": "vllm", "model_args": {"enforce_eager": True}, "python": str(VLLM_PY)}
    (root / "sweep.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        killed = _kill_inside_first_eval(root / "sweep.yaml")
        report = run_sweep(load_sweep(root / "sweep.yaml"), progress=False)
    return {"hf": hf / "out", "out": root / "out", "killed": killed, "report": report}


# S from the engine against transformers' on SmolLM2 (30 layers) in float32: S, each prompt's S and each (layer, head)
# figure within 2.1e-5 measured (the tiny models of test_engine_capture: 5e-6); a difference of two S within twice it.
TOLERANCE = 5e-5


def test_resident_sweep_gives_the_hf_sweeps_table_and_responses(resident):
    """Every table column (S from the engine included: to `TOLERANCE`, a delta of two S to twice it) and every
    response identical to an evaluation per checkpoint; each unit records the interpreter and vLLM's version."""
    hf, out = resident["hf"], resident["out"]
    tables = [json.loads((o / "table.json").read_text()) for o in (hf, out)]
    assert tables[0]["columns"] == tables[1]["columns"] and "sink_strength/sink_strength,none" in tables[1]["columns"]
    for f_row, r_row in zip(tables[0]["rows"], tables[1]["rows"], strict=True):
        assert r_row["status"] == "ok" and r_row["checkpoint"] == f_row["checkpoint"]
        assert r_row["metrics"] == pytest.approx(f_row["metrics"], abs=TOLERANCE)
        assert r_row["sink_strength"] == pytest.approx(f_row["sink_strength"], abs=TOLERANCE)
        assert r_row["delta_vs_reference"] == pytest.approx(f_row["delta_vs_reference"], abs=2 * TOLERANCE)
        assert r_row["sink_strength_delta_vs_reference"] == pytest.approx(
            f_row["sink_strength_delta_vs_reference"], abs=2 * TOLERANCE
        )
    for name in CHECKPOINTS:
        assert _responses(out / "evals" / name) == _responses(hf / "evals" / name), name
        marker = _marker(out, name)
        assert marker["lm_eval_python"] == str(VLLM_PY) and marker["eval_versions"]["vllm"] == "0.32.0+cpu"
        results = json.loads((out / "evals" / name / marker["results"]).read_text())
        assert results["config"]["model"] == "vllm" and results["config"]["model_args"]["pretrained"] == marker["model"]
        assert "engine" not in _marker(hf, name)  # the per-checkpoint side: an lm_eval process per checkpoint


def test_each_checkpoints_s_is_measured_on_the_resident_engine_and_equals_its_transformers_s(resident):
    """Each eval unit's sink_strength and each strength: unit come from the engine that holds the checkpoint
    (capture_backend vllm, no child), equal to the HF sweep's transformers S of that checkpoint: S, the layer x head
    matrix and each prompt's S for the eval units (15 prompts, last 10 layers), S and its figures for the strength:
    units (5 prompts, last 2 layers); their markers name the engine and S's wall time."""
    import numpy as np

    hf, out = resident["hf"], resident["out"]
    notes = resident["report"].notes
    assert "vllm engine: the eval units' Sink Strength tasks measured on the engine (no second load)" in notes, notes
    assert any(n.startswith("vllm engine: the strength: units measured on the engine") for n in notes), notes
    for name in CHECKPOINTS:
        got, want = (json.loads((o / "evals" / name / _marker(o, name)["results"]).read_text()) for o in (out, hf))
        record = got["configs"]["sink_strength"]["metadata"]["capture"]
        assert record["capture_backend"] == "vllm" and record["dtype"] == "float32" and record["lora"] is None
        assert record["process"] == "lm-eval's vLLM engine, in its own forward" and "not_on_engine" not in record
        assert want["configs"]["sink_strength"]["metadata"]["capture"]["capture_backend"] == "hf"
        s_got, s_want = got["results"]["sink_strength"], want["results"]["sink_strength"]
        assert s_got["sink_strength,none"] == pytest.approx(s_want["sink_strength,none"], abs=TOLERANCE)
        matrix = [np.array(s["sink_strength_layer_head,none"]["values"]) for s in (s_got, s_want)]
        np.testing.assert_allclose(matrix[0], matrix[1], atol=TOLERANCE)
        prompts = [
            [s["sink_strength"]["sink_strength_prompt"] for s in _samples(o / "evals" / name)] for o in (out, hf)
        ]
        np.testing.assert_allclose(prompts[0], prompts[1], atol=TOLERANCE)
        assert _marker(out, name)["timings"]["sink_strength"] == record["wall_seconds"] > 0
        strength = [json.loads((o / "strength" / name / "strength.json").read_text()) for o in (out, hf)]
        assert strength[0]["sink_strength"] == pytest.approx(strength[1]["sink_strength"], abs=TOLERANCE)
        assert strength[0]["provenance"]["capture"]["capture_backend"] == "vllm"
        assert strength[0]["provenance"]["dtype"] == strength[1]["provenance"]["dtype"] == "float32"
        assert strength[0]["layers"] == strength[1]["layers"] == [28, 29]
        engine = _marker(out, name)["engine"]
        assert (
            json.loads((out / "strength" / name / "COMPLETE.json").read_text())["engine"]["process"]
            == engine["process"]
        )


def test_one_engine_takes_every_checkpoint_in_both_orders_in_vllms_default_process_mode(resident):
    """Reference, then the candidate (other responses), then the near-reference merge (the reference's responses
    again): each swap equals a fresh evaluation (above), so nothing of the checkpoint before it leaked. The engine
    core ran in a process of its own, so every call into the workers went through vLLM's serializer."""
    hf, out = resident["hf"], resident["out"]
    ref, cand = _responses(hf / "evals" / "reference"), _responses(hf / "evals" / "candidate")
    assert ref != cand and _responses(out / "evals" / "near_reference") == ref
    engines = [_marker(out, n)["engine"] for n in CHECKPOINTS]
    assert [e["weights"] for e in engines] == ["built", "reloaded", "reloaded"]
    assert {e["process"] for e in engines} == {engines[0]["process"]} and {e["engine"] for e in engines} == {1}
    assert [e["unit_on_engine"] for e in engines] == [1, 2, 3]
    assert (
        engines[0]["built_because"] == "the first checkpoint"
        and engines[0]["built_for"] == _marker(out, "reference")["model"]
    )
    assert any("one resident engine for the sweep" in n for n in resident["report"].notes), resident["report"].notes
    (log,) = (out / "evals" / "reference" / "lm_eval" / "logs").glob("lm_eval_*.log")
    (core,) = engine_core_pids(log.read_text())
    assert core != engines[0]["process"]


def test_swaps_write_the_weights_in_place(resident):
    """After each swap the engine's model tensors are the ones it was built with, at the same storage
    (`weight_storage` of its one worker: nothing allocated beside them); each unit records its times and memory."""
    storage = [_marker(resident["out"], n)["engine"]["weight_storage"] for n in CHECKPOINTS]
    assert storage[0] == storage[1] == storage[2] and len(storage[0]) == 1  # one worker
    assert storage[0][0]["tensors"] > 0 and storage[0][0]["bytes"] > 0
    for name in CHECKPOINTS:
        marker = _marker(resident["out"], name)
        assert marker["timings"]["evaluate"] > 0 and marker["peak_rss"] > 0
        assert marker["peak_accelerator_memory"] is None  # a CPU run


def test_resident_sweep_resumes_after_a_kill_and_its_engine_dies_with_the_driver(resident):
    killed, report = resident["killed"], resident["report"]
    assert killed["engines"] and killed["survived"] == []  # the engine process did not outlive its sweep
    assert killed["partial"] == [] or all(p.startswith("reference.partial-") for p in killed["partial"])
    assert report.ran == [f"{kind}:{n}" for n in CHECKPOINTS for kind in ("eval", "strength")] and not report.failures
    assert "merge:near_reference" in report.skipped
    assert not list((resident["out"] / "evals").glob("*.partial-*"))  # the killed unit's staged folder tidied


# --- one runner through the edge cases --------------------------------------------------------------------


def _config_changed(reference: Path, out: Path) -> Path:
    """A copy of the reference (weights linked) whose config.json fixes a shorter context: an engine of its own."""
    out.mkdir()
    for f in reference.iterdir():
        if f.name == "model.safetensors":
            (out / f.name).symlink_to(f)
        elif f.name != "COMPLETE.json":
            shutil.copy2(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return out


def _truncated(model: Path, out: Path) -> Path:
    """A copy of `model` whose weights file stops half way."""
    shutil.copytree(model, out, symlinks=False, ignore=shutil.ignore_patterns("model.safetensors"))
    data = (model / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    return out


@pytest.fixture(scope="module")
def edge(smollm2_sweep, default_model, tmp_path_factory, vllm_env) -> dict:
    """One engine runner over the reference (an engine), a copy with another config.json (a new engine) and a copy
    of that whose weights stop half way (refused before the engine is asked); then the runner's state and why it
    would start a new engine for the next unit, a checkpoint its engine held."""
    from lm_eval_sink.commands.sweep import load_sweep
    from lm_eval_sink.commands.engine_sweep import EngineRunner, checkpoint_fields

    root = tmp_path_factory.mktemp("edge")
    changed = _config_changed(default_model, root / "changed")
    models = {"A": default_model, "C": changed, "broken": _truncated(changed, root / "broken")}
    settings = load_sweep(smollm2_sweep).eval
    settings = replace(settings, backend="vllm", device=None, model_args={"enforce_eager": True})
    settings = replace(settings, tasks=("ifeval",), limit=1, gen_kwargs={**settings.gen_kwargs, "max_gen_toks": 16})
    runner, errors = EngineRunner(settings, root / "logs"), {}
    try:
        for name, model in models.items():
            try:
                runner.run(
                    Unit("eval", name, f"key-{name}", root / "evals" / name, EvalWork(str(model), name, settings))
                )
            except Exception as e:  # the unit's failure, as the sweep records it
                errors[name] = e
        state = {"failed": runner.failed, "process": runner.process, "started": runner.started}
        state["next"] = runner.new_engine_reason("C2", checkpoint_fields(str(changed), settings))
        state["failed_engine_alive"] = _alive(_marker(root, "C")["engine"]["process"])  # before the runner closes
        state["first_engine_alive"] = _alive(_marker(root, "A")["engine"]["process"])
    finally:
        runner.close()
    return {"out": root, "errors": errors, "notes": runner.notes, "state": state}


def test_a_config_change_starts_a_new_engine_in_a_new_process(edge):
    out = edge["out"]
    first, engine = _marker(out, "A")["engine"], _marker(out, "C")["engine"]
    assert (first["engine"], engine["engine"]) == (1, 2) and first["process"] != engine["process"]
    assert engine["weights"] == "built" and engine["unit_on_engine"] == 1
    assert engine["built_because"] == "C differs from A in config.json max_position_embeddings"
    assert edge["notes"] == [f"eval:C: a new vLLM engine: {engine['built_because']}"]
    assert _responses(out / "evals" / "C") == _responses(out / "evals" / "A")
    assert edge["state"]["first_engine_alive"] is False  # the old engine's process was shut down, not kept beside it


def test_damaged_weights_are_the_units_one_line_before_the_engine_is_asked(edge):
    """The copy whose weights stop half way reached the engine's reload (a SafetensorError there, the engine shut
    down); the one safetensors reader (`weights.py`) names the file before the engine is asked, and the engine that
    holds C runs on and would take C's weights again."""
    from lm_eval_sink.errors import UserError

    out, error = edge["out"], edge["errors"].get("broken")
    assert set(edge["errors"]) == {"broken"} and isinstance(error, UserError)
    assert error.line().startswith(f"{out / 'broken' / 'model.safetensors'}: is cut short"), error.line()
    assert not (out / "evals" / "broken").exists() and not (out / "logs" / "eval-broken").exists()
    state = edge["state"]
    assert (state["failed"], state["started"], state["next"], state["failed_engine_alive"]) == (None, 2, None, True)
    assert state["process"] is not None
