"""lm-eval's index of its own tasks, kept between processes (called by `discovery.patch_task_manager`).

lm-eval 0.4.13 parses every YAML under `lm_eval/tasks/` (about 14,000 files, 5-6 s on one core) each time a
`TaskManager` is built, i.e. in every `lm_eval` process and every sweep eval unit. That folder is part of the
installed lm-eval, so its index is kept in `cache_dir()/task_index/`, under a key of lm-eval's version, the
folder and every YAML's path, size and modification time: an edited, added or removed file or another lm-eval
makes another key, and a key not found is built by lm-eval itself. Reading it back takes under a second.
Other folders (`--include_path`, this project's tasks) are small and always built by lm-eval, then merged as
lm-eval merges them: a later folder's task replaces an earlier one's, with lm-eval's warning.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
Build = Callable[..., dict[str, Any]]


def folder_key(root: Path, yaml_files: Iterable[Path], version: str) -> str:
    """The key of `root`'s index: lm-eval's version, the folder, and each YAML's relative path, size and mtime."""
    digest = hashlib.sha256(f"{version}\0{root}\0".encode())
    for path in yaml_files:
        stat = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return pickle.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except Exception as err:  # a torn or foreign file: build again and replace it
        log.debug("lm-eval-sink: rebuilding the task index (%s unreadable: %s)", path, err)
        return None


def cached_build(build: Build, paths: Iterable[Path], *, resolve_includes: bool = True) -> dict[str, Any]:
    """`TaskIndex.build(paths)` with lm-eval's own folder read from the cache (stored there on a miss)."""
    import lm_eval

    from lm_eval_sink.io import atomic_write_bytes, cache_dir

    paths = [Path(p) for p in paths]
    own = Path(lm_eval.__file__).parent / "tasks"
    if not paths or paths[0] != own or not resolve_includes:
        return build(paths, resolve_includes=resolve_includes)
    key = folder_key(own, sorted(own.rglob("*.yaml")), lm_eval.__version__)
    stored = cache_dir() / "task_index" / f"{key}.pickle"
    index = _read(stored)
    if index is None:
        index = build([own])
        try:
            atomic_write_bytes(stored, pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as err:  # a read-only cache costs the next process the build, nothing else
            log.debug("lm-eval-sink: task index not kept (%s)", err)
    for name, entry in build(paths[1:]).items():
        if name in index:
            log.warning(
                "Task '%s' from %s overrides existing task from %s", name, entry.yaml_path, index[name].yaml_path
            )
        index[name] = entry
    return index
