"""Cost of the content fingerprint: whole-file xxh3-128 vs a plain read of the same files, and the cached call.

Writes SIZE_MB of random bytes in files of 256 MiB (a sharded checkpoint's shape) into a temporary
folder, then prints, each the median of --repeats runs: a plain chunked read of every file (the
floor any whole-file hash pays), `model_identity` with an empty hash cache (hash + cache write),
and `model_identity` again (one stat per file). Throughputs in GB/s and the ratios against the
plain read. The page cache is warm for all three (the files were just written), so the figures
compare CPU cost, not the disk.
Usage: python benchmarks/bench_fingerprint.py [--size-mb 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def plain_read(folder: Path) -> int:
    n = 0
    for f in sorted(folder.iterdir()):
        with open(f, "rb") as fh:
            while block := fh.read(8 << 20):
                n += len(block)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_fp_"))
    os.environ["LM_EVAL_SINK_CACHE"] = str(root / "cache")
    from lm_eval_sink.identity import model_identity

    model = root / "model"
    model.mkdir()
    left, i = args.size_mb << 20, 0
    while left > 0:
        n = min(left, 256 << 20)
        (model / f"model-{i:05d}.safetensors").write_bytes(os.urandom(n))
        left, i = left - n, i + 1
    (model / "config.json").write_text("{}")
    total = sum(f.stat().st_size for f in model.iterdir())
    try:
        t_read, t_cold, t_warm = [], [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plain_read(model)
            t_read.append(time.perf_counter() - t0)
            shutil.rmtree(root / "cache", ignore_errors=True)
            t0 = time.perf_counter()
            first = model_identity(str(model))
            t_cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            again = model_identity(str(model))
            t_warm.append(time.perf_counter() - t0)
            assert again == first
        r, c, w = (statistics.median(t) for t in (t_read, t_cold, t_warm))
        gb = total / 1e9
        print(f"files: {len(list(model.iterdir()))}, {gb:.2f} GB (page cache warm), median of {args.repeats}")
        print(f"plain read            {r:8.3f} s  {gb / r:6.2f} GB/s")
        print(f"fingerprint, no cache {c:8.3f} s  {gb / c:6.2f} GB/s  ratio to plain read {c / r:.2f}")
        print(
            f"fingerprint, cached   {w * 1e3:8.3f} ms ({w / len(first['files']) * 1e6:.0f} us a file)  "
            f"ratio to plain read {w / r:.5f}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
