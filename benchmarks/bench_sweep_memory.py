"""In-memory sweep benchmark: the per-checkpoint cost of merge + in-process eval + S on one resident model.

SmolLM2-135M-Instruct (the embedded default model) is the reference (and, in the chain lineage,
the base); the candidate is a copy moved by a few Adam steps on the calibration prompts, made by
this script. For each control (linear_uniform, ties, tsv): `merging.inmemory.merge_into` into the
resident model, `harness.inprocess.evaluate` (ifeval, limit 8, max_gen_toks 64, results and samples
written) and `harness.inprocess.measure_strength`; against it, the bare work on the same loaded
model: `lm_eval.simple_evaluate` on `HFLM(pretrained=model)` with the same TaskManager, and
`strength.measure`. One warm-up bare evaluation first (dataset caches), untimed. float32 on CPU.

Memory: RSS after the resident model is loaded (imports, model, TaskManager), the peak RSS of the
whole run (ru_maxrss), and the resident model's parameter bytes.

TODO (needs the sweep integration of issue 22: `merge: {in_memory: true}` in the sweep file):
the three engines on the same sweeps, each from a cold process: on-disk local, in-memory local,
in-memory Ray (2 actors), on the 10-unit tiny sweep of bench_scale and on this SmolLM2 sweep.

Usage: OMP_NUM_THREADS=2 python benchmarks/bench_sweep_memory.py [--workdir DIR] [--controls a,b]
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LM_EVAL_SINK_DATA", "/work/shared/data")
os.environ.setdefault("NLTK_DATA", "/work/shared/data/nltk_data")

CONTROLS = ("linear_uniform", "ties", "tsv")


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--controls", default=",".join(CONTROLS))
    ap.add_argument("--make-candidate", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_candidate:  # in its own process, so that its optimizer state is not in the figures' RSS
        from lm_eval_sink.models import default_model_dir

        make_candidate(default_model_dir(), args.make_candidate)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_sweep_memory_"))
    work.mkdir(parents=True, exist_ok=True)

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
    for name in args.controls.split(","):
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
