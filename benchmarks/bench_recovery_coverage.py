"""Coverage of the recovered share's interval (recovery.fieller_share) by simulation; the figures are in
docs/merging.md. Not run in CI: `python benchmarks/bench_recovery_coverage.py [--reps 2000]`.

Per doc: the reference passes with probability 0.6; the candidate loses a passed doc with probability `lost` and
gains a failed one with 0.05; the control takes the reference's outcome back on a doc where the two differ with
probability `share`, and flips a doc where they agree with probability `flip` (noise both ways). The true share is
E[control - candidate] / E[reference - candidate], computed exactly over the 8 outcome patterns. Coverage counts the
draws whose interval holds it, among those where the share is given (the gap detectable: exact McNemar p < 0.05).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from lm_eval_sink.buckets.stats import mcnemar_exact
from lm_eval_sink.recovery import fieller_share

REF_PASS, GAIN = 0.6, 0.05


def cell_probabilities(lost: float, share: float, flip: float) -> dict[tuple[int, int, int], float]:
    """P(reference r, candidate k, control c) of the model above."""
    out = {}
    for r, k, c in itertools.product((0, 1), repeat=3):
        pr = REF_PASS if r else 1 - REF_PASS
        pk = (1 - lost if k else lost) if r else (GAIN if k else 1 - GAIN)
        back = share if r != k else flip  # the control moves off the candidate's outcome
        pc = back if c != k else 1 - back
        out[(r, k, c)] = pr * pk * pc
    return out


def true_share(cells: dict[tuple[int, int, int], float]) -> float:
    num = sum(p * (c - k) for (r, k, c), p in cells.items())
    return num / sum(p * (r - k) for (r, k, c), p in cells.items())


def coverage(n: int, lost: float, share: float, flip: float, reps: int, seed: int) -> tuple[float, float, float]:
    """(coverage among the draws with a share, share of draws with a bounded interval, median width)."""
    cells = cell_probabilities(lost, share, flip)
    keys, probs = list(cells), np.array(list(cells.values()))
    truth, rng = true_share(cells), np.random.default_rng(seed)
    held, given, widths = 0, 0, []
    for _ in range(reps):
        rows = np.array(keys)[rng.choice(len(keys), size=n, p=probs)].astype(float)
        ref, cand, ctrl = rows.T
        if mcnemar_exact(int(np.sum((ref == 1) & (cand == 0))), int(np.sum((ref == 0) & (cand == 1)))) >= 0.05:
            continue
        ci = fieller_share(ref, cand, ctrl, True, 0.95)
        if ci is None:
            continue
        given += 1
        held += ci[0] <= truth <= ci[1]
        widths.append(ci[1] - ci[0])
    return held / max(given, 1), given / reps, float(np.median(widths)) if widths else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    args = parser.parse_args()
    print("| n | lost | true share | flip | coverage (95%) | share given | median width |")
    print("|---|---|---|---|---|---|---|")
    for n, lost, share, flip in itertools.product((100, 500), (0.2, 0.4), (0.0, 0.5, 1.0), (0.0, 0.05)):
        cov, given, width = coverage(n, lost, share, flip, args.reps, seed=0)
        truth = true_share(cell_probabilities(lost, share, flip))
        print(f"| {n} | {lost:g} | {truth:.2f} | {flip:g} | {cov:.3f} | {given:.2f} | {width:.2f} |")


if __name__ == "__main__":
    main()
