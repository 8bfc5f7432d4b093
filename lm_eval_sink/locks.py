"""One writer per output folder: an exclusive, non-blocking file lock with a record of its holder.

`hold(folder)` locks `<folder>/.lock` (the folder is created); `hold(folder, sibling=True)` locks
`<folder>.lock` beside it, for folders that are built staged and renamed into place. The holder
writes `<lock>.json` (host, pid, argv, started_utc); a second process gets one line naming the
holder. A folder the lock itself created is removed again if nothing else was written to it.
The lock is the OS's (filelock: flock on POSIX), so a killed holder frees it at once.
Lock files are left out of every tree hash (`identity.SKIPPED_NAMES`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json


def lock_path(folder: Path, sibling: bool = False) -> Path:
    folder = Path(folder)
    return folder.with_name(folder.name + ".lock") if sibling else folder / ".lock"


def _holder(record: Path) -> str:
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
        return f"pid {info['pid']} on {info['host']} since {info['started_utc']} ({' '.join(info['argv'])[:120]})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def hold(folder: Path, sibling: bool = False) -> Iterator[Path]:
    """Hold the lock of `folder` for the block; refuse with one line when another process holds it."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    if not sibling and folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder", "pass a folder path")
    path = lock_path(folder, sibling)
    created = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = path.with_name(path.name + ".json")
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise UserError(
            f"{folder} is in use by {_holder(record)}",
            "wait for that run to finish (or stop it), or choose another output folder",
        ) from None
    try:
        atomic_write_json(
            record,
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "argv": list(sys.argv),
                "started_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            },
        )
        yield path
    finally:
        with contextlib.suppress(OSError):
            record.unlink()
        lock.release()
        if created and {p.name for p in path.parent.iterdir()} <= {path.name}:  # a refused run leaves nothing behind
            with contextlib.suppress(OSError):
                path.unlink()
                path.parent.rmdir()
