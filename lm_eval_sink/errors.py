"""The one exception type for problems the user can fix, and the one warning category.

Library code raises `UserError`; only `cli.py` catches it, prints one line and exits 2.
Any other exception is a bug and keeps its traceback. `SinkWarning` is every warning this
project emits (the test suite turns it into an error).
"""

from __future__ import annotations


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
