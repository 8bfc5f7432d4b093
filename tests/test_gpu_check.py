"""The GPU check's own plumbing on a CPU machine: every check skipped with the reason, the wheel folder's contents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "packaging"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import gpu_wheels  # noqa: E402
from checks import CHECKS  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: tests/gpu runs the checks themselves")
def test_without_cuda_every_check_is_skipped_with_the_reason_and_the_exit_code_is_0():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "run.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    skipped = [x for x in lines if x.startswith("SKIP ")]
    assert [x.split()[1].rstrip(":") for x in skipped] == list(CHECKS)
    assert all("CUDA is not available" in x for x in skipped)
    assert lines[-1] == f"gpu-check: {len(CHECKS)} checks, 0 failed"


def test_a_wheel_folder_without_the_project_is_one_error_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu" / "run.py"), "--wheels", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "make gpu-wheels" in proc.stderr


def test_gpu_wheels_carries_what_a_cuda_python_lacks_and_nothing_it_has():
    carried = {name for name, _ in gpu_wheels.needed("3.12", set())}
    assert {"lm-eval", "mergekit", "datasets", "pydantic", "nltk", "langdetect", "immutabledict"} <= carried
    assert not carried & {
        "torch",
        "transformers",
        "accelerate",
        "numpy",
        "scipy",
        "pandas",
        "tokenizers",
        "huggingface-hub",
        "safetensors",
    }
    assert "pyarrow" not in {name for name, _ in gpu_wheels.needed("3.12", {"pyarrow"})}
