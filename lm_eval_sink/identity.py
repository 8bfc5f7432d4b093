"""Content identity of a model: what decides whether an earlier result may be reused.

A local folder is the xxh3-128 of each whole file (cached by stat identity in the private project cache), a hub id
its commit sha with the blob hashes of the files a load reads (`FINGERPRINT_RULE`; the rules: docs/identity.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.cache import cache_dir, read_private_text
from lm_eval_sink.disk_full import DiskFull
from lm_eval_sink.io import atomic_write_json, canonical_json, sha256_text
from lm_eval_sink.outputs import COMPLETE, FAILED_FILE, REPORT_FILES, read_complete
from lm_eval_sink.tables import first_few

FINGERPRINT_RULE = "xxh3_128-whole-files-v2"
SKIPPED_NAMES = frozenset({COMPLETE, FAILED_FILE, *REPORT_FILES.values(), ".lock", ".lock.json"})
_HASH = re.compile(r"xxh3_128:[0-9a-f]{32}")  # the one form a cached file hash may take


def file_hash(path: Path) -> str:
    """xxh3-128 of the whole file, cached by its stat identity."""
    import xxhash

    path = Path(path).resolve()
    st = path.stat()
    stat_key = sha256_text(f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}")
    entry = cache_dir() / "file_hashes" / stat_key[:2] / f"{stat_key}.json"
    try:
        known = json.loads(read_private_text(entry))
        if known == {"path": str(path), "size": st.st_size, "hash": known["hash"]} and _HASH.fullmatch(known["hash"]):
            return known["hash"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        pass  # absent, torn, another user's or not an entry this function writes: hashed again and replaced
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    digest = "xxh3_128:" + h.hexdigest()
    try:
        atomic_write_json(entry, {"path": str(path), "size": st.st_size, "hash": digest})
    except (OSError, DiskFull):
        pass  # a read-only or full cache only costs the re-hash next time
    return digest


def folder_identity(folder: Path) -> dict[str, str]:
    """{relative path: file hash} of a folder's files, sorted; lock files, markers and hidden files left out."""
    folder = Path(folder)
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.name not in SKIPPED_NAMES
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and "__pycache__" not in p.parts
    )
    return {str(p.relative_to(folder)): file_hash(p) for p in files}


def files_fingerprint(files: dict[str, str]) -> str:
    """The fingerprint of a {relative path: file hash} table."""
    return "sha256:" + hashlib.sha256(canonical_json(files).encode("utf-8")).hexdigest()


def looks_like_hub_id(text: str) -> bool:
    """`owner/name`, the shape of a hub model id (each part starts and ends with a word character)."""
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


# The tokenizer files a load reads: the part of a checkpoint an engine's tokenizer and chat template come from.
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
# The files besides its weights that a load of a hub model reads: only these are fingerprinted (docs/identity.md).
HUB_LOAD_FILES = frozenset({"config.json", "generation_config.json", *TOKENIZER_FILES})


def hub_load_files(files: dict[str, str]) -> dict[str, str]:
    """The part of a hub revision's {file: blob hash} table that a load reads (`HUB_LOAD_FILES`, weights)."""
    top = {n: h for n, h in files.items() if "/" not in n}
    weights = {n for n in top if n.endswith(".safetensors") or n == "model.safetensors.index.json"}
    if not weights:
        weights = {n for n in top if n.startswith("pytorch_model") and n.endswith((".bin", ".bin.index.json"))}
    return {n: h for n, h in sorted(top.items()) if n in HUB_LOAD_FILES or n in weights}


def snapshot_dir(repo_id: str, sha: str) -> Path | None:
    """The local HF cache folder of one commit of a hub model, or None when its config is not cached."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=sha)
    return Path(found).parent if isinstance(found, str) else None


def cached_folder(model: str) -> Path | None:
    """A model's folder on this machine: itself, or a hub id's snapshot in the local HF cache (else None)."""
    if Path(model).is_dir():
        return Path(model)
    repo_id, revision = split_revision(model)
    return snapshot_dir(repo_id, revision or "main")


def hub_snapshot(repo_id: str, revision: str | None = None) -> tuple[str, dict[str, str]] | None:
    """(revision sha, {file a load reads: blob hash, which is its blob's name}) of a hub model at `revision` (a commit
    sha, branch or tag; default main) from the local HF cache (`scan_cache_dir`), or None when not cached."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    rev = revision or "main"
    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)
    except CacheNotFound:
        return None
    repo = next((r for r in cache.repos if r.repo_id == repo_id and r.repo_type == "model"), None)
    cached = next((r for r in repo.revisions if r.commit_hash == rev or rev in r.refs), None) if repo else None
    if cached is None:
        return None
    files = {
        f.file_path.relative_to(cached.snapshot_path).as_posix(): ("sha256:" if len(f.blob_path.name) == 64 else "git:")
        + f.blob_path.name
        for f in cached.files
    }
    return cached.commit_hash, hub_load_files(files)


def listed_files(info: Any) -> dict[str, str]:
    """{file a load reads: blob hash} of a hub `ModelInfo` fetched with `files_metadata=True`."""
    files = {s.rfilename: (f"sha256:{s.lfs.sha256}" if s.lfs else f"git:{s.blob_id}") for s in info.siblings or []}
    return hub_load_files(files)


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
    return info.sha, listed_files(info)


def model_identity(model: str) -> dict[str, Any]:
    """The identity record of a model folder, a one-file model (GGUF) or a hub id (`org/name[@REVISION]`)."""
    from huggingface_hub import is_offline_mode

    p = Path(model)
    if p.is_dir() or p.is_file():
        files = folder_identity(p) if p.is_dir() else {p.name: file_hash(p)}
        model = str(p)
        sha = p.name if p.parent.name == "snapshots" and p.is_dir() else None  # a folder inside the HF cache
    else:
        repo_id, revision = split_revision(model)
        snap = hub_snapshot(repo_id, revision)
        if snap is None and is_offline_mode():
            raise UserError(
                f"{model}: not in the local Hugging Face cache and the hub is offline (HF_HUB_OFFLINE=1)",
                "download it once online, or pass a local model folder",
            )
        sha, files = snap or _hub_online(repo_id, revision)
    return {
        "model": model,
        "revision": sha,
        "fingerprint_rule": FINGERPRINT_RULE,
        "fingerprint": files_fingerprint(files),
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
    if path.is_dir() and (path / FAILED_FILE).is_file() and read_complete(path) is None:
        raise UserError(
            f"{path}: left by a failed run (FAILED.json, no COMPLETE.json)",
            "rerun the command that makes it, or pass another folder",
        )


def local_identity(model: str | None) -> dict[str, Any] | None:
    """The identity of a run's model when it is a local folder that still exists, else None."""
    return model_identity(model) if model and Path(model).is_dir() else None


def check_same_identity(old: dict[str, Any] | None, new: dict[str, Any], where: Path) -> None:
    """Refuse reusing `where` when the identity it was made from is not `new`'s (one line, naming the changed file)."""
    missing = [k for k in ("fingerprint_rule", "fingerprint", "files") if not isinstance(old, dict) or k not in old]
    if missing:
        raise UserError(
            f"{where}: its model identity has no {', '.join(missing)} (written by hand, cut short, or by a version "
            "before the fingerprint rule)",
            "pass --force to recompute it",
        )
    if old.get("fingerprint_rule") != FINGERPRINT_RULE:
        raise UserError(
            f"{where}: made with an older fingerprint rule ({old['fingerprint_rule']}, now {FINGERPRINT_RULE})",
            "pass --force to recompute it",
        )
    if old.get("fingerprint") == new["fingerprint"]:
        return
    before, after = old.get("files") or {}, new["files"]
    changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    raise UserError(
        f"{where}: made from other inputs: {new['model']} changed ({first_few(changed, 3) or 'the revision'})",
        "pass --force to recompute, or choose another --output",
    )
