"""Content identity of a model: what decides whether an earlier result may be reused.

Rules (`FINGERPRINT_RULE`):
- a local folder: every regular file below it, whole, hashed with xxh3-128 (xxhash: several GB/s,
  so hashing costs less than reading), except lock files,
  dot-files, the COMPLETE/FAILED markers and extraction/injection reports (metadata, not model content); the
  fingerprint is the
  hash of the sorted `{relative path: file hash}` table, which is kept so a refusal can name the
  file that changed;
- a file hash is cached by (path, st_dev, inode, size, mtime_ns, ctime_ns) under the project
  cache, so a repeated call costs one stat per file; an in-place write changes mtime and ctime;
- a hub id (`org/name`, or `org/name@REVISION` with a branch, tag or commit sha): its commit sha
  (online from the hub, offline from the local HF cache), with the blob names as file hashes (the
  sha256 of each LFS file); the sha is passed as `revision` to loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import COMPLETE, atomic_write_json, cache_dir, canonical_json, read_complete, sha256_text

FINGERPRINT_RULE = "xxh3_128-whole-files-v2"
SKIPPED_NAMES = frozenset({COMPLETE, "FAILED.json", "extraction.json", "injection.json", ".lock", ".lock.json"})
_CHUNK = 8 << 20
_SHA = re.compile(r"[0-9a-f]{40}")


def _hash_cache() -> Path:
    return cache_dir() / "file_hashes"


def file_hash(path: Path) -> str:
    """xxh3-128 of the whole file, cached by its stat identity."""
    import xxhash

    path = Path(path).resolve()
    st = path.stat()
    stat_key = sha256_text(f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}")
    entry = _hash_cache() / stat_key[:2] / f"{stat_key}.json"
    try:
        return json.loads(entry.read_text(encoding="utf-8"))["hash"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    digest = "xxh3_128:" + h.hexdigest()
    try:
        atomic_write_json(entry, {"path": str(path), "size": st.st_size, "hash": digest})
    except OSError:
        pass  # a read-only cache only costs the re-hash next time
    return digest


def tree_files(folder: Path) -> list[Path]:
    """The files a folder's identity covers (sorted), lock files and markers left out."""
    folder = Path(folder)
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.name not in SKIPPED_NAMES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and "__pycache__" not in p.parts
    )


def folder_identity(folder: Path) -> dict[str, str]:
    """{relative path: file hash} of a folder."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): file_hash(p) for p in tree_files(folder)}


def _combine(files: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(files).encode("utf-8")).hexdigest()


def looks_like_hub_id(text: str) -> bool:
    """`owner/name`, the shape of a hub model id (each part starts and ends with a letter, digit or `_`: `./x` is a
    path)."""
    return re.fullmatch(r"\w(?:[\w.-]*\w)?/\w(?:[\w.-]*\w)?", text) is not None


def split_revision(ref: str) -> tuple[str, str | None]:
    """`org/name@rev` -> ("org/name", "rev"); no '@' -> (ref, None). mergekit's rule (one '@' at most)."""
    if ref.count("@") > 1:
        raise UserError(
            f"{ref}: more than one '@' (mergekit reads ID@REVISION)", "write org/name@REVISION with one '@'"
        )
    path, at, rev = ref.partition("@")
    if at and not rev:
        raise UserError(
            f"{ref}: nothing after '@'", "write org/name@REVISION (a branch, tag or commit sha), or drop the '@'"
        )
    return path, rev or None


def _snapshot_root(repo_id: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def _cached_sha(repo_id: str, revision: str | None) -> str | None:
    """The commit sha a revision names in the local HF cache (`refs/<rev>`; a full sha names itself)."""
    rev = revision or "main"
    if _SHA.fullmatch(rev):
        return rev
    ref = _snapshot_root(repo_id) / "refs" / rev
    return ref.read_text(encoding="utf-8").strip() if ref.is_file() else None


def snapshot_dir(repo_id: str, sha: str) -> Path | None:
    """The local HF cache folder of one commit of a hub model, or None when it is not cached."""
    snap = _snapshot_root(repo_id) / "snapshots" / sha
    return snap if snap.is_dir() else None


def cached_folder(model: str) -> Path | None:
    """Where a model's files are on this machine: the folder itself, or a hub id's snapshot in the local HF cache (None
    if neither)."""
    if Path(model).is_dir():
        return Path(model)
    repo_id, revision = split_revision(model)
    sha = _cached_sha(repo_id, revision)
    return snapshot_dir(repo_id, sha) if sha else None


def hub_snapshot(repo_id: str, revision: str | None = None) -> tuple[str, dict[str, str]] | None:
    """(revision sha, {file: blob hash}) of a hub model (at `revision`, default main) from the local HF cache, or None
    when not cached."""
    sha = _cached_sha(repo_id, revision)
    snap = snapshot_dir(repo_id, sha) if sha else None
    if snap is None:
        return None
    files = {}
    for p in sorted(snap.rglob("*")):
        if p.is_file():
            target = Path(os.path.realpath(p))
            files[str(p.relative_to(snap))] = ("sha256:" if len(target.name) == 64 else "git:") + target.name
    return sha, files


def _hub_online(repo_id: str, revision: str | None) -> tuple[str, dict[str, str]]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise UserError(
            f"{repo_id}" + (f"@{revision}" if revision else "") + f": not found on the hub ({type(e).__name__})",
            "check the model id and revision",
        ) from None
    files = {s.rfilename: (f"sha256:{s.lfs.sha256}" if s.lfs else f"git:{s.blob_id}") for s in info.siblings or []}
    return info.sha, files


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set (huggingface_hub's own spellings of true)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def model_identity(model: str) -> dict[str, Any]:
    """The identity record of a model folder or hub id, `org/name` or `org/name@REVISION` (see the module rules)."""
    p = Path(model)
    if p.is_dir():
        files = folder_identity(p)
        revision = p.name if p.parent.name == "snapshots" else None  # a folder inside the HF cache
        return {
            "model": str(p),
            "revision": revision,
            "fingerprint_rule": FINGERPRINT_RULE,
            "fingerprint": _combine(files),
            "files": files,
        }
    repo_id, revision = split_revision(model)
    snap = hub_snapshot(repo_id, revision)
    if snap is None:
        if hub_offline():
            raise UserError(
                f"{model}: not in the local Hugging Face cache and the hub is offline (HF_HUB_OFFLINE=1)",
                "download it once online, or pass a local model folder",
            )
        snap = _hub_online(repo_id, revision)
    sha, files = snap
    return {
        "model": model,
        "revision": sha,
        "fingerprint_rule": FINGERPRINT_RULE,
        "fingerprint": _combine(files),
        "files": files,
    }


def check_finished_folder(path: Path) -> None:
    """Refuse, as a model input, a staging folder or a folder a failed run left (FAILED.json without COMPLETE.json)."""
    path = Path(path)
    if ".partial-" in path.name or ".old-" in path.name:
        raise UserError(
            f"{path}: a staging folder left by an interrupted run, not a model",
            "pass the finished folder (rerun the command that makes it)",
        )
    if path.is_dir() and (path / "FAILED.json").is_file() and read_complete(path) is None:
        raise UserError(
            f"{path}: left by a failed run (FAILED.json, no COMPLETE.json)",
            "rerun the command that makes it, or pass another folder",
        )


def local_identity(model: str | None) -> dict[str, Any] | None:
    """The identity of a run's model when it is a local folder that still exists (provenance of buckets and
    attribution), else None."""
    return model_identity(model) if model and Path(model).is_dir() else None


def check_same_identity(old: dict[str, Any] | None, new: dict[str, Any], where: Path) -> None:
    """Refuse reusing `where` when the identity it was made from is not `new`'s (one line, naming the changed file)."""
    if not isinstance(old, dict) or old.get("fingerprint_rule") != FINGERPRINT_RULE:
        raise UserError(
            f"{where}: made with an older fingerprint rule; rerun with --force", "pass --force to recompute it"
        )
    if old.get("fingerprint") == new["fingerprint"]:
        return
    before, after = old.get("files") or {}, new["files"]
    changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    shown = (
        ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        if changed
        else "the revision"
    )
    raise UserError(
        f"{where}: made from other inputs: {new['model']} changed ({shown})",
        "pass --force to recompute, or choose another --output",
    )
