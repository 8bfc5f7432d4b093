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

from helpers import REPO, TINY_SWEEP_TASK, TINY_SWEEP_TASKS, start_ray_cluster, stop_ray_cluster
from helpers import write_tiny_sweep as _write_sweep

from lm_eval_sink.cli import main

pytest.importorskip("ray")

_VOLATILE = ("provenance", "created_utc", "time_utc")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head` with 2 CPUs and 2 declared GPUs (Ray assigns their ids; none is used), token auth
    with the session's token (conftest), listening on 127.0.0.1 alone; the address is exported for `auto`.
    ONE cluster for the module (a start costs 6-50 s); stopped after."""
    from lm_eval_sink.merging.engines import LOOPBACK_ENV

    assert os.environ["RAY_AUTH_MODE"] == "token" and Path(os.environ["RAY_AUTH_TOKEN_PATH"]).is_file()
    temp = tmp_path_factory.mktemp("ray")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # Ray refuses more GPUs than it lists
    env.update({"RAY_USAGE_STATS_ENABLED": "0", LOOPBACK_ENV: "0"})
    # workers import the package from the checkout under test (not whichever one is installed editable)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    old = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_USAGE_STATS_ENABLED", LOOPBACK_ENV)}
    try:
        address = start_ray_cluster(temp, env, num_cpus=2, num_gpus=2)  # fails the fixture with ray's output
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


def _stable(table: dict) -> dict:
    return {k: v for k, v in table.items() if k not in _VOLATILE}


def _table(sweep: Path) -> dict:
    return json.loads((sweep.parent / "out" / "table.json").read_text())


@pytest.fixture(scope="module")
def local_table(uninterrupted) -> dict:
    """The table of the session's tiny sweep under the local engine (the sweep file `_write_sweep` writes)."""
    return _table(uninterrupted)


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
    assert 1 <= done_before < 7 and not (out / "table.json").exists()
    capsys.readouterr()
    assert main(["sweep", str(sweep), "--quiet", "--ray-address", "auto"]) == 0
    assert f"{done_before} already finished" in capsys.readouterr().out
    assert _stable(_table(sweep)) == _stable(local_table)
    assert (
        len(local_table["rows"]) == 3
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
    assert "0 steps run, 7 already finished" in capsys.readouterr().out
    assert _stable(_table(sweep)) == _stable(local_table)


def test_screen_on_ray_keeps_finished_models_when_one_fails_then_equals_local_screen(
    ray_cluster, tmp_path, tiny_trio, capsys
):
    """A model that fails in its task (a tensor of the wrong shape) is reported in one line; the others' results were
    written as their tasks finished and are reused by the rerun, which equals the local screen."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_trio["candidate"], broken)
    weights = load_file(broken / "model.safetensors")  # a whole file whose tensor fits no layer: fails in the task
    name = sorted(k for k in weights if "down_proj" in k)[0]
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] + 1)
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    models = [str(tiny_trio["reference"]), str(tiny_trio["candidate"])]
    args = ["--n-prompts", "5", "--last-k", "2", "--dtype", "float32", "--quiet"]
    on_ray = ["--engine", "ray", "--ray-address", "auto"]
    assert main(["screen", *models, str(broken), *args, "--output", str(tmp_path / "ray"), *on_ray]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 of 3 model(s) failed" in err[0] and str(broken) in err[0], err
    assert sorted(f.name for f in (tmp_path / "ray" / "strength").glob("*.strength.json")) == [
        "candidate.strength.json",
        "reference.strength.json",
    ]
    assert not (tmp_path / "ray" / "screen.json").exists()
    assert main(["screen", *models, *args, "--output", str(tmp_path / "local")]) == 0
    capsys.readouterr()
    assert main(["screen", *models, *args, "--output", str(tmp_path / "ray"), *on_ray]) == 0
    assert capsys.readouterr().out.count(": reused ") == 2
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
        # a zero-GPU task sees no GPU (the cluster declares two), and says so in its provenance
        assert (
            b["provenance"]["placement"]["gpu_ids"] == [] and b["provenance"]["placement"]["CUDA_VISIBLE_DEVICES"] == ""
        )
        assert "placement" not in a["provenance"]
    assert (tmp_path / "ray" / "screen.png").is_file()


def test_gpu_units_see_exactly_the_gpus_ray_assigned(ray_cluster, tmp_path):
    """Through `run_on_ray` (the path a sweep's units take): two concurrent 1-GPU units get different ids and
    each sees only its own; a zero-GPU unit sees none; the placement is what the unit's provenance records."""
    from functools import partial
    from types import SimpleNamespace

    import ray

    from lm_eval_sink.errors import UserError
    from lm_eval_sink.merging.engines import EngineSpec, Resources, gpu_placement, run_on_ray

    def _probe_unit(unit, root: str):  # nested: Ray sends it by value (workers cannot import this module)
        """What a unit sees on its worker, written to `root/seen/<id>.json`; GPU units wait for each other
        (so the two provably run at once) before they record."""
        import json
        import os
        import time
        from pathlib import Path

        from lm_eval_sink.merging.engines import placement_fields

        started = Path(root) / "started"
        started.mkdir(exist_ok=True)
        (started / unit.checkpoint).touch()
        if unit.kind == "eval":
            deadline = time.time() + 120
            while len(list(started.glob("gpu*"))) < 2:
                if time.time() > deadline:
                    raise RuntimeError("the other GPU unit never started")
                time.sleep(0.1)
        seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), **placement_fields()}
        (Path(root) / "seen").mkdir(exist_ok=True)
        (Path(root) / "seen" / f"{unit.id}.json").write_text(json.dumps(seen))

    kinds = (("eval", "gpu-a"), ("eval", "gpu-b"), ("strength", "cpu-c"))
    units = [SimpleNamespace(id=f"{k}:{c}", kind=k, checkpoint=c) for k, c in kinds]
    engine = EngineSpec(
        kind="ray",
        address="auto",
        resources={"merge": Resources(), "eval": Resources(num_gpus=1), "strength": Resources(num_gpus=0)},
    )
    errors = {}
    run_on_ray(
        units,
        engine,
        tmp_path,
        lambda u, e: errors.__setitem__(u.id, e),
        partial(_probe_unit, root=str(tmp_path)),
        progress=False,
    )
    assert errors == {"eval:gpu-a": None, "eval:gpu-b": None, "strength:cpu-c": None}
    seen = {u.id: json.loads((tmp_path / "seen" / f"{u.id}.json").read_text()) for u in units}
    a, b, c = (seen[u.id] for u in units)
    assert {a["CUDA_VISIBLE_DEVICES"], b["CUDA_VISIBLE_DEVICES"]} == {"0", "1"}
    for s in (a, b):
        assert s["placement"]["gpu_ids"] == [s["CUDA_VISIBLE_DEVICES"]] == [s["placement"]["CUDA_VISIBLE_DEVICES"]]
    assert c["CUDA_VISIBLE_DEVICES"] == "" and c["placement"]["gpu_ids"] == []

    # the worker's check refuses a task that could see GPUs Ray did not assign it
    @ray.remote(num_gpus=0)
    def widened() -> str:
        os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
        try:
            gpu_placement()
        except UserError as e:
            return e.line()
        finally:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "ran"

    line = ray.get(widened.remote())
    assert "sees CUDA_VISIBLE_DEVICES='0,1' but Ray assigned GPUs []" in line


@pytest.mark.slow
def test_a_cuda_merge_that_fails_under_ray_leaves_its_units_not_run(ray_cluster, tmp_path, tiny_trio, capsys):
    """`merge: {device: cuda}` gets 1 GPU by default; on this CPU machine the merge task (which sees GPU id 0 or 1)
    fails, its checkpoint's units are "not run", the endpoints' units finish (on no GPU) and the table is written."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("shows a cuda merge failing on a machine without CUDA")
    sweep = _write_sweep(
        tmp_path, tiny_trio, configs=["linear_95_5"], eval=False, merge={"device": "cuda"}, engine={"kind": "ray"}
    )
    assert main(["sweep", str(sweep), "--quiet", "--ray-address", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 sweep step(s) failed (merge:linear_95_5, strength:linear_95_5)" in err[0], err
    out = sweep.parent / "out"
    rows = {json.loads(x)["unit"]: json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()}
    assert rows["merge:linear_95_5"]["status"] == "failed" and "CUDA" in rows["merge:linear_95_5"]["error"]
    assert "strength:linear_95_5" not in rows  # "not run" units leave no manifest line
    assert rows["strength:reference"]["status"] == rows["strength:candidate"]["status"] == "done"
    complete = json.loads((out / "strength" / "reference" / "COMPLETE.json").read_text())
    assert complete["provenance"]["placement"]["gpu_ids"] == []
    table = json.loads((out / "table.json").read_text())
    assert {r["checkpoint"]: r["status"] for r in table["rows"]}["linear_95_5"] != "ok"


def test_gpu_settings_follow_the_device(tmp_path, tiny_trio, capsys):
    """device cuda defaults num_gpus to 1 and refuses 0; device cpu refuses GPUs; device auto (the default) takes the
    GPUs given, none by default; vLLM's CPU build (0) is allowed."""
    from lm_eval_sink.commands.sweep import load_sweep

    def spec(**extra):
        return load_sweep(_write_sweep(tmp_path, tiny_trio, **extra)).engine.resources

    ray = {"kind": "ray"}
    res = spec(merge={"device": "cuda"}, strength={"device": "cuda", "n_prompts": 5}, engine=ray)
    assert (res["merge"].num_gpus, res["strength"].num_gpus, res["eval"].num_gpus) == (1, 1, 0)
    res = spec(engine={**ray, "resources": {"strength": {"num_gpus": 1}}})
    assert (res["merge"].num_gpus, res["strength"].num_gpus, res["eval"].num_gpus) == (0, 1, 0)
    vllm = {
        "tasks": [TINY_SWEEP_TASK],
        "include_path": str(TINY_SWEEP_TASKS),
        "backend": "vllm",
        "model_args": {"tensor_parallel_size": 2},
    }
    assert spec(eval=vllm, engine=ray)["eval"].num_gpus == 2
    assert spec(eval=vllm, engine={**ray, "resources": {"eval": {"num_gpus": 0}}})["eval"].num_gpus == 0
    bad = [
        (
            {"merge": {"device": "cuda"}, "engine": {**ray, "resources": {"merge": {"num_gpus": 0}}}},
            "engine.resources.merge.num_gpus = 0 with device cuda",
        ),
        (
            {"strength": {"device": "cpu"}, "engine": {**ray, "resources": {"strength": {"num_gpus": 1}}}},
            "engine.resources.strength.num_gpus = 1 but the device is cpu",
        ),
        ({"merge": {"device": "cuda:1"}, "engine": ray}, "device cuda:1 names a GPU"),
    ]
    for extra, needle in bad:
        assert main(["sweep", str(_write_sweep(tmp_path, tiny_trio, **extra)), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(["screen", str(tiny_trio["reference"]), "--engine", "ray", "--device", "cuda", "--num-gpus", "0"]) == 2
    assert "--num-gpus = 0 with device cuda" in capsys.readouterr().err
    assert main(["screen", str(tiny_trio["reference"]), "--engine", "ray", "--device", "cpu", "--num-gpus", "1"]) == 2
    assert "--num-gpus = 1 but the device is cpu" in capsys.readouterr().err


_PROBE = """
import sys
from lm_eval_sink.errors import UserError
from lm_eval_sink.merging.engines import connect
try:
    ray = connect(sys.argv[1])
except UserError as e:
    print(e.line())
    sys.exit(2)
print("connected:", ray.get(ray.remote(lambda: "ran").remote()))
"""


def _driver(address: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    """A driver process connecting to `address` with `home` as its HOME and none of the session's Ray auth
    variables unless given in `env` (Ray's connection retries cut to 1 s)."""
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    env = {**base, "HOME": str(home), "RAY_gcs_server_port_wait_time_s": "1", **env}
    return subprocess.run([sys.executable, "-c", _PROBE, address], env=env, capture_output=True, text=True, timeout=180)


def test_a_stale_default_token_is_refused_in_one_line_and_the_isolated_token_connects(ray_cluster, tmp_path):
    """The failure once seen on a fresh clone: ~/.ray/auth_token left by an earlier Ray, a cluster that does not
    use it. The driver that reads it is refused, in one line naming the cause; with the cluster's own token
    path (what the tests' isolation gives cluster and driver alike) the same driver connects."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0" * 64)  # another cluster's token
    stale = _driver("auto", home)
    assert stale.returncode == 2, stale.stdout + stale.stderr[-2000:]
    assert stale.stdout.strip() == stale.stdout.strip().splitlines()[0]
    assert stale.stdout.startswith(f"the cluster at {ray_cluster} refused this driver's Ray auth token (fix: ")
    assert "ray start --head" not in stale.stdout
    isolated = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}
    fixed = _driver("auto", home, **isolated)
    assert fixed.returncode == 0 and "connected: ran" in fixed.stdout, fixed.stdout + fixed.stderr[-2000:]


def test_a_token_auth_cluster_takes_only_its_token(ray_cluster, tmp_path):
    """The module's cluster runs with RAY_AUTH_MODE=token: a driver with no token is refused (one line), a
    driver given the token (RAY_AUTH_TOKEN, at an explicit address) connects and runs a task."""
    (tmp_path / "home").mkdir()
    none = _driver(ray_cluster, tmp_path / "home")
    assert none.returncode == 2 and "refused this driver's Ray auth token" in none.stdout, (
        none.stdout + none.stderr[-2000:]
    )
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text()
    right = _driver(ray_cluster, tmp_path / "home", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    assert right.returncode == 0 and "connected: ran" in right.stdout, right.stdout + right.stderr[-2000:]


def test_worker_checks_are_one_line(tmp_path):
    from lm_eval_sink.merging.engines import run_task, worker_versions

    versions = worker_versions()
    _, err = run_task(lambda: 1, {**versions, "torch": "0.0"}, tmp_path, None)
    assert err.startswith("worker ") and "has torch" in err and "the driver 0.0" in err
    code = {**versions["code"], "lm_eval_sink/capture.py": "0" * 32}  # the driver's capture.py is another
    _, err = run_task(lambda: 1, {**versions, "code": code}, tmp_path, None)
    assert "has other lm-eval-sink code than the driver (lm_eval_sink/capture.py)" in err
    _, err = run_task(lambda: 1, versions, tmp_path / "gone", None)
    assert "cannot see the output folder" in err and str(tmp_path / "gone") in err
    assert run_task(lambda: 1, versions, tmp_path, tmp_path / "t.log") == (1, None)


def _busy_actor_pid() -> int | None:
    """The pid of an actor of the in-memory pool in the middle of a job (Ray titles it `ray::PoolActor.run`)."""
    import psutil

    for p in psutil.process_iter(["pid", "cmdline"]):
        if any("PoolActor.run" in part for part in p.info["cmdline"] or []):
            return p.info["pid"]
    return None


@pytest.mark.slow
def test_in_memory_actor_pool_gives_the_local_table_when_an_actor_is_killed_mid_unit(
    ray_cluster, local_table, tmp_path, tiny_trio
):
    """Two actors, each with its resident model, take whole checkpoints; one is SIGKILLed inside a unit,
    is replaced, its checkpoint is redone, and the table equals the local on-disk engine's."""
    sweep = _write_sweep(
        tmp_path / "m",
        tiny_trio,
        merge={"random_seed": 0, "in_memory": True},
        engine={"kind": "ray", "resources": {"eval": {"num_cpus": 1}}},
    )
    out = sweep.parent / "out"
    cmd = [sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(sweep), "--quiet", "--ray-address", "auto"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed, deadline = None, time.time() + 300
    while killed is None and time.time() < deadline and proc.poll() is None:
        if list(out.glob("*/*.partial-*")):
            killed = _busy_actor_pid()
            if killed is not None:
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    stdout, stderr = proc.communicate(timeout=600)
    assert killed is not None, "no actor was caught inside a unit"
    assert proc.returncode == 0, stderr[-2000:]
    assert "its actor was lost; a new actor redid the checkpoint" in stdout, stdout
    assert _stable(_table(sweep)) == _stable(local_table)
    assert not (out / "merges").exists() and not list(out.rglob("*.partial-*"))
    done = [json.loads(x)["unit"] for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(done) == sorted(u for u in json.loads((out / "sweep.json").read_text())["units"] if "merge:" not in u)
    marker = json.loads((out / "evals" / "dare_linear" / "COMPLETE.json").read_text())
    assert marker["in_memory"] is True and marker["provenance"]["placement"]["gpu_ids"] == []
