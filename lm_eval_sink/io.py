"""Reading and writing files: atomic writes, canonical JSON, hashes, and the readers of a user's text, JSON and JSONL
that name the file and line of what is wrong (docs/development.md, 'Faults'). Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_eval_sink.disk_full import room_for
from lm_eval_sink.errors import UserError


def canonical_json(obj: Any) -> str:
    """Sorted keys, no NaN, two-space indent, trailing newline: byte-identical on rerun."""
    return json.dumps(obj, sort_keys=True, allow_nan=False, indent=2, ensure_ascii=False) + "\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return sha256_bytes(text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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


def parse_json(text: str, where: str, hint: str, line: int | None = None) -> Any:
    """JSON text -> data; what does not parse (a syntax error, nesting past Python's recursion, an integer longer than
    it converts) is a UserError naming `where` and the line (`line`: that of a JSONL file's line `text`)."""
    at = f"{where}:{line}" if line else where
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}:{line or e.lineno}: not valid JSON ({e.msg})", hint) from None
    except ValueError as e:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise UserError(f"{at}: not valid JSON ({str(e).split(':')[0]})", hint) from None
    except RecursionError:
        raise UserError(f"{at}: not valid JSON (nested too deeply to read)", hint) from None


def json_lines(text: str, where: str, hint: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of JSONL text, each read by `parse_json`."""
    return ((n, parse_json(line, where, hint, n)) for n, line in enumerate(text.split("\n"), 1) if line.strip())


def read_json(path: Path) -> Any:
    """Read a JSON file; a missing, undecodable or malformed file is a UserError naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file", "check the path")
    return parse_json(read_text(path), str(path), "pass a JSON file written by lm-eval or lm-eval-sink")


def saved_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, read leniently (one this project wrote earlier, or an optional file): None when
    missing, unreadable, malformed (an integer past 4,300 digits, nested too deep) or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


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
