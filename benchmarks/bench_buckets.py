"""Benchmark of `lm-eval-sink buckets` on full-size logs: wall time and peak memory.

Synthesizes two runs of the full IFEval set (541 real prompts) and two of GSM8K (1319 real
problems, strict-match and flexible-extract lines) with responses written by tests/bucket_logs.py
and metrics computed by lm-eval's own IFEval checker / regex filters / exact_match, then measures:
- baseline: reading both samples files (read_samples), the unavoidable I/O;
- bucket: resolve runs + read + pair + statistics (10,000 bootstrap resamples) + failure kinds;
- the same without failure kinds (IFEval: no checker re-run);
- end to end: the CLI in a fresh process writing JSON, Markdown, CSV and PNGs (imports included).
Peak memory: tracemalloc peak of Python allocations in-process; max RSS of the CLI process.
Usage: python benchmarks/bench_buckets.py [--shared ../shared/data] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import bucket_logs as bl  # noqa: E402

from lm_eval_sink.buckets.settings import BucketSettings  # noqa: E402
from lm_eval_sink.commands.buckets import compare_runs  # noqa: E402
from lm_eval_sink.runs import read_samples, resolve_run  # noqa: E402


def synth_ifeval(shared: Path, out: Path) -> tuple[Path, Path]:
    docs = bl.ifeval_docs(shared)
    rng = random.Random(0)
    gen = {"until": [], "do_sample": False, "temperature": 0.0, "max_gen_toks": 256}
    ref, cand = [], []
    for i, doc in enumerate(docs):
        text = bl.build_response(doc, rng, n_sentences=rng.randint(6, 40))
        ref.append(bl.ifeval_sample(i, doc, text, gen, chat=True))
        if rng.random() < 0.35:
            text = bl.perturb(text, rng, limit_bytes=rng.randint(1024, 1400))  # cuts: ~4-5.5 bytes per token
        cand.append(bl.ifeval_sample(i, doc, text, gen, chat=True))
    return (
        bl.write_run(out / "ifeval_ref", {"ifeval": ref}, model="reference-llm", limit=None),
        bl.write_run(out / "ifeval_cand", {"ifeval": cand}, model="candidate-backbone", limit=None),
    )


def synth_gsm8k(shared: Path, out: Path) -> tuple[Path, Path]:
    docs = bl.gsm8k_docs(shared)
    rng = random.Random(1)
    ref, cand = [], []
    for i, doc in enumerate(docs):
        rv = rng.choices(["right", "format", "wrong"], [0.6, 0.1, 0.3])[0]
        cv = rv if rng.random() < 0.8 else rng.choice(["right", "format", "wrong"])
        lead = " ".join(s for s in bl._sentences(rng, rng.randint(3, 10)))
        ref += bl.gsm8k_samples(i, doc, lead + " " + bl.gsm8k_response(doc, rv))
        cand += bl.gsm8k_samples(i, doc, lead + " " + bl.gsm8k_response(doc, cv))
    return (
        bl.write_run(out / "gsm8k_ref", {"gsm8k_cot_zeroshot": ref}, model="reference-llm"),
        bl.write_run(out / "gsm8k_cand", {"gsm8k_cot_zeroshot": cand}, model="candidate-backbone"),
    )


def measure(fn, repeats: int = 3) -> tuple[float, float, object]:
    """Median wall seconds over `repeats` and the tracemalloc peak (MiB) of one call."""
    times = []
    result = None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return sorted(times)[len(times) // 2], peak, result


def cli_end_to_end(ref: Path, cand: Path, out: Path, *extra: str) -> tuple[float, float]:
    code = (
        "import resource, sys; from lm_eval_sink.cli import main; rc = main(sys.argv[1:]); "
        "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
    )
    t = time.perf_counter()
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "buckets",
            str(ref),
            str(cand),
            "--output",
            str(out),
            "--quiet",
            "--force",
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(res.stderr)
    rss_kib = int(res.stdout.rsplit("MAXRSS", 1)[1].split()[0])
    return wall, rss_kib / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--shared", type=Path, default=Path(os.environ.get("LM_EVAL_SINK_DATA", REPO.parent / "shared" / "data"))
    )
    ap.add_argument("--keep", type=Path, default=None, help="keep the synthesized runs here")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_buckets_"))
    try:
        run(args, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    t = time.perf_counter()
    ifeval = synth_ifeval(args.shared, root)
    gsm8k = synth_gsm8k(args.shared, root)
    print(f"synthesized logs in {time.perf_counter() - t:.1f} s (not measured)")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import lm_eval.tasks.ifeval.utils"], check=True)
    t_imp = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    print(
        "importing lm-eval's IFEval checker in a fresh process: "
        f"{t_imp - (time.perf_counter() - t):.2f} s (paid once per CLI call with failure kinds)"
    )
    settings = BucketSettings()
    print(
        f"{'pair':8} {'docs':>5} {'lines':>6} {'MiB':>5} | {'read (baseline)':>15} | {'bucket':>16} "
        f"{'ratio':>6} | {'no failure kinds':>16} "
        f"| {'CLI end to end':>26} | {'CLI --no-failure-kinds':>26}"
    )
    for name, (ref, cand) in (("ifeval", ifeval), ("gsm8k", gsm8k)):
        r_run, c_run = resolve_run(ref), resolve_run(cand)
        r_path, c_path = next(iter(r_run.samples.values())), next(iter(c_run.samples.values()))
        size = (r_path.stat().st_size + c_path.stat().st_size) / 2**20
        lines = sum(1 for _ in open(r_path)) + sum(1 for _ in open(c_path))
        t_read, m_read, _ = measure(lambda r=r_path, c=c_path: (read_samples(r), read_samples(c)))
        t_b, m_b, rep = measure(lambda r=ref, c=cand: compare_runs(r, c, None, settings))
        t_nf, m_nf, _ = measure(lambda r=ref, c=cand: compare_runs(r, c, None, BucketSettings(failure_kinds=False)))
        wall, rss = cli_end_to_end(ref, cand, root / f"out_{name}")
        wall_nf, rss_nf = cli_end_to_end(ref, cand, root / f"out_{name}_nf", "--no-failure-kinds")
        print(
            f"{name:8} {rep.n:>5} {lines:>6} {size:>5.1f} | {t_read:6.3f} s {m_read:5.1f} MiB | "
            f"{t_b:6.3f} s {m_b:5.1f} MiB {t_b / t_read:5.1f}x | {t_nf:6.3f} s {m_nf:5.1f} MiB "
            f"| {wall:5.2f} s, max RSS {rss:4.0f} MiB | {wall_nf:5.2f} s, max RSS {rss_nf:4.0f} MiB"
        )
        split = rep.format_split or {}
        print(
            f"         counts {rep.counts}, regressions' kinds "
            f"{(rep.failure_kinds or {}).get('counts')}, format split "
            f"{split.get('format_failure')}/{split.get('wrong_answer')}"
        )
    print(
        f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, peak RSS of this process "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )


if __name__ == "__main__":
    main()
