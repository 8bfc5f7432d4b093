"""One vLLM engine per sweep against one per checkpoint: wall time, peak memory, and each checkpoint's time.

The SmolLM2 sweep: the embedded SmolLM2-135M-Instruct as the reference, a copy with seeded noise
in 20 MLP matrices as the candidate (fluent, other responses), three merges (linear_uniform,
linear_95_5, ties); IFEval (limit 8, max_gen_toks 64, chat template) and `sink_strength` (measured
on the engine since S comes from it, `LM_EVAL_SINK_S_ON_ENGINE=0` for the transformers child of the figures in
docs/scale.md; `bench_engine_strength.py` compares the two), float32, `enforce_eager` both ways, vLLM's CPU build
in `.venv-vllm` (in-process engine, one OpenMP thread, 1 GiB of KV cache). The merges are made
once beforehand (a sweep with `eval: false` and S on 5 prompts); each measured sweep runs on a
copy of that folder, so it runs the 5 eval units alone: once with `--fresh-engine` (an `lm_eval`
process per checkpoint, today's path) and once with the resident engine (one engine process for
the sweep), each `lm-eval-sink sweep` in a fresh process, its peak RSS sampled every 0.2 s over
the driver and its descendants (sum, and the largest process). Both tables must agree in every
column to 1e-5 and every response must be the same.

Each checkpoint's time: its wall time (the unit's log start to its COMPLETE.json), the S child
(`capture.wall_seconds`), generation (lm-eval's "Running generate_until requests" to its next log
line, 1 s resolution, `bench_vllm.generation_seconds`), writing (resident: timed; fresh: part of the
rest), and the rest, its start-up: for the fresh path the `lm_eval` process start, imports, task
index, engine build and weight load; for the resident engine each part as its process timed it
(process start, imports, task index, engine build, swap = reload_weights + prefix-cache reset).
Ratios: wall time and peak RSS resident / fresh; the share of the fresh path's start-up that the
resident engine removes (goal >= 80%), over the sweep (its one engine start included) and per
checkpoint whose weights were swapped in; each swap as a share of its checkpoint's evaluation (goal < 10%).
`--ray`: the resident sweep once more under Ray (a local cluster started here with 2 CPUs, its own
auth token, on 127.0.0.1; `resources.eval` 1 CPU and no GPU, so two actors, each with its engine), its
table checked the same way.

Usage: python benchmarks/bench_vllm_sweep.py [--workdir DIR] [--limit 8] [--max-gen-toks 64]
       [--vllm-python .venv-vllm/bin/python] [--ray]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LM_EVAL_SINK_DATA", "/work/shared/data")
os.environ.setdefault("NLTK_DATA", "/work/shared/data/nltk_data")

REPO = Path(__file__).resolve().parent.parent
CONTROLS = ("linear_uniform", "linear_95_5", "ties")
CHECKPOINTS = ("reference", "candidate", *CONTROLS)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def make_candidate(reference: Path, out: Path) -> Path:
    """The reference with seeded noise (std 0.02) in the MLP down projections of layers 10-29."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("COMPLETE.json"))
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for layer in range(10, 30):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        weights[name] = weights[name] + 0.02 * torch.randn(weights[name].shape, generator=generator)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def sweep_file(folder: Path, models: dict[str, str], evals: dict | bool, extra: dict | None = None) -> Path:
    data = {
        "output": "out",
        "models": models,
        "configs": list(CONTROLS),
        "eval": evals,
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32"},  # a calibrated setting
        **(extra or {}),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "sweep.yaml"


def _tree_rss(root: int) -> tuple[float, float]:
    """(sum, largest) RSS in MiB of `root`, its descendants and every Ray actor of a pool on the machine with its
    descendants (its engine process)."""
    import psutil

    procs = {}
    try:
        top = psutil.Process(root)
        procs = {p.pid: p for p in [top, *top.children(recursive=True)]}
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter(["cmdline"]):
        if any("PoolActor" in part for part in p.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                procs |= {q.pid: q for q in [p, *p.children(recursive=True)]}
    sizes = []
    for p in procs.values():
        try:
            sizes.append(p.memory_info().rss / 2**20)
        except psutil.Error:
            pass
    return sum(sizes), max(sizes, default=0.0)


def timed(cmd: list[str], env: dict[str, str]) -> dict:
    """Run `cmd`: its wall seconds and peak RSS in MiB (the sum over its process tree, the largest process)."""
    start, peak_sum, peak_one = time.perf_counter(), 0.0, 0.0
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        total, one = _tree_rss(proc.pid)
        peak_sum, peak_one = max(peak_sum, total), max(peak_one, one)
        time.sleep(0.2)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:6]} failed ({proc.returncode}): {output[-3000:]}")
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 1), "peak_rss_sum_mib": round(peak_sum), "peak_rss_largest_mib": round(peak_one)}


def timed_sweep(path: Path, extra: list[str], env: dict[str, str] | None = None) -> dict:
    """`lm-eval-sink sweep` in a fresh process: its wall seconds and peak RSS (sum over its tree, largest process)."""
    cmd = [sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(path), "--quiet", *extra]
    return timed(cmd, {**os.environ, **VLLM_ENV, **(env or {})})


def _log(unit: Path) -> Path:
    return next((unit / "lm_eval" / "logs").glob("lm_eval_*.log"))


def _fresh_parts(log: str, started: float, s_child: float) -> dict:
    """An lm_eval process's start-up parts: until lm-eval builds the model (process start, imports, task index; the
    S child taken out), and the model's build (engine build and weight load: to lm-eval's next log line from outside
    its vLLM model, whose constructor logs too)."""
    from bench_vllm import _STAMP

    stamps = [(m.group(1), line) for line in log.splitlines() if (m := _STAMP.match(line))]
    at = next(i for i, (_, line) in enumerate(stamps) if "Initializing vllm model" in line)
    end = next(i for i in range(at + 1, len(stamps)) if "[models.vllm_causallms" not in stamps[i][1])
    t0, t1 = (dt.datetime.strptime(stamps[i][0], "%Y-%m-%d:%H:%M:%S").timestamp() for i in (at, end))
    return {"process_imports_task_index_s": t0 - started - s_child, "engine_build_s": t1 - t0}


def breakdown(unit: Path) -> dict:
    """One eval unit's time: wall, S child, generation, writing and the rest (start-up), with the resident engine's
    own parts where it timed them."""
    from bench_vllm import generation_seconds

    marker = json.loads((unit / "COMPLETE.json").read_text())
    log = _log(unit)
    started = dt.datetime.strptime(log.stem.removeprefix("lm_eval_"), "%Y-%m-%dT%H-%M-%S-%f").timestamp()
    wall = (unit / "COMPLETE.json").stat().st_mtime - started
    results = json.loads((unit / marker["results"]).read_text())
    s_child = max(
        (c.get("metadata", {}).get("capture", {}).get("wall_seconds", 0) for c in results["configs"].values()),
        default=0,
    )
    timings = marker.get("timings") or {}
    generation = generation_seconds(log.read_text(errors="replace")) or 0.0
    write = timings.get("write", 0.0)
    row = {"wall_s": wall, "s_child_s": s_child, "generation_s": generation, "write_s": write}
    row["start_up_s"] = wall - s_child - generation - write
    for part in ("process_start", "imports", "task_index", "engine_build", "swap"):
        if part in timings:
            row[f"{part}_s"] = timings[part]
    if not timings:  # an lm_eval process: its parts from lm-eval's log (1 s resolution)
        row |= _fresh_parts(log.read_text(errors="replace"), started, s_child)
    if "engine" in marker:
        row["weights"] = marker["engine"]["weights"]
        row["peak_rss_mib"] = round(marker["peak_rss"] / 2**20)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def _responses(unit: Path) -> dict:
    out = {}
    for path in (unit / "lm_eval").glob("*/samples_*.jsonl"):
        task = path.name.split("_20")[0].removeprefix("samples_")
        out[task] = sorted((json.loads(x)["doc_id"], json.loads(x)["resps"]) for x in path.read_text().splitlines())
    return out


def compare(fresh: Path, other: Path) -> dict:
    """The largest difference of any table column (S included) and the checkpoints whose responses differ."""
    a, b = (json.loads((p / "table.json").read_text()) for p in (fresh, other))
    diffs = [0.0]
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        for col in a["columns"]:
            x, y = ra["metrics"][col], rb["metrics"].get(col)
            diffs.append(abs(x - y) if x is not None and y is not None else float("inf"))
        if ra["sink_strength"] is not None:
            diffs.append(abs(ra["sink_strength"] - rb["sink_strength"]))
    differ = [c for c in CHECKPOINTS if _responses(fresh / "evals" / c) != _responses(other / "evals" / c)]
    return {"max_column_diff": max(diffs), "responses_differ": differ, "columns": a["columns"] == b["columns"]}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(runs: dict, units: dict) -> dict:
    """The ratios the issue asks for, from the two runs' figures."""
    resident = units["resident"]
    startup = {k: sum(u["start_up_s"] for u in v.values()) for k, v in units.items()}  # per run, all checkpoints
    swaps = [u["swap_s"] / u["wall_s"] for u in resident.values() if "swap_s" in u]
    swapped = [u["start_up_s"] for u in resident.values() if "swap_s" in u]  # the checkpoints after the first
    fresh = [u["start_up_s"] for u in units["fresh"].values()]
    return {
        "wall_ratio_resident_over_fresh": round(runs["resident"]["wall_s"] / runs["fresh"]["wall_s"], 3),
        "peak_rss_sum_ratio": round(runs["resident"]["peak_rss_sum_mib"] / runs["fresh"]["peak_rss_sum_mib"], 3),
        "peak_rss_largest_ratio": round(
            runs["resident"]["peak_rss_largest_mib"] / runs["fresh"]["peak_rss_largest_mib"], 3
        ),
        "start_up_s": {k: round(v, 1) for k, v in startup.items()},
        "start_up_removed": round(1 - startup["resident"] / startup["fresh"], 3),
        "start_up_removed_per_swapped_checkpoint": round(1 - _mean(swapped) / _mean(fresh), 3),
        "swap_share_of_checkpoint": {"max": round(max(swaps), 3), "mean": round(sum(swaps) / len(swaps), 3)},
        "eval_units_s": {k: round(sum(u["wall_s"] for u in v.values()), 1) for k, v in units.items()},
    }


def ray_run(work: Path, models: dict[str, str], evals: dict) -> dict:
    """The resident sweep on a local Ray cluster started here (2 CPUs: two actors, each with its own engine)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import isolated_ray_auth, start_ray_cluster, stop_ray_cluster

    from lm_eval_sink.merging.engines import LOOPBACK_ENV

    env = {"RAY_USAGE_STATS_ENABLED": "0", LOOPBACK_ENV: "0", **isolated_ray_auth(work / "ray_auth")}
    temp = work / "ray_tmp"
    address = start_ray_cluster(temp, {**os.environ, **VLLM_ENV, **env}, num_cpus=2)  # workers inherit VLLM_*
    try:
        shutil.copytree(work / "prep", work / "ray")
        engine = {"engine": {"kind": "ray", "address": address, "resources": {"eval": {"num_cpus": 1, "num_gpus": 0}}}}
        return timed_sweep(sweep_file(work / "ray", models, evals, engine), [], env)
    finally:
        stop_ray_cluster(temp)


def main() -> None:
    from lm_eval_sink.models import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-gen-toks", type=int, default=64)
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--ray", action="store_true")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_vllm_sweep_"))
    reference = default_model_dir()
    models = {"reference": str(reference), "candidate": str(make_candidate(reference, work / "candidate"))}
    t = time.perf_counter()
    timed_sweep(sweep_file(work / "prep", models, False), [])  # the merges and strength units, once
    print(f"merges made in {time.perf_counter() - t:.1f} s", flush=True)
    evals = {"tasks": ["ifeval", "sink_strength"], "apply_chat_template": True, "num_fewshot": 0, "limit": args.limit}
    evals |= {"gen_kwargs": {"max_gen_toks": args.max_gen_toks}, "batch_size": "auto", "dtype": "float32"}
    evals |= {"backend": "vllm", "python": args.vllm_python, "model_args": {"enforce_eager": True}, "seed": 0}
    runs, units = {}, {}
    for mode, flags in (("fresh", ["--fresh-engine"]), ("resident", [])):
        shutil.copytree(work / "prep", work / mode)
        runs[mode] = timed_sweep(sweep_file(work / mode, models, evals), flags)
        units[mode] = {c: breakdown(work / mode / "out" / "evals" / c) for c in CHECKPOINTS}
        print(mode, json.dumps(runs[mode]), flush=True)
    if args.ray:
        runs["ray"] = ray_run(work, models, evals)
        units["ray"] = {c: breakdown(work / "ray" / "out" / "evals" / c) for c in CHECKPOINTS}
    report = {"runs": runs, "units": units, "summary": summary(runs, units)}
    report["equal"] = {m: compare(work / "fresh" / "out", work / m / "out") for m in runs if m != "fresh"}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
