"""The one exception type for problems the user can fix (raised anywhere; only cli.py catches it, prints one line
and exits 2: any other exception is a bug and keeps its traceback), and `SinkWarning`, every warning this project
emits (the test suite turns it into an error)."""

from __future__ import annotations

import re
from collections.abc import Iterable


class UserError(Exception):
    """A bad path, value, config or combination, with what to do about it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def line(self) -> str:
        """The single line shown to the user."""
        return self.message if not self.hint else f"{self.message} (fix: {self.hint})"


class SinkWarning(UserWarning):
    """Something the user should know that does not stop the run (a result limited by it, a hook that could not
    register)."""


def one_line(e: Exception) -> str:
    """An exception as the one line a failed unit or task is reported with: a UserError's line, else `Type: msg`."""
    line = e.line() if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
    return (line.splitlines() or [""])[0]


# A Python exception's last line (`AssertionError: ...`, `pkg.mod.SomeError: ...`) or this project's one-line error.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::|$)|^error: ")
_PROGRESS_BAR = re.compile(r"\d+%\||\|\s*\d+/\d+\s*\[")  # tqdm: ` 0%| | 0/2 [00:00<?, ?it/s]`


def failure_line(lines: Iterable[str]) -> str:
    """Why a subprocess failed, from its output: the last exception line it printed, never a progress bar
    (tqdm's `\\r` updates count as lines); without one, its last line that is no progress bar."""
    exception = plain = ""
    for line in lines:
        for part in line.split("\r"):
            text = part.strip()
            if _EXCEPTION_LINE.match(text):
                exception = text
            elif text and not _PROGRESS_BAR.search(text):
                plain = text
    return exception or plain
