"""In-memory sweeps (`merge: {in_memory: true}`): the on-disk sweep's table, units, keys and resume, without
writing a merged checkpoint or starting lm_eval; and the refusals of what one resident model cannot do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import TINY_SWEEP_TASK as TASK
from helpers import TINY_SWEEP_TASKS as TASKS
from helpers import write_tiny_sweep

from lm_eval_sink.cli import main

CONTROLS = ["linear_95_5", "tsv", "star"]


def _write_sweep(folder: Path, trio: dict[str, Path], merge: dict | None = None, **extra) -> Path:
    """The sweep tests' file (`helpers.write_tiny_sweep`) with three controls, evaluated in float32."""
    evals = {"tasks": [TASK], "include_path": str(TASKS), "batch_size": 1, "seed": 0, "dtype": "float32"}
    sections = {"configs": CONTROLS, "merge": {"random_seed": 0, **(merge or {})}, "eval": evals}
    return write_tiny_sweep(folder, trio, **{**sections, **extra})


def _set_in_memory(sweep: Path, **merge) -> None:
    data = yaml.safe_load(sweep.read_text())
    data["merge"].update(merge)
    sweep.write_text(yaml.safe_dump(data, sort_keys=False))


def _rows(sweep: Path) -> list[dict]:
    return json.loads((sweep.parent / "out" / "table.json").read_text())["rows"]


def _done(sweep: Path) -> list[str]:
    lines = (sweep.parent / "out" / "manifest.jsonl").read_text().splitlines()
    return [json.loads(x)["unit"] for x in lines if x.endswith("}") and json.loads(x)["status"] == "done"]


def _copy(sweep: Path, dst: Path) -> Path:
    shutil.copytree(sweep.parent, dst)
    return dst / "sweep.yaml"


def _drop(sweep: Path, *units: str) -> None:
    """Forget finished units: their folders and manifest lines (as if they had never run)."""
    out = sweep.parent / "out"
    for uid in units:
        kind, name = uid.split(":")
        shutil.rmtree(out / {"merge": "merges", "eval": "evals", "strength": "strength"}[kind] / name)
    kept = [x for x in (out / "manifest.jsonl").read_text().splitlines() if not any(f'"{u}"' in x for u in units)]
    (out / "manifest.jsonl").write_text("\n".join(kept) + "\n")


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory, tiny_trio) -> Path:
    sweep = _write_sweep(tmp_path_factory.mktemp("disk"), tiny_trio)
    assert main(["sweep", str(sweep), "--quiet"]) == 0
    return sweep


@pytest.fixture(scope="module")
def in_memory(tmp_path_factory, tiny_trio) -> Path:
    sweep = _write_sweep(tmp_path_factory.mktemp("memory"), tiny_trio, merge={"in_memory": True})
    assert main(["sweep", str(sweep), "--quiet"]) == 0
    return sweep


@pytest.mark.slow
def test_in_memory_table_units_and_keys_equal_the_on_disk_sweep(on_disk, in_memory, capsys):
    """float32: every metric and every S equal; the same units and keys; no merged weights written."""
    assert _rows(in_memory) == _rows(on_disk)
    assert [r["checkpoint"] for r in _rows(in_memory)] == ["reference", "candidate", *CONTROLS]
    assert all(r["status"] == "ok" for r in _rows(in_memory))
    disk, mem = (json.loads((s.parent / "out" / "sweep.json").read_text()) for s in (on_disk, in_memory))
    assert mem["units"] == disk["units"] and mem["sweep"]["merge"]["in_memory"] is True
    assert _done(in_memory) == [u for u in _done(on_disk) if not u.startswith("merge:")]
    out = in_memory.parent / "out"
    assert not (out / "merges").exists()
    marker = json.loads((out / "evals" / "tsv" / "COMPLETE.json").read_text())
    assert marker["in_memory"] is True and marker["key"] == disk["units"]["eval:tsv"]
    assert marker["model"] == str(out / "merges" / "tsv")  # named as the on-disk path names it
    assert marker["peak_accelerator_memory"] is None  # no accelerator here (docs/scale.md, On GPUs)
    strength = json.loads((out / "strength" / "star" / "strength.json").read_text())
    assert strength["provenance"]["model"]["in_memory"] is True
    assert strength["provenance"]["model"]["device_map"] == {"cpu": 2}  # decoder layers per device
    assert strength["provenance"]["model"]["merge_inputs_key"]
    # the lm-eval files are laid out as lm-eval writes them, under the folder named for the checkpoint
    disk_marker = json.loads((on_disk.parent / "out" / "evals" / "tsv" / "COMPLETE.json").read_text())
    for m in (marker, disk_marker):
        assert Path(m["results"]).parts[:2] == ("lm_eval", Path(m["results"]).parts[1])
        assert Path(m["results"]).parts[1].endswith("merges__tsv") and set(m["samples"]) == {TASK}
    capsys.readouterr()
    assert main(["sweep", str(in_memory), "--quiet"]) == 0 and _rows(in_memory) == _rows(on_disk)
    printed = capsys.readouterr().out
    assert "0 steps run, 10 already finished" in printed and "3 merged checkpoint(s) not written to disk" in printed


@pytest.mark.slow
def test_buckets_and_report_read_an_in_memory_unit(in_memory, tmp_path, capsys):
    out = in_memory.parent / "out"
    runs = [str(out / "evals" / name / "lm_eval") for name in ("reference", "tsv")]
    args = ["buckets", *runs, "--output", str(tmp_path / "b")]
    assert main(args) == 0, capsys.readouterr().err
    buckets = json.loads((tmp_path / "b" / "buckets.json").read_text())
    assert buckets["n"] == 6 and buckets["task"] == TASK and buckets["protocol_differences"] == {}
    strength = [str(out / "strength" / name / "strength.json") for name in ("reference", "tsv")]
    report = ["report", "--buckets", str(tmp_path / "b"), "--strength", *strength]
    assert main([*report, "-o", str(tmp_path / "r.html")]) == 0, capsys.readouterr().err
    html = (tmp_path / "r.html").read_text()
    assert "merges/tsv" in html and "<img" in html


@pytest.mark.slow
def test_a_sweep_started_on_disk_resumes_in_memory_and_back(on_disk, in_memory, tmp_path, capsys):
    """The path is part of no key: finished units are kept across it, the rest are redone, the table is the same.
    keep_weights writes the merged checkpoint the on-disk merge unit writes."""
    sweep = _copy(on_disk, tmp_path / "a")
    _drop(sweep, "merge:tsv", "eval:tsv", "strength:tsv")
    _set_in_memory(sweep, in_memory=True, keep_weights=True)
    capsys.readouterr()
    assert main(["sweep", str(sweep), "--quiet"]) == 0
    assert "3 steps run, 10 already finished" in capsys.readouterr().out
    assert _rows(sweep) == _rows(on_disk)
    merged, disk = sweep.parent / "out" / "merges" / "tsv", on_disk.parent / "out" / "merges" / "tsv"
    assert (merged / "model.safetensors").read_bytes() == (disk / "model.safetensors").read_bytes()
    units = json.loads((on_disk.parent / "out" / "sweep.json").read_text())["units"]
    assert json.loads((merged / "COMPLETE.json").read_text())["key"] == units["merge:tsv"]

    back = _copy(in_memory, tmp_path / "b")
    _drop(back, "strength:star")
    assert main(["sweep", str(back), "--on-disk", "--quiet"]) == 0
    assert "strength:star" in _done(back) and _rows(back) == _rows(on_disk)


@pytest.mark.slow
def test_kill_9_mid_in_memory_sweep_then_resume_gives_the_same_table(in_memory, tmp_path):
    """SIGKILL the driver (which evaluates in its own process) inside eval:tsv: the rerun redoes exactly the
    unfinished units and gives the uninterrupted run's table."""
    from helpers import kill_sweep_when

    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    sweep = _copy(in_memory, tmp_path / "k")
    _drop(sweep, "eval:tsv", "strength:tsv", "eval:star", "strength:star")
    out = sweep.parent / "out"
    (out / "table.json").unlink()
    killed = kill_sweep_when(sweep, out / "evals", "tsv.partial-*", timeout=300)
    assert killed, "the sweep finished before it could be killed"
    assert not (out / "table.json").exists() and "eval:tsv" not in _done(sweep)
    report = run_sweep(load_sweep(sweep), progress=False)
    assert not report.failures
    assert sorted(report.ran) == ["eval:star", "eval:tsv", "strength:star", "strength:tsv"]
    assert any("interrupted run" in n for n in report.notes) and not list(out.rglob("*.partial-*"))
    assert _rows(sweep) == _rows(in_memory)


@pytest.mark.parametrize(
    ("merge", "extra", "needle"),
    [
        ({"delete_merged": True}, {}, "delete_merged has no meaning in memory"),
        ({"tokenizer_source": "union"}, {}, "rebuilds the tokenizer"),
        ({}, {"eval": {"tasks": ["ifeval"], "backend": "vllm"}}, "vLLM loads its own weights from disk"),
        ({}, {"eval": {"tasks": [TASK], "python": "/usr/bin/python3"}}, "is another interpreter"),
        ({}, {"strength": {"dtype": "bfloat16"}}, "one resident model serves every checkpoint"),
    ],
)
def test_what_one_resident_model_cannot_do_is_refused_at_plan_time(
    tmp_path, tiny_trio, user_error, merge, extra, needle
):
    sweep = _write_sweep(tmp_path, tiny_trio, merge={"in_memory": True, **merge}, **extra)
    line = user_error(["sweep", str(sweep), "--quiet"], tmp_path / "out")
    assert needle in line and "in_memory: false" in line, line


def test_keep_weights_without_in_memory_is_refused(tmp_path, tiny_trio, user_error):
    sweep = _write_sweep(tmp_path, tiny_trio, merge={"keep_weights": True})
    assert "keep_weights is an in-memory setting" in user_error(["sweep", str(sweep)], tmp_path / "out")


def test_an_actor_holds_the_gpus_its_merge_eval_or_strength_device_needs(tmp_path, tiny_trio):
    """Under Ray each in-memory actor takes an eval slot's resources with the most GPUs any of its kinds needs."""
    from lm_eval_sink.commands.sweep import load_sweep
    from lm_eval_sink.merging.engines import actor_resources

    ray = {"kind": "ray", "resources": {"eval": {"num_cpus": 2}}}
    cpu = load_sweep(_write_sweep(tmp_path / "cpu", tiny_trio, merge={"in_memory": True}, engine=ray))
    assert actor_resources(cpu.engine).num_gpus == 0 and actor_resources(cpu.engine).num_cpus == 2
    cuda = load_sweep(
        _write_sweep(tmp_path / "cuda", tiny_trio, merge={"in_memory": True, "device": "cuda"}, engine=ray)
    )
    assert actor_resources(cuda.engine).num_gpus == 1 and actor_resources(cuda.engine).num_cpus == 2
