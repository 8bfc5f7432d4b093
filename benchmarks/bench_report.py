"""Benchmark of `lm-eval-sink report` on full-size inputs: compute time after imports (target < 2 s).

Inputs: two full IFEval bucket outputs of one pair (541 real prompts; responses synthesized by
tests/bucket_logs.py as in bench_buckets.py, scored by lm-eval's checker; `lm-eval-sink buckets`
run twice, strict and loose metric) and an 8-checkpoint sweep table (reference, candidate and six
merges, written in table.json's schema with constructed values: a real 8-checkpoint sweep takes
far longer than the report and its numbers do not change the report's cost).
Measures, in one process after every import:
- baseline: reading every input the report reads (JSON, both samples files twice, sha256), the unavoidable I/O;
- report: load + check + view model + figures + HTML + atomic write (median of 5; the first call too);
and the CLI end to end in a fresh process (imports included).
Usage: python benchmarks/bench_report.py [--shared ../shared/data] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

from bench_buckets import synth_ifeval  # noqa: E402

from lm_eval_sink.buckets.settings import BucketSettings  # noqa: E402
from lm_eval_sink.commands.buckets import run_buckets  # noqa: E402
from lm_eval_sink.io import atomic_write_json, sha256_file  # noqa: E402
from lm_eval_sink.commands.report import load_inputs  # noqa: E402
from lm_eval_sink.io import atomic_write_text  # noqa: E402
from lm_eval_sink.report.render import render_html  # noqa: E402
from lm_eval_sink.runs import read_samples  # noqa: E402

N_CHECKPOINTS = 8


def sweep_table(out: Path) -> Path:
    """table.json of an 8-checkpoint sweep (schema of merging.sweep.build_table; constructed values)."""
    rng = random.Random(0)
    cols = [
        "ifeval/prompt_level_strict_acc,none",
        "ifeval/inst_level_strict_acc,none",
        "gsm8k_cot_zeroshot/exact_match,strict-match",
    ]
    names = ["reference", "candidate", "linear_95_5", "linear_90_10", "ties", "dare_linear", "slerp", "tsv"]
    ref = {c: rng.uniform(0.3, 0.7) for c in cols}
    rows = []
    for i, name in enumerate(names):
        m = ref if i == 0 else {c: v - rng.uniform(0, 0.1) for c, v in ref.items()}
        s = 1.7 - 0.05 * i
        rows.append(
            {
                "checkpoint": name,
                "role": name if i < 2 else "merge",
                "method": None if i < 2 else name,
                "setting": None,
                "status": "ok",
                "metrics": m,
                "delta_vs_reference": {c: m[c] - ref[c] for c in cols},
                "sink_strength": s,
                "sink_strength_delta_vs_reference": s - 1.7,
            }
        )
    table = {
        "schema_version": 1,
        "lineage": "chain",
        "models": {"reference": "reference-llm", "candidate": "candidate-backbone"},
        "columns": cols,
        "rows": rows,
        "final": True,
        "final_note": None,
        "protocol": {"eval": {}, "harness_sha256": None, "model_differences": []},
        "strength_settings": None,
        "provenance": {},
    }
    atomic_write_json(out / "table.json", table)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_report_"))
    if root.exists() and args.keep:
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    ref, cand = synth_ifeval(args.shared, root / "runs")
    buckets = []
    for metric in ("prompt_level_strict_acc", "prompt_level_loose_acc"):
        out = root / f"buckets_{metric}"
        run_buckets(str(ref), str(cand), "ifeval", BucketSettings(metric=metric), out)
        buckets.append(out)
    sweep = sweep_table(root / "sweep")
    n = json.loads((buckets[0] / "buckets.json").read_text())["n"]
    regressions = [json.loads((b / "buckets.json").read_text())["counts"]["regression"] for b in buckets]

    def baseline() -> None:
        for b in buckets:
            data = json.loads((b / "buckets.json").read_text())
            for role in ("reference", "candidate"):
                p = Path(data["runs"][role]["samples_file"])
                sha256_file(p)
                read_samples(p)
        json.loads((sweep / "table.json").read_text())

    report = root / "report.html"

    def run() -> None:
        atomic_write_text(report, render_html(load_inputs(report, buckets=buckets, sweep=sweep)))

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    first = timed(run)
    times = sorted(timed(run) for _ in range(5))
    base = sorted(timed(baseline) for _ in range(5))
    t_report, t_base = times[2], base[2]
    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval_sink.cli",
            "report",
            "--buckets",
            str(buckets[0]),
            "--buckets",
            str(buckets[1]),
            "--sweep",
            str(sweep),
            "-o",
            str(root / "cli.html"),
        ],
        check=True,
        capture_output=True,
    )
    t_cli = time.perf_counter() - t
    size = report.stat().st_size / 2**20
    print(
        f"inputs: 2 IFEval bucket outputs ({n} prompts each; {regressions[0]} and {regressions[1]} "
        f"regressions), {N_CHECKPOINTS}-checkpoint sweep table"
    )
    print("| step | median of 5 |")
    print("|---|---|")
    print(f"| baseline: read every input (JSON, 4 samples files, sha256) | {t_base:.3f} s |")
    print(f"| report: load, check, view, 3 figures, HTML, write | {t_report:.3f} s (first call {first:.3f} s) |")
    print(f"| ratio report / baseline | {t_report / t_base:.1f} |")
    print(f"| CLI in a fresh process, imports included (one run) | {t_cli:.2f} s |")
    print(f"report size: {size:.2f} MiB; target: report compute < 2 s -> {'met' if t_report < 2 else 'NOT met'}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
