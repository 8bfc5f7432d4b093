"""The one schema layer: frozen pydantic models for input files, and `parse()`, which turns the first pydantic error
into one `UserError` line naming the file and the key path (docs/development.md, 'Input files').
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Iterable
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from lm_eval_sink.errors import UserError

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """Base of every input-file schema; `what` names an entry in messages ("score", "the eval section")."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    what: ClassVar[str] = "the entry"


def did_you_mean(word: str, options: Iterable[str], cutoff: float = 0.6) -> str:
    """' (did you mean 'x'?)' naming the closest option, or an empty string: the one did-you-mean."""
    near = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=cutoff)
    return f" (did you mean {near[0]!r}?)" if near else ""


def key_path(loc: Iterable[Any]) -> str:
    """A pydantic location as a key path: ('scores', 2, 'value') -> 'scores[2].value'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _unwrap(ann: Any) -> list[Any]:
    """The alternatives of an annotation, without Optional / Annotated wrappers."""
    if typing.get_origin(ann) is typing.Annotated:
        return _unwrap(typing.get_args(ann)[0])
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(ann) for a in _unwrap(arg) if a is not type(None)]
    return [ann]


def _field(model: type[BaseModel], key: Any) -> Any:
    """The field of `model` that `key` names (by name or alias); None for another key or a list index."""
    return next((f for n, f in model.model_fields.items() if key in (n, f.alias)), None)


def _walk(model: type[BaseModel], loc: Iterable[Any]) -> tuple[tuple[Any, ...], list[Any]]:
    """How far `loc` follows fields, dict values and list items, and the annotations reached there."""
    anns: list[Any] = [model]
    followed: list[Any] = []
    for part in loc:
        nxt: list[Any] = []
        for ann in anns:
            for a in _unwrap(ann):
                if isinstance(a, type) and issubclass(a, BaseModel):
                    field = _field(a, part)
                    if field is not None:
                        nxt.append(field.annotation)
                elif typing.get_origin(a) is dict and isinstance(part, str):
                    nxt.append(typing.get_args(a)[1])
                elif typing.get_origin(a) in (list, tuple) and isinstance(part, int):
                    nxt.append(typing.get_args(a)[0])
        if not nxt:
            break
        followed.append(part)
        anns = nxt
    return tuple(followed), anns


def model_at(model: type[BaseModel], loc: Iterable[Any]) -> type[BaseModel] | None:
    """The schema that describes the node at `loc` (None past a scalar or an unknown key)."""
    loc = tuple(loc)
    followed, anns = _walk(model, loc)
    if len(followed) < len(loc):
        return None
    return next((a for ann in anns for a in _unwrap(ann) if isinstance(a, type) and issubclass(a, BaseModel)), None)


_EXPECT = {  # pydantic's error types -> what the value must be, in a user's words
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "a number"),
    **dict.fromkeys(("finite_number",), "a finite number"),
    **dict.fromkeys(("string_type",), "a string"),
    **dict.fromkeys(("list_type", "tuple_type"), "a list"),
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "a mapping"),
}


def _expectation(err: dict[str, Any]) -> str:
    if err["type"] == "literal_error":
        return f"one of {err['ctx']['expected']}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if err["type"] in bounds:
        return f"a value {bounds[err['type']]} {next(iter(err['ctx'].values()))}"
    if err["type"] == "too_short":
        return f"at least {err['ctx']['min_length']} item(s)"
    if err["type"] in _EXPECT:
        return _EXPECT[err["type"]]
    msg = str(err["msg"]).removeprefix("Value error, ")
    return msg[:1].lower() + msg[1:]


def _description(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[str, str] | None:
    """(key, what it expects) when the innermost field on `loc` that says what it expects does."""
    for end in range(len(loc), 0, -1):
        owner, key = model_at(model, loc[: end - 1]), loc[end - 1]
        field = _field(owner, key) if owner else None
        if field is not None:
            return (key, field.description) if field.description else None
    return None


def _got(value: Any) -> str:
    return f"a {type(value).__name__}" if isinstance(value, (dict, list)) else repr(value)


def _at(where: str, loc: tuple[Any, ...]) -> str:
    return f"{where}: {key_path(loc)}" if loc else where


def user_error(exc: ValidationError, model: type[BaseModel], where: str) -> UserError:
    """The first problem of a ValidationError as one line '<where>: <key path>: <what is wrong>'."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    loc = tuple(err["loc"])
    owner = model_at(model, loc[:-1])  # the entry holding the key an unknown or missing key error names
    what = owner.what if owner else "the entry"
    if err["type"] == "extra_forbidden":
        allowed = [f.alias or n for n, f in owner.model_fields.items()] if owner else []
        return UserError(
            f"{_at(where, loc[:-1])}: {what} has unknown key {loc[-1]!r}{did_you_mean(str(loc[-1]), allowed)}",
            f"allowed keys: {', '.join(allowed)}",
        )
    if err["type"] == "missing":
        keys = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and tuple(e["loc"][:-1]) == loc[:-1]]
        needed = [f.alias or n for n, f in owner.model_fields.items() if f.is_required()] if owner else keys
        return UserError(
            f"{_at(where, loc)}: missing key(s) {', '.join(keys)} ({what} lacks {keys[0]!r})",
            f"every {what.removeprefix('the ')} needs {', '.join(needed)}",
        )
    if loc[-1] == "[key]":  # a mapping's key outside its Literal: an unknown key, as for an entry's
        allowed = re.findall(r"'([^']*)'", err["ctx"]["expected"]) if err["type"] == "literal_error" else []
        return UserError(
            f"{_at(where, loc[:-2])}: unknown key {loc[-2]!r}{did_you_mean(str(loc[-2]), allowed)}",
            f"allowed keys: {', '.join(allowed)}",
        )
    loc = _walk(model, loc)[0]  # without pydantic's union-member tags
    owner = model_at(model, loc[:-1]) if loc else None
    said = f" ({owner.what} has {loc[-1]} {_got(err['input'])})" if owner and loc and isinstance(loc[-1], str) else ""
    described = _description(model, loc)
    if described:
        return UserError(
            f"{_at(where, loc)}: {described[0]} {described[1]}, got {_got(err['input'])}",
            f"see the {described[0]} key's format",
        )
    expected = _expectation(err)
    if err["type"] == "literal_error" and isinstance(err["input"], str):
        said += did_you_mean(err["input"], re.findall(r"'([^']*)'", err["ctx"]["expected"]))
    return UserError(
        f"{_at(where, loc)}: expected {expected}, got {_got(err['input'])}{said}",
        f"set {key_path(loc) or 'it'} to {expected}",
    )


def parse(model: type[M], data: Any, where: str) -> M:
    """`data` (from YAML or JSON) validated against `model`; any problem is one UserError line."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise user_error(e, model, where) from None
