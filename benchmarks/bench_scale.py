"""Scale benchmark: the tiny merge-and-evaluate sweep under the local engine and the Ray engine.

The sweep of tests/test_ray.py: tiny random Llama reference and candidate (tests/helpers.py's
`make_tiny_lm`), two controls (linear_95_5, dare_linear), the tiny local lm-eval task of
tests/data/merging_task, Sink Strength on 5 prompts: 10 units (2 merges, 4 evals, 4 strength).

1. Local engine wall time (the baseline, measured in the same run).
2. Ray engine on a local cluster of ONE worker slot (`ray start --head --num-cpus 1`) and of TWO
   (`--num-cpus 2`): sweep wall time over the local one; the cluster start is timed apart.
Each run writes a fresh output folder. RAY_USAGE_STATS_ENABLED=0, bound to 127.0.0.1.
Usage: OMP_NUM_THREADS=1 python benchmarks/bench_scale.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def sweep_file(folder: Path, models: dict[str, Path], engine: dict | None) -> Path:
    folder.mkdir(parents=True)
    data = {
        "output": "out",
        "models": {k: str(v) for k, v in models.items()},
        "configs": ["linear_95_5", "dare_linear"],
        "eval": {
            "tasks": ["lm_eval_sink_tiny_choice"],
            "include_path": str(REPO / "tests" / "data" / "merging_task"),
            "batch_size": 1,
            "seed": 0,
        },
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32"},
        **({"engine": engine} if engine else {}),
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def timed_sweep(path: Path, env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(path), "--quiet"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t


def main() -> None:
    from helpers import make_tiny_lm, start_ray_cluster, stop_ray_cluster

    from lm_eval_sink.merging.engines import LOOPBACK_ENV

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_scale_"))
    models = {
        "reference": make_tiny_lm(work / "reference", "llama", 1),
        "candidate": make_tiny_lm(work / "candidate", "llama", 2),
    }
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        LOOPBACK_ENV: "0",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("RAY_ADDRESS", None)
    local = timed_sweep(sweep_file(work / "local", models, None), env)
    print(f"local engine: {local:.1f} s (10 units)")
    ray_times = {}
    for cpus in (1, 2):
        temp = work / f"ray_tmp_{cpus}"
        t = time.perf_counter()
        address = start_ray_cluster(temp, env, num_cpus=cpus)
        start = time.perf_counter() - t
        try:
            wall = timed_sweep(sweep_file(work / f"ray{cpus}", models, {"kind": "ray", "address": address}), env)
        finally:
            stop_ray_cluster(temp)
        ray_times[cpus] = wall
        print(
            f"ray engine, {cpus} worker slot(s): {wall:.1f} s = {wall / local:.2f} x local (cluster "
            f"start {start:.1f} s, not included)"
        )
    print(f"two workers vs one: speed-up {ray_times[1] / ray_times[2]:.2f} x")


if __name__ == "__main__":
    main()
