"""The output-folder mechanism: every command that writes several files writes them into one folder built the same way.

`check_output_dir` refuses it before any work starts (also when it overlaps an input of the command:
`check_not_inputs`, the one rule that keeps outputs off inputs), `staged_dir` holds its `<out>.lock`
(`locks.hold`), tidies what a killed build left (`clean_stale`), builds it in a `<out>.partial-<uuid>` sibling and
renames it when complete. A folder that others reuse (a model, a merge, a sweep unit) also carries a `COMPLETE`
marker (`write_complete`, with the input `key` that made it and an optional `manifest` of its files);
`read_complete` is the one reader, and `read_complete(folder, key)` is resume-by-key: the marker only when it was
made from those inputs. One-file outputs (`-o FILE`) are checked by `check_new_outputs` and held by `new_files`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lm_eval_sink.disk_full import DiskFull, room_for
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json
from lm_eval_sink.locks import hold

COMPLETE = "COMPLETE.json"  # the marker of a finished, reusable output folder
log = logging.getLogger(__name__)


def check_not_inputs(outputs: Iterable[str | Path], *, inputs: Iterable[str | Path | None], option: str) -> None:
    """Refuse an output that is, contains or lies inside an input of the command, with or without `--force`.

    The one rule that keeps a command from destroying or changing what it reads (`--force` would
    swap the folder away and delete it; writing inside a model folder changes its identity). Paths
    are compared resolved, symlinks followed. An input that names no existing path (a hub id, or a
    path the command refuses itself) is skipped: pass a hub model's snapshot folder where the
    command has one. None entries (an option not given) are skipped too.
    """
    found = [(str(i), _real(i)) for i in inputs if i is not None and Path(str(i)).expanduser().exists()]
    for out in outputs:
        o = _real(out)
        for name, i in found:
            how = (
                "is"
                if o == i
                else "lies inside"
                if o.is_relative_to(i)
                else "contains"
                if i.is_relative_to(o)
                else None
            )
            if how:
                raise UserError(
                    f"{option} {out} {how} the input {name}",
                    f"choose {option} outside every input (--force never replaces or writes into an input)",
                )


def _real(path: str | Path) -> Path:
    """The path with `~` expanded and every symlink followed (also for a path that does not exist yet)."""
    return Path(os.path.realpath(Path(str(path)).expanduser()))


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
    """(the folder to blame, why) when no file can be made in `folder`, which is made first when missing; None when
    one can. Checks the deepest folder of its path that exists: a file there, a pseudo-filesystem, a read-only
    filesystem (root included), no write permission. Nothing is written: the one test of an output's place, for
    `check_writable` and the lock (`hold`)."""
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


def check_writable(out: Path, option: str = "--output") -> None:
    """Refuse, before any work, in one line naming `out` and why, an output that cannot be written (`unwritable`):
    a file in its path, a pseudo-filesystem (/proc, /sys), a read-only filesystem, no permission, or a missing parent
    folder that cannot be made for one of these reasons (a parent that can be made is made when the output is
    written). An existing folder `out` must be writable too (commands write into it)."""
    out = Path(out).expanduser()
    parent = out.absolute().parent
    for folder in (parent, out) if out.is_dir() else (parent,):
        found = unwritable(folder)
        if found is not None:
            missing = "" if found[0] == folder or found[1].startswith("is a file") else f"no such folder {parent}, and "
            raise UserError(
                f"{option} {out} cannot be written: {missing}{found[0]} {found[1]}",
                f"choose {option} in a writable folder",
            )


def _refuse_existing(out: Path, force: bool, option: str) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"{option} {out} is a file, not a folder", f"pass a folder path as {option}")
    if out.exists() and not force:
        raise UserError(f"output already exists: {out}", f"pass --force to overwrite, or choose another {option}")


def check_output_dir(out: Path, force: bool, option: str = "--output", *, inputs: Iterable[str | Path | None]) -> None:
    """Refuse, before any work, an output folder that is a file, exists without `force`, or overlaps an input.

    `inputs`: every path the command reads (models, configs, runs, sample logs, plans); see
    `check_not_inputs`. `option` names the folder in the hint.
    """
    out = Path(out)
    check_not_inputs([out], inputs=inputs, option=option)
    _refuse_existing(out, force, option)
    check_writable(out, option)


def check_new_outputs(
    paths: list[Path], force: bool, option: str = "--output", *, inputs: Iterable[str | Path | None]
) -> None:
    """Refuse, before any work, existing outputs without `force` and any output that overlaps an input."""
    check_not_inputs(paths, inputs=inputs, option=option)
    folder = next((p for p in paths if Path(p).is_dir()), None)
    if folder is not None:
        raise UserError(f"{option} {folder} is a folder", f"pass a file path as {option}")
    for path in paths:
        check_writable(path, option)
    existing = [str(p) for p in paths if Path(p).exists()]
    if existing and not force:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise UserError(f"output already exists: {shown}", f"pass --force to overwrite, or choose another {option}")


@contextlib.contextmanager
def new_files(
    paths: list[Path], force: bool, option: str = "--output", *, inputs: Iterable[str | Path | None]
) -> Iterator[None]:
    """One-file outputs (`-o FILE`): `check_new_outputs`, then hold each file's `<file>.lock` while the
    block writes it, so two runs never write one file at once."""
    check_new_outputs(paths, force, option, inputs=inputs)
    with contextlib.ExitStack() as stack:
        for path in paths:
            stack.enter_context(hold(Path(path), sibling=True))
        yield


_STAGING = re.compile(r"(.+)\.(partial|old)-[0-9a-f]{8}")  # staged_dir's siblings of an output named group 1


def clean_stale(out: Path, key: str | None = None) -> list[str]:
    """Tidy the `<out>.partial-*` / `<out>.old-*` siblings an interrupted build left; call it holding `<out>.lock`
    (or the lock of a folder that holds every build of `out`, as a sweep holds its units').

    Every build of `out` takes that lock before it makes a sibling, so while we hold it no live process owns one.
    When `out` itself is missing (a kill between `staged_dir`'s two renames), the newest finished build made
    for `key` (a `.partial-*` whose COMPLETE marker carries it) is promoted, else the newest `.old-*` (the
    previous, complete output) is restored; the rest are deleted. One line per folder promoted, restored or removed.
    """
    if not out.parent.is_dir():
        return []
    kinds = {p: m[2] for p in out.parent.iterdir() if (m := _STAGING.fullmatch(p.name)) and m[1] == out.name}
    stale = sorted(kinds, key=lambda p: p.stat().st_mtime_ns)
    notes = []
    if not out.exists():
        done = [p for p in stale if kinds[p] == "partial" and key is not None and read_complete(p, key) is not None]
        keep = (done or [p for p in stale if kinds[p] == "old"] or [None])[-1]
        if keep is not None:
            os.replace(keep, out)
            stale.remove(keep)
            what = "promoted the finished build" if done else "restored the previous output"
            notes.append(f"{what} {keep.name} to {out}, left by an interrupted run")
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
        notes.append(f"removed {p}, left by an interrupted run")
    return notes


def clean_stale_all(keys: Mapping[Path, str | None]) -> list[str]:
    """`clean_stale` of each output in `keys` with its key, then of every other output with staging siblings in
    their folders (no key); for a caller holding the lock of a folder that holds all of them (a sweep)."""
    notes = [n for out, key in keys.items() for n in clean_stale(Path(out), key)]
    parents = {Path(out).parent for out in keys}
    others = {p.parent / m[1] for d in parents if d.is_dir() for p in d.iterdir() if (m := _STAGING.fullmatch(p.name))}
    return notes + [n for out in sorted(others) for n in clean_stale(out)]


@contextlib.contextmanager
def staged_dir(
    out: Path, force: bool = False, option: str = "--output", key: str | None = None, size: int | None = None
) -> Iterator[Path]:
    """Build a directory in `<out>.partial-<uuid>` and rename it to `out` only on success.

    Holds `<out>.lock` (`hold(out, sibling=True)`) for the block and first tidies what an
    interrupted build of `out` left (`clean_stale`, with `key`). An interrupted build leaves only the
    `.partial-` sibling, never a folder at `out` that looks complete. With `force`, an existing
    `out` is swapped away by rename, then deleted. Refuses a file at `out`, or an existing `out`
    without `force` (call `check_output_dir` first as well, so nothing runs before a refusal).
    A build with a `key` (a folder others reuse) must write its COMPLETE marker with that key in the block.
    A write that fails for want of room is one `DiskFull` line naming `out` and what it needs: `size` (about what
    the build writes) when given, else what was written plus the file that did not fit.
    """
    out = Path(out)
    _refuse_existing(out, force, option)
    with hold(out, sibling=True):
        for note in clean_stale(out, key):
            log.warning("%s", note)
        _refuse_existing(out, force, option)
        tmp = out.with_name(f"{out.name}.partial-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            with room_for(out, size):
                yield tmp
            if key is not None and read_complete(tmp, key) is None:
                raise RuntimeError(f"the build of {out} wrote no COMPLETE marker with its key")
        except DiskFull as e:
            written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            shutil.rmtree(tmp, ignore_errors=True)
            raise (DiskFull(out, size, e.code) if size else e.moved(out, written)) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = None
        if out.exists():
            old = out.with_name(f"{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def manifest(folder: Path, names: Iterable[str]) -> dict[str, int]:
    """Byte size of each named file of `folder`: the optional manifest a COMPLETE marker carries."""
    return {n: (Path(folder) / n).stat().st_size for n in names}


def write_complete(folder: Path, marker: Mapping[str, Any]) -> Path:
    """Write the COMPLETE marker of a staged folder (inside `staged_dir`, before its rename)."""
    return atomic_write_json(Path(folder) / COMPLETE, dict(marker))


def read_complete(folder: Path, key: str | None = None) -> dict[str, Any] | None:
    """The folder's COMPLETE marker; None when absent, unreadable or (with `key`) made from other inputs."""
    try:
        data = json.loads((Path(folder) / COMPLETE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or (key is not None and data.get("key") != key):
        return None
    return data
