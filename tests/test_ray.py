"""The Ray engine on a real local cluster (started by the fixture as its own process): the same
table as the local engine, a kill -9 of the driver then a rerun, and `screen --engine ray`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lm_eval_sink.cli import main

pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))
TASKS = Path(__file__).parent / "data" / "merging_task"
TASK = "lm_eval_sink_tiny_choice"
_VOLATILE = ("provenance", "created_utc", "time_utc")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 with 2 CPUs; the address is exported for `auto`; stopped after."""
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [RAY, "start", "--head", "--num-cpus", "2", "--include-dashboard=false", "--temp-dir", str(temp), "--node-ip-address", "127.0.0.1",
           "--port", "0", "--disable-usage-stats"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    address = next(line.split("'")[1] for line in (proc.stdout + proc.stderr).splitlines() if "ray start --address=" in line)
    old = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED")}
    os.environ.update(RAY_ADDRESS=address, RAY_USAGE_STATS_ENABLED="0")
    try:
        yield address
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _write_sweep(folder: Path, trio: dict[str, Path], **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "output": "out",
        "models": {"reference": str(trio["reference"]), "candidate": str(trio["candidate"])},
        "configs": ["linear_95_5", "dare_linear"],
        "eval": {"tasks": [TASK], "include_path": str(TASKS), "batch_size": 1, "seed": 0},
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32"},
        **extra,
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _stable(table: dict) -> dict:
    return {k: v for k, v in table.items() if k not in _VOLATILE}


def _table(sweep: Path) -> dict:
    return json.loads((sweep.parent / "out" / "table.json").read_text())


@pytest.fixture(scope="module")
def local_table(tmp_path_factory, tiny_trio) -> dict:
    sweep = _write_sweep(tmp_path_factory.mktemp("local"), tiny_trio)
    assert main(["sweep", str(sweep), "--quiet"]) == 0
    return _table(sweep)


@pytest.mark.slow
def test_ray_engine_gives_the_local_table(ray_cluster, local_table, tmp_path, tiny_trio):
    sweep = _write_sweep(tmp_path / "s", tiny_trio, engine={"kind": "ray", "address": "auto", "max_pending_merges": 1,
                                                             "resources": {"merge": {"num_cpus": 1}, "eval": {"num_cpus": 1}}})
    assert main(["sweep", str(sweep), "--quiet"]) == 0
    out = sweep.parent / "out"
    assert _stable(_table(sweep)) == _stable(local_table)
    assert len(local_table["rows"]) == 4 and all(r["status"] == "ok" for r in local_table["rows"])
    # one manifest line per unit, written by the driver; each worker's log in its own file
    rows = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(r["unit"] for r in rows if r["status"] == "done") == sorted(json.loads((out / "sweep.json").read_text())["units"])
    assert (out / "logs" / "merge-dare_linear" / "task.log").is_file() and (out / "logs" / "eval-reference" / "task.log").is_file()
    # the engine is in no unit key: the local engine finds everything finished
    assert main(["sweep", str(sweep), "--quiet", "--engine", "local"]) == 0
    assert _stable(_table(sweep)) == _stable(local_table)


@pytest.mark.slow
def test_kill_9_of_the_ray_driver_then_rerun_gives_the_same_table(ray_cluster, local_table, tmp_path, tiny_trio):
    sweep = _write_sweep(tmp_path / "k", tiny_trio)
    manifest = sweep.parent / "out" / "manifest.jsonl"
    cmd = [sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(sweep), "--quiet", "--engine", "ray", "--ray-address", "auto"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (manifest.is_file() and '"done"' in manifest.read_text()):
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = sum('"done"' in x for x in manifest.read_text().splitlines())
    assert 1 <= done_before < 10 and not (sweep.parent / "out" / "table.json").exists()
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"{done_before} already finished" in rerun.stdout
    assert _stable(_table(sweep)) == _stable(local_table)


def test_screen_on_ray_equals_local_screen(ray_cluster, tmp_path, tiny_trio):
    models = [str(tiny_trio["reference"]), str(tiny_trio["candidate"])]
    args = ["--n-prompts", "5", "--last-k", "2", "--dtype", "float32", "--quiet"]
    assert main(["screen", *models, *args, "--output", str(tmp_path / "local")]) == 0
    assert main(["screen", *models, *args, "--output", str(tmp_path / "ray"), "--engine", "ray", "--ray-address", "auto"]) == 0
    local, remote = (json.loads((tmp_path / d / "screen.json").read_text()) for d in ("local", "ray"))
    assert {k: v for k, v in remote.items() if k != "provenance"} == {k: v for k, v in local.items() if k != "provenance"}
    for slug in (m["slug"] for m in local["models"]):
        a, b = (json.loads((tmp_path / d / "strength" / f"{slug}.strength.json").read_text()) for d in ("local", "ray"))
        assert b["sink_strength"] == a["sink_strength"] and b["sink_strength_layer_head"] == a["sink_strength_layer_head"]
    assert (tmp_path / "ray" / "screen.png").is_file()


def test_worker_checks_are_one_line(tmp_path):
    from lm_eval_sink.io import package_versions
    from lm_eval_sink.merging.engines import run_task

    versions = package_versions()
    _, err = run_task(lambda: 1, {**versions, "torch": "0.0"}, tmp_path, None)
    assert err.startswith("worker ") and "has torch" in err and "the driver 0.0" in err
    _, err = run_task(lambda: 1, versions, tmp_path / "gone", None)
    assert "cannot see the output folder" in err and str(tmp_path / "gone") in err
    assert run_task(lambda: 1, versions, tmp_path, tmp_path / "t.log") == (1, None)
