"""Glue that makes lm-eval 0.4.13 find this project's tasks with no flag (called by `hooks.py`).

- `patch_task_manager`: every `TaskManager` built with lm-eval's defaults also indexes
  `tasks_dir()` (the `sink_strength` tasks) and, with `LM_EVAL_SINK_DATA` set, points the covered stock tasks at
  local files
  (`offline.py`). `include_defaults=False` keeps lm-eval's contract (only the given include
  paths). Explicit form without the hook: `--include_path "$(lm-eval-sink tasks-dir)"`.
- `patch_evaluator`: a `sink_strength` task on a backend without attention access (vllm, API
  models, dummy) is refused before any request runs, and one asked of a flash attention
  implementation (`--model_args attn_implementation=flash_attention_2`) before the model loads.
- `patch_cli`: under the `lm_eval` console script, this project's `UserError`s print one line
  (`error: ...`) and exit 2 instead of a traceback.
Each patch is idempotent and keeps lm-eval's own behaviour for everything else.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError

log = logging.getLogger(__name__)
_MARK = "_lm_eval_sink_patched"


def tasks_dir() -> Path:
    """The folder of this project's lm-eval task YAMLs (installed as package data)."""
    return Path(str(resources.files("lm_eval_sink.tasks")))


class UnsupportedBackend(UserError, ValueError):
    """A sink_strength task was asked of a model backend that exposes no attention."""


def _apply_offline_overrides(manager: Any) -> None:
    from lm_eval.tasks._index import Entry, Kind

    from lm_eval_sink.harness.offline import data_root, write_overrides

    root = data_root()
    if root is None:
        return
    candidates = {
        name: (entry.cfg, Path(entry.yaml_path))
        for name, entry in manager._index.items()
        if entry.kind == Kind.TASK and entry.cfg and entry.yaml_path and "dataset_path" in entry.cfg
    }
    for name, path in write_overrides(candidates, root).items():
        old = manager._index[name]
        manager._index[name] = Entry(name=name, kind=old.kind, yaml_path=path, cfg=old.cfg, tags=old.tags)
    log.debug("lm-eval-sink: offline data from %s", root)


def patch_task_manager() -> None:
    from lm_eval.tasks.manager import TaskManager

    if getattr(TaskManager.__init__, _MARK, False):
        return
    original = TaskManager.__init__

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if not bound.arguments["include_defaults"]:  # lm-eval's contract: only the given include paths
            original(*bound.args, **bound.kwargs)
            return
        include_path = bound.arguments["include_path"]
        ours = str(tasks_dir())
        paths = (
            []
            if include_path is None
            else list(include_path)
            if isinstance(include_path, (list, tuple))
            else [include_path]
        )
        if ours not in {str(p) for p in paths}:
            paths.insert(0, ours)  # user paths come later, so they can still shadow ours
        bound.arguments["include_path"] = paths
        original(*bound.args, **bound.kwargs)
        _apply_offline_overrides(self)

    setattr(__init__, _MARK, True)
    TaskManager.__init__ = __init__


def check_backend(lm: Any, task_dict: Any) -> None:
    """Refuse sink_strength tasks on a backend that cannot give attention (not HFLM)."""
    from lm_eval_sink.harness.task import REQUEST_TYPE

    tasks = task_dict.get("tasks", {}) if isinstance(task_dict, dict) else {}
    ours = sorted(name for name, t in tasks.items() if getattr(t, "OUTPUT_TYPE", None) == REQUEST_TYPE)
    if not ours:
        return
    inner = getattr(lm, "lm", lm)  # CachingLM (--use_cache) wraps the real model
    if not callable(getattr(type(inner), REQUEST_TYPE, None)):
        raise UnsupportedBackend(
            f"task {ours[0]} needs attention weights, which the {type(inner).__name__} backend does not expose",
            "run it with --model hf (other tasks may use any backend in a separate call)",
        )


@functools.cache
def own_task_names() -> frozenset[str]:
    """The task and group names this project's YAMLs define."""
    import re

    return frozenset(
        m.group(2)
        for p in tasks_dir().rglob("*.yaml")
        for m in re.finditer(r"^(task|group):\s*(\S+)\s*$", p.read_text(encoding="utf-8"), re.M)
    )


def check_attention_request(model_args: Any, tasks: Any) -> None:
    """Refuse, before the model is loaded, a sink_strength task asked of a flash attention implementation."""
    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string(model_args) if isinstance(model_args, str) else dict(model_args or {})
    impl = str(args.get("attn_implementation") or "")
    names = [t if isinstance(t, str) else t.get("task") if isinstance(t, dict) else None for t in tasks or []]
    ours = sorted(n for n in names if isinstance(n, str) and n in own_task_names())
    if ours and impl:
        from lm_eval_sink.capture import check_wrappable

        check_wrappable(
            impl,
            f"task {ours[0]}",
            "pass attn_implementation=sdpa or eager in --model_args for it; other tasks may use flash "
            "in a separate call",
        )


def patch_evaluator() -> None:
    import lm_eval.evaluator as ev

    if getattr(ev.evaluate, _MARK, False):
        return
    original, original_simple = ev.evaluate, ev.simple_evaluate

    @functools.wraps(original)
    def evaluate(lm: Any, task_dict: Any, *args: Any, **kwargs: Any) -> Any:
        check_backend(lm, task_dict)
        return original(lm, task_dict, *args, **kwargs)

    signature = inspect.signature(original_simple)

    @functools.wraps(original_simple)
    def simple_evaluate(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:  # lm-eval's own error for bad arguments, unchanged
            bound = {}
        check_attention_request(bound.get("model_args"), bound.get("tasks"))
        return original_simple(*args, **kwargs)

    setattr(evaluate, _MARK, True)
    ev.evaluate, ev.simple_evaluate = evaluate, simple_evaluate


def patch_cli() -> None:
    import lm_eval.__main__ as main_mod

    if getattr(main_mod.cli_evaluate, _MARK, False):
        return
    original = main_mod.cli_evaluate

    @functools.wraps(original)
    def cli_evaluate(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except UserError as e:
            print(f"error: {e.line()}", file=sys.stderr)
            raise SystemExit(2) from None

    setattr(cli_evaluate, _MARK, True)
    main_mod.cli_evaluate = cli_evaluate


def _compact_matrices(result_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy whose per-layer-per-head matrices read as a short note (the JSON keeps them whole)."""
    out = dict(result_dict)
    for column in ("results", "groups"):
        if column not in result_dict:
            continue
        out[column] = {}
        for task, metrics in result_dict[column].items():
            metrics = dict(metrics)
            for key, value in metrics.items():
                if key.startswith("sink_strength_layer_head,") and isinstance(value, dict):
                    metrics[key] = (
                        f"[{len(value.get('layers', []))} layers x {len(value.get('values', [[]])[0])} heads: see "
                        "results JSON]"
                    )
            out[column][task] = metrics
    return out


def patch_table() -> None:
    """The console table shows a note instead of the raw sink_strength_layer_head matrix."""
    import lm_eval.utils as lu

    if getattr(lu.make_table, _MARK, False):
        return
    original = lu.make_table

    @functools.wraps(original)
    def make_table(result_dict: dict[str, Any], *args: Any, **kwargs: Any) -> str:
        return original(_compact_matrices(result_dict), *args, **kwargs)

    setattr(make_table, _MARK, True)
    lu.make_table = make_table
