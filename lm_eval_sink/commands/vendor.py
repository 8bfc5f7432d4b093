"""`lm-eval-sink vendor add`: record one vendor (or independent) figure in a user registry file, validated."""

from __future__ import annotations

import datetime
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

import lm_eval_sink
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_text, read_text
from lm_eval_sink.locks import hold
from lm_eval_sink.vendors import NewScore, add_score, load_registry, registry_with, user_registry_path
from lm_eval_sink.yaml_input import parse_yaml


def _verification(at: str | None, quote: str | None, date: str | None, unverified: str | None) -> dict[str, Any]:
    """`verified` (where, the exact text, the date: today unless given) or `unverified` (a reason), never both."""
    if at or quote:
        if not (at and quote):
            raise UserError("--verified-at and --quote go together", "pass both, or --unverified REASON")
        if unverified:
            raise UserError("--unverified with --verified-at / --quote", "a figure is verified or unverified, not both")
        return {"verified": {"date": date or datetime.date.today().isoformat(), "source": at, "quote": quote}}
    return {
        "unverified": unverified or "recorded with `lm-eval-sink vendor add` without a quote from its source",
    }


def _target(registry_file: str | Path | None) -> Path:
    """Where the figure goes: --registry FILE, else the project cache's vendors.yaml; never the package's data."""
    path = Path(registry_file) if registry_file is not None else user_registry_path()
    package = Path(lm_eval_sink.__file__).resolve().parent
    if path.resolve().is_relative_to(package):
        raise UserError(
            f"{path} is inside the installed package ({package})",
            "keep your figures in a file of your own: --registry FILE, or leave it out for the project cache",
        )
    if path.exists() and not path.is_file():
        raise UserError(f"{path} is not a file", "pass a YAML file path with --registry")
    return path


def run_vendor_add(new: NewScore, registry_file: str | Path | None = None, **verification: Any) -> list[str]:
    """The `vendor add` command: the user file with the new score, validated with the bundled registry, written
    atomically under its lock; `verification`: at, quote, date, unverified (the CLI's flags)."""
    new = replace(new, **_verification(**verification))
    path = _target(registry_file)
    if new.verified and registry_file is None:
        raise UserError(
            f"a verified figure (--verified-at, --quote) would go into the project cache's {path}, whose figures "
            "count as unverified (a cache never decides that a figure is verified)",
            "keep verified figures in a file of your own: add --registry FILE, and pass it to attribute",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with hold(path, sibling=True):
        current = parse_yaml(read_text(path, "the registry"), str(path)) if path.is_file() else None
        # the bundled registry alone while the user file does not exist yet (the default one must not be read)
        reg = load_registry(path) if path.is_file() else registry_with({}, "(new user registry)")
        data, score_id = add_score(current, reg, new)
        registry_with(data, str(path))  # the whole file, as every later load will read it
        atomic_write_text(path, yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
    state = "verified " + new.verified["date"] if new.verified else "UNVERIFIED"
    return [
        f"added {score_id}: {new.model} {new.benchmark} {new.value:g} (source {new.source}, protocol {new.protocol}, "
        f"{state}) to {path}",
        "`lm-eval-sink attribute ... --vendor` reads it"
        + ("" if registry_file is None else f" with --registry {path}")
        + "; a local model folder is matched to it only by --as NAME or its recorded hub id",
    ]
