"""Cost of keying results by their code (`code_key.source_hashes`): the hashes of the files on a result's path.

Prints, each the median of --repeats runs:
- cold: the first call in a fresh interpreter (reads, scans and hashes every file of the closure), for the S code
  (`strength.StrengthWork.CODE`) and an eval unit's (`harness.runner.CODE`), beside `provenance.package_versions`
  of the same key's
  packages in the same fresh interpreter (the other half of the key, and what keys cost before);
- warm: a repeated call in one process (one stat per file);
- probe: the runner's probe of another interpreter (--python, default this one) with the code hashes and without,
  the one subprocess an eval unit in another venv costs per process.
Usage: python benchmarks/bench_code_key.py [--repeats 5] [--python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_COLD = """
import json, time
from lm_eval_sink.code_key import source_hashes
from lm_eval_sink.provenance import package_versions
roots = ROOTS
t0 = time.perf_counter(); n = len(source_hashes(roots)); t1 = time.perf_counter()
package_versions(("torch", "transformers", "lm_eval")); t2 = time.perf_counter()
print(json.dumps({"files": n, "hash": t1 - t0, "versions": t2 - t1}))
"""


def cold(roots: tuple[str, ...], repeats: int) -> dict[str, float]:
    """Medians of the first `source_hashes(roots)` and `package_versions` call in fresh interpreters."""
    runs = []
    for _ in range(repeats):
        code = _COLD.replace("ROOTS", repr(roots))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    return {k: statistics.median(r[k] for r in runs) for k in ("files", "hash", "versions")}


def warm(roots: tuple[str, ...], repeats: int) -> float:
    from lm_eval_sink.code_key import source_hashes

    source_hashes(roots)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        source_hashes(roots)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def probe(python: str, repeats: int) -> tuple[float, float]:
    """Medians of the runner's probe subprocess, with and without the code hashes."""
    from lm_eval_sink.harness.runner import _PROBE, run_probe

    without = _PROBE.replace('"code": code() if', '"code": None if')
    assert without != _PROBE
    out = []
    for code in (_PROBE, without):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run_probe(python, code)
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times))
    return out[0], out[1]


def main() -> None:
    from lm_eval_sink.harness import runner
    from lm_eval_sink.strength import StrengthWork

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    for name, roots in (("S (StrengthWork.CODE)", StrengthWork.CODE), ("eval unit (runner.CODE)", runner.CODE)):
        c = cold(roots, args.repeats)
        w = warm(roots, args.repeats)
        print(
            f"{name}: {c['files']:.0f} files; cold {c['hash'] * 1e3:.1f} ms "
            f"({c['hash'] / c['versions']:.1f}x package_versions' {c['versions'] * 1e3:.1f} ms); "
            f"warm {w * 1e3:.2f} ms ({w / c['hash']:.3f} of cold)"
        )
    with_code, without = probe(args.python, args.repeats)
    print(
        f"probe of {args.python}: {with_code * 1e3:.0f} ms with the code hashes, {without * 1e3:.0f} ms without "
        f"(ratio {with_code / without:.2f})"
    )


if __name__ == "__main__":
    main()
