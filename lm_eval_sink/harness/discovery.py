"""Glue that makes lm-eval find and run this project's tasks with no flag (the patches `hooks.py` arms).

`patch_task_index` (this project's tasks, the offline data, the cached index), `patch_evaluator` (S decided and
measured before a backend without attention is built; checks and this project's tasks first in `evaluate`),
`patch_cli` (one-line errors) and `patch_table` (the console lines), each through `patching.patch`: docs/lm-eval.md.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.backends import backend_label, has_attention, unsupported
from lm_eval_sink.harness.model_args import parsed_model_args
from lm_eval_sink.harness.patching import HANDED_BACK, attempt, mismatch, patch, read_name
from lm_eval_sink.harness.vllm_preflight import check_engine_memory

log = logging.getLogger(__name__)


def tasks_dir() -> Path:
    """The folder of this project's lm-eval task YAMLs (installed as package data)."""
    return Path(str(resources.files("lm_eval_sink.tasks")))


TASK_CLASS = "lm_eval_sink.harness.task.SinkStrengthTask"  # the class every task of this project names


def _model_class(model: Any) -> type | None:
    """The class lm-eval would build for `model` (a --model name or an LM object); None when it cannot say."""
    if not isinstance(model, str):
        return type(model)
    from lm_eval.api.registry import get_model

    try:
        return get_model(model)
    except Exception:  # unknown name, or its package is missing: lm-eval reports that itself
        return None


def task_leaves(requested: Sequence[Any], index: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every task `requested` stands for (names, YAML paths, inline config dicts; through groups and tags), with its
    config as lm-eval will build it (an inline dict's keys over the indexed config)."""
    from lm_eval.tasks._index import Kind

    out: dict[str, dict[str, Any]] = {}
    stack, seen = list(requested), set()
    while stack:
        item, over = stack.pop(), {}
        if isinstance(item, dict):
            if not isinstance(item.get("task"), str):  # an inline group: its members
                stack.extend(_as_list(item.get("task")))
                continue
            item, over = item["task"], {k: v for k, v in item.items() if k != "task"}
        if not isinstance(item, str) or (item in seen and not over):
            continue  # a Task object: the patched evaluate() sees it
        seen.add(item)
        entry = index.get(item) or (_path_entry(Path(item)) if Path(item).is_file() else None)
        if entry is None:
            continue
        if entry.kind == Kind.GROUP:
            stack.extend(_as_list((entry.cfg or {}).get("task")))
        elif entry.kind == Kind.TAG:
            stack.extend(name for name, e in index.items() if item in e.tags and e.kind != Kind.TAG)
        else:
            out[entry.name] = {**(entry.cfg or {}), **over}
    return out


def _path_entry(path: Path) -> Any:
    """A YAML path's entry as lm-eval's factory reads it: with its config (includes merged, functions unresolved),
    which lm-eval's `entry_from_path` leaves out (so a group's members and a task's class are seen)."""
    from dataclasses import replace

    from lm_eval.tasks._index import TaskIndex
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = TaskIndex.entry_from_path(path)
    return None if entry is None else replace(entry, cfg=load_yaml(path, resolve_func=False))


INDEX = "task_index|_task_index"  # TaskManager's index of entries: lm-eval 0.4.13's name, then 0.5's


def index_of(manager: Any) -> dict[str, Any]:
    """A TaskManager's index of entries (name -> lm-eval's `Entry`), under either version's name."""
    return getattr(manager, read_name(type(manager), INDEX) or INDEX)


@functools.cache
def holds_own_task(tasks: tuple[str, ...], include_path: str | None) -> bool:
    """Whether lm-eval `--tasks` names (globs and YAML paths too) hold a task of this project, read from this
    project's folder and `include_path` alone (lm-eval's own groups and tags never hold one)."""
    import fnmatch

    if set(tasks) & own_task_names():
        return True
    from lm_eval.tasks._index import TaskIndex

    index = TaskIndex.build([tasks_dir(), *([Path(include_path)] if include_path else [])])
    requested = [name for t in tasks for name in (fnmatch.filter(index, t) if set("*?[") & set(t) else [t])]
    return bool(own_leaves(task_leaves(requested, index)))


def own_leaves(leaves: dict[str, dict[str, Any]]) -> list[str]:
    """This project's tasks among `task_leaves`' tasks (by name, or by the class a user's YAML names), sorted."""
    return sorted(
        name
        for name, cfg in leaves.items()
        if name in own_task_names() or str(cfg.get("class") or "").endswith(TASK_CLASS)
    )


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def check_pretrained(arguments: dict[str, Any]) -> None:
    """Before anything loads: the safetensors files transformers would load of a local `pretrained` folder, one line
    naming one that is missing, cut short or not safetensors (a file transformers never reads is left to lm-eval)."""
    from lm_eval_sink.weights import check_weights, file_tensors

    model_args = parsed_model_args(arguments.get("model_args")) if isinstance(arguments.get("model"), str) else {}
    pretrained = model_args.get("pretrained")
    if isinstance(pretrained, str) and Path(pretrained).is_dir():
        single = Path(pretrained) / "model.safetensors"  # transformers' first choice: then it reads no other
        if single.is_file():
            file_tensors(single)
        else:
            check_weights(Path(pretrained))


def _task_manager(arguments: dict[str, Any]) -> Any:
    """The TaskManager simple_evaluate would build itself (model_args and metadata as every task's metadata)."""
    if arguments.get("task_manager") is not None:
        return arguments["task_manager"]
    from lm_eval.tasks import TaskManager

    return TaskManager(metadata=parsed_model_args(arguments.get("model_args")) | (arguments.get("metadata") or {}))


def measure_first_request(arguments: dict[str, Any]) -> tuple[Any, Any] | None:
    """Before lm-eval builds a backend without attention, where this project's tasks are measured: (None, TaskManager)
    where the engine lm-eval builds measures S (`engine_strength.decide`), else (rows, TaskManager) with the rows the
    child measured first (`task.Measured` per task) and the revisions it measured pinned in `arguments`; None when no
    such task is asked of such a backend. One line when the backend has no `pretrained` transformers can load; why the
    engine path was not taken is said in one line once the checks passed, and recorded (`not_on_engine`)."""
    model = arguments.get("model")
    model_class = _model_class(model)
    if has_attention(model_class):
        return None
    task_manager = _task_manager(arguments)
    ours = own_leaves(task_leaves(_requested(arguments), index_of(task_manager)))
    if not ours:
        return None
    label = model if isinstance(model, str) else backend_label(type(model))
    model_args = parsed_model_args(arguments.get("model_args")) if isinstance(model, str) else {}
    if not model_args.get("pretrained"):
        raise unsupported(ours[0], label)
    from dataclasses import replace

    import lm_eval_sink.harness.measure_first as first
    from lm_eval_sink.harness.engine_strength import decide, fallback_line, is_lm_eval_vllm

    why = decide(model_class, model_args)
    if why is None:
        return None, task_manager
    why = why if is_lm_eval_vllm(model_class) else None  # the line is vLLM's alone
    load = first.pin_revisions(first.hf_load_args(model_args, ours[0], label))
    first.check_loadable(load, ours[0], label)
    arguments["model_args"] = first.engine_model_args(arguments.get("model_args"), load)  # the commits measured
    if why is not None:
        print(fallback_line(ours, why), file=sys.stderr, flush=True)
    measured = first.measure_first(load, first.task_jobs(task_manager, ours), label)
    if why is not None:
        measured = {n: replace(m, record={**m.record, "not_on_engine": why}) for n, m in measured.items()}
    return measured, task_manager


def _apply_offline_overrides(index: dict[str, Any]) -> None:
    """With LM_EVAL_SINK_DATA set, the stock tasks it covers pointed at generated YAMLs (`offline.py`)."""
    from dataclasses import replace

    from lm_eval.tasks._index import Kind

    from lm_eval_sink.harness.offline import data_root, write_overrides

    root = data_root()
    if root is None:
        return
    candidates = {
        name: (entry.cfg, Path(entry.yaml_path))
        for name, entry in index.items()
        if entry.kind == Kind.TASK and entry.cfg and entry.yaml_path and "dataset_path" in entry.cfg
    }
    try:
        written = write_overrides(candidates, root)
    except OSError as err:  # a temp folder that cannot be made: the stock tasks stay as lm-eval indexed them (a full
        # disk is not caught here: `DiskFull`'s one line names it, where the stock tasks would fail later on the hub)
        log.warning("lm-eval-sink: offline data from %s not applied (%s)", root, err)
        return
    for name, path in written.items():
        index[name] = replace(index[name], yaml_path=path)
    log.debug("lm-eval-sink: offline data from %s", root)


def _wrap_build(original: Any) -> Any:
    """`TaskIndex.build` of lm-eval's defaults with this project's folder, the cache and the offline data (docs/
    footguns.md); any other call is lm-eval's own."""
    import lm_eval

    from lm_eval_sink.harness.task_index import cached_build

    lm_evals = Path(lm_eval.__file__).parent / "tasks"  # the folder of lm-eval's defaults (TaskManager's own)

    def with_ours(given: Sequence[Any], resolve_includes: bool) -> dict[str, Any] | None:
        paths = [Path(p) for p in given]
        if not paths or paths[0] != lm_evals:
            return None  # not lm-eval's defaults: lm-eval's own
        if tasks_dir() not in paths:
            paths = [paths[0], tasks_dir(), *paths[1:]]
        index = cached_build(original, paths, resolve_includes=resolve_includes)
        _apply_offline_overrides(index)
        return index

    @functools.wraps(original)
    def build(paths: Any, *, resolve_includes: bool = True, **more: Any) -> dict[str, Any]:
        if more or not isinstance(paths, (list, tuple)):  # read once, so an iterator goes to lm-eval untouched
            return original(paths, resolve_includes=resolve_includes, **more)
        index = attempt("TaskIndex.build", lambda: with_ours(paths, resolve_includes), lambda: False)
        return original(paths, resolve_includes=resolve_includes) if index is None or index is HANDED_BACK else index

    return build


def patch_task_index() -> None:
    from lm_eval.tasks._index import TaskIndex

    from lm_eval_sink.harness.task_index import entry_mismatch

    patch(TaskIndex, "build", _wrap_build, leading=("paths",), needs=("resolve_includes",), more=entry_mismatch)


def prepare_tasks(lm: Any, task_dict: Any) -> Any:
    """Before any request: the checks S needs of the built model, each own task's `capture` record, them first."""
    from lm_eval_sink.harness.task import capture_record, check_capturable, measured_task

    ours = _own_in(task_dict)
    if not ours:
        return task_dict
    tasks = task_dict["tasks"]
    inner = getattr(lm, "lm", lm)  # CachingLM (--use_cache) wraps the real model
    if has_attention(type(inner)):
        check_capturable(inner.model)
        record = capture_record(inner.model, "lm-eval's own, on the model it built")
        records = {name: {**record, "adapter": getattr(inner, "peft", None)} for name in ours}
    else:
        records = {name: m.record for name in ours if (m := measured_task(name)) is not None}
        on_engine = [name for name in ours if name not in records]
        if on_engine:  # S on lm-eval's vLLM engine (engine_strength), else the one line of backends.unsupported
            from lm_eval_sink.harness.engine_strength import engine_records

            records |= engine_records(inner, on_engine)
    for name in ours:
        tasks[name].config.metadata["capture"] = records[name]
    ordered = {name: tasks[name] for name in ours} | {n: t for n, t in tasks.items() if n not in ours}
    return {**task_dict, "tasks": ordered}


@functools.cache
def own_task_names() -> frozenset[str]:
    """The task and group names this project's YAMLs define (read from the files: no lm-eval import, no private API)."""
    import re

    return frozenset(
        m.group(2)
        for p in tasks_dir().rglob("*.yaml")
        for m in re.finditer(r"^(task|group):\s*(\S+)\s*$", p.read_text(encoding="utf-8"), re.M)
    )


def _own_in(task_dict: Any) -> list[str]:
    """The names of this project's tasks in an `evaluate` task dict (by their request type)."""
    from lm_eval_sink.harness.task import REQUEST_TYPE

    tasks = task_dict.get("tasks") if isinstance(task_dict, dict) else None
    return [name for name, t in (tasks or {}).items() if getattr(t, "OUTPUT_TYPE", None) == REQUEST_TYPE]


def _wrap_evaluate(original: Any) -> Any:
    @functools.wraps(original)
    def evaluate(lm: Any, task_dict: Any, *args: Any, **kwargs: Any) -> Any:
        prepared = attempt("evaluate", lambda: prepare_tasks(lm, task_dict), lambda: bool(_own_in(task_dict)))
        return original(lm, task_dict if prepared is HANDED_BACK else prepared, *args, **kwargs)

    return evaluate


def _requested(arguments: dict[str, Any]) -> list[Any]:
    """simple_evaluate's `tasks` as a list: names (a comma list split), YAML paths, config dicts, Task objects."""
    tasks = arguments.get("tasks")
    requested = [tasks] if isinstance(tasks, (str, dict)) else list(tasks or [])
    return [t for r in requested for t in (r.split(",") if isinstance(r, str) else [r])]


def _names_own(arguments: dict[str, Any]) -> bool:
    """Whether simple_evaluate's `tasks` may hold a task of this project (`holds_own_task`; a config dict: yes)."""
    requested = _requested(arguments)
    return holds_own_task(tuple(t for t in requested if isinstance(t, str)), None) or any(
        isinstance(t, dict) for t in requested
    )


def _wrap_simple_evaluate(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def simple_evaluate(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # lm-eval's own error for bad arguments, unchanged
            return original(*args, **kwargs)
        first = attempt("simple_evaluate", lambda: _first(bound.arguments), lambda: _names_own(bound.arguments))
        if first is None or first is HANDED_BACK:
            return original(*args, **kwargs)
        from lm_eval_sink.harness.task import provided

        measured, bound.arguments["task_manager"] = first
        if measured is None:  # S measured on the engine lm-eval builds, built with the capture (engine_strength)
            from lm_eval_sink.harness.engine_strength import engine_builder

            with engine_builder():
                return original(*bound.args, **bound.kwargs)
        with provided(measured):
            return original(*bound.args, **bound.kwargs)

    return simple_evaluate


def _first(arguments: dict[str, Any]) -> Any:
    check_engine_memory(arguments)  # vllm_preflight: vLLM's start-up memory check, before anything loads
    check_pretrained(arguments)
    return measure_first_request(arguments)


def _lm_eval_reads() -> tuple[tuple[Any, str], ...]:
    """What `measure_first_request` and `task_leaves` read on lm-eval's objects (`_lm_eval_calls`: what they pass)."""
    import lm_eval.api.registry as registry
    import lm_eval.tasks._yaml_loader as yaml_loader
    import lm_eval.utils as lu
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    return (
        (TaskManager, INDEX),
        (TaskIndex, "entry_from_path"),
        (registry, "get_model"),
        (lu, "simple_parse_args_string"),
        (yaml_loader, "load_yaml"),
    )


def _lm_eval_calls() -> str | None:
    """Why lm-eval's functions do not take what `measure_first_request` passes them (`TaskManager(metadata=)`,
    `load_yaml(resolve_func=False)`), or its `Entry` and `Kind` are not what it reads (`task_index.entry_mismatch`)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    from lm_eval_sink.harness.task_index import entry_mismatch

    manager, loader = mismatch(TaskManager.__init__, needs=("metadata",)), mismatch(load_yaml, needs=("resolve_func",))
    return (
        (f"calls TaskManager, which {manager}" if manager else None)
        or (f"calls load_yaml, which {loader}" if loader else None)
        or entry_mismatch()
    )


def patch_evaluator() -> None:
    import lm_eval.evaluator as ev

    patch(ev, "evaluate", _wrap_evaluate, leading=("lm", "task_dict"))
    needs = ("model", "model_args", "tasks", "task_manager", "metadata")  # what measure_first_request reads, by name
    patch(ev, "simple_evaluate", _wrap_simple_evaluate, needs=needs, reads=_lm_eval_reads(), more=_lm_eval_calls)


def _wrap_cli(original: Any) -> Any:
    @functools.wraps(original)
    def cli_evaluate(*args: Any, **kwargs: Any) -> Any:
        try:
            check_cli_limit(sys.argv[1:])
            return original(*args, **kwargs)
        except UserError as e:
            print(f"error: {e.line()}", file=sys.stderr)
            raise SystemExit(2) from None

    return cli_evaluate


def check_cli_limit(argv: Sequence[str]) -> None:
    """Refuse an `lm_eval` command line of this project's tasks whose `--limit` leaves no document (0 or below), which
    lm-eval finds only after the model has loaded, as a traceback; a stock run's is lm-eval's own."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--limit", "-L", type=float, default=None)
    parser.add_argument("--tasks", "-t", default=None)
    parser.add_argument("--include_path", default=None)
    try:
        known = parser.parse_known_args(list(argv))[0]
    except SystemExit:  # not a number: lm-eval's own parser says so
        return
    if known.limit is None or known.limit > 0 or not known.tasks:
        return
    if holds_own_task(tuple(t.strip() for t in known.tasks.split(",") if t.strip()), known.include_path):
        raise UserError(
            f"--limit {known.limit:g}: no document of any task would run",
            "pass a count (--limit 5) or a fraction of each task (--limit 0.1), or leave --limit out",
        )


def patch_cli() -> None:
    import lm_eval.__main__ as main_mod

    patch(main_mod, "cli_evaluate", _wrap_cli)


_SCORES = ("sink_strength", "sink_strength_content_rows", "sink_strength_template_rows")  # the rest: companions


def _compact_matrices(result_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy for the console table: this project's tasks without lists or empty values (the JSON keeps them
    whole; the layer x head matrix reads as a short note) and with no arrow beside a figure that is not a score."""
    out = dict(result_dict)
    ours = own_task_names()
    for column in ("results", "groups"):
        if column not in result_dict:
            continue
        out[column] = {}
        for task, metrics in result_dict[column].items():
            metrics = dict(metrics)
            for key, value in list(metrics.items()):
                if key.startswith("sink_strength_layer_head,") and isinstance(value, dict):
                    metrics[key] = (
                        f"[{len(value.get('layers', []))} layers x {len(value.get('values', [[]])[0])} heads: see "
                        "results JSON]"
                    )
                elif task in ours and (value is None or isinstance(value, list)):
                    del metrics[key]
            out[column][task] = metrics
    out["higher_is_better"] = {
        task: {m: (hib if task not in ours or m in _SCORES else None) for m, hib in metrics.items()}
        for task, metrics in (result_dict.get("higher_is_better") or {}).items()
    }
    return out


def strength_lines(result_dict: dict[str, Any]) -> list[str]:
    """One line per Sink Strength task of a results dict: S and its companions in words, what S means, and the
    note of a model without a sink; then a line for what was asked and not applied (the chat template, K beyond
    the depth, `--limit` / `--samples`, which never cut the calibration set)."""
    from lm_eval_sink.comparability import setting_of_results
    from lm_eval_sink.strength import S_MEANING, absent_sink_note

    lines = []
    for task, m in sorted((result_dict.get("results") or {}).items()):
        s, pos0 = m.get("sink_strength,none"), m.get("pos0_argmax_fraction,none")
        if not isinstance(s, float) or not isinstance(pos0, float):
            continue
        setting = setting_of_results(result_dict, task)
        depth = setting.attention_layers or "the"
        share = "" if setting.k_share is None else f" ({setting.k_share:.0%})"
        where = f"all {depth}" if setting.last_k_asked is None else f"the last {setting.last_k} of {depth}"
        parts = [f"{task}: S = {s:.4f} {setting.measured_in()} over {where} attention layers{share}"]
        parts.append(f"position 0 is the sink in {100 * pos0:.1f}% of rows")
        content, template = m.get("sink_strength_content_rows,none"), m.get("sink_strength_template_rows,none")
        if isinstance(content, float) and isinstance(template, float):
            share = m.get("template_row_fraction,none")
            parts.append(
                f"S over the prompts' own rows {content:.4f}, over the chat template's rows {template:.4f}"
                + (f" ({100 * share:.0f}% of rows)" if isinstance(share, float) else "")
            )
        note = absent_sink_note(s, pos0)
        lines.append("; ".join(parts) + (f"; note: {note}" if note else "") + f". ({S_MEANING})")
        lines += [f"{task}: note: {line.removeprefix(task + ': ')}" for line in setting.asked_not_applied(task)]
        lines += _limit_line(result_dict, task)
    return lines


def _limit_line(result_dict: dict[str, Any], task: str) -> list[str]:
    """The one line saying that --limit / --samples did not cut the calibration set, when either was given."""
    ignored = ((result_dict.get("configs") or {}).get(task, {}).get("metadata") or {}).get("limit_ignored")
    if ignored is None:
        return []
    n = ((result_dict.get("n-samples") or {}).get(task) or {}).get("effective")
    asked = f"--limit {ignored}" if not str(ignored).startswith("samples=") else f"--samples ({ignored})"
    return [f"{task}: {asked} not applied: S uses the whole calibration set ({n} prompts), whatever the limit"]


def _wrap_table(original: Any) -> Any:
    @functools.wraps(original)
    def make_table(result_dict: dict[str, Any], *args: Any, **kwargs: Any) -> str:
        column = args[0] if args else kwargs.get("column", "results")

        def work() -> tuple[dict[str, Any], list[str]]:
            return _compact_matrices(result_dict), strength_lines(result_dict) if column == "results" else []

        prepared = attempt("make_table", work, lambda: bool(set(result_dict.get(column) or ()) & own_task_names()))
        if prepared is HANDED_BACK:
            return original(result_dict, *args, **kwargs)
        table = original(prepared[0], *args, **kwargs)
        lines = prepared[1]
        return "\n".join([table.rstrip("\n"), *lines]) + "\n" if lines else table

    return make_table


def patch_table() -> None:
    import lm_eval.utils as lu

    patch(lu, "make_table", _wrap_table, leading=("result_dict", "column"))
