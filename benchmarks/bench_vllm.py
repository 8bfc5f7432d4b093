"""vLLM vs HF for IFEval on a CPU: wall time, generation time, peak RSS, and whether the responses agree.

One run evaluates the embedded SmolLM2-135M-Instruct (float32) on the local IFEval prompts with the
chat template, three ways, through the project's runner: `--backend hf` on one thread at batch 1 and
at batch 8 (as the VL experiment runs it), and `--backend vllm` at batch auto in `.venv-vllm`
(`make venv-vllm`; in-process engine, one OpenMP thread). Each lm-eval subprocess is started from
a fresh helper process, so its peak RSS is its own (getrusage of that helper's children).
Generation time is read from lm-eval's log (from "Running generate_until requests" to the next
timestamped line; 1 s resolution). Needs LM_EVAL_SINK_DATA (the local IFEval copy) and NLTK_DATA.
`--part sink` instead runs `--backend vllm` twice, `--tasks ifeval` and `--tasks sink_strength,ifeval`
(S measured first with transformers in a child process): the cost of S in the same vLLM call, as the
added seconds and their share of the whole call's wall time, and the child's own wall time (recorded
in the task's `capture` metadata) as a share of the same call's.
Usage: python benchmarks/bench_vllm.py [--part backends|sink] [--limit 40] [--max-gen-toks 256]
       [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import re
import resource
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2}:\d{2}:\d{2}:\d{2}) ")


def generation_seconds(log: str) -> float | None:
    """Seconds from lm-eval's "Running generate_until requests" line to the next timestamped line."""
    stamps = [(m.group(1), line) for line in log.splitlines() if (m := _STAMP.match(line))]
    for i, (stamp, line) in enumerate(stamps[:-1]):
        if "Running generate_until requests" in line:
            start, end = (dt.datetime.strptime(s, "%Y-%m-%d:%H:%M:%S") for s in (stamp, stamps[i + 1][0]))
            return (end - start).total_seconds()
    return None


def _one_run(model: str, settings_json: dict, out: str, env: dict[str, str]) -> dict:
    """In a fresh process: one lm-eval run; wall time, generation time, peak RSS of the lm-eval process."""
    from lm_eval_sink.harness.runner import EvalSettings, run_lm_eval

    t = time.perf_counter()
    run = run_lm_eval(model, EvalSettings(**{**settings_json, "tasks": tuple(settings_json["tasks"])}), out, env=env)
    wall = time.perf_counter() - t
    log = max(Path(out, "logs").glob("*.log"), key=lambda p: p.stat().st_mtime).read_text()
    samples = [json.loads(x) for x in run.samples["ifeval"].read_text().splitlines()]
    data = json.loads(run.results.read_text())
    results = data["results"]["ifeval"]
    capture = data["configs"].get("sink_strength", {}).get("metadata", {}).get("capture", {})
    return {
        "first_s": capture.get("wall_seconds"),  # S measured first (sink_strength under vllm)
        "wall_s": wall,
        "generation_s": generation_seconds(log),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6,
        "responses": {s["doc_id"]: s["resps"][0][0] for s in samples},
        "prompt_strict": results["prompt_level_strict_acc,none"],
        "prompt_loose": results["prompt_level_loose_acc,none"],
    }


def main() -> None:
    from lm_eval_sink.models import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-gen-toks", type=int, default=256)
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--part", choices=("backends", "sink"), default="backends")
    args = ap.parse_args()
    model = str(default_model_dir())
    base = {
        "tasks": ["ifeval"],
        "apply_chat_template": True,
        "num_fewshot": 0,
        "limit": args.limit,
        "gen_kwargs": {"max_gen_toks": args.max_gen_toks},
        "dtype": "float32",
    }
    one_thread = {"OMP_NUM_THREADS": "1"}
    vllm = (
        {**base, "batch_size": "auto", "backend": "vllm", "device": None, "python": args.vllm_python},
        {**one_thread, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    runs = {  # fastest first: each finished run's figures are printed at once
        "vllm, batch auto": vllm,
        "hf, 1 thread, batch 8": ({**base, "batch_size": 8}, one_thread),
        "hf, 1 thread, batch 1": ({**base, "batch_size": 1}, one_thread),
    }
    if args.part == "sink":
        runs = {
            "vllm, ifeval": vllm,
            "vllm, sink_strength,ifeval": ({**vllm[0], "tasks": ["sink_strength", "ifeval"]}, vllm[1]),
        }
    figures: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (settings, env)) in enumerate(runs.items()):
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                f = pool.submit(_one_run, model, settings, f"{tmp}/{i}", env).result()
            print(
                f"{name}: wall {f['wall_s']:.0f} s, generation {f['generation_s']} s,"
                f" peak RSS {f['peak_rss_gb']:.2f} GB,"
                f" prompt strict {f['prompt_strict']:.3f} / loose {f['prompt_loose']:.3f}",
                flush=True,
            )
            for other, g in figures.items():
                same = sum(f["responses"][k] == v for k, v in g["responses"].items())
                print(f"  responses identical to {other}: {same}/{len(g['responses'])}", flush=True)
            figures[name] = f
    if args.part == "sink":
        without, with_s = (figures[k]["wall_s"] for k in runs)
        added, first = with_s - without, figures["vllm, sink_strength,ifeval"]["first_s"]
        print(
            f"S in the same call: +{added:.1f} s, {added / with_s:.1%} of its wall time, ratio {with_s / without:.3f}"
        )
        print(f"the child that measured S first: {first:.1f} s, {first / with_s:.1%} of the call's wall time")


if __name__ == "__main__":
    main()
