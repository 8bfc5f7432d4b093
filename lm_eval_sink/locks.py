"""One writer per output folder: an exclusive, non-blocking OS file lock with a record of its holder (docs/identity.md,
'Locks').
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import errno
import os
import re
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json


_UNKNOWN = "another process"


def _holder(record: Path) -> str:
    try:
        info = json.loads(record.read_text(encoding="utf-8"))
        return f"pid {info['pid']} on {info['host']} since {info['started_utc']} ({' '.join(info['argv'])[:120]})"
    except (OSError, ValueError, KeyError, TypeError):
        return _UNKNOWN


_HELD: dict[Path, int] = {}  # lock file -> pid of this process while it holds it (`hold` is reentrant)


@contextlib.contextmanager
def hold(folder: Path, sibling: bool = False, wait: Callable[[str, float], None] | None = None) -> Iterator[Path]:
    """Hold `<folder>/.lock` (or with `sibling` `<folder>.lock`) for the block, reentrant within a process; refuse with
    one line when another process holds it, or with `wait` wait, calling `wait(holder, seconds waited)` meanwhile."""
    from filelock import FileLock, Timeout

    folder = Path(folder)
    if not sibling and folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file, not a folder", "pass a folder path")
    path = folder.with_name(folder.name + ".lock") if sibling else folder / ".lock"
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
        now = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "argv": sys.argv, "started_utc": now}
        atomic_write_json(record, holder)
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
        holder = _holder(record)
        if waited and holder == _UNKNOWN:  # no record mid-wait: its holder is letting go; take it without a note
            with contextlib.suppress(Timeout):
                lock.acquire(timeout=1.0, poll_interval=0.05)
                return
        wait(holder, waited)
        try:
            lock.acquire(timeout=WAIT_NOTE_S, poll_interval=0.2)
            return
        except Timeout:
            waited = time.monotonic() - start


# Filesystems that hold no files of a user's (Linux): an output there cannot be written whatever the permissions say
# (root may "write" /proc and /sys as far as os.access can tell).
_PSEUDO_FILESYSTEMS = frozenset(
    "proc sysfs devpts cgroup cgroup2 debugfs tracefs securityfs pstore bpf configfs fusectl mqueue binfmt_misc "
    "efivarfs rpc_pipefs nsfs selinuxfs".split()
)


def _filesystem(folder: Path) -> str | None:
    """The type of the filesystem the existing `folder` is on (the last mount over the longest matching mount point in
    /proc/self/mountinfo); None where the system does not say."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(folder), "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # mountinfo escapes ' ' as \040
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, right.split()[0]
    return kind


def unwritable(folder: Path) -> tuple[Path, str] | None:
    """(the folder to blame, why) when no file can be made in `folder`: a file, a pseudo-filesystem, a read-only
    filesystem or no permission at the deepest folder of its path that exists; the one test, writing nothing."""
    folder = Path(folder).expanduser().absolute()
    there = next(p for p in (folder, *folder.parents) if _lexists(p))
    try:
        if not stat.S_ISDIR(os.stat(there).st_mode):
            return there, "is a file, not a folder"
    except OSError as e:  # a link to nothing, or a folder above that may not be searched
        return there, f"cannot be reached ({e.strerror})"
    kind = _filesystem(there)
    if kind in _PSEUDO_FILESYSTEMS:
        return there, f"is on a {kind} pseudo-filesystem, which holds no files"
    if not os.access(there, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return there, "is on a read-only filesystem" if _read_only(there) else "is not writable (permission denied)"
    return None


def _lexists(path: Path) -> bool:
    """Whether `path` names something (a folder we may not search counts as something, to be blamed by name)."""
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        return e.errno != errno.ENOTDIR
    return True


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False
