"""Overhead of adding sink_strength to an `lm_eval --tasks ifeval --limit N` run (SmolLM2, CPU).

Runs the real lm_eval CLI (through the project's runner) twice in this run, once with
`--tasks ifeval` and once with `--tasks sink_strength,ifeval`, same flags otherwise, and prints the
wall times and their ratio. Needs LM_EVAL_SINK_DATA (or the hub) for IFEval.
Usage: python benchmarks/bench_harness.py [--limit 10] [--max-gen-toks 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from lm_eval_sink.harness.runner import EvalSettings, run_lm_eval
from lm_eval_sink.models import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-gen-toks", type=int, default=128)
    args = ap.parse_args()
    model = str(default_model_dir())
    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tasks in (("ifeval",), ("sink_strength", "ifeval")):
            settings = EvalSettings(
                tasks=tasks, apply_chat_template=True, limit=args.limit, gen_kwargs={"max_gen_toks": args.max_gen_toks}
            )
            t = time.perf_counter()
            run_lm_eval(model, settings, f"{tmp}/{'_'.join(tasks)}")
            times[tasks] = time.perf_counter() - t
            print(f"--tasks {','.join(tasks)}: {times[tasks]:.1f} s")
    base, both = times[("ifeval",)], times[("sink_strength", "ifeval")]
    print(
        f"IFEval --limit {args.limit}, max_gen_toks {args.max_gen_toks}: adding sink_strength costs "
        f"{both - base:+.1f} s, ratio {both / base:.3f}"
    )


if __name__ == "__main__":
    main()
