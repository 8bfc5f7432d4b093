"""Results keyed by the code that made them: `{package path: xxh3-128}` of every project file on a result's path
(docs/identity.md, 'How `code` is found'). This module names no module of the package itself, so that it adds nothing
to a closure. Standard library + xxhash.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path

import xxhash

from lm_eval_sink.tables import first_few

PACKAGE = "lm_eval_sink"
_HERE = Path(__file__).resolve().parent  # this interpreter's lm_eval_sink folder
_NAME = re.compile(r"\blm_eval_sink(?:\.\w+)*")
_FROM = re.compile(r"\bfrom\s+(lm_eval_sink(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n]*)")
_DATA = re.compile(r"""["'](data/[\w.-]+)["']""")
_FOLDER = re.compile(r"""files\(\s*["'](lm_eval_sink\.[\w.]+)["']\s*\)""")  # resources.files of a subpackage
_SHOWN = 4  # changed files named in a message; the rest are counted

# path -> (stat signature, hash, names of modules or data files the file refers to)
_seen: dict[Path, tuple[tuple[int, ...], str, tuple[str, ...]]] = {}


def _read(path: Path) -> tuple[str, tuple[str, ...]]:
    """The file's hash and what it refers to, from this process's cache while its stat is unchanged."""
    st = os.stat(path)
    sig = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    cached = _seen.get(path)
    if cached is not None and cached[0] == sig:
        return cached[1], cached[2]
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    refs = {*_NAME.findall(text), *(f"{p}.{n}" for p, names in _FROM.findall(text) for n in _imported(names))}
    refs |= {f"{PACKAGE}/{d}" for d in _DATA.findall(text)} | {f"{f}/" for f in _FOLDER.findall(text)}
    _seen[path] = (sig, xxhash.xxh3_128_hexdigest(data), tuple(sorted(refs)))
    return _seen[path][1], _seen[path][2]


def _imported(names: str) -> list[str]:
    """The names of a `from X import (a, b as c)` clause (comments dropped)."""
    return [n.split()[0] for n in re.sub(r"#[^\n]*", "", names).strip("()").split(",") if n.strip()]


def _module_file(name: str) -> Path | None:
    """The source file of module `name` of this package in this interpreter (None: not one of its modules)."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    base = _HERE.joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _resolve(ref: str) -> tuple[tuple[str, Path], ...]:
    """A reference as (package path, file) pairs: a data file, or the longest dotted prefix that is a module, with
    the packages above it (their `__init__` runs on import). Which files exist is read once per process."""
    if ref.endswith("/"):  # a package folder read as data: every file in it
        try:
            folder = Path(str(resources.files(ref[:-1])))
        except ModuleNotFoundError:  # named in text that is not an import
            return ()
        named = ref[:-1].replace(".", "/")
        files = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        return tuple((f"{named}/{p.relative_to(folder).as_posix()}", p) for p in files)
    if "/" in ref:
        path = _HERE / ref.removeprefix(f"{PACKAGE}/")
        return ((ref, path),) if path.is_file() else ()
    parts = ref.split(".")
    while parts and _module_file(".".join(parts)) is None:
        parts.pop()
    found = []
    for i in range(1, len(parts) + 1):
        path = _module_file(".".join(parts[:i]))
        if path is not None:
            found.append((f"{PACKAGE}/{path.relative_to(_HERE).as_posix()}", path))
    return tuple(found)


def source_hashes(roots: Iterable[str]) -> dict[str, str]:
    """`{package path: xxh3-128}` of the modules `roots` (dotted names) can import, transitively, and of the data
    they read; a root that names no module of this package raises ValueError (docs/identity.md says why)."""
    roots = tuple(roots)
    missing = [root for root in roots if _module_file(root) is None]
    if missing:
        raise ValueError(f"code_key roots that name no module of {PACKAGE}: {', '.join(missing)}")
    todo = [item for root in roots for item in _resolve(root)]
    out: dict[str, str] = {}
    while todo:
        name, path = todo.pop()
        if name in out:
            continue
        out[name], refs = _read(path)
        if name.endswith((".py", ".yaml")):
            todo += [item for ref in refs for item in _resolve(ref) if item[0] not in out]
    return dict(sorted(out.items()))


def changed_files(old: Mapping[str, str], new: Mapping[str, str]) -> str:
    """The files whose hash differs between two `{path: hash}` records, e.g. `lm_eval_sink/capture.py, ... (new)`."""
    names = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
    return first_few([n + (" (new)" if n not in old else " (gone)" if n not in new else "") for n in names], _SHOWN)
