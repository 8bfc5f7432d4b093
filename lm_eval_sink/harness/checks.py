"""Plan-time checks of an lm-eval protocol, before anything runs (`sweep`, `eval`).

Task names resolved by lm-eval's own `TaskManager` in the interpreter that will run lm-eval (with a did-you-mean),
`gen_kwargs` keys a task would override, and generation lengths that reach a model's maximum (no weights read).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.model_args import model_arg_flag
from lm_eval_sink.protocols import gen_toks_key


@functools.cache
def task_manager(include_path: str | None) -> Any:
    """This interpreter's lm-eval TaskManager for `include_path` (with this project's tasks, through the hook)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def describe(tasks: Sequence[str], include_path: str | None) -> dict[str, Any]:
    """What lm-eval here makes of `tasks` (JSON-safe): names it cannot resolve (with a did-you-mean), and each
    generating task's own `generation_kwargs` (groups and tags expanded)."""
    import glob

    from lm_eval_sink.harness.discovery import index_of, own_task_names, task_leaves
    from lm_eval_sink.schema import did_you_mean

    manager = task_manager(include_path)
    unknown: dict[str, str] = {}
    generation: dict[str, Any] = {}
    for name in tasks:
        if name.endswith(".yaml"):
            if not glob.glob(name):
                unknown[name] = ""
            continue
        matches = manager.match_tasks([name])
        if not matches:
            unknown[name] = did_you_mean(name, manager.all_tasks)
        for task, cfg in sorted(task_leaves(matches, index_of(manager)).items()):
            if task not in own_task_names() and "class" not in cfg and cfg.get("output_type") == "generate_until":
                generation[task] = cfg.get("generation_kwargs")
    return {"unknown": unknown, "generation": generation}


@functools.cache
def task_facts(python: str, include_path: str | None, tasks: tuple[str, ...]) -> dict[str, Any]:
    """`describe` run where lm-eval will run: in this process, or in `python` (once per arguments and process)."""
    from lm_eval_sink.harness.runner import ask

    return ask(python, f"{__name__}.describe", list(tasks), include_path)


def check_protocol(settings: Any, models: Sequence[str]) -> None:
    """Refuse, before anything runs, what lm-eval would fail on or silently ignore (`check_tasks`, then
    `check_lengths`; `settings`: harness.runner.EvalSettings)."""
    check_lengths(check_tasks(settings), settings, models)


def check_tasks(settings: Any) -> dict[str, tuple[int, str]]:
    """The checks that need no model (task names, `gen_kwargs` keys), run before a model is resolved or converted;
    returns each generating task's (most tokens it will generate, where that number comes from)."""
    from lm_eval_sink.harness.runner import check_interpreter

    if settings.interpreter() != sys.executable:  # the probe needs lm-eval and this project there
        check_interpreter(settings)
    facts = task_facts(settings.interpreter(), settings.include_path, tuple(settings.tasks))
    if facts["unknown"]:
        name, near = next(iter(facts["unknown"].items()))
        raise UserError(
            f"tasks: no lm-eval task, group or tag is named {name!r}{near}",
            "check the name (`lm_eval ls tasks` lists them), or add the folder that defines it as include_path",
        )
    return {task: _generation_length(task, gen, settings) for task, gen in sorted(facts["generation"].items())}


def _generation_length(task: str, own: dict[str, Any] | None, settings: Any) -> tuple[int, str]:
    """(the most tokens `task` will generate, where that number comes from), as lm-eval merges the settings."""
    from lm_eval.defaults import DEFAULT_MAX_GEN_TOKS

    given = settings.gen_kwargs or {}
    merged = {**(own or {"max_gen_toks": DEFAULT_MAX_GEN_TOKS}), **given}
    read = gen_toks_key(merged)
    ignored = gen_toks_key({k: v for k, v in given.items() if k != read})
    if ignored is not None:
        raise UserError(
            f"gen_kwargs: {ignored} would be ignored for {task}: its generation settings have {read}: "
            f"{merged[read]}, which lm-eval reads first",
            f"write {read}: {given[ignored]} instead of {ignored}",
        )
    if read is None:
        return DEFAULT_MAX_GEN_TOKS, "lm-eval's default max_gen_toks"
    return int(merged[read]), f"gen_kwargs {read}" if read in given else f"the task's own {read}"


def check_lengths(lengths: dict[str, tuple[int, str]], settings: Any, models: Sequence[str]) -> None:
    """Refuse a generation (`check_tasks`' lengths) that reaches a model's maximum length (its config; no weights)."""
    for model in models if lengths else ():
        limit = _max_length(model, settings)
        task, (n, source) = max(lengths.items(), key=lambda kv: kv[1][0])
        if n >= limit:
            raise UserError(
                f"{task} would generate up to {n} tokens ({source}), but {model} takes at most {limit} tokens "
                "in all (prompt included)",
                f"set gen_kwargs max_gen_toks well below {limit}, e.g. {limit // 4}",
            )


def _max_length(model: str, settings: Any) -> int:
    """The model's maximum sequence length as lm-eval will take it: model_args max_length (vLLM: max_model_len),
    else its config and tokenizer (`lm_eval.models.utils.resolve_max_length`); no weights are read."""
    from lm_eval.models.utils import DEFAULT_MAX_LENGTH, resolve_max_length
    from transformers import AutoConfig, AutoTokenizer

    given = settings.model_args.get("max_model_len" if settings.backend == "vllm" else "max_length")
    if given is not None:
        return int(given)
    trust = model_arg_flag(settings.model_args.get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust)
    except (OSError, ValueError) as e:
        raise UserError(f"{model}: cannot read its config ({str(e).splitlines()[0]})", "check the model") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust)
    except (OSError, ValueError):
        tokenizer = None  # the config's length is enough (lm-eval falls back to its default otherwise)
    return resolve_max_length(config, tokenizer, default=DEFAULT_MAX_LENGTH)
