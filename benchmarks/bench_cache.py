"""Cost of the private cache's checks on the hot paths, against another checkout measured in the same run.

What the checks add: `io.cache_dir` stats the cache folder and the folders above it on every access, the task
index and hash entries are read through `io.read_private_text` (one fstat), the offline task YAMLs are written into
a new folder of each process (`tempfile.mkdtemp`) instead of being compared with the cache's copies, and every use
of `default` hashes the converted model's files through the hash cache (one stat and one small JSON per file) to
compare them with its COMPLETE.json. Timed, each the median of --repeats fresh processes (the two checkouts
alternating), for this checkout and for the code before (--baseline DIR, a checkout; else `git archive` of commit
BEFORE, the main branch these checks were written against, into a temporary folder), each with its own warm cache
under a temporary folder (the index built and the default model converted once, untimed):
- `TaskManager()` with LM_EVAL_SINK_DATA set, the first of a process and a second one in the same process;
- `models.default_model_dir()` (what `default` costs before any work);
- `lm-eval-sink strength default --output DIR` run again on its own output (the result reused), whole process.
Prints each figure, the difference and the ratio this/baseline.
Usage: python benchmarks/bench_cache.py [--baseline DIR] [--repeats 5]  (LM_EVAL_SINK_DATA set)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
BEFORE = "e14825b"  # main before the private cache, the process's offline YAMLs and the default model's file hashes
CHILD = """
import json, sys, time
mode = sys.argv[1]
if mode == "taskmanager":
    from lm_eval.tasks import TaskManager
    t0 = time.perf_counter(); TaskManager(); t1 = time.perf_counter(); TaskManager(); t2 = time.perf_counter()
    print(json.dumps({"TaskManager, first in process": t1 - t0, "TaskManager, second in process": t2 - t1}))
else:
    from lm_eval_sink.models import default_model_dir
    default_model_dir()  # imports and the first hash-cache reads out of the way
    t0 = time.perf_counter(); default_model_dir(); t1 = time.perf_counter()
    print(json.dumps({"default_model_dir()": t1 - t0}))
"""


def _env(code: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(code), "LM_EVAL_SINK_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _child(code: Path, cache: Path, mode: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env=_env(code, cache), capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _strength(code: Path, cache: Path, out: Path) -> float:
    cli = [sys.executable, "-m", "lm_eval_sink.cli", "strength", "default", "--output", str(out), "--quiet"]
    t0 = time.perf_counter()
    subprocess.run(cli, env=_env(code, cache), capture_output=True, text=True, check=True)
    return time.perf_counter() - t0


def _warm(code: Path, root: Path) -> None:
    """The index built and the default model converted and measured once, into the cache under `root`."""
    _child(code, root / "cache", "taskmanager")
    _strength(code, root / "cache", root / "strength")


def _once(code: Path, root: Path) -> dict[str, float]:
    """Every figure once for the checkout `code` with its warm cache under `root`."""
    cache = root / "cache"
    out = {**_child(code, cache, "taskmanager"), **_child(code, cache, "default")}
    out["strength default, result reused (process)"] = _strength(code, cache, root / "strength")
    return out


def measure(codes: dict[str, Path], root: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of each figure per checkout; the checkouts alternate in each repeat, so a change in the
    machine's load falls on both."""
    for name, code in codes.items():
        _warm(code, root / name)
    runs: dict[str, dict[str, list[float]]] = {name: {} for name in codes}
    for _ in range(repeats):
        for name, code in codes.items():
            for figure, seconds in _once(code, root / name).items():
                runs[name].setdefault(figure, []).append(seconds)
    return {name: {f: statistics.median(v) for f, v in figures.items()} for name, figures in runs.items()}


def _archive(rev: str, into: Path) -> Path:
    """The project's files at commit `rev`, unpacked into `into` (a checkout without git metadata)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(HERE), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, default=None, help=f"a checkout to compare with (default: {BEFORE})")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if "LM_EVAL_SINK_DATA" not in os.environ:
        sys.exit("set LM_EVAL_SINK_DATA (the offline task YAMLs are part of what is timed)")
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as tmp:
        baseline = args.baseline.resolve() if args.baseline else _archive(BEFORE, Path(tmp) / "code")
        medians = measure({"baseline": baseline, "this": HERE}, Path(tmp), args.repeats)
    base, this = medians["baseline"], medians["this"]
    print(f"{'figure':<45} {'baseline s':>11} {'this s':>9} {'this - baseline':>16} {'ratio':>7}")
    for name in base:
        diff = this[name] - base[name]
        print(f"{name:<45} {base[name]:>11.4f} {this[name]:>9.4f} {diff:>+16.4f} {this[name] / base[name]:>7.2f}")


if __name__ == "__main__":
    main()
