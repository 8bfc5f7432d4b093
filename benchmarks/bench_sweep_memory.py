"""In-memory sweep benchmark: three engines on the same sweeps, and the per-checkpoint cost on one resident model.

Part `engines`: `lm-eval-sink sweep` from a cold process (a fresh output folder each) with the
on-disk local engine, the in-memory local engine (`--in-memory`) and the in-memory Ray engine (a
local cluster started here with 2 CPUs; `resources.eval.num_cpus: 1`, so 2 actors), on (1) the
10-unit tiny sweep of bench_scale and (2) the SmolLM2 sweep below (linear_uniform, ties, tsv; ifeval
limit 8, max_gen_toks 64, batch 8, float32; S on 15 prompts). Reported: wall time, its ratio to the
on-disk local run, the peak RSS (sampled every 0.2 s: the largest single process, and the sum over
the driver, its children and the Ray actors), and whether each table equals the on-disk one.

Part `unit`:
SmolLM2-135M-Instruct (the embedded default model) is the reference (and, in the chain lineage,
the base); the candidate is a copy moved by a few Adam steps on the calibration prompts, made by
this script. For each control (linear_uniform, ties, tsv): `merging.inmemory.merge_into` into the
resident model, `harness.inprocess.evaluate` (ifeval, limit 8, max_gen_toks 64, results and samples
written) and `harness.inprocess.measure_strength`; against it, the bare work on the same loaded
model: `lm_eval.simple_evaluate` on `HFLM(pretrained=model)` with the same TaskManager, and
`strength.measure`. One warm-up bare evaluation first (dataset caches), untimed. float32 on CPU.

Memory: RSS after the resident model is loaded (imports, model, TaskManager), the peak RSS of the
whole run (ru_maxrss), and the resident model's parameter bytes.

Usage: OMP_NUM_THREADS=2 python benchmarks/bench_sweep_memory.py [--part engines|unit|all] [--workdir DIR]
[--controls a,b] [--sweeps tiny,smollm2] [--engines on_disk_local,in_memory_local,in_memory_ray_2_actors]
(on_disk_local always runs: it is the baseline of every ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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

CONTROLS = ("linear_uniform", "ties", "tsv")
REPO = Path(__file__).resolve().parent.parent


def rss_mib() -> float:
    """Current resident set size of this process (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_candidate(reference: Path, out: Path, steps: int = 3) -> Path:
    """The reference after `steps` Adam steps (lr 1e-4) on the calibration prompts, saved as a model folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_eval_sink.calibration import load_prompts

    tok = AutoTokenizer.from_pretrained(reference)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    prompts = load_prompts().prompts
    for step in range(steps):
        batch = tok(prompts[step % len(prompts)], return_tensors="pt")
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def clock() -> tuple[float, float]:
    """(wall, CPU) seconds of this process (under contention both move: OpenMP threads spin while one waits)."""
    return time.perf_counter(), time.process_time()


def since(t: tuple[float, float]) -> tuple[float, float]:
    now = clock()
    return round(now[0] - t[0], 2), round(now[1] - t[1], 2)


def bare(resident, settings, strength) -> tuple[tuple[float, float], tuple[float, float]]:
    """simple_evaluate (no files) and strength.measure on the loaded model: (wall, CPU) seconds each."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from lm_eval_sink.strength import measure

    t = clock()
    lm = HFLM(pretrained=resident.model, tokenizer=resident.tokenizer, batch_size=settings.batch_size)
    lm_eval.simple_evaluate(
        model=lm,
        tasks=list(settings.tasks),
        limit=settings.limit,
        gen_kwargs=dict(settings.gen_kwargs),
        task_manager=resident.task_manager,
        log_samples=True,
    )
    t_eval = since(t)
    t = clock()
    measure(resident.model, resident.tokenizer, strength, progress=False)
    return t_eval, since(t)


def _sweep_file(folder: Path, models: dict[str, Path], configs: list[str], ev: dict, strength: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"output": "out", "models": {k: str(v) for k, v in models.items()}, "configs": configs, "eval": ev}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({**data, "strength": strength}, sort_keys=False))
    return path


def _tree_rss(root: int) -> tuple[float, float]:
    """(sum, largest) RSS in MiB of `root`, its descendants and every in-memory Ray actor on the machine."""
    import psutil

    procs = {}
    try:
        top = psutil.Process(root)
        procs = {p.pid: p for p in [top, *top.children(recursive=True)]}
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter(["cmdline"]):
        if any("PoolActor" in part for part in p.info["cmdline"] or []):
            procs[p.pid] = p
    sizes = []
    for p in procs.values():
        try:
            sizes.append(p.memory_info().rss / 2**20)
        except psutil.Error:
            pass
    return sum(sizes), max(sizes, default=0.0)


def timed_sweep(path: Path, extra: list[str], env: dict[str, str]) -> dict:
    """One cold `lm-eval-sink sweep` run: wall seconds and the peak RSS (sum and largest process)."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(path), "--quiet", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak_sum = peak_one = 0.0
    while proc.poll() is None:
        total, one = _tree_rss(proc.pid)
        peak_sum, peak_one = max(peak_sum, total), max(peak_one, one)
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"sweep {path} failed: {proc.stderr.read()[-2000:]}")
    rows = json.loads((path.parent / "out" / "table.json").read_text())["rows"]
    wall = round(time.perf_counter() - t, 1)
    return {"wall_s": wall, "peak_rss_sum_mib": round(peak_sum), "peak_rss_largest_mib": round(peak_one), "rows": rows}


ENGINES = ("on_disk_local", "in_memory_local", "in_memory_ray_2_actors")


def engines(work: Path, controls: list[str], only_sweeps: list[str], only_engines: list[str]) -> dict:
    """The three engines on the tiny sweep and on the SmolLM2 sweep, each run from a cold process."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import make_tiny_lm

    from lm_eval_sink.merging.engines import LOOPBACK_ENV
    from lm_eval_sink.models import default_model_dir

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", LOOPBACK_ENV: "0"}
    env.pop("RAY_ADDRESS", None)
    tiny = {
        "reference": make_tiny_lm(work / "tiny_ref", "llama", 1),
        "candidate": make_tiny_lm(work / "tiny_cand", "llama", 2),
    }
    candidate = work / "candidate"
    if not (candidate / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--make-candidate", str(candidate)], check=True)
    tiny_eval = {"tasks": ["lm_eval_sink_tiny_choice"], "include_path": str(REPO / "tests" / "data" / "merging_task")}
    sweeps = {
        "tiny": (
            tiny,
            ["linear_95_5", "dare_linear"],
            {**tiny_eval, "batch_size": 1, "seed": 0},
            {"n_prompts": 5, "last_k": 2, "dtype": "float32"},
        ),
        "smollm2": (
            {"reference": default_model_dir(), "candidate": candidate},
            controls,
            {"tasks": ["ifeval"], "limit": 8, "gen_kwargs": {"max_gen_toks": 64}, "dtype": "float32", "batch_size": 8},
            {"dtype": "float32"},
        ),
    }
    out: dict = {}
    for name in only_sweeps:
        models, configs, ev, st = sweeps[name]
        runs = {}
        runs["on_disk_local"] = timed_sweep(_sweep_file(work / name / "disk", models, configs, ev, st), [], env)
        if "in_memory_local" in only_engines:
            runs["in_memory_local"] = timed_sweep(
                _sweep_file(work / name / "mem", models, configs, ev, st), ["--in-memory"], env
            )
        if "in_memory_ray_2_actors" in only_engines:
            runs["in_memory_ray_2_actors"] = ray_run(work / name, (models, configs, ev, st), env)
        base_wall, base_rows = runs["on_disk_local"]["wall_s"], runs["on_disk_local"]["rows"]
        for run in runs.values():
            run["x_on_disk_local"] = round(run["wall_s"] / base_wall, 3)
            run["table_equals_on_disk"] = run.pop("rows") == base_rows
        out[name] = runs
        print(name, json.dumps(runs, indent=2), flush=True)
    return out


def ray_run(folder: Path, sweep: tuple, env: dict) -> dict:
    """The in-memory sweep on a local Ray cluster started here (2 CPUs, one actor per CPU)."""
    from helpers import start_ray_cluster, stop_ray_cluster

    temp = folder / "ray_tmp"
    address = start_ray_cluster(temp, env, num_cpus=2)
    try:
        ray_sweep = _sweep_file(folder / "ray", *sweep)
        data = yaml.safe_load(ray_sweep.read_text())
        data["engine"] = {"kind": "ray", "address": address, "resources": {"eval": {"num_cpus": 1}}}
        ray_sweep.write_text(yaml.safe_dump(data, sort_keys=False))
        return timed_sweep(ray_sweep, ["--in-memory"], env)
    finally:
        stop_ray_cluster(temp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--controls", default=",".join(CONTROLS))
    ap.add_argument("--part", choices=("engines", "unit", "all"), default="all")
    ap.add_argument("--sweeps", default="tiny,smollm2", help="engines part: which sweeps (tiny, smollm2)")
    ap.add_argument(
        "--engines", default=",".join(ENGINES), help="engines part: which engines beside on_disk_local, the baseline"
    )
    ap.add_argument("--make-candidate", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_candidate:  # in its own process, so that its optimizer state is not in the figures' RSS
        from lm_eval_sink.models import default_model_dir

        make_candidate(default_model_dir(), args.make_candidate)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_sweep_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.part in ("engines", "all"):
        figures = engines(work, args.controls.split(","), args.sweeps.split(","), args.engines.split(","))
        (work / "engines.json").write_text(json.dumps(figures, indent=2))
    if args.part in ("unit", "all"):
        unit(work, args.controls.split(","))


def unit(work: Path, controls: list[str]) -> None:
    """The per-checkpoint part: merge + in-process eval + S on one resident model, against the bare calls."""

    from lm_eval_sink.harness.inprocess import evaluate, load_resident, measure_strength
    from lm_eval_sink.harness.runner import EvalSettings
    from lm_eval_sink.merging.configs import render
    from lm_eval_sink.merging.inmemory import merge_into
    from lm_eval_sink.models import default_model_dir
    from lm_eval_sink.strength import StrengthSettings

    reference = default_model_dir()
    t = time.perf_counter()
    candidate = work / "candidate"
    if not (candidate / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--make-candidate", str(candidate)], check=True)
    fig: dict = {"candidate_s": round(time.perf_counter() - t, 2), "rss_start_mib": round(rss_mib(), 1)}
    settings = EvalSettings(tasks=("ifeval",), limit=8, gen_kwargs={"max_gen_toks": 64}, dtype="float32", batch_size=8)
    strength = StrengthSettings()
    t = time.perf_counter()
    resident = load_resident(reference, settings)
    fig["load_resident_s"] = round(time.perf_counter() - t, 2)
    fig["rss_resident_mib"] = round(rss_mib(), 1)
    fig["model_mib"] = round(sum(p.numel() * p.element_size() for p in resident.model.parameters()) / 2**20, 1)
    t = time.perf_counter()
    bare(resident, settings, strength)  # warm-up: dataset and tokenizer caches
    fig["warmup_s"] = round(time.perf_counter() - t, 2)
    fig["rss_after_warmup_mib"] = round(rss_mib(), 1)
    rows = []
    for name in controls:
        text = render(name, reference, candidate).text
        t = clock()
        merge_into(resident.model, text, name, random_seed=0)
        merge = since(t)
        t = clock()
        evaluate(resident, settings, work / "eval" / name, work / "merged" / name)
        ev = since(t)
        t = clock()
        measure_strength(resident, strength, "float32")
        s = since(t)
        b_eval, b_s = bare(resident, settings, strength)
        row = {"control": name, "merge": merge, "eval": ev, "strength": s, "bare_eval": b_eval, "bare_strength": b_s}
        for i, what in ((0, "wall"), (1, "cpu")):
            unit, base = merge[i] + ev[i] + s[i], b_eval[i] + b_s[i]
            row[f"overhead_{what}_x"] = round(unit / base, 3)
            row[f"overhead_without_merge_{what}_x"] = round((ev[i] + s[i]) / base, 3)
        row["rss_mib"] = round(rss_mib(), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    fig["rows"] = rows
    fig["peak_rss_mib"] = round(peak_mib(), 1)
    fig["peak_over_resident_x"] = round(fig["peak_rss_mib"] / fig["rss_resident_mib"], 3)
    print(json.dumps(fig, indent=2))
    (work / "figures.json").write_text(json.dumps(fig, indent=2))


if __name__ == "__main__":
    main()
