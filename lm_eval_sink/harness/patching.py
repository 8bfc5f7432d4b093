"""The one mechanism of every change this project makes to lm-eval: check the target, then patch it or leave it.

lm-eval 0.4.13 has no plugin API for what `discovery.py` and `task.py` need, so they change lm-eval's objects:
`patch` replaces a function by a wrapper, `add_method` gives a model class a method lm-eval does not have, and
`engine_target_problem` checks the one scoped replacement (the resident vLLM engine's `LLM`). Each
checks first that the target is what the change was written for (the parameters a wrapper passes or reads; an
attribute the method reads; no method of that name already), not lm-eval's version, so a compatible release keeps
working; a target that differs is left exactly as installed, with one warning line per process
(`left_as_installed`: a SinkWarning naming lm-eval's version and what to do instead). Every change, its reason and
its check: docs/footguns.md.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

from lm_eval_sink.errors import SinkWarning

log = logging.getLogger(__name__)

_MARK = "_lm_eval_sink_patched"
EXPLICIT_WAY = '--include_path "$(lm-eval-sink tasks-dir)"'  # this project's tasks with no patch at all
_SAID: list[str] = []  # the one line of this process about a patch target left as installed


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


def left_as_installed(label: str, why: str, then: str = "") -> None:
    """One SinkWarning line per process, naming lm-eval's version and what to do (`then`, else the explicit way;
    later ones: debug)."""
    from importlib.metadata import version

    then = then or f"to use this project's tasks, pass {EXPLICIT_WAY}"
    line = (
        f"lm-eval {version('lm_eval')}'s {label} {why}, so lm-eval-sink leaves it as installed "
        f"(lm-eval runs as without this project there); {then}"
    )
    if _SAID:
        log.debug("%s", line)
        return
    _SAID.append(line)
    warnings.warn_explicit(line, SinkWarning, "lm-eval-sink", 0)  # "lm-eval-sink:0: SinkWarning: ...", one line


def patch(
    owner: Any,
    name: str,
    wrap: Any,
    *,
    leading: tuple[str, ...] = (),
    needs: tuple[str, ...] = (),
    more: Any = None,
) -> None:
    """`owner.name` replaced by `wrap(original)` when the original is what the wrapper was written for (`mismatch`,
    and `more()` when given); otherwise left untouched, with one line (`left_as_installed`). Idempotent."""
    original = inspect.getattr_static(owner, name)
    static = isinstance(original, staticmethod)
    original = original.__func__ if static else original
    if getattr(original, _MARK, False):
        return
    why = mismatch(original, leading, needs) or (more() if more else None)
    if why:
        where = f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type) else owner.__name__
        left_as_installed(f"{where}.{name}", why)
        return
    wrapper = wrap(original)
    setattr(wrapper, _MARK, True)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def add_method(owner: type, name: str, method: Any, *, needs: tuple[str, ...] = (), more: Any = None) -> bool:
    """`owner.name = method`, a method lm-eval does not have, when `owner` has no `name` of its own or inherited (a
    release that defines one keeps it) and has every attribute in `needs` (what `method` reads), and `more()` finds
    nothing amiss; otherwise left untouched, with one line (`left_as_installed`). Idempotent; whether it is there."""
    if getattr(owner.__dict__.get(name), _MARK, False):
        return True
    absent = object()
    present = inspect.getattr_static(owner, name, absent)
    present = absent if getattr(present, _MARK, False) else present  # this project's, inherited from a base class
    missing = [n for n in needs if inspect.getattr_static(owner, n, absent) is absent]
    why = (
        (f"already has {name} ({getattr(present, '__qualname__', present)})" if present is not absent else None)
        or (f"has no {', '.join(missing)}" if missing else None)
        or (more() if more else None)
    )
    if why:
        label = f"{owner.__module__}.{owner.__qualname__}"
        left_as_installed(label, why, f"the {name} task refuses to run there (measure S with lm-eval-sink strength)")
        return False
    setattr(method, _MARK, True)
    setattr(owner, name, method)
    return True


def engine_target_problem(module: Any) -> str | None:
    """Why the resident engine (`ResidentEngine.serving`) cannot replace the `LLM(...)` that lm-eval's vLLM model
    builds (None when it can): `module` must hold `LLM`, and its `VLLM.__init__` must call that module global (what
    `serving` swaps), not another name for vLLM's class, which would build a new engine per checkpoint unseen."""
    import dis

    if inspect.getattr_static(module, "LLM", None) is None:
        return "has no LLM"
    code = getattr(inspect.getattr_static(getattr(module, "VLLM", None), "__init__", None), "__code__", None)
    if code is None or not any(i.opname == "LOAD_GLOBAL" and i.argval == "LLM" for i in dis.get_instructions(code)):
        return "builds its engine in VLLM.__init__ through no module global LLM"
    return None
