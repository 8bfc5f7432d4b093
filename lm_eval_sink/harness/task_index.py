"""lm-eval's index of its own tasks, kept between processes as JSON (called by `discovery.patch_task_index`).

lm-eval parses every YAML under `lm_eval/tasks/` (about 14,000 files, 5-6 s) each time a `TaskManager` is built; the
index is kept in `cache_dir()/task_index/<key>.json`, keyed by the content of every file it may read (`folder_key`),
checked as it is read back, in a private cache. What is keyed and checked, and the figures: docs/lm-eval.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)
Build = Callable[..., dict[str, Any]]
FORMAT = "lm-eval-sink task index, JSON v1"
ENTRY_FIELDS = ("name", "kind", "yaml_path", "cfg", "tags")  # lm-eval's `Entry`, as stored
KINDS = ("TASK", "PY_TASK", "GROUP", "TAG")  # the `Kind` members an index holds


def entry_mismatch() -> str | None:
    """Why lm-eval's `Entry` / `Kind` are not what this file stores (None when they are)."""
    from dataclasses import fields

    from lm_eval.tasks._index import Entry, Kind

    names = tuple(f.name for f in fields(Entry))
    if names != ENTRY_FIELDS:
        return f"Entry has the fields ({', '.join(names)}), not ({', '.join(ENTRY_FIELDS)})"
    missing = [k for k in KINDS if k not in Kind.__members__]
    return f"Kind has no member {', '.join(missing)}" if missing else None


def _keyed(folder: str, rel: str = "") -> list[tuple[str, str]]:
    """(relative POSIX path, path) of every file under `folder` the index may read (all but Python files), unsorted;
    symbolic links to folders are not followed, as `os.walk` follows none."""
    out = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                out += [] if entry.name == "__pycache__" else _keyed(entry.path, f"{rel}{entry.name}/")
            elif not entry.name.endswith((".py", ".pyc")) and not entry.is_dir():
                out.append((rel + entry.name, entry.path))
    return out


def folder_key(root: Path, version: str) -> str:
    """The key of `root`'s index: the format, lm-eval's version, the folder, and each keyed file's relative path and
    bytes (an edit that keeps the size, mtime and ctime makes another key too)."""
    digest = hashlib.sha256(f"{FORMAT}\0{version}\0{root}\0".encode())
    for rel, path in sorted(_keyed(str(root))):
        with open(path, "rb") as file:
            data = file.read()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:32]


def _outside(rel: str) -> bool:
    """Whether `rel` names no file inside the folder: absolute, up, or the folder itself ("" or ".")."""
    path = PurePosixPath(rel)
    return path.is_absolute() or ".." in path.parts or not path.parts


def _problem(row: dict[str, Any]) -> str | None:
    """Why `row` is not an entry as this file stores it (None when it is): the one rule of writing and reading."""
    if tuple(row) != ENTRY_FIELDS or row["kind"] not in KINDS:
        return "not an entry"
    name, rel, cfg, tags = row["name"], row["yaml_path"], row["cfg"], row["tags"]
    if not isinstance(name, str) or not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return "a name and tags must be strings"
    if row["kind"] == "TAG":
        return "a tag names a file or a config" if rel is not None or cfg is not None else None
    if not (isinstance(rel, str) and isinstance(cfg, dict)) or _outside(rel):
        return "no file inside lm-eval's task folder"
    return None


def _row(entry: Any, root: Path) -> dict[str, Any]:
    rel = None if entry.yaml_path is None else Path(entry.yaml_path).relative_to(root).as_posix()
    return {"name": entry.name, "kind": entry.kind.name, "yaml_path": rel, "cfg": entry.cfg, "tags": sorted(entry.tags)}


def encode(index: dict[str, Any], root: Path) -> str | None:
    """The index of `root` as JSON text; None when `decode` would not give it back equal."""
    try:
        text = json.dumps({"format": FORMAT, "entries": [_row(e, root) for e in index.values()]}, ensure_ascii=False)
        if decode(json.loads(text), root) != index:
            raise ValueError("a name or cfg JSON does not keep")
    except (TypeError, ValueError, AttributeError) as err:  # a value JSON does not keep, a file elsewhere, ...
        log.debug("lm-eval-sink: task index not kept (%s)", err)
        return None
    return text


def _entry(row: Any, root: Path) -> Any:
    from lm_eval.tasks._index import Entry, Kind

    why = _problem(row) if isinstance(row, dict) else "not an entry"
    if why:
        raise ValueError(f"{why}: {str(row)[:80]}")
    path = None if row["yaml_path"] is None else root / row["yaml_path"]
    return Entry(name=row["name"], kind=Kind[row["kind"]], yaml_path=path, cfg=row["cfg"], tags=set(row["tags"]))


def decode(data: Any, root: Path) -> dict[str, Any]:
    """The index a stored JSON document holds (ValueError when it is not one `encode` writes)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError("not a task index of this format")
    entries = [_entry(row, root) for row in data["entries"]]
    return {entry.name: entry for entry in entries}


def _read(path: Path, root: Path) -> dict[str, Any] | None:
    from lm_eval_sink.cache import read_private_text

    try:
        return decode(json.loads(read_private_text(path)), root)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, RecursionError) as err:  # torn, foreign, another's: built again, replaced
        log.debug("lm-eval-sink: rebuilding the task index (%s unreadable: %s)", path, err)
        return None


def cached_build(build: Build, paths: Iterable[Path], *, resolve_includes: bool = True) -> dict[str, Any]:
    """`TaskIndex.build(paths)` with lm-eval's own folder read from the cache (stored there on a miss)."""
    import lm_eval
    from lm_eval.tasks._index import TaskIndex

    from lm_eval_sink.cache import cache_dir
    from lm_eval_sink.disk_full import DiskFull
    from lm_eval_sink.io import atomic_write_text

    paths = [Path(p) for p in paths]
    own = Path(lm_eval.__file__).parent / "tasks"
    if not paths or paths[0] != own or not resolve_includes:
        return build(paths, resolve_includes=resolve_includes)
    stored = cache_dir() / "task_index" / f"{folder_key(own, lm_eval.__version__)}.json"
    index = _read(stored, own)
    if index is None:
        index = build([own])
        text = encode(index, own)
        try:
            if text is not None:
                atomic_write_text(stored, text)
        except (OSError, DiskFull) as err:  # a read-only or full cache costs the next process the build, no more
            log.debug("lm-eval-sink: task index not kept (%s)", err)
    lm_evals_log = logging.getLogger(TaskIndex.__module__)  # the logger lm-eval's own merge warns on
    for name, entry in build(paths[1:]).items():
        if name in index:
            lm_evals_log.warning(
                "Task '%s' from %s overrides existing task from %s", name, entry.yaml_path, index[name].yaml_path
            )
        index[name] = entry
    return index
