"""The one table helper: Markdown and CSV text of a table given as a header and rows of cells, shown as given
(callers format numbers; text is not escaped: the tables are read in a terminal as often as rendered). CSV is the
csv module's dialect with `\\n` line ends. Pure: returns text."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence


def markdown_lines(head: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: header, `|---|` rule, one line per row."""

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return [line(head), "|" + "---|" * len(head)] + [line(r) for r in rows]


def markdown_table(head: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table as text, ending in a newline."""
    return "\n".join(markdown_lines(head, rows)) + "\n"


def csv_text(head: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """A CSV table as text: the header, then one record per row."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(head)
    writer.writerows(rows)
    return buf.getvalue()


def first_few(names: Sequence[str], n: int) -> str:
    """The first `n` names, comma-separated, then "and K more" for the rest (messages naming many things)."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")
