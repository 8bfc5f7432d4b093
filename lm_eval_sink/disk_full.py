"""A write refused for want of room, as one line naming the output (docs/development.md, 'Faults'). Standard library."""

from __future__ import annotations

import contextlib
import errno
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from lm_eval_sink.errors import UserError

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
    """A write refused for want of room, naming the output, about how much it needs and what is free there."""

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
