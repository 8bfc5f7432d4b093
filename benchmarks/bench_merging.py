"""Merging benchmark: eight merges in one sweep process vs eight `mergekit-yaml` calls; TSV/STAR peak memory.

Models: the embedded SmolLM2-135M-Instruct as the reference and, as the candidate, SmolLM2 with
every floating tensor perturbed by Gaussian noise (0.02 x that tensor's std, seed 0). The pair is
SYNTHETIC (a real VLM backbone of this size is not available offline); it exercises the same
code paths and tensor shapes. Chain lineage (base = reference), all eight bundled controls.

1. Wall time of the eight merges as the sweep runs them (`sweep.run_unit`, one process, mergekit
   imported once) vs eight `mergekit-yaml FILE OUT --random-seed 0` subprocesses (the console
   script; TSV/STAR reach it through the package's import hook, else this says so and runs the
   same entry point after `register()`). Both write the same outputs; the ratio is printed.
2. Peak resident memory of one `lm-eval-sink merge` process for TSV and for STAR, against the same
   process doing task arithmetic (the baseline), each in a fresh interpreter.

Usage: python benchmarks/bench_merging.py [--workdir DIR]   (needs ~3 GB of free disk)
On a shared, oversubscribed machine run it with OMP_NUM_THREADS=1 (every process inherits it):
multi-threaded LAPACK SVDs slow down ~10x under contention, which would swamp both figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lm_eval_sink.merging.configs import bundled_names, render
from lm_eval_sink.models import default_model_dir


def perturbed_copy(src: Path, dst: Path, scale: float = 0.02, seed: int = 0) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("COMPLETE.json", "*.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() > 1:
            t = t + scale * t.float().std() * torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
        out[name] = t.contiguous()
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def hook_active() -> bool:
    from lm_eval_sink import hooks

    return "mergekit.merge_methods.registry" in getattr(hooks, "POST_IMPORT", {})


def run_cli(cfg: Path, out: Path, via_hook: bool) -> None:
    if via_hook:
        cmd = [str(Path(sys.executable).with_name("mergekit-yaml")), str(cfg), str(out), "--random-seed", "0"]
    else:
        code = (
            "import sys; from lm_eval_sink.merging.methods import register; register(); "
            "from mergekit.scripts.run_yaml import main; sys.argv[0] = 'mergekit-yaml'; main()"
        )
        cmd = [sys.executable, "-c", code, str(cfg), str(out), "--random-seed", "0"]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def peak_rss_mib(cfg: Path, out: Path) -> tuple[float, float]:
    code = (
        "import resource, sys, time; t = time.time(); from lm_eval_sink.merging.merge import merge_config; "
        "merge_config(sys.argv[1], sys.argv[2], random_seed=0); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.time() - t)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cfg), str(out)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    rss, secs = proc.stdout.split()[-2:]
    return float(rss), float(secs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_merging_"))
    work.mkdir(parents=True, exist_ok=True)
    ref = default_model_dir()
    cand = perturbed_copy(ref, work / "candidate")
    names = bundled_names()
    print(
        f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch "
        f"{torch.get_num_threads()}; cpus {os.cpu_count()}, load {os.getloadavg()[0]:.1f}"
    )
    print(f"models: reference {ref} (SmolLM2-135M-Instruct, fp32), candidate = reference + 0.02*std noise (synthetic)")
    cfgs = {}
    for n in names:
        cfgs[n] = work / f"{n}.yaml"
        cfgs[n].write_text(render(n, ref, cand).text)

    # 1. one sweep process vs eight mergekit-yaml calls
    from lm_eval_sink.commands.sweep import run_unit
    from lm_eval_sink.merging.configs import validate_text
    from lm_eval_sink.merging.merge import MergeWork
    from lm_eval_sink.merging.sweep import unit as sweep_unit

    t0 = time.time()
    import mergekit.merge  # noqa: F401  (the import is part of the sweep's cost)

    for n in names:
        unit = sweep_unit("merge", n, work / "sweep" / n, MergeWork(validate_text(cfgs[n].read_text()), 0, "cpu", n))
        run_unit(unit)
        shutil.rmtree(unit.output)
    in_process = time.time() - t0
    via_hook = hook_active()
    t0 = time.time()
    per_call = []
    for n in names:
        t1 = time.time()
        run_cli(cfgs[n], work / "cli" / n, via_hook)
        per_call.append(time.time() - t1)
        shutil.rmtree(work / "cli" / n)
    cli = time.time() - t0
    how = (
        "console script, TSV/STAR via the import hook"
        if via_hook
        else "the import hook is not installed: mergekit-yaml's entry point after register()"
    )
    print(
        f"eight merges: one sweep process {in_process:.1f} s vs eight mergekit-yaml calls {cli:.1f} s ({how}); "
        f"ratio CLI / sweep = {cli / in_process:.2f}x; mean per CLI call {sum(per_call) / len(per_call):.1f} s"
    )

    # 2. peak memory of TSV / STAR vs task arithmetic, each in a fresh process
    base_rss, base_s = peak_rss_mib(cfgs["task_arithmetic"], work / "mem_ta")
    for n in ("tsv", "star"):
        rss, secs = peak_rss_mib(cfgs[n], work / f"mem_{n}")
        print(
            f"peak RSS {n}: {rss:.0f} MiB ({secs:.1f} s) vs task_arithmetic {base_rss:.0f} MiB "
            f"({base_s:.1f} s): ratio {rss / base_rss:.2f}x"
        )
    for p in work.glob("mem_*"):
        shutil.rmtree(p)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print(f"(model size: {(ref / 'model.safetensors').stat().st_size / 2**20:.0f} MiB on disk; workdir {work})")


if __name__ == "__main__":
    main()
