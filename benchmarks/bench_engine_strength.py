"""Sink Strength from the vLLM engine against the transformers child measuring it first: wall time, memory, S's share.

Two parts, each run both ways in this one run on the same checkpoints, alternating:
- `one-call`: `lm_eval --model vllm --tasks sink_strength,ifeval` (the hook's CLI entry, as `lm-eval-sink eval
  --backend vllm` runs it) on the embedded SmolLM2-135M-Instruct, float32, `enforce_eager`, IFEval on `--limit`
  local prompts with `--max-gen-toks` new tokens and the chat template: S measured on the engine lm-eval built
  (the default) against the transformers child the start-up hook runs before the engine starts
  (`LM_EVAL_SINK_S_ON_ENGINE=0`);
- `sweep`: a 3-checkpoint resident vLLM sweep (the reference, a copy with seeded noise in 20 MLP matrices, and
  the `linear_95_5` merge of the two, made once beforehand), eval units `[ifeval, sink_strength]` and `strength:`
  units (5 prompts, last 2 layers, float32; the prep's own S units removed): S on the resident engine (the eval
  units' task and the strength: units, `strength` requests) against the child in each eval unit and the
  strength: units with transformers in the sweep's process.
Each run is a fresh process; its peak RSS is sampled every 0.2 s over it and its descendants (the engine core and
worker in vLLM's default process mode, the S child, the engine process): the peak of the sum, and the largest one.
S's cost: the task's `capture.wall_seconds` (the engine's measurement, or the child's wall time), plus for the
sweep each strength: unit's time (its COMPLETE.json after its checkpoint's eval unit's); its share of the call's
or the sweep's wall time. The IFEval responses and scores of both ways must be equal, and S within 5e-5.

Usage: nice python benchmarks/bench_engine_strength.py [--workdir DIR] [--limit 4] [--max-gen-toks 32]
       [--part one-call|sweep|all] [--in-process] [--vllm-python .venv-vllm/bin/python]
vLLM runs in its default process mode (as users run it) unless `--in-process`, on one OpenMP thread, 1 GiB of KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_sweep import make_candidate, timed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LM_EVAL_SINK_DATA", "/work/shared/data")
os.environ.setdefault("NLTK_DATA", "/work/shared/data/nltk_data")

REPO = Path(__file__).resolve().parent.parent
CHECKPOINTS = ("reference", "candidate", "linear_95_5")
WAYS = {"engine": {}, "child": {"LM_EVAL_SINK_S_ON_ENGINE": "0"}}
S_TOLERANCE = 5e-5


def _results(folder: Path) -> dict:
    return json.loads(next(folder.glob("*/results_*.json")).read_text())


def _responses(folder: Path) -> list:
    path = next(folder.glob("*/samples_ifeval_*.jsonl"))
    return sorted((json.loads(x)["doc_id"], json.loads(x)["resps"]) for x in path.read_text().splitlines())


def one_call(work: Path, model: str, settings: object, env: dict[str, str]) -> dict:
    """Both ways of one `lm_eval --model vllm --tasks sink_strength,ifeval` call: figures and the S cost's share."""
    from lm_eval_sink.harness.runner import _ENTRY

    out = {}
    for way, extra in WAYS.items():
        folder = work / "one_call" / way
        cmd = [settings.interpreter(), "-c", _ENTRY, *settings.command(model, folder)]
        run = timed(cmd, {**env, **extra})
        data = _results(folder)
        s_seconds = data["configs"]["sink_strength"]["metadata"]["capture"]["wall_seconds"]
        out[way] = {
            **run,
            "s_seconds": s_seconds,
            "s_share": round(s_seconds / run["wall_s"], 3),
            "capture_backend": data["configs"]["sink_strength"]["metadata"]["capture"]["capture_backend"],
            "S": data["results"]["sink_strength"]["sink_strength,none"],
            "ifeval": {k: v for k, v in data["results"]["ifeval"].items() if k.endswith(",none")},
        }
        print(way, json.dumps(out[way]), flush=True)
    folders = [work / "one_call" / w for w in WAYS]
    out["equal"] = {
        "responses": _responses(folders[0]) == _responses(folders[1]),
        "ifeval": out["engine"]["ifeval"] == out["child"]["ifeval"],
        "S_difference": abs(out["engine"]["S"] - out["child"]["S"]),
    }
    return out


def _sweep_file(folder: Path, models: dict[str, str], evals: dict | bool, strength: dict | bool) -> Path:
    data = {"output": "out", "models": models, "configs": ["linear_95_5"], "eval": evals, "strength": strength}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sweep.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "sweep.yaml"


def _s_cost(out: Path) -> dict:
    """Per checkpoint: its eval unit's S seconds (capture record) and its strength unit's (marker after marker)."""
    rows = {}
    for c in CHECKPOINTS:
        unit = out / "evals" / c
        marker = json.loads((unit / "COMPLETE.json").read_text())
        capture = json.loads((unit / marker["results"]).read_text())["configs"]["sink_strength"]["metadata"]["capture"]
        strength = (out / "strength" / c / "COMPLETE.json").stat().st_mtime - (unit / "COMPLETE.json").stat().st_mtime
        rows[c] = {"eval_s": capture["wall_seconds"], "backend": capture["capture_backend"], "strength_s": strength}
        rows[c]["strength_S"] = json.loads((out / "strength" / c / "strength.json").read_text())["sink_strength"]
    return rows


def sweep(work: Path, models: dict[str, str], evals: dict, env: dict[str, str]) -> dict:
    """Both ways of the 3-checkpoint resident sweep on copies of one folder whose merge is made."""
    strength = {"n_prompts": 5, "last_k": 2, "dtype": "float32"}
    prep = _sweep_file(work / "prep", models, False, {"n_prompts": 5, "last_k": 1, "dtype": "float32"})
    timed([sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(prep), "--quiet"], env)  # the merge, once
    out = {}
    for way, extra in WAYS.items():
        shutil.copytree(work / "prep", work / way)
        shutil.rmtree(work / way / "out" / "strength")  # the prep's S units (a sweep needs one unit to plan)
        path = _sweep_file(work / way, models, evals, strength)
        run = timed([sys.executable, "-m", "lm_eval_sink.cli", "sweep", str(path), "--quiet"], {**env, **extra})
        cost = _s_cost(work / way / "out")
        s_seconds = sum(r["eval_s"] + r["strength_s"] for r in cost.values())
        out[way] = {
            **run,
            "units": cost,
            "s_seconds": round(s_seconds, 1),
            "s_share": round(s_seconds / run["wall_s"], 3),
        }
        print(way, json.dumps(out[way]), flush=True)
    tables = [json.loads((work / w / "out" / "table.json").read_text()) for w in WAYS]
    diffs = [
        abs(a["metrics"][k] - b["metrics"][k])
        for a, b in zip(tables[0]["rows"], tables[1]["rows"], strict=True)
        for k in a["metrics"]
    ]
    diffs += [abs(a["sink_strength"] - b["sink_strength"]) for a, b in zip(*(t["rows"] for t in tables), strict=True)]
    responses = [[_responses(work / w / "out" / "evals" / c / "lm_eval") for c in CHECKPOINTS] for w in WAYS]
    out["equal"] = {"max_column_difference": max(diffs), "responses": responses[0] == responses[1]}
    return out


def ratios(part: dict) -> dict:
    e, c = part["engine"], part["child"]
    return {
        "wall_engine_over_child": round(e["wall_s"] / c["wall_s"], 3),
        "peak_rss_sum_engine_over_child": round(e["peak_rss_sum_mib"] / c["peak_rss_sum_mib"], 3),
        "peak_rss_largest_engine_over_child": round(e["peak_rss_largest_mib"] / c["peak_rss_largest_mib"], 3),
        "s_seconds_engine_over_child": round(e["s_seconds"] / c["s_seconds"], 3),
        "s_share": {"engine": e["s_share"], "child": c["s_share"]},
    }


def main() -> None:
    from lm_eval_sink.harness.runner import EvalSettings
    from lm_eval_sink.models import default_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-gen-toks", type=int, default=32)
    ap.add_argument("--part", choices=("one-call", "sweep", "all"), default="all")
    ap.add_argument("--in-process", action="store_true")
    ap.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_engine_strength_"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("LM_EVAL_SINK_S_ON_ENGINE", None)
    env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if args.in_process else {}
    if not args.in_process:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    reference = default_model_dir()
    evals = {"tasks": ["sink_strength", "ifeval"], "apply_chat_template": True, "num_fewshot": 0, "limit": args.limit}
    evals |= {"gen_kwargs": {"max_gen_toks": args.max_gen_toks}, "batch_size": "auto", "dtype": "float32", "seed": 0}
    evals |= {"backend": "vllm", "python": args.vllm_python, "model_args": {"enforce_eager": True}}
    report = {"settings": {**vars(args), "workdir": str(work), "load_before": os.getloadavg()}}
    if args.part in ("one-call", "all"):
        settings = EvalSettings(**{**evals, "tasks": tuple(evals["tasks"]), "device": None})
        report["one_call"] = one_call(work, str(reference), settings, env)
        report["one_call"]["ratios"] = ratios(report["one_call"])
    if args.part in ("sweep", "all"):
        models = {"reference": str(reference), "candidate": str(make_candidate(reference, work / "candidate"))}
        report["sweep"] = sweep(work, models, evals, env)
        report["sweep"]["ratios"] = ratios(report["sweep"])
    report["settings"]["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
