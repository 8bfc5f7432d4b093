"""Memory and time of Sink Strength on one long prompt, against a plain forward of the same input.

The embedded SmolLM2-135M-Instruct (fp32, CPU), one prompt of 512 / 2,048 / 4,096 tokens (plain
text, no chat template), S over the last 10 layers. Each variant runs in a process of its own
(peak RSS only grows): a plain forward with full logits (as a user runs the model), a plain
forward with `logits_to_keep=1`, and `strength.measure`. Each child loads the model, runs a
16-token warm-up forward, then times one call of its variant; it reports its peak RSS and the RSS
of the loaded model before the call. `--before DIR` also runs `strength.measure` from another
checkout of this project (e.g. a `git worktree` of an older commit) on the same input.

    python benchmarks/bench_long_prompt.py [--lengths 512 2048 4096] [--before DIR] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time, torch
from lm_eval_sink.models import load_model
from lm_eval_sink.calibration import encode_prompts
from lm_eval_sink.strength import StrengthSettings, measure
variant, prompt_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
m = load_model("default", dtype="float32")
settings = StrengthSettings(prompts_file=prompt_file, use_chat_template=False, last_k=10)
text = open(prompt_file, encoding="utf-8").read().strip()
ids = torch.tensor([encode_prompts(m.tokenizer, [text], use_chat_template=False).input_ids[0]])
with torch.no_grad():
    m.model(input_ids=ids[:, :16], use_cache=False)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
if variant == "measure":
    s = measure(m.model, m.tokenizer, settings, progress=False).sink_strength
else:
    keep = {"logits_to_keep": 1} if variant == "plain_last" else {}
    with torch.no_grad():
        m.model(input_ids=ids, use_cache=False, **keep)
    s = None
seconds = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kib": peak, "base_kib": base, "tokens": ids.shape[1], "S": s}))
"""


def write_prompt(folder: Path, n_tokens: int) -> Path:
    """A plain-text prompt of exactly `n_tokens` tokens (the calibration prompts repeated, cut, decoded)."""
    from lm_eval_sink.calibration import builtin_prompts, encode_prompts
    from lm_eval_sink.models import default_model_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    text = " ".join(builtin_prompts()) + " "
    ids = tok(text * (n_tokens // 100 + 2), add_special_tokens=False)["input_ids"]
    for cut in range(n_tokens, 0, -1):  # decoding may merge tokens: cut until the text re-encodes to n_tokens
        prompt = tok.decode(ids[:cut]).replace("\n", " ").strip()
        if len(encode_prompts(tok, [prompt], use_chat_template=False).input_ids[0]) == n_tokens:
            path = folder / f"prompt_{n_tokens}.txt"
            path.write_text(prompt + "\n", encoding="utf-8")
            return path
    raise RuntimeError(f"no prompt of {n_tokens} tokens")


def child(code: Path, variant: str, prompt: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-c", CHILD, variant, str(prompt), str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096])
    ap.add_argument("--before", type=Path, default=None, help="Another checkout whose strength.measure to run too.")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    runs = [("plain forward, full logits", REPO, "plain_full"), ("plain forward, logits_to_keep=1", REPO, "plain_last")]
    runs.append(("strength.measure", REPO, "measure"))
    if args.before is not None:
        runs.append((f"strength.measure of {args.before.name}", args.before, "measure"))
    print(
        f"SmolLM2-135M-Instruct fp32, CPU, {args.threads} thread(s), last 10 layers, one prompt; one call per process"
    )
    print(
        "| tokens | variant | time s | peak RSS MiB | over loaded model MiB | time / plain (full, last) | "
        "peak / plain (full, last) | S |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.lengths:
            prompt = write_prompt(Path(tmp), n)
            got = {name: child(code, variant, prompt, args.threads) for name, code, variant in runs}
            full, last = got[runs[0][0]], got[runs[1][0]]
            for name, r in got.items():
                s = "" if r["S"] is None else f"{r['S']:.4f}"
                print(
                    f"| {r['tokens']} | {name} | {r['seconds']:.2f} | {r['peak_kib'] / 1024:.0f} | "
                    f"{(r['peak_kib'] - r['base_kib']) / 1024:.0f} | "
                    f"{r['seconds'] / full['seconds']:.2f}, {r['seconds'] / last['seconds']:.2f} | "
                    f"{r['peak_kib'] / full['peak_kib']:.2f}, {r['peak_kib'] / last['peak_kib']:.2f} | {s} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
