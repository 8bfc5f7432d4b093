"""lm-eval and Sink Strength in this process, on one resident model: the in-memory sweep's evaluation.

One model loaded once (`load_resident`), each checkpoint copied into it, evaluated with the command line's own
fields (`cli_config`) and written as lm-eval's CLI writes them; what differs from a subprocess run: docs/merging.md.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_sink.devices import DEFAULT_DEVICE, Placement
from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.model_args import model_arg_flag
from lm_eval_sink.harness.runner import EvalSettings, new_run, results_files
from lm_eval_sink.runs import RunFiles


@dataclass(frozen=True)
class Resident:
    """One loaded model, its tokenizer and one lm-eval TaskManager, for every checkpoint of a sweep."""

    model: Any
    tokenizer: Any
    task_manager: Any
    settings: EvalSettings | None  # the sweep's eval settings (every `evaluate` uses them); None: S only
    dtype: str  # the resident parameters' dtype, e.g. "float32"
    placement: Placement  # where its weights are (kept for every checkpoint: merges are copied in place)


# lm-eval's HFLM arguments that place a model it loads itself; the resident is placed by this project
# (`devices.place`, from eval.device, `auto` when parallelize=True), so HFLM never gets them.
PLACEMENT_ARGS = frozenset({"parallelize", "device_map", "max_memory_per_gpu", "max_cpu_memory", "offload_folder"})


def cli_config(settings: EvalSettings, model: str, output_path: str | Path) -> Any:
    """lm-eval's `EvaluatorConfig` of the subprocess command line `settings.command(model, output_path)`, by lm-eval's
    own parser and validation, so both paths read one source."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    namespace = HarnessCLI()._parser.parse_args(["run", *settings.command(model, Path(output_path))])
    return EvaluatorConfig.from_cli(namespace)


def _hflm_parameters() -> frozenset[str]:
    from lm_eval.models.huggingface import HFLM

    return frozenset(inspect.signature(HFLM.__init__).parameters) - {"self", "kwargs", "pretrained", "tokenizer"}


def _load_kwargs(model_args: dict[str, Any]) -> dict[str, Any]:
    """The model_args HFLM would hand to `from_pretrained` (not its own parameters), e.g. attn_implementation."""
    own = _hflm_parameters() | PLACEMENT_ARGS
    return {k: v for k, v in model_args.items() if k not in own and k not in ("pretrained", "dtype")}


def resident_device(settings: EvalSettings | None, device: str) -> str:
    """The resident's device: eval's (`auto` when its model_args ask lm-eval to parallelize), else `device` (S's)."""
    if settings is None:
        return device
    return "auto" if model_arg_flag(settings.model_args.get("parallelize", False)) else settings.device


def load_resident(
    reference: str | Path, settings: EvalSettings | None, dtype: str | None = None, device: str = DEFAULT_DEVICE
) -> Resident:
    """Load `reference` as the subprocess path's HFLM would (dtype, model_args), straight onto its devices, with one
    TaskManager as lm-eval's CLI builds it for the reference's command line; without eval settings (`eval: false`)
    in `dtype` on `device` (Sink Strength's), with none."""
    from lm_eval_sink.models import load_checkpoint, torch_dtype

    load_kwargs: dict[str, Any] = {}
    revision: dict[str, Any] = {}
    manager = None
    if settings is not None:
        if settings.backend != "hf":
            raise UserError(
                f"an in-memory evaluation runs lm-eval's hf backend in this process, not {settings.backend!r}",
                "set merge: {in_memory: false} to evaluate with vllm on disk",
            )
        cfg = cli_config(settings, str(reference), "/nonexistent")
        dtype, load_kwargs = settings.dtype, _load_kwargs(cfg.model_args)
        revision = {"revision": cfg.model_args["revision"]} if "revision" in cfg.model_args else {}
        manager = task_manager(settings, reference)
    device = resident_device(settings, device)
    model, tokenizer, placement = load_checkpoint(
        str(reference), torch_dtype(dtype or "auto"), device, (reference, revision), **revision, **load_kwargs
    )
    model = model.requires_grad_(False)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Resident(
        model=model, tokenizer=tokenizer, task_manager=manager, settings=settings, dtype=dtype, placement=placement
    )


def task_manager(settings: EvalSettings, model: str | Path) -> Any:
    """One lm-eval TaskManager for every checkpoint, as lm-eval's CLI builds it for `model`'s command line (this
    project's tasks and offline data through the import hook, `hooks.install`)."""
    from lm_eval.tasks import TaskManager

    from lm_eval_sink.hooks import install

    install()
    cfg = cli_config(settings, str(model), "/nonexistent")
    return TaskManager(include_path=cfg.include_path, metadata=cfg.metadata or {})


def _tasks(manager: Any, names: str | list[str]) -> list[Any]:
    """The task names resolved by the resident TaskManager, as lm-eval's CLI resolves them."""
    listed = names.split(",") if isinstance(names, str) else [t for n in names for t in n.split(",")]
    out: list[Any] = []
    for name in dict.fromkeys(listed):
        matches = manager.match_tasks([name])
        if not matches:
            raise UserError(f"lm-eval task {name!r} not found", "check the task name and eval.include_path")
        out += [m for m in matches if m not in out]
    return out


def _hflm(resident: Resident, cfg: Any) -> Any:
    """lm-eval's HF model on the resident model, with the HFLM arguments of the command line's model_args."""
    from lm_eval.models.huggingface import HFLM

    own = _hflm_parameters() - PLACEMENT_ARGS
    return HFLM(
        pretrained=resident.model,
        tokenizer=resident.tokenizer,
        batch_size=cfg.batch_size,
        **({"max_batch_size": cfg.max_batch_size} if cfg.max_batch_size is not None else {}),
        **{k: v for k, v in cfg.model_args.items() if k in own and k not in ("batch_size", "max_batch_size")},
    )


def evaluate(resident: Resident, settings: EvalSettings, output_path: str | Path, name: str | Path) -> RunFiles:
    """Evaluate the resident model with lm-eval in this process, the files under `output_path/<name>/` as
    `run_lm_eval(name, settings, output_path)` writes them; `name` is the checkpoint as that path names it (an
    absolute path: `owner/name` reads as a hub id)."""
    from lm_eval_sink.merging.merge import isolated_rng

    if settings != resident.settings:
        raise UserError(
            "these eval settings differ from the ones the resident model and its TaskManager were built for",
            "load one resident per sweep with the sweep's eval settings",
        )
    output_path = Path(output_path)
    cfg = cli_config(settings, str(name), output_path)
    with isolated_rng():  # lm-eval seeds the global generators, as in its own process; the caller's stay
        return evaluate_model(_hflm(resident, cfg), cfg, resident.task_manager, output_path)


def evaluate_model(
    lm: Any, cfg: Any, task_manager: Any, output_path: Path, timings: dict[str, float] | None = None
) -> RunFiles:
    """`simple_evaluate` with the command line's fields (`cfg`: `cli_config`) on `lm`, an lm-eval model object or a
    `--model` name (built by lm-eval from `cfg.model_args`, as its CLI does: the resident vLLM engine's process),
    the results and samples written as the CLI writes them; `timings` gets the seconds of each (evaluate, write)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    before, start = results_files(output_path), time.perf_counter()
    tracker = EvaluationTracker(output_path=cfg.output_path)
    seeds = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    # the fields of the command line that simple_evaluate takes under the same name
    same = ("model_args", "num_fewshot", "batch_size", "max_batch_size", "device", "limit", "log_samples", "metadata")
    same += ("system_instruction", "apply_chat_template", "fewshot_as_multiturn", "gen_kwargs")
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=_tasks(task_manager, cfg.tasks),
        evaluation_tracker=tracker,
        task_manager=task_manager,
        **{name: getattr(cfg, name) for name in same},
        **dict(zip(seeds, cfg.seed or [None] * 4, strict=True)),
    )
    written = time.perf_counter()
    run = _save(tracker, results, cfg, output_path, before)
    if timings is not None:
        timings["evaluate"] = round(written - start, 3)
        timings["write"] = round(time.perf_counter() - written, 3)
    return run


def _save(tracker: Any, results: dict[str, Any], cfg: Any, output_path: Path, before: set[Path]) -> RunFiles:
    """Write results and samples as lm-eval's CLI does, with the backend where lm-eval recorded the model object."""
    results["config"]["model"] = cfg.model
    tracker.general_config_tracker.model_source = cfg.model
    samples = results.pop("samples") if cfg.log_samples else None
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    return new_run(output_path, before, "check that the folder is writable")


def measure_strength(resident: Resident, settings: Any, dtype: str, provenance: dict[str, Any] | None = None) -> Any:
    """`strength.measure` on the resident model; `dtype` must be the resident's (no second copy is made)."""
    from lm_eval_sink.merging.merge import isolated_rng
    from lm_eval_sink.strength import measure

    if dtype not in ("auto", resident.dtype):
        raise UserError(
            f"strength dtype {dtype} differs from the resident model's {resident.dtype}",
            "give strength and eval the same dtype for an in-memory sweep, or set merge: {in_memory: false}",
        )
    with isolated_rng():
        return measure(resident.model, resident.tokenizer, settings, progress=False, provenance=provenance)
