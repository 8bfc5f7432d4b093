"""The output-folder mechanism: refused before any work, built staged under its lock, tidied after a kill, marked
`COMPLETE` (docs/identity.md, 'Locks', 'Outputs never touch inputs', 'Recovery'; docs/development.md, 'Outputs').
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lm_eval_sink.disk_full import DiskFull, room_for
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json, saved_object
from lm_eval_sink.locks import hold, unwritable
from lm_eval_sink.tables import first_few

COMPLETE = "COMPLETE.json"  # the marker of a finished, reusable output folder
FAILED_FILE = "FAILED.json"  # the marker of an extract or inject folder whose verification failed
REPORT_FILES = {"extract": "extraction.json", "inject": "injection.json"}  # the report each of them writes
log = logging.getLogger(__name__)


def check_not_inputs(outputs: Iterable[str | Path], *, inputs: Iterable[str | Path | None], option: str) -> None:
    """Refuse an output that is, contains or lies inside an input of the command, with or without `--force`: paths
    compared resolved; an input naming no existing path (a hub id: pass its snapshot folder) or None is skipped."""
    found = [(str(i), _real(i)) for i in inputs if i is not None and Path(str(i)).expanduser().exists()]
    for out in outputs:
        o = _real(out)
        for name, i in found:
            if o.is_relative_to(i) or i.is_relative_to(o):  # the same path, or one inside the other
                how = "is" if o == i else "lies inside" if o.is_relative_to(i) else "contains"
                raise UserError(
                    f"{option} {out} {how} the input {name}",
                    f"choose {option} outside every input (--force never replaces or writes into an input)",
                )


def _real(path: str | Path) -> Path:
    """The path with `~` expanded and every symlink followed (also for a path that does not exist yet)."""
    return Path(os.path.realpath(Path(str(path)).expanduser()))


def check_writable(out: Path, option: str = "--output") -> None:
    """Refuse, before any work, in one line naming `out` and why, an output whose folder cannot be written
    (`unwritable`); an existing folder `out` must be writable too (commands write into it)."""
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
    """Refuse, before any work, an output folder that is a file, exists without `force`, overlaps an input (every
    path the command reads: `check_not_inputs`) or cannot be written; `option` names it in the hint."""
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
        shown = first_few(existing, 3)
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
    """Tidy the `<out>.partial-*` / `<out>.old-*` siblings an interrupted build left (docs/identity.md, 'Recovery'),
    holding `<out>.lock` or a lock over every build of `out`; one line per folder promoted, restored or removed."""
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
def staged_dir(out: Path, force: bool = False, key: str | None = None, size: int | None = None) -> Iterator[Path]:
    """Build `<out>.partial-<uuid>` under `<out>.lock`, renamed to `out` only on success (docs/identity.md, 'Recovery');
    a build with a `key` must write its COMPLETE marker with it; a full disk is one `DiskFull` line naming `out`."""
    out = Path(out)
    _refuse_existing(out, force, "--output")
    with hold(out, sibling=True):
        for note in clean_stale(out, key):
            log.warning("%s", note)
        _refuse_existing(out, force, "--output")
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
            raise DiskFull(out, size or (e.needed or 0) + written or None, e.code) from None  # for `out`, not the temp
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
    data = saved_object(Path(folder) / COMPLETE)
    return None if data is None or (key is not None and data.get("key") != key) else data
