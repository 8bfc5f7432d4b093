"""One key for every result, derived from the values its work receives (docs/identity.md, `keys.py`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import canonical_json, saved_object, sha256_file, sha256_text

KEY_RULE = 1  # how a key is derived from a declaration: a result keyed otherwise is recomputed, saying so
CONTENT = {"key": "content"}
MODEL = {"key": "model"}
UNKEYED = {"key": None}


class Work:
    """The declaration a result kind's inputs dataclass inherits: what its key holds beside the fields."""

    CODE: ClassVar[tuple[str, ...]] = ()
    PACKAGES: ClassVar[tuple[str, ...]] = ()
    ENV: ClassVar[tuple[str, ...]] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    """A result's key (`key`), the key of its inputs alone (`inputs_key`) and the versions it holds."""

    key: str
    inputs_key: str
    versions: dict[str, Any]

    def change(self, recorded: Mapping[str, Any]) -> str | None:
        """What changed when `recorded` was made from the same inputs by other versions (`version_change`)."""
        return version_change(recorded, self.inputs_key, self.versions)


def key_of(work: Work, versions: Mapping[str, Any] | None = None) -> Key:
    """The key of `work`; `versions`: those of code that runs elsewhere, named apart (`lm-eval code`, `engine vllm`,
    `merge code`), held beside this interpreter's `CODE` and `PACKAGES`."""
    env = {name: keyed(os.environ.get(name), "content") for name in work.ENV}
    inputs = {"kind": type(work).__name__, "inputs": keyed(work), "env": env}
    ikey = sha256_text(canonical_json(inputs))
    own = key_versions(type(work))
    if set(own) & set(versions or {}):
        raise ValueError(f"versions of code elsewhere named as this interpreter's: {set(own) & set(versions or {})}")
    held = {**(versions or {}), **own}
    return Key(versioned_key(ikey, held), ikey, held)


def keyed(value: Any, how: str = "value") -> Any:
    """`value` as a key holds it (`how`: a field's marker): by value, by content or by the model's identity."""
    if dataclasses.is_dataclass(value):
        return {
            f.name: keyed(getattr(value, f.name), f.metadata.get("key", "value"))
            for f in dataclasses.fields(value)
            if f.metadata.get("key", "value") is not None
        }
    if isinstance(value, Mapping):  # content: the values that name a file or folder (peft=, tokenizer=)
        return {str(k): keyed(v, how) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [keyed(v, how) for v in value]
    if how == "model" and value is not None:
        from lm_eval_sink.models import model_fingerprint

        return model_fingerprint(str(value))["fingerprint"]
    if isinstance(value, Path) or (how == "content" and isinstance(value, str) and value):
        return content(value) if Path(value).expanduser().exists() else str(value)  # a path naming nothing: itself
    return value


def content(path: str | Path) -> str:
    """The content of a file (sha256 of its bytes: no cache, so no stat can stand in for it) or folder (every file
    below it by its relative path: `identity.folder_identity`, whose whole-file hashes a stat change renews)."""
    from lm_eval_sink.identity import files_fingerprint, folder_identity

    path = Path(path).expanduser()
    return files_fingerprint(folder_identity(path)) if path.is_dir() else "sha256:" + sha256_file(path)


def key_versions(kind: type[Work]) -> dict[str, Any]:
    """The versions a result of `kind` is keyed by, as this interpreter has them: its `PACKAGES`' installed versions
    and `code`, the hashes of its `CODE` modules with what they import (`code_key.source_hashes`)."""
    from lm_eval_sink.code_key import source_hashes
    from lm_eval_sink.provenance import package_versions

    return {"key rule": KEY_RULE, **package_versions(kind.PACKAGES), "code": source_hashes(kind.CODE)}


def versioned_key(inputs_key: str, versions: Mapping[str, Any]) -> str:
    """A result key: the inputs' key and the versions of the code that computes the result."""
    return sha256_text(canonical_json({"inputs": inputs_key, "versions": dict(versions)}))


def version_change(recorded: Mapping[str, Any], inputs_key: str, versions: Mapping[str, Any]) -> str | None:
    """What changed ("torch 2.13.0 -> 2.14.0, code changed: lm_eval_sink/capture.py") when `recorded` was made from
    the same inputs by other versions, or before results were keyed by this rule (`KEY_RULE`); None otherwise."""
    old = recorded.get("key_versions")
    if not isinstance(old, dict) or old.get("key rule") != KEY_RULE:
        return "made before results were keyed by the values their work receives"
    if recorded.get("inputs_key") != inputs_key:
        return None
    return _changes(old, versions) or None


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between two `key_versions`: a package's version, or the files of a code record (`code`, and a
    merged checkpoint's `merge code`) whose hashes changed."""
    from lm_eval_sink.code_key import changed_files

    def shown(v: Any) -> str:
        return "absent" if v is None else str(v)

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
    """Refuse (unless `force`) an existing output whose record (`path`: `key_versions` at its top or in its
    `provenance`) was made by other versions, naming them; other refusals stay the caller's."""
    data = {} if force else saved_object(path) or {}
    old = data.get("key_versions", (data.get("provenance") or {}).get("key_versions"))
    changed = _changes(old, versions) if isinstance(old, dict) else None
    if changed:
        raise UserError(
            f"{path}: made by other versions ({changed})", "pass --force to recompute it, or choose another output"
        )
