"""Merge into a resident model: mergekit's in-memory plan, run and copied into the model's parameters.

Each tensor is cast as the on-disk merge would write it, then copied into the resident parameter of its name, so
both paths give equal weights; rules and refusals: docs/merging.md (`merge_into`).
"""

from __future__ import annotations

from typing import Any

from lm_eval_sink.errors import UserError

# mergekit 0.1.5's `plan_in_memory()` fails under pydantic 2.14 (its ReturnTensor validates the tensor
# task against the abstract `Task[Tensor]` and raises "Can't instantiate abstract class"), so the merge is
# planned with `plan_to_disk` and only the SaveTensor tasks' own tensor tasks are run: the writer task,
# which alone would use this path, is never executed.
_NO_WRITER = "/nonexistent/lm-eval-sink-in-memory"


def endpoint_text(path: str) -> str:
    """The mergekit config that copies one model unchanged (`passthrough`): how an endpoint enters the resident."""
    import yaml

    return yaml.safe_dump({"merge_method": "passthrough", "models": [{"model": str(path)}]})


def _plan(model: Any, text: str, name: str, options: Any) -> list[Any]:
    """mergekit's SaveTensor tasks of `text` for `model` (names checked against its parameters)."""
    from mergekit.architecture import get_architecture_info
    from mergekit.io.tasks import SaveTensor
    from mergekit.plan import MergePlanner

    from lm_eval_sink.merging.merge import pinned_configs
    from lm_eval_sink.merging.methods import register

    register()
    config, _, _ = pinned_configs(text, None)  # a fresh copy whose hub inputs load at their pinned commits
    if config.tokenizer_source is not None or config.tokenizer is not None:
        raise UserError(
            f"control {name!r} rebuilds the tokenizer (tokenizer_source), so its output vocabulary may differ from "
            "the resident model's",
            "set merge: {in_memory: false} for this sweep",
        )
    arch_info = get_architecture_info(config, options)
    planner = MergePlanner(config, arch_info, options=options, out_model_config=model.config)
    saves = [t for t in planner.plan_to_disk(out_path=_NO_WRITER) if isinstance(t, SaveTensor)]
    _check_names(model, {s.tensor_name for s in saves}, name)
    return saves


def check_plan(model: Any, text: str, name: str) -> None:
    """Refuse, before anything runs, a control that cannot be merged into `model` (which may live on the meta
    device: planning reads configs, no weights)."""
    from mergekit.options import MergeOptions

    _plan(model, text, name, MergeOptions(quiet=True))


def merge_into(
    model: Any,
    text: str,
    name: str,
    random_seed: int | None = None,
    device: str = "cpu",
) -> int:
    """Run the validated merge config `text` and copy every tensor into `model`'s parameter of its name, where it
    lives (an offloaded one is refused); returns how many it copied."""
    import torch
    import transformers
    from mergekit.common import dtype_from_name
    from mergekit.graph import Executor
    from mergekit.io.tasks import LoaderCache
    from mergekit.options import MergeOptions

    from lm_eval_sink.devices import math_device
    from lm_eval_sink.merging.merge import isolated_rng

    targets = dict(model.state_dict(keep_vars=True))  # tied weights appear under each of their names
    _check_not_offloaded(targets, name)
    options = MergeOptions(random_seed=random_seed, device=math_device(device), quiet=True)
    with isolated_rng(), torch.no_grad():
        if random_seed is not None:
            transformers.trainer_utils.set_seed(random_seed)
        LoaderCache().setup(options=options)
        saves = _plan(model, text, name, options)
        by_task: dict[Any, list[Any]] = {}
        for save in saves:
            by_task.setdefault(save.tensor_task, []).append(save)
        n = 0
        for task, value in Executor(list(by_task), math_device=options.device, storage_device="cpu").run(quiet=True):
            for save in by_task[task]:
                if value is None and save.optional:
                    continue
                tensor = value.to(dtype_from_name(save.dtype)) if save.dtype else value
                targets[save.tensor_name].data.copy_(tensor)
                n += 1
    return n


def _check_not_offloaded(targets: dict[str, Any], control: str) -> None:
    """Refuse a resident with offloaded (meta) tensors: a merge copied into them would be lost."""
    offloaded = sorted(n for n, t in targets.items() if t.is_meta)
    if offloaded:
        raise UserError(
            f"control {control!r}: the resident's {offloaded[0]!r} (and {len(offloaded) - 1} more) is offloaded to the "
            "CPU or the disk (a meta tensor in the model), so a merge cannot be copied into it",
            "load the resident without offload (a device map over GPUs only), or set merge: {in_memory: false}",
        )


def _check_names(model: Any, names: set[str], control: str) -> None:
    """Every merged tensor names a resident parameter, and every resident parameter is merged."""
    targets = model.state_dict(keep_vars=True)
    unwritten = sorted({n for n, _ in model.named_parameters()} - names)
    if unwritten:
        raise UserError(
            f"control {control!r}: mergekit writes no tensor for the resident parameter {unwritten[0]!r} "
            f"(and {len(unwritten) - 1} more), which would keep the previous checkpoint's values",
            "set merge: {in_memory: false} for this sweep",
        )
    missing = sorted(names - set(targets))
    if missing:
        raise UserError(
            f"control {control!r}: mergekit's output tensor {missing[0]!r} (and {len(missing) - 1} more) is no "
            f"parameter of the resident {type(model).__name__}",
            "set merge: {in_memory: false} for this sweep",
        )
