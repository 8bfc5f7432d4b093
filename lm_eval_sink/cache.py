"""The project cache: where it is, and the check that nobody but this user can change what it holds (docs/footguns.md,
'The project cache is private to its user'). Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from lm_eval_sink.errors import UserError

CACHE_ENV = "LM_EVAL_SINK_CACHE"


def cache_dir() -> Path:
    """$LM_EVAL_SINK_CACHE, else ~/.cache/lm_eval_sink: created 0700, refused in one line when another user could
    change it (`private_problem`); a folder that cannot be made is returned as is (writes fail and cost a rebuild)."""
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
    """Why another user could change what `folder` holds (None when nobody but this user and root can): the folder,
    and every folder holding an entry on its path (`_holders`), checked as docs/footguns.md says."""
    if not hasattr(os, "geteuid"):  # no POSIX owners (Windows): nothing to check
        return None
    me = os.geteuid()
    st = os.stat(folder)
    if st.st_uid != me:
        return f"is owned by another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"is writable by {_who(st.st_mode)} (mode {st.st_mode & 0o777:o})"
    for parent in _holders(Path(folder)):
        pst = os.stat(parent)
        if pst.st_uid not in (me, 0):
            return f"is in {parent}, owned by another user (uid {pst.st_uid}), who can rename it"
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return f"is in {parent}, which {_who(pst.st_mode)} can write (mode {pst.st_mode & 0o777:o}, no sticky bit)"
    return None


def _holders(path: Path, depth: int = 0) -> list[Path]:
    """The folders holding an entry on the way to `path`: those above it as given, and for each symlink on it those
    on the way to its target (a link's folder decides where the link points)."""
    path = Path(os.path.abspath(path))
    found = list(path.parents)
    for entry in (*reversed(path.parents), path):
        if depth < 40 and entry.is_symlink():  # 40: the kernel's limit on links followed in one lookup
            found += _holders(entry.parent / os.readlink(entry), depth + 1)
    return sorted(set(found))


def _who(mode: int) -> str:
    return "others" if mode & 0o002 else "its group"


def read_private_text(path: Path) -> str:
    """The text of a file in the project cache, when this user owns it and nobody else can write it; else
    PermissionError, which every reader treats as absent (the content is built again and replaced)."""
    with open(path, encoding="utf-8") as f:
        st = os.fstat(f.fileno())
        if hasattr(os, "geteuid") and (st.st_uid != os.geteuid() or st.st_mode & 0o022):
            raise PermissionError(f"{path}: owned by uid {st.st_uid}, mode {st.st_mode & 0o777:o}; not trusted")
        return f.read()
