"""One resident vLLM engine per sweep: checkpoints' weights swapped in place, against an engine per checkpoint.

The per-checkpoint side is the suite's SmolLM2 vLLM sweep (conftest `smollm2_sweeps`, `engine_reuse: false`):
reference, a perturbed candidate whose greedy responses differ, and a merge near the reference. Two runs on
real vLLM (CPU build, float32, in-process engine, one thread) are compared with it:
- `resident`: the same sweep with the resident engine (the default), killed after its first checkpoint and
  resumed (every eval unit again; the merge and S units are the fresh sweep's, copied);
- `edge`: one engine runner (the sweep's own eval path) over reference, candidate, reference (both orders on
  one engine), a copy of the reference whose config differs (a new engine), a copy of that with truncated
  weights (its reload fails) and the reference again (on a rebuilt engine).
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
from helpers import VLLM_PY, vllm_missing_reason

from lm_eval_sink.merging.sweep import Unit

pytestmark = [pytest.mark.skipif(not VLLM_PY.is_file(), reason=vllm_missing_reason())]
CHECKPOINTS = ("reference", "candidate", "near_reference")


def _marker(out: Path, name: str) -> dict:
    return json.loads((out / "evals" / name / "COMPLETE.json").read_text())


def _responses(unit_folder: Path, task: str = "ifeval") -> list:
    """Each sample's responses of a task, in document order, from an eval unit's folder."""
    (path,) = unit_folder.glob(f"lm_eval/*/samples_{task}_*.jsonl")
    rows = sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return [r["resps"] for r in rows]


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
            if proc.name.isdigit() and ppid == parent and b"vllm_resident" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _kill_after_first_eval(sweep: Path, timeout: float = 900) -> dict:
    """Run `sweep` in a forked driver, SIGKILL the driver alone once its first eval unit is in the manifest; then
    whether its engine process died with it (no process of the test may outlive it: the group is killed after)."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    manifest = sweep.parent / "out" / "manifest.jsonl"
    before = manifest.read_text() if manifest.is_file() else ""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            run_sweep(load_sweep(sweep), progress=False)
        finally:
            os._exit(0)
    deadline, engines = time.time() + timeout, []
    while time.time() < deadline and '"unit": "eval:' not in manifest.read_text()[len(before) :]:
        engines = _engine_pids(pid) or engines
        assert os.waitpid(pid, os.WNOHANG)[0] == 0, "the sweep ended before its first eval unit"
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    end = time.time() + 30
    while any(_alive(p) for p in engines) and time.time() < end:
        time.sleep(0.2)
    survived = [p for p in engines if _alive(p)]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return {"engines": engines, "survived": survived}


@pytest.fixture(scope="module")
def resident(smollm2_sweeps, tmp_path_factory, vllm_env) -> dict:
    """The fresh sweep's folder copied, its eval units removed and run again on the resident engine: killed after
    the first, then resumed in this process."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    fresh = smollm2_sweeps["vllm"].parent
    root = tmp_path_factory.mktemp("resident") / "vllm"
    shutil.copytree(fresh, root, symlinks=True)
    shutil.rmtree(root / "out" / "evals")
    data = yaml.safe_load((root / "sweep.yaml").read_text())
    data["eval"] = {k: v for k, v in data["eval"].items() if k != "engine_reuse"} | {"python": str(VLLM_PY)}
    (root / "sweep.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    killed = _kill_after_first_eval(root / "sweep.yaml")
    report = run_sweep(load_sweep(root / "sweep.yaml"), progress=False)
    return {"fresh": fresh / "out", "out": root / "out", "killed": killed, "report": report}


def test_resident_sweep_gives_the_fresh_engines_table_and_responses(resident):
    """Every table column to 1e-5 and every response identical to an engine per checkpoint; one engine served the
    resumed run's checkpoints, the candidate's weights swapped out for the near-reference merge's."""
    fresh, out = resident["fresh"], resident["out"]
    tables = [json.loads((o / "table.json").read_text()) for o in (fresh, out)]
    assert tables[0]["columns"] == tables[1]["columns"] and "sink_strength/sink_strength,none" in tables[1]["columns"]
    for f_row, r_row in zip(tables[0]["rows"], tables[1]["rows"], strict=True):
        assert r_row["status"] == "ok" and r_row["checkpoint"] == f_row["checkpoint"]
        assert r_row["metrics"] == pytest.approx(f_row["metrics"], abs=1e-5)
        assert r_row["sink_strength"] == pytest.approx(f_row["sink_strength"], abs=1e-5)
    for name in CHECKPOINTS:
        for task in ("ifeval", "sink_strength"):
            assert _responses(out / "evals" / name, task) == _responses(fresh / "evals" / name, task), (name, task)
        marker = _marker(out, name)
        results = json.loads((out / "evals" / name / marker["results"]).read_text())
        assert results["config"]["model"] == "vllm" and results["config"]["model_args"]["pretrained"] == marker["model"]
        assert "engine" not in _marker(fresh, name)  # the fresh side: an lm_eval process per checkpoint
    assert _responses(fresh / "evals" / "candidate") != _responses(fresh / "evals" / "reference")
    first, second, third = (_marker(out, n)["engine"] for n in CHECKPOINTS)
    assert first["weights"] == "built" and first["process"] != second["process"]  # run 1, killed
    assert (second["weights"], third["weights"]) == ("built", "reloaded")
    assert second["process"] == third["process"] and second["engine"] == third["engine"] == 1
    assert third["unit_on_engine"] == 2 and third["built_for"] == _marker(out, "candidate")["model"]


def test_resident_sweep_resumes_after_a_kill_and_its_engine_dies_with_the_driver(resident):
    killed, report = resident["killed"], resident["report"]
    assert killed["engines"] and killed["survived"] == []  # the engine process did not outlive its sweep
    assert report.ran == ["eval:candidate", "eval:near_reference"] and not report.failures
    assert "eval:reference" in report.skipped and "merge:near_reference" in report.skipped
    assert any("one resident engine for the sweep" in n for n in report.notes), report.notes
    for name in CHECKPOINTS:
        marker = _marker(resident["out"], name)
        assert marker["timings"]["evaluate"] > 0 and marker["timings"]["s_child"] > 0
        assert marker["peak_rss"] > 500 * 2**20 and marker["peak_accelerator_memory"] is None  # a CPU run


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
    """A copy of `model` whose weights file stops half way (its header intact: the same engine fields)."""
    shutil.copytree(model, out, symlinks=False, ignore=shutil.ignore_patterns("model.safetensors"))
    data = (model / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) // 2])
    return out


EDGE = ("A1", "B", "A2", "C", "broken", "A3")


@pytest.fixture(scope="module")
def edge(smollm2_sweeps, smollm2_candidate, default_model, tmp_path_factory, vllm_env) -> dict:
    from lm_eval_sink.commands.sweep import load_sweep
    from lm_eval_sink.commands.vllm_resident import EngineRunner

    root = tmp_path_factory.mktemp("edge")
    changed = _config_changed(default_model, root / "changed")
    models = {"A1": default_model, "B": smollm2_candidate, "A2": default_model, "C": changed}
    models |= {"broken": _truncated(changed, root / "broken"), "A3": default_model}
    settings = replace(load_sweep(smollm2_sweeps["vllm"]).eval, tasks=("ifeval",))
    runner, errors = EngineRunner(settings, root / "logs"), {}
    try:
        for name in EDGE:
            inputs = {"model": str(models[name]), "settings": settings, "identity": None}
            unit = Unit("eval", name, f"key-{name}", root / "evals" / name, inputs)
            try:
                runner.run(unit)
            except Exception as e:  # the unit's failure, as the sweep records it
                errors[name] = e
    finally:
        runner.close()
    return {"out": root, "errors": errors, "notes": runner.notes, "fresh": smollm2_sweeps["vllm"].parent / "out"}


def test_edge_nothing_of_a_previous_checkpoint_leaks_in_either_order(edge):
    out, fresh = edge["out"], edge["fresh"]
    ref, cand = _responses(fresh / "evals" / "reference"), _responses(fresh / "evals" / "candidate")
    assert ref != cand
    assert [_responses(out / "evals" / n) for n in ("A1", "B", "A2")] == [ref, cand, ref]
    engines = [_marker(out, n)["engine"] for n in ("A1", "B", "A2")]
    assert [e["weights"] for e in engines] == ["built", "reloaded", "reloaded"]
    assert {e["engine"] for e in engines} == {1}


def test_edge_memory_does_not_grow_across_swaps(edge):
    """The peak RSS of each unit is recorded; the second swap's is no higher than the first's (5% slack: lm-eval's
    own buffers), and each new engine's build peaks as the first did (a new process each). A swap's peak exceeds
    the build's by about one weights file (vLLM maps it to reload)."""
    peaks = {n: _marker(edge["out"], n)["peak_rss"] for n in ("A1", "B", "A2", "C", "A3")}
    assert all(p > 500 * 2**20 for p in peaks.values())
    assert peaks["A2"] <= peaks["B"] * 1.05, peaks
    assert max(peaks["C"], peaks["A3"]) <= peaks["A1"] * 1.05, peaks


def test_edge_a_config_change_starts_a_new_engine(edge):
    out = edge["out"]
    engine = _marker(out, "C")["engine"]
    assert engine["engine"] == 2 and engine["weights"] == "built" and engine["unit_on_engine"] == 1
    assert "config.json max_position_embeddings" in engine["built_because"]
    assert edge["notes"] == [f"eval:C: a new vLLM engine: {engine['built_because']}"]
    assert _responses(out / "evals" / "C") == _responses(edge["fresh"] / "evals" / "reference")


def test_edge_a_failed_reload_is_the_units_one_line_and_the_next_gets_a_rebuilt_engine(edge):
    from lm_eval_sink.errors import UserError

    out, error = edge["out"], edge["errors"].get("broken")
    assert set(edge["errors"]) == {"broken"} and isinstance(error, UserError)
    assert "\n" not in error.line() and "SafetensorError" in error.message, error.line()
    assert not (out / "evals" / "broken").exists() and list((out / "logs" / "eval-broken").glob("*.log"))
    engine = _marker(out, "A3")["engine"]
    assert engine["engine"] == 3 and engine["built_because"] == "the previous unit (eval:broken) failed"
    assert engine["process"] != _marker(out, "C")["engine"]["process"]  # a new process: it starts clean
    assert _responses(out / "evals" / "A3") == _responses(edge["fresh"] / "evals" / "reference")
