"""`make gpu-check`: every check of tests/gpu/checks.py, one line each with its figures; exit 1 on any failure.

    python tests/gpu/run.py [--wheels DIR] [--only NAME,...] [--device cpu]

`--wheels DIR` (the folder `make gpu-wheels` prepared) installs this project and what it needs beyond
torch / transformers / accelerate / numpy / scipy / pandas into a temporary folder first, so the check
runs offline on any CUDA machine whose Python has those. Without CUDA every check is printed as skipped
with the reason and the exit code is 0. `--device cpu` runs the checks' paths against the CPU itself (a
dry run of the check code, for development; no figure of it says anything about a GPU).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path


SITECUSTOMIZE = """# Written by lm-eval-sink's tests/gpu/run.py: this folder is on PYTHONPATH, not a site folder,
# so read its .pth files (lm-eval-sink's start-up hook) here, in every interpreter that inherits
# PYTHONPATH; then run the machine's own sitecustomize, if it has one.
import importlib.machinery, os, site, sys
_here = os.path.dirname(os.path.abspath(__file__))
site.addsitedir(_here)
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None:
    _spec.loader.exec_module(type(sys)("sitecustomize"))
"""


def _install(wheels: Path) -> str:
    """pip-install every wheel of `wheels` (no index, no dependency resolution) into a new folder; its path."""
    found = sorted(wheels.glob("*.whl"))
    if not any(w.name.startswith("lm_eval_sink-") for w in found):
        print(
            f"error: {wheels} holds no lm_eval_sink wheel (fix: run `make gpu-wheels` on a machine with an index, "
            "then copy its folder here)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    target = tempfile.mkdtemp(prefix="lm-eval-sink-gpu-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", target]
    subprocess.run([*cmd, *map(str, found)], check=True)
    (Path(target) / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="the folder make gpu-wheels prepared")
    parser.add_argument("--only", help="comma-separated check names")
    parser.add_argument("--device", help="run against this device instead of CUDA (cpu: a dry run)")
    args = parser.parse_args(argv)
    if args.wheels is not None:  # install, then run again in an interpreter that sees the install first
        site = _install(args.wheels)
        rest = list(argv if argv is not None else sys.argv[1:])
        i = rest.index("--wheels")
        del rest[i : i + 2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
        return subprocess.run([sys.executable, str(Path(__file__).resolve()), *rest], env=env).returncode
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from checks import CHECKS, Context, Skip, accelerator

    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"error: unknown check(s) {', '.join(unknown)} (fix: use {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    device, about = (args.device, f"dry run on {args.device}") if args.device else accelerator()
    import lm_eval_sink
    import torch
    import transformers

    print(
        f"gpu-check: {about}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"lm_eval_sink from {Path(lm_eval_sink.__file__).parent}"
    )
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        os.chdir(work)  # a checkout's own lm_eval_sink/ folder never shadows the installed one in subprocesses
        ctx = Context(device=device or "cuda", work=Path(work))
        for name in names:
            if device is None:
                print(f"SKIP {name}: {about}", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                line = CHECKS[name](ctx)
                print(f"PASS {name} ({time.perf_counter() - t0:.1f} s): {line}", flush=True)
            except Skip as e:
                print(f"SKIP {name}: {e}", flush=True)
            except Exception as e:  # one line per failed check; the traceback goes to stderr
                failed += 1
                print(f"FAIL {name} ({time.perf_counter() - t0:.1f} s): {type(e).__name__}: {str(e)[:500]}", flush=True)
                traceback.print_exc(file=sys.stderr)
    print(f"gpu-check: {len(names)} checks, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
