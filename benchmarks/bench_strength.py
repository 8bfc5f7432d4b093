"""Cost of Sink Strength vs a plain forward of the same batch, on SmolLM2-135M-Instruct (CPU).

Prints, for the 15 calibration prompts in one padded batch: the median wall time of S (runs of the
two alternate in one process) over that of a plain sdpa forward (ratio), and the peak
resident memory added by each over the loaded model, each measured in its own subprocess (peak RSS
is per process). Also prints S for K = 10 / all layers and N = 5 / 15, and the time of `measure`
with its default batching (all 15 prompts in one padded forward) against one prompt per forward
(`batch_size=1`), alternating in one process (medians), with the two values of S.
Usage: python benchmarks/bench_strength.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time, torch
from lm_eval_sink.models import load_model
from lm_eval_sink.calibration import Batching, builtin_prompts, encode_prompts
from lm_eval_sink.capture import capture_prompts, _batch
from lm_eval_sink.strength import StrengthSettings, reduce_captures
mode, repeats = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(2)
m = load_model("default", dtype="float32")
enc = encode_prompts(m.tokenizer, builtin_prompts())
n = len(enc)
layers = StrengthSettings().layers_for(range(30))
ids, mask, pos, first = _batch(enc.input_ids, 0, torch.device("cpu"))
def plain():
    with torch.inference_mode():
        m.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
def sink():
    caps = capture_prompts(m.model, enc, layers, Batching(batch_size=n), progress=False)
    reduce_captures(caps, StrengthSettings(), 30)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # model loaded, nothing run yet
times = {"plain": [], "sink": []}
if mode == "time":  # alternate the two, so load on the machine hits both alike
    plain(); sink()
    for _ in range(repeats):
        for name, fn in (("plain", plain), ("sink", sink)):
            t = time.perf_counter(); fn(); times[name].append(time.perf_counter() - t)
else:  # peak memory of one kind of call, in a process of its own
    (plain if mode == "plain" else sink)()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"times": times, "peak_kib": peak, "base_kib": base}))
"""


def child(mode: str, repeats: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(repeats)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def batching_ratio(m, repeats: int) -> None:
    """Time of `measure` at its default batching (one forward of the 15 prompts) over batch size 1 (15 forwards)."""
    from lm_eval_sink.strength import StrengthSettings, measure

    times: dict[str, list[float]] = {"all": [], "one": []}
    values = {}
    for _ in range(repeats):
        for name, settings in (("all", StrengthSettings()), ("one", StrengthSettings(batch_size=1))):
            t = time.perf_counter()
            values[name] = measure(m.model, m.tokenizer, settings, progress=False).sink_strength
            times[name].append(time.perf_counter() - t)
    t_all, t_one = statistics.median(times["all"]), statistics.median(times["one"])
    print(
        f"measure, 15 prompts: default (one padded forward) {t_all:.3f} s, batch size 1 (15 forwards) {t_one:.3f} s, "
        f"time ratio default / batch 1: {t_all / t_one:.2f}; S {values['all']:.6f} vs {values['one']:.6f} "
        f"(|diff| {abs(values['all'] - values['one']):.1e})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    timing = child("time", args.repeats)
    plain, sink = child("plain", 0), child("sink", 0)
    tp, ts = statistics.median(timing["times"]["plain"]), statistics.median(timing["times"]["sink"])
    print(
        f"15 prompts, one batch, CPU fp32, {args.repeats} alternating runs each (medians); peak RSS "
        "from one call per process"
    )
    for name, r, t in (("plain forward", plain, tp), ("Sink Strength", sink, ts)):
        print(
            f"{name:14s} {t:.3f} s   peak RSS {r['peak_kib'] / 1024:.0f} MiB "
            f"(+{(r['peak_kib'] - r['base_kib']) / 1024:.0f} MiB over the loaded model)"
        )
    print(
        f"time ratio S / forward: {ts / tp:.2f}   peak RSS ratio: {sink['peak_kib'] / plain['peak_kib']:.3f}   "
        "ratio of the increments: "
        f"{(sink['peak_kib'] - sink['base_kib']) / max(1, plain['peak_kib'] - plain['base_kib']):.2f}"
    )

    from lm_eval_sink.models import load_model
    from lm_eval_sink.strength import StrengthSettings, measure

    m = load_model("default", dtype="float32")
    batching_ratio(m, args.repeats)
    for k in (10, None):
        for n in (5, 15):
            t = time.perf_counter()
            r = measure(m.model, m.tokenizer, StrengthSettings(last_k=k, n_prompts=n), progress=False)
            print(
                f"S(K={k or 'all'}, N={n}) = {r.sink_strength:.4f}  (content rows {r.sink_strength_content_rows:.4f}, "
                f"template rows {r.sink_strength_template_rows:.4f}, template share "
                f"{r.template_row_fraction:.3f}; {time.perf_counter() - t:.1f} s)"
            )


if __name__ == "__main__":
    main()
