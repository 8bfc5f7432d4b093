"""One writer per output folder: an exclusive, non-blocking file lock with a record of its holder.

`hold(folder)` locks `<folder>/.lock` (the folder is created); `hold(folder, sibling=True)` locks
`<folder>.lock` beside it, for folders that are built staged and renamed (`io.staged_dir` takes
that one itself). The holder writes `<lock>.json` (host, pid, argv, started_utc); a second
process gets one line naming the holder. The lock file and its record are removed on release, and
a folder the lock itself created is removed again if nothing else was written to it. The lock is
the OS's (filelock: flock on POSIX), so a killed holder frees it at once (its lock file stays until
the next holder takes it over and releases it). Reentrant within a process. Lock files are left
out of every tree hash (`identity.SKIPPED_NAMES`). The implementation lives in io.py beside `staged_dir`, which needs
it (io.py is the one output-folder mechanism); this module is its public name.
"""

from lm_eval_sink.io import hold, lock_path

__all__ = ["hold", "lock_path"]
