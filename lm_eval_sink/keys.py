"""Results keyed by the code that made them (docs/identity.md)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import canonical_json, sha256_text

# --- results keyed by the code that made them ----------------------------------------------
#
# A result key is `versioned_key(inputs_key, versions)`: `inputs_key` hashes what the user chose
# (models' identities, settings), `versions` (`key_versions`) names the code that computed the
# number: the hashes of this project's files on its path (`code_key.source_hashes`: every module its
# entry modules can import, and the data files they name) and the installed versions of the packages
# that produce it. A record keeps all three (`key`, `inputs_key`, `key_versions`), so a result of the
# same inputs made by other code is told apart from one of other inputs (`version_change`) and the
# message names the changed files. The project's own package version and git commit are recorded,
# never keyed: a docs change, or a change to a module no result's path imports, invalidates nothing.


def key_versions(code: Iterable[str], packages: Iterable[str]) -> dict[str, Any]:
    """The versions a result key holds: `{package: installed version, "code": {file: hash}}` for the modules `code`
    (dotted names) and what they import (`code_key.source_hashes`), as this interpreter has them."""
    from lm_eval_sink.code_key import source_hashes
    from lm_eval_sink.provenance import package_versions

    return {**package_versions(packages), "code": source_hashes(code)}


def versioned_key(inputs_key: str, versions: Mapping[str, Any]) -> str:
    """A result key: the inputs' key and the versions of the code that computes the result."""
    return sha256_text(canonical_json({"inputs": inputs_key, "versions": dict(versions)}))


def version_change(recorded: Mapping[str, Any], inputs_key: str, versions: Mapping[str, Any]) -> str | None:
    """What changed ("torch 2.13.0 -> 2.14.0, code changed: lm_eval_sink/capture.py") when `recorded` (a record
    with `inputs_key` and `key_versions`) was made from the same inputs by other versions; None otherwise."""
    if recorded.get("inputs_key") != inputs_key:
        return None
    old = recorded.get("key_versions")
    if not isinstance(old, dict):
        return "made before results were keyed by code versions"
    return _changes(old, versions) or None


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between two `key_versions`: a package's version, or the files of a code record (`code`, and a
    merged checkpoint's `merge code`) whose hashes changed."""
    from lm_eval_sink.code_key import changed_files

    def shown(v: Any) -> str:
        return "absent" if v is None else str(v)

    if any(isinstance(v, dict) and n not in old for n, v in new.items()):
        return "made before results were keyed by the hashes of their code"
    out = []
    for n in sorted(set(old) | set(new)):
        a, b = old.get(n), new.get(n)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out.append(f"{n} changed: {changed_files(a, b)}")
        else:
            out.append(f"{n} {shown(a)} -> {shown(b)}")
    return ", ".join(out)


def versions_text(versions: Mapping[str, Any]) -> str:
    """`key_versions` in one line: each package's version, and a code record as its file count and digest."""
    return ", ".join(
        f"{k} {len(v)} files (sha256 {sha256_text(canonical_json(v))[:12]})" if isinstance(v, dict) else f"{k} {v}"
        for k, v in versions.items()
    )


def check_same_versions(path: Path, versions: Mapping[str, Any], force: bool) -> None:
    """Refuse (unless `force`) an existing output whose record (`path`: a JSON file with `key_versions` at its
    top or in its `provenance`) was made by other versions, naming them; other refusals (and records
    without versions) stay the caller's."""
    path = Path(path)
    if force or not path.is_file():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    old = (
        data.get("key_versions", (data.get("provenance") or {}).get("key_versions")) if isinstance(data, dict) else None
    )
    changed = _changes(old, versions) if isinstance(old, dict) else None
    if changed:
        raise UserError(
            f"{path}: made by other versions ({changed})", "pass --force to recompute it, or choose another output"
        )
