"""The Ray engine on a real local cluster (started by the fixture as its own process): the same
table as the local engine after a kill -9 of the driver and a rerun, and `screen --engine ray`."""

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

from helpers import stop_ray_cluster

from lm_eval_sink.cli import main

pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))
TASKS = Path(__file__).parent / "data" / "merging_task"
TASK = "lm_eval_sink_tiny_choice"
_VOLATILE = ("provenance", "created_utc", "time_utc")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head` with 2 CPUs, on 127.0.0.1 alone; the address is exported for `auto`; stopped after."""
    from lm_eval_sink.merging.engines import LOOPBACK_ENV

    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", LOOPBACK_ENV: "0"}
    cmd = [
        RAY,
        "start",
        "--head",
        "--num-cpus",
        "2",
        "--include-dashboard=false",
        "--temp-dir",
        str(temp),
        "--node-ip-address",
        "127.0.0.1",
        "--port",
        "0",
        "--disable-usage-stats",
    ]
    old = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED", LOOPBACK_ENV)}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        address = (temp / "ray_current_cluster").read_text().strip()  # the GCS address `ray start` wrote
        assert address.startswith("127.0.0.1:"), address
        os.environ.update({"RAY_ADDRESS": address, "RAY_USAGE_STATS_ENABLED": "0", LOOPBACK_ENV: "0"})
        yield address
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        stop_ray_cluster(temp)  # this cluster only (`ray stop` would stop every Ray on the machine)
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
def test_ray_driver_killed_after_its_first_unit_then_rerun_gives_the_local_table(
    ray_cluster, local_table, tmp_path, tiny_trio, capsys
):
    """One sweep's worth of work for both claims: every unit runs under the Ray engine (the first in a
    driver subprocess that is SIGKILLed once it has finished, the rest in the rerun), and the table
    equals the local engine's; then the local engine finds everything finished (the engine is in no key)."""
    sweep = _write_sweep(
        tmp_path / "k",
        tiny_trio,
        engine={
            "kind": "ray",
            "max_pending_merges": 1,
            "resources": {"merge": {"num_cpus": 1}, "eval": {"num_cpus": 1}},
        },
    )
    out = sweep.parent / "out"
    manifest = out / "manifest.jsonl"
    cmd = [sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(sweep), "--quiet", "--ray-address", "auto"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while (
        time.time() < deadline and proc.poll() is None and not (manifest.is_file() and '"done"' in manifest.read_text())
    ):
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = sum('"done"' in x for x in manifest.read_text().splitlines())
    assert 1 <= done_before < 10 and not (out / "table.json").exists()
    capsys.readouterr()
    assert main(["sweep", str(sweep), "--quiet", "--ray-address", "auto"]) == 0
    assert f"{done_before} already finished" in capsys.readouterr().out
    assert _stable(_table(sweep)) == _stable(local_table)
    assert (
        len(local_table["rows"]) == 4
        and all(r["status"] == "ok" for r in local_table["rows"])
        and local_table["columns"]
    )
    # one "done" manifest line per unit, written by the drivers; each worker's log in its own file
    rows = [json.loads(x) for x in manifest.read_text().splitlines()]
    assert sorted(r["unit"] for r in rows if r["status"] == "done") == sorted(
        json.loads((out / "sweep.json").read_text())["units"]
    )
    assert (out / "logs" / "merge-dare_linear" / "task.log").is_file() and (
        out / "logs" / "eval-reference" / "task.log"
    ).is_file()
    assert main(["sweep", str(sweep), "--quiet", "--engine", "local"]) == 0
    assert "0 steps run, 10 already finished" in capsys.readouterr().out
    assert _stable(_table(sweep)) == _stable(local_table)


def test_screen_on_ray_equals_local_screen(ray_cluster, tmp_path, tiny_trio):
    models = [str(tiny_trio["reference"]), str(tiny_trio["candidate"])]
    args = ["--n-prompts", "5", "--last-k", "2", "--dtype", "float32", "--quiet"]
    assert main(["screen", *models, *args, "--output", str(tmp_path / "local")]) == 0
    assert (
        main(["screen", *models, *args, "--output", str(tmp_path / "ray"), "--engine", "ray", "--ray-address", "auto"])
        == 0
    )
    local, remote = (
        json.loads((tmp_path / d / "screen.json").read_text().replace(str(tmp_path / d), "OUT"))
        for d in ("local", "ray")
    )
    assert {k: v for k, v in remote.items() if k != "provenance"} == {
        k: v for k, v in local.items() if k != "provenance"
    }
    assert [m["strength_file"] for m in remote["models"]] == [
        "OUT/strength/candidate.strength.json",
        "OUT/strength/reference.strength.json",
    ]
    for slug in (m["slug"] for m in local["models"]):
        a, b = (json.loads((tmp_path / d / "strength" / f"{slug}.strength.json").read_text()) for d in ("local", "ray"))
        assert (
            b["sink_strength"] == a["sink_strength"] and b["sink_strength_layer_head"] == a["sink_strength_layer_head"]
        )
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
