"""The one mechanism of every change this project makes to lm-eval: declare what it relies on, check, patch or leave.

Each change (`patch`, `add_method`) declares the parameters, attributes and methods it relies on, all checked before
it arms (not lm-eval's version); a target that differs is left as installed with one line (`left_as_installed`).
Every change, its reason, its check: docs/footguns.md.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from typing import Any

from lm_eval_sink.errors import SinkWarning, UserError

log = logging.getLogger(__name__)

_MARK = "_lm_eval_sink_patched"
EXPLICIT_WAY = '--include_path "$(lm-eval-sink tasks-dir)"'  # this project's tasks with no patch at all
TESTED = ("0.4.13", "0.5.0.dev2")  # the lm-eval versions the hook arms on (make test, make test-next)
HOOK_PARTS = (
    "the sink_strength tasks without a flag, the LM_EVAL_SINK_DATA offline data, S measured first under other "
    "backends, the checks before any request, the results-table lines and one-line errors"
)
_SAID: set[str] = set()  # the targets this process has warned about (one line each)
HANDED_BACK = object()  # what `attempt` returns when lm-eval's own function takes the call
Reads = tuple[tuple[Any, str], ...]


def mismatch(target: Any, leading: tuple[str, ...] = (), needs: tuple[str, ...] = ()) -> str | None:
    """Why `target` is not the function a wrapper was written for (None when it is): its parameters must begin
    with `leading` (what the wrapper passes by position) and hold `needs` (what it reads or passes by name)."""
    try:
        names = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # not a callable, or one without a signature
        return f"is {type(target).__name__}, not a function with a signature"
    if names[: len(leading)] != list(leading):
        return f"takes ({', '.join(names)}), not ({', '.join(leading)}, ...)"
    missing = [n for n in needs if n not in names]
    return f"takes ({', '.join(names)}), without {', '.join(missing)}" if missing else None


def read_name(owner: Any, names: str) -> str | None:
    """The first of `names` ("a|b") that `owner` has (attribute, property, method or dataclass field), running none."""
    import dataclasses

    absent = object()
    fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    return next(
        (n for n in names.split("|") if n in fields or inspect.getattr_static(owner, n, absent) is not absent), None
    )


def reads_mismatch(reads: Reads) -> str | None:
    """Why lm-eval's objects lack an attribute or method a change reads (None when they have them all)."""
    missing = [f"{_where(owner)}.{names}" for owner, names in reads if read_name(owner, names) is None]
    return f"reads {', '.join(missing)}, which this lm-eval does not have" if missing else None


def _where(owner: Any) -> str:
    return f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__


def _say(label: str, line: str) -> None:
    """One SinkWarning line per `label` and process (later ones: debug)."""
    if label in _SAID:
        log.debug("%s", line)
        return
    _SAID.add(label)
    warnings.warn_explicit(line, SinkWarning, "lm-eval-sink", 0)  # "lm-eval-sink:0: SinkWarning: ...", one line


def left_as_installed(label: str, why: str, then: str = "") -> None:
    """The one line of a target left as installed: it, lm-eval's version, what to do (`then`, else the explicit way)."""
    from importlib.metadata import version

    then = then or f"to use this project's tasks, pass {EXPLICIT_WAY}"
    _say(
        label,
        f"lm-eval {version('lm_eval')}'s {label} {why}, so lm-eval-sink leaves it as installed "
        f"(lm-eval runs as without this project there); {then}",
    )


def stands_aside() -> bool:
    """Whether the installed lm-eval is outside `TESTED`: then the start-up hook changes nothing, said in one line."""
    import lm_eval

    found = getattr(lm_eval, "__version__", "unknown")
    if found in TESTED:
        return False
    _say(
        "version",
        f"lm-eval {found} is not a version lm-eval-sink was tested with ({', '.join(TESTED)}), so its start-up hook "
        f"stands aside: {HOOK_PARTS}; lm-eval runs as without this project; to use this project's tasks, pass "
        f"{EXPLICIT_WAY}",
    )
    return True


def attempt(label: str, work: Callable[[], Any], ours: Callable[[], bool]) -> Any:
    """`work()`, a wrapper's own part; `HANDED_BACK` (lm-eval's own function takes the call, one line) when it fails
    unexpectedly and the call holds none of this project's tasks (`ours()`). A UserError always propagates."""
    try:
        return work()
    except UserError:
        raise
    except Exception as err:
        try:
            mine = ours()
        except Exception:  # cannot tell: the call goes to lm-eval as it ships
            mine = False
        if mine:
            raise
        _say(f"{label} run", f"lm-eval-sink's {label} met {type(err).__name__}: {err}; lm-eval's own takes the call")
        return HANDED_BACK


def patch(
    owner: Any,
    name: str,
    wrap: Any,
    *,
    leading: tuple[str, ...] = (),
    needs: tuple[str, ...] = (),
    reads: Reads = (),
    more: Any = None,
) -> None:
    """`owner.name` replaced by `wrap(original)` when everything the wrapper relies on is there (`mismatch`,
    `reads_mismatch`, `more()` when given), else left untouched with one line (`left_as_installed`); idempotent."""
    original = inspect.getattr_static(owner, name)
    static = isinstance(original, staticmethod)
    original = original.__func__ if static else original
    if getattr(original, _MARK, False):
        return
    why = mismatch(original, leading, needs) or reads_mismatch(reads) or (more() if more else None)
    if why:
        left_as_installed(f"{_where(owner)}.{name}", why)
        return
    wrapper = wrap(original)
    setattr(wrapper, _MARK, True)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def add_method(owner: type, name: str, method: Any, *, reads: tuple[str, ...] = (), more: Any = None) -> bool:
    """`owner.name = method`, a method lm-eval does not have, when `owner` has no `name` of its own or inherited (a
    release that defines one keeps it) and has every attribute in `reads` (what `method` reads), and `more()` finds
    nothing amiss; otherwise left untouched, with one line (`left_as_installed`). Idempotent; whether it is there."""
    if getattr(owner.__dict__.get(name), _MARK, False):
        return True
    absent = object()
    present = inspect.getattr_static(owner, name, absent)
    present = absent if getattr(present, _MARK, False) else present  # this project's, inherited from a base class
    why = (
        (f"is lm-eval's own ({getattr(present, '__qualname__', present)})" if present is not absent else None)
        or reads_mismatch(tuple((owner, n) for n in reads))
        or (more() if more else None)
    )
    if why:
        then = f"the {name} task refuses to run there (measure S with lm-eval-sink strength)"
        left_as_installed(f"{_where(owner)}.{name}", why, then)
        return False
    setattr(method, _MARK, True)
    setattr(owner, name, method)
    return True


def engine_target_problem(module: Any, sets: tuple[str, ...] = ()) -> str | None:
    """Why `module`'s `VLLM.__init__` (read from its bytecode) does not build its engine through the module global
    `LLM` (what `engine_strength.engine_builder` swaps), or sets no attribute of `sets`; None when it does both."""
    import dis

    if inspect.getattr_static(module, "LLM", None) is None:
        return "has no LLM"
    code = getattr(inspect.getattr_static(getattr(module, "VLLM", None), "__init__", None), "__code__", None)
    found = {(i.opname, i.argval) for i in dis.get_instructions(code)} if code is not None else set()
    if ("LOAD_GLOBAL", "LLM") not in found:
        return "builds its engine in VLLM.__init__ through no module global LLM"
    missing = [name for name in sets if ("STORE_ATTR", name) not in found]
    return f"VLLM.__init__ sets no {', '.join(missing)}" if missing else None
