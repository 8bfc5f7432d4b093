"""One writer per output folder: an exclusive, non-blocking file lock with a record of its holder.

`hold(folder)` locks `<folder>/.lock` (the folder is created); `hold(folder, sibling=True)` locks
`<folder>.lock` beside it, for folders that are built staged and renamed (`outputs.staged_dir` takes
that one itself). The holder writes `<lock>.json` (host, pid, argv, started_utc); a second
process gets one line naming the holder. The lock file and its record are removed on release, and
a folder the lock itself created is removed again if nothing else was written to it. The lock is
the OS's (filelock: flock on POSIX), so a killed holder frees it at once (its lock file stays until
the next holder takes it over and releases it). Reentrant within a process. Lock files are left
out of every tree hash (`identity.SKIPPED_NAMES`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


_HELD: dict[Path, int] = {}  # lock file -> pid of this process while it holds it (`hold` is reentrant)


@contextlib.contextmanager
def hold(folder: Path, sibling: bool = False, wait: Callable[[str, float], None] | None = None) -> Iterator[Path]:
    """Hold the lock of `folder` for the block; refuse with one line when another process holds it, or with `wait`
    wait until it lets go, calling `wait(holder, seconds waited)` at once and every `WAIT_NOTE_S` (its progress).

    `<folder>/.lock` (the folder is created), or with `sibling` `<folder>.lock` beside it, for a
    folder built staged and renamed. Reentrant within a process (an outer holder keeps it). The
    lock file and its record are removed on release, so a finished run leaves no lock file.
    """
    from filelock import FileLock, Timeout

    from lm_eval_sink.outputs import unwritable

    folder = Path(folder)
    if not sibling and folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder", "pass a folder path")
    path = lock_path(folder, sibling)
    if _HELD.get(path.absolute()) == os.getpid():
        yield path
        return
    found = unwritable(path.parent)  # else filelock reports a lock it cannot make as one held by another process
    if found is not None:
        raise UserError(f"{folder} cannot be written: {found[0]} {found[1]}", "choose an output in a writable folder")
    created = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = path.with_name(path.name + ".json")
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        if wait is None:
            raise UserError(
                f"{folder} is in use by {_holder(record)}",
                "wait for that run to finish (or stop it), or choose another output folder",
            ) from None
        _wait_for(lock, record, wait)
    _HELD[path.absolute()] = os.getpid()
    try:
        atomic_write_json(record, _holder_record())
        yield path
    finally:
        _HELD.pop(path.absolute(), None)
        record.unlink(missing_ok=True)
        path.unlink(missing_ok=True)  # while held: a peer that opened this inode finds it unlinked; filelock refuses it
        lock.release()
        if created:  # a refused run leaves nothing behind (rmdir removes only an empty folder)
            with contextlib.suppress(OSError):
                path.parent.rmdir()


WAIT_NOTE_S = 15.0  # while `hold(wait=)` waits: how often it says it still does


def _wait_for(lock: Any, record: Path, wait: Callable[[str, float], None]) -> None:
    """Take `lock` once its holder lets go (a killed holder's lock goes with it), calling `wait` at once and every
    `WAIT_NOTE_S` with the holder and the seconds waited."""
    from filelock import Timeout

    start, waited = time.monotonic(), 0.0
    while True:
        wait(_holder(record), waited)
        try:
            lock.acquire(timeout=WAIT_NOTE_S, poll_interval=0.2)
            return
        except Timeout:
            waited = time.monotonic() - start


def _holder_record() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "argv": list(sys.argv),
        "started_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
