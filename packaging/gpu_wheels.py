"""`make gpu-wheels`: the folder `make gpu-check` installs from on a CUDA machine that has no index.

    python packaging/gpu_wheels.py --out gpu-wheels [--python-version 3.12] [--skip NAME,...]

It holds this project's wheel and one wheel for every distribution this project needs (its
dependencies, lm-eval's `hf` and `ifeval` extras, and theirs) beyond what the CUDA machine's Python is
assumed to have: torch, transformers, accelerate, numpy, scipy, pandas and what they require directly.
Versions are the ones installed in this interpreter (pinned by constraints.txt). Binary wheels are
downloaded for the target Python (`--python-version`, manylinux x86-64); a distribution published
only as source is built here into a pure-Python wheel. `--skip` leaves out distributions the target
already has (e.g. pyarrow, matplotlib on an image that ships them), to keep the folder small.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ASSUMED = ("torch", "transformers", "accelerate", "numpy", "scipy", "pandas")
PROJECT = "lm-eval-sink"
ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64"]


def closure(roots: dict[str, set[str]], python_version: str, depth: int | None = None) -> set[str]:
    """Canonical names of `roots` ({name: extras}) and what they require (`depth` levels deep; None: all),
    markers evaluated for the target Python."""
    env = {**default_environment(), "python_version": python_version, "python_full_version": f"{python_version}.0"}
    extras_of: dict[str, set[str]] = {}
    level = {canonicalize_name(n): set(x) for n, x in roots.items()}
    n = 0
    while level and (depth is None or n <= depth):
        nxt: dict[str, set[str]] = {}
        for name, extras in level.items():
            if name in extras_of and extras <= extras_of[name]:
                continue
            extras_of.setdefault(name, set()).update(extras)
            for text in md.requires(name) or []:
                req = Requirement(text)
                if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {""} | extras):
                    nxt.setdefault(canonicalize_name(req.name), set()).update(req.extras)
        level, n = nxt, n + 1
    return set(extras_of)


def needed(python_version: str, skip: set[str]) -> list[tuple[str, str]]:
    """(name, installed version) of every distribution to carry, sorted. Assumed on the target: ASSUMED and
    their direct requirements (any version of those has them); deeper ones vary with the versions there."""
    assumed = closure({n: set() for n in ASSUMED}, python_version, depth=1)
    own = closure({PROJECT: set()}, python_version) - {canonicalize_name(PROJECT)}
    return sorted((n, md.version(n)) for n in own - assumed - {canonicalize_name(s) for s in skip})


def _fetch(name: str, version: str, out: Path, python_version: str) -> None:
    """A wheel of name==version for the target: a binary one from the index, else a pure one built here."""
    pip = [sys.executable, "-m", "pip", "-q"]
    spec = f"{name}=={version}"
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    binary = [
        *pip,
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *plat,
        "-d",
        str(out),
        spec,
    ]
    if subprocess.run(binary, capture_output=True).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([*pip, "wheel", "--no-deps", "-w", tmp, spec], check=True)
        built = list(Path(tmp).glob("*.whl"))
        if len(built) != 1 or not built[0].name.endswith("-none-any.whl"):
            sys.exit(
                f"error: {spec} has no wheel for Python {python_version} and builds no pure one (fix: --skip it "
                "if the target has it, or build it on the target)"
            )
        shutil.copy(built[0], out)


def _project_wheel(out: Path) -> None:
    """This project's wheel, built from the files git tracks (a stale build/ folder cannot leak into it)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        for rel in filter(None, files.decode().split("\0")):
            if (ROOT / rel).is_file():
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, Path(tmp) / rel)
        subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "-w", str(out), tmp], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--python-version", default="3.12")
    parser.add_argument("--skip", default="", help="comma-separated distributions the target already has")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: {args.out} is not empty (fix: remove it, or pass another --out)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    carry = needed(args.python_version, set(filter(None, args.skip.split(","))))
    for name, version in carry:
        _fetch(name, version, args.out, args.python_version)
    _project_wheel(args.out)
    size = sum(p.stat().st_size for p in args.out.glob("*.whl"))
    print(
        f"{args.out}: {len(carry) + 1} wheels, {size / 2**20:.1f} MiB (Python {args.python_version}): "
        + ", ".join(f"{n}=={v}" for n, v in carry)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
