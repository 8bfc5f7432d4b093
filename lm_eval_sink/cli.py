"""The `lm-eval-sink` command line: thin click commands over the Python API.

This is the only place that catches `UserError` (one `error:` line on stderr, exit 2) and picks
exit codes. Heavy packages are imported inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from lm_eval_sink.calibration import Batching
from lm_eval_sink.devices import DEFAULT_DEVICE, DEVICE_HELP, DTYPES, check_device
from lm_eval_sink.errors import UserError

if TYPE_CHECKING:
    from lm_eval_sink.options import MeasureOptions
    from lm_eval_sink.strength import StrengthSettings

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

_BATCHING = Batching()  # the defaults of --batch-size, --batch-tokens and --query-chunk


def _device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    return value if value is None else check_device(value)


# What `--quiet` sets for the libraries, read when they are imported (here and in every process started from here).
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}


def _quiet(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """The one place --quiet is decided: it silences the libraries' progress bars and warnings too (every tqdm bar,
    here and in the processes started from here); errors are kept."""
    if value:
        os.environ.update(QUIET_ENV)
        if "transformers" in sys.modules:
            from transformers.utils import logging

            logging.disable_progress_bar()
            logging.set_verbosity_error()
    return value


# lm-eval's option names that a command here calls otherwise: named when one is given.
_OUR_NAMES = {"--limit": "--n-prompts", "--batch_size": "--batch-size"}
_PATH = click.Path(path_type=Path)


class _Command(click.Command):
    """A command whose function returns (or yields, before it fails) the lines to print (None: it printed its own)."""

    def invoke(self, ctx: click.Context) -> None:
        for line in super().invoke(ctx) or ():
            click.echo(line)


class _Group(click.Group):
    command_class = _Command
    group_class = type  # its groups are _Group too


def _options(*decorators: Decorator) -> Decorator:
    """Several click decorators as one, in the order they would be stacked."""

    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def _path_option(*decls: str, **attrs: Any) -> Decorator:
    """An option naming a file or folder, given to the command as a Path (None when left out)."""
    return click.option(*decls, type=_PATH, **attrs)


def _force(text: str) -> Decorator:
    return click.option("--force", is_flag=True, help=text)


def _quiet_option(text: str = "No progress bars and no library warnings (errors are kept).") -> Decorator:
    return click.option("--quiet", is_flag=True, callback=_quiet, help=text)


def _lm_eval_python(default: str) -> Decorator:
    return _path_option(
        "--lm-eval-python",
        "lm_eval_python",
        help=f"The interpreter lm-eval runs in, e.g. .venv-vllm/bin/python (default: {default}).",
    )


_REGISTRY_HELP = (
    "A user registry YAML added to the bundled one (default: vendors.yaml in the project cache, if present)."
)
_LAST_K_HELP = (
    "S over the last K attention layers: a count (the paper's; a different share of models of different depth), "
    "N%% of each model's attention layers (e.g. 33%%), or 'all'."
)
# Shared by `strength`, `screen`, `margin` and `protect-plan` (read by `_measuring`): the calibration of a Sink
# Strength measurement, the model's dtype and device, --force and --quiet.
_CALIBRATION_OPTIONS = _options(
    _path_option("--prompts", "prompts_file", help="JSONL with a 'prompt' field, or text with one prompt a line."),
    click.option("--n-prompts", type=int, help="First N prompts (builtin set: 5 or 15; default all)."),
    click.option(
        "--rows",
        type=click.Choice(["all", "content"]),
        default="all",
        help="Rows used: every query position >= 1, or the user message's tokens only.",
    ),
    click.option(
        "--chat-template/--no-chat-template",
        "use_chat_template",
        default=True,
        help="Render prompts through the chat template.",
    ),
    click.option("--system-prompt", help="System message before each prompt (chat template only)."),
    click.option("--dtype", type=click.Choice(DTYPES), default="auto"),
    click.option("--device", default=DEFAULT_DEVICE, callback=_device, help=f"Where the model runs: {DEVICE_HELP}."),
    _force("Overwrite earlier results."),
    _quiet_option(),
    # How the measurement runs (calibration.Batching): memory and speed, never S.
    click.option(
        "--batch-size",
        type=int,
        default=_BATCHING.batch_size,
        help="Prompts per forward at most (default: as many as --batch-tokens allows).",
    ),
    click.option(
        "--batch-tokens",
        type=int,
        default=_BATCHING.batch_tokens,
        help="Padded tokens (prompts x longest) per forward at most; a longer prompt runs alone.",
    ),
    click.option(
        "--query-chunk",
        type=int,
        default=_BATCHING.query_chunk,
        help="Query rows whose attention logits are held at once per layer (memory, not S).",
    ),
)


def _measuring(
    last_k: str, dtype: str, device: str, force: bool, quiet: bool, prompts_file: Path | None, **fields: Any
) -> tuple[StrengthSettings, MeasureOptions]:
    """The StrengthSettings (K: the command's own --last-k) and MeasureOptions of `_CALIBRATION_OPTIONS` (and a
    command's own --statistic, --seed)."""
    from lm_eval_sink.options import MeasureOptions
    from lm_eval_sink.strength import StrengthSettings, parse_last_k

    prompts = str(prompts_file) if prompts_file else None
    settings = StrengthSettings(last_k=parse_last_k(last_k), prompts_file=prompts, **fields)
    return settings, MeasureOptions(dtype=dtype, device=device, force=force, progress=not quiet)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(package_name="lm-eval-sink")
def cli() -> None:
    """Sink Strength, regression buckets and merging controls for lm-evaluation-harness."""


@cli.group()
def models() -> None:
    """The embedded default model, and GGUF files as model folders."""


@models.command("default")
def models_default() -> list[str]:
    """Print the converted SmolLM2-135M-Instruct folder, creating it if needed."""
    from lm_eval_sink.models import default_model_dir

    return [str(default_model_dir())]


@models.command("convert")
@click.argument("gguf_file", type=_PATH)
@click.argument("out_dir", type=_PATH)
@_force("Replace an existing OUT_DIR.")
def models_convert(gguf_file, out_dir, force) -> Iterable[str]:
    """A GGUF file as a model folder (dequantized to float32), for merges, sweeps, extraction and eval."""
    from lm_eval_sink.commands.models import run_models_convert

    return run_models_convert(gguf_file, out_dir, force=force)


def _slug(name: str) -> str:
    from lm_eval_sink.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    if name == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(name.rstrip("/")).name or name)


@cli.command("tasks-dir")
def tasks_dir_cmd() -> Iterable[str]:
    """Print the folder of this project's lm-eval tasks (for lm_eval --include_path)."""
    from lm_eval_sink.harness import tasks_dir

    return [str(tasks_dir())]


# --- screening, fits and sink margins (issue 9) ---


@cli.command()
@click.argument("model_names", metavar="MODEL [MODEL ...]", nargs=-1, required=True)
@click.option("--last-k", default="10", help=_LAST_K_HELP)
@click.option("--statistic", type=click.Choice(["median", "mean"]), default="median")
@_CALIBRATION_OPTIONS
@click.option("--seed", type=int, default=0)
@_path_option("--output", required=True, help="Folder for the JSON, tables and heatmaps.")
def strength(model_names, last_k, output, **calibration) -> Iterable[str]:
    """Sink Strength S of one or more models (MODEL: a folder, a GGUF file, a hub id when online, or 'default')."""
    from lm_eval_sink.commands.strength import run_strength

    settings, options = _measuring(last_k, **calibration)
    return run_strength(list(model_names), [_slug(n) for n in model_names], settings, output, options)


@cli.command()
@click.argument("model_names", metavar="MODEL [MODEL ...]", nargs=-1, required=True)
@_path_option(
    "--pairs",
    "pairs_file",
    help="PAIRS.yaml of pairs measured in the models' setting (S as *.strength.json paths): predicted deltas.",
)
@click.option(
    "--paper-line",
    is_flag=True,
    help="Predicted deltas from the paper's six pairs (their S from the paper's prompts), each with that caveat.",
)
@click.option("--last-k", default="10", help=_LAST_K_HELP)
@_CALIBRATION_OPTIONS
@_path_option(
    "--output", help="Folder for screen.json/.md/.csv/.png and per-model strength files (default: print only)."
)
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", help="ray: one Ray task per model.")
@click.option("--ray-address", help="Ray cluster: auto or ray://host:port (default: start Ray here).")
@click.option(
    "--num-gpus",
    type=float,
    help="GPUs per model's Ray task (default: 1 with --device cuda, else 0: auto then runs on the CPU).",
)
def screen(
    model_names, pairs_file, paper_line, last_k, output, engine, ray_address, num_gpus, **calibration
) -> Iterable[str]:
    """Rank backbones by Sink Strength S within each setting; predicted post-VL deltas with --pairs or --paper-line
    (MODEL: folder, hub id or 'default')."""
    from lm_eval_sink.commands.screen import run_screen
    from lm_eval_sink.options import ScreenOptions

    settings, options = _measuring(last_k, **calibration)
    predict = ScreenOptions(pairs_file=pairs_file, paper_line=paper_line)
    if engine == "ray":
        from lm_eval_sink.merging.engines import import_ray, ray_measure_all

        import_ray(local_only=ray_address is None)
        measure_all = ray_measure_all(ray_address, num_gpus=num_gpus, device=options.device, progress=options.progress)
        options = replace(options, measure_all=measure_all)
    elif ray_address is not None:
        raise UserError("--ray-address needs --engine ray", "add --engine ray, or drop --ray-address")
    return run_screen(list(model_names), [_slug(n) for n in model_names], settings, output, options, predict)


@cli.command()
@click.argument("pairs_file", metavar="[PAIRS.yaml]", required=False, type=_PATH)
@_path_option("--output", help="Folder for fit.json, fit.md and fit_<task>.png (default: print only).")
@_force("Overwrite earlier results.")
def fit(pairs_file, output, force) -> Iterable[str]:
    """Fit S -> delta per task: Spearman rho, exact permutation p, line, leave-one-pair-out errors (no file: the paper's
    table)."""
    from lm_eval_sink.commands.fit import run_fit

    return run_fit(pairs_file, output, force=force)


@cli.command()
@click.argument("reference")
@click.argument("candidate")
@click.option("--quantile", type=float, default=0.95, help="Quantile of the per-row shift for the second B_gap.")
@click.option("--last-k", default="all", help="Layers of the margin table: the last K, or 'all'.")
@click.option("--strength-last-k", default="10", help="K of both models' own Sink Strength S.")
@_CALIBRATION_OPTIONS
@_path_option(
    "--output", help="Folder for margin.json/.md/.csv, margin_rows.npz and margin_heatmap.png (default: print only)."
)
def margin(reference, candidate, quantile, last_k, strength_last_k, output, **calibration) -> Iterable[str]:
    """Per-head sink margins G_base - B_gap of CANDIDATE (e.g. a VLM backbone) against REFERENCE (its LLM)."""
    from lm_eval_sink.commands.margin import run_margin
    from lm_eval_sink.margin import MarginSettings
    from lm_eval_sink.strength import parse_last_k

    st, options = _measuring(strength_last_k, **calibration)
    settings = MarginSettings(strength=st, last_k=parse_last_k(last_k, shares=False), quantile=quantile)
    return run_margin(reference, candidate, settings, output, options)


# --- VLM backbone extraction (issue 6) ---


@cli.command()
@click.argument("vlm_path", type=_PATH)
@click.argument("out_dir", type=_PATH)
@click.option(
    "--dtype",
    type=click.Choice(["keep", "bf16", "fp32"]),
    default="keep",
    help="Dtype of the written tensors (keep: as stored in the VLM).",
)
@click.option(
    "--verify/--no-verify",
    default=True,
    help="Compare the VLM's text path and the backbone's logits on a fixed probe (loads both, one after the other).",
)
@_force("Replace an existing OUT_DIR.")
@_quiet_option()
def extract(vlm_path, out_dir, dtype, verify, force, quiet) -> Iterator[str]:
    """Write VLM_PATH's language backbone to OUT_DIR as a standalone causal LM (AutoModelForCausalLM)."""
    from lm_eval_sink.commands.extract import run_extract

    outcome = run_extract(vlm_path, out_dir, dtype=dtype, verify=verify, force=force, progress=not quiet)
    yield from outcome.lines
    outcome.raise_for_failure()


@cli.command()
@click.argument("backbone", type=_PATH)
@click.argument("vlm_path", type=_PATH)
@click.argument("out_dir", type=_PATH)
@click.option(
    "--verify/--no-verify",
    default=True,
    help="Compare the new VLM's text path with BACKBONE's logits on a fixed probe.",
)
@_force("Replace an existing OUT_DIR.")
@_quiet_option()
def inject(backbone, vlm_path, out_dir, verify, force, quiet) -> Iterator[str]:
    """Write a copy of VLM_PATH to OUT_DIR whose language model is BACKBONE (e.g. a merged backbone)."""
    from lm_eval_sink.commands.extract import run_inject

    outcome = run_inject(backbone, vlm_path, out_dir, verify=verify, force=force, progress=not quiet)
    yield from outcome.lines
    outcome.raise_for_failure()


# --- protocols, vendor registry and gap attribution (issue 8) ---


@cli.group()
def protocol() -> None:
    """Protocol fingerprints of lm-eval runs: what was run, and how two runs differ."""


@protocol.command("show")
@click.argument("run")
@click.option("--json", "as_json", is_flag=True, help="Print the fingerprint as JSON instead of a table.")
@_path_option("-o", "--output", help="Also write the fingerprint JSON (with provenance) here.")
@_force("Overwrite --output.")
def protocol_show(run, as_json, output, force) -> Iterable[str]:
    """Protocol fingerprint of RUN (a results JSON, samples JSONL or lm-eval output folder)."""
    from lm_eval_sink.commands.protocol import run_protocol_show

    return run_protocol_show(run, as_json, output, force=force)


@protocol.command("diff")
@click.argument("run_a")
@click.argument("run_b")
@click.option("--json", "as_json", is_flag=True, help="Print the differences as JSON instead of a table.")
@_path_option("-o", "--output", help="Also write the differences JSON (with provenance) here.")
@_force("Overwrite --output.")
def protocol_diff(run_a, run_b, as_json, output, force) -> Iterable[str]:
    """Only the protocol fields that differ between RUN_A and RUN_B, each marked whether it can change scores."""
    from lm_eval_sink.commands.protocol import run_protocol_diff

    return run_protocol_diff(run_a, run_b, as_json, output, force=force)


class _ManyValues(_Command):
    """Lets `--reference A B --candidate C` stand for `--reference A --reference B --candidate C` (`attribute`), and
    `--strength A B` for `--strength A --strength B` (`report`)."""

    many = ("--reference", "--candidate", "--strength")

    def parse_args(self, ctx, args) -> list[str]:
        out, current, after_flag = [], None, False  # after_flag: the value right after one of `many`, taken as is
        for arg in args:
            is_flag = arg.startswith("-") and arg != "-" and not after_flag
            if is_flag:
                current = arg if arg in self.many else None
            elif current is not None and not after_flag:
                out.append(current)
            after_flag = is_flag and current is not None
            out.append(arg)
        return super().parse_args(ctx, out)


@cli.group()
def vendor() -> None:
    """The vendor registry: reported and independently measured scores, each with source and protocol."""


@vendor.command("list")
@_path_option("--registry", "registry_file", help=_REGISTRY_HELP)
def vendor_list(registry_file) -> None:
    """Models in the registry with their number of scores and gaps."""
    from lm_eval_sink.vendors import list_markdown, load_registry

    click.echo(list_markdown(load_registry(registry_file)), nl=False)


@vendor.command("show")
@click.argument("model")
@_path_option("--registry", "registry_file", help=_REGISTRY_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def vendor_show(model, registry_file, as_json) -> None:
    """Every score and gap of MODEL (name, alias or hub id), with source and protocol."""
    from lm_eval_sink.io import canonical_json
    from lm_eval_sink.vendors import load_registry, show_markdown

    reg = load_registry(registry_file)
    if as_json:
        m = reg.model(model)
        click.echo(
            canonical_json(
                {
                    "model": m.name,
                    "hub_id": m.hub_id,
                    "kind": m.kind,
                    "scores": [s.model_dump() for s in reg.scores_of(m.name)],
                    "gaps": [g.model_dump() for g in reg.gaps_of(m.name)],
                }
            ),
            nl=False,
        )
    else:
        click.echo(show_markdown(reg, model), nl=False)


@vendor.command("add")
@click.option("--model", required=True, help="Registry name of the model (a new one is defined in your file).")
@click.option("--benchmark", required=True, help="Benchmark family, as in benchmarks.yaml (IFEval, GSM8K, MMLU, ...).")
@click.option("--value", type=float, required=True, help="The reported score, in points (0-100).")
@click.option("--source", required=True, help="Source id: an existing one, or a new one with --source-title.")
@click.option("--protocol", required=True, help="Protocol id: an existing one, or a new one with --described.")
@click.option("--metric", help="The metric as the source names it (default: the family's strict metric).")
@click.option("--id", "score_id", help="The score's id (default: MODEL/BENCHMARK/SOURCE, lower case).")
@click.option("--hub-id", help="A new model's hub id (what matches a run of that hub id to it).")
@click.option("--kind", type=click.Choice(["llm", "vlm"]), default="llm", help="A new model's kind.")
@click.option("--source-title", help="A new source's title (the report, model card or page, and table).")
@click.option("--source-kind", type=click.Choice(["vendor", "independent", "paper"]), default="vendor")
@click.option("--source-url", help="A new source's URL.")
@click.option("--described", help="A new protocol: what the source says about how it measured.")
@click.option(
    "--stated",
    multiple=True,
    metavar="KEY=VALUE",
    help="A new protocol: what the source states (apply_chat_template, num_fewshot, enable_thinking, ...); repeatable.",
)
@click.option("--verified-at", help="Where you read the figure: URL or file, table, row and column.")
@click.option("--quote", help="The exact text you read there (with --verified-at).")
@click.option("--date", help="When you read it (ISO date; default today).")
@click.option("--unverified", help="Why the figure is not verified (default: no quote was given).")
@click.option("--note", help="A remark kept with the score.")
@_path_option(
    "--registry",
    "registry_file",
    help="The user registry file to add to (created if missing; default: vendors.yaml in the project cache).",
)
def vendor_add(registry_file, stated, verified_at, quote, date, unverified, **score) -> Iterable[str]:
    """Record one vendor (or independent) figure with its source, protocol and model, validated against the registry's
    schema, in a user registry file (never the package's own data)."""
    from lm_eval_sink.commands.vendor import run_vendor_add
    from lm_eval_sink.protocols import parse_gen_kwargs
    from lm_eval_sink.vendors import NewScore

    new = NewScore(stated=parse_gen_kwargs(list(stated)), **score)
    return run_vendor_add(new, registry_file, at=verified_at, quote=quote, date=date, unverified=unverified)


@cli.command(cls=_ManyValues)
@click.option(
    "--reference",
    "references",
    multiple=True,
    required=True,
    metavar="RUN...",
    help="Reference runs (lm-eval output folder, results JSON) or registry entries (vendor:SCORE_ID, vendor:MODEL).",
)
@click.option(
    "--candidate",
    "candidates",
    multiple=True,
    required=True,
    metavar="RUN...",
    help="Candidate runs or registry entries, as --reference.",
)
@click.option(
    "--vendor",
    is_flag=True,
    help="Add vendor-reported scores and reported gaps of the models involved from the registry (and say which "
    "models have none).",
)
@_path_option("--registry", "registry_file", help=_REGISTRY_HELP)
@_path_option("--benchmarks", "benchmarks_file", help="A YAML of benchmark families (construct, metric keys).")
@click.option(
    "--lineage",
    "declared_lineage",
    type=click.Choice(["parent", "not-parent"]),
    help="Declare whether the reference is the candidate's parent (checked against model cards).",
)
@click.option(
    "--mixture",
    multiple=True,
    metavar="KEY=VALUE",
    help="A fact of the VL training recipe, e.g. text_share=0.1 (repeatable; shown, never inferred).",
)
@click.option(
    "--baseline-protocol", help="Protocol the others' effects are measured against (default: the first one seen)."
)
@click.option("--allow-partial", is_flag=True, help="Pair only the docs both sample logs hold (the drop is recorded).")
@click.option(
    "--as",
    "as_names",
    multiple=True,
    metavar="[FOLDER=]NAME",
    help="The registry model a run's local model folder is (FOLDER left out: the one local model); repeatable.",
)
@_path_option("--output", help="Folder for attribution.json, attribution.md, attribution.png.")
@_force("Overwrite --output.")
def attribute(references, candidates, output, force, **options) -> Iterable[str]:
    """Attribute each benchmark's candidate-minus-reference gap to lineage, protocol, access vs capacity, construct and
    mixture."""
    from lm_eval_sink.attribution import AttributeOptions
    from lm_eval_sink.commands.attribute import run_attribute

    return run_attribute(list(references), list(candidates), output, AttributeOptions(**options), force=force)


@cli.command("eval")
@click.argument("model")
@click.option(
    "--protocol",
    "protocol_name",
    required=True,
    help="Named protocol: instruct, community, or one from --protocol-file.",
)
@_path_option("--protocol-file", help="A YAML of extra named protocols (see lm_eval_sink/data/protocols.yaml).")
@click.option("--tasks", required=True, help="Comma-separated lm-eval task names, e.g. ifeval,gsm8k_cot_zeroshot.")
@click.option("--limit", type=float, help="Docs per task (or a fraction); the scores are then not final.")
@click.option(
    "--gen-kwargs",
    multiple=True,
    metavar="KEY=VALUE",
    help="Generation overrides on top of the protocol's, e.g. max_gen_toks=256.",
)
@click.option("--batch-size", help="Batch size, where the protocol does not fix it (default 1).")
@click.option("--dtype", type=click.Choice(DTYPES), help="Model dtype, where the protocol does not fix it.")
@click.option("--seed", type=int, help="Seed for lm-eval's random generators, where the protocol does not fix it.")
@click.option("--device", callback=_device, help=f"HF only: {DEVICE_HELP} (default {DEFAULT_DEVICE}).")
@click.option(
    "--backend",
    type=click.Choice(["hf", "vllm"]),
    default="hf",
    help="lm-eval model backend; vllm needs vllm installed (sink_strength is then measured first with transformers).",
)
@click.option(
    "--model-args",
    "model_args",
    metavar="K=V,...",
    help="Extra backend arguments, e.g. tensor_parallel_size=2,max_model_len=4096.",
)
@click.option("--include-path", help="One extra folder of lm-eval task YAMLs.")
@click.option(
    "--no-log-samples",
    is_flag=True,
    help="Do not write per-sample logs (attribution then works from aggregate scores only).",
)
@_lm_eval_python("this one; docs/scale.md")
@_path_option("--output", required=True, help="lm-eval output folder for this run.")
@_force("Write into an existing --output.")
def eval_cmd(
    model, protocol_name, protocol_file, gen_kwargs, model_args, no_log_samples, lm_eval_python, output, force, **run
) -> Iterable[str]:
    """Run lm-eval on MODEL under a named protocol, then print the run's protocol fingerprint check."""
    from lm_eval_sink.commands.eval import EvalOptions, parse_model_args, run_eval
    from lm_eval_sink.protocols import RunRequest, parse_gen_kwargs

    request = RunRequest(
        **run,
        gen_kwargs=parse_gen_kwargs(gen_kwargs),
        log_samples=not no_log_samples,
        model_args=parse_model_args(model_args),
        python=str(lm_eval_python) if lm_eval_python else None,
    )
    return run_eval(EvalOptions(model, protocol_name, output, request, protocol_file=protocol_file, force=force))


# --- buckets (issue 5) ---
@cli.command()
@click.argument("reference")
@click.argument("candidate", required=False)
@click.option("--task", help="Task whose samples to pair (default: the one task both runs share).")
@click.option(
    "--checkpoint",
    help="With a sweep's output folder: the checkpoint to compare with its reference (default: the candidate).",
)
@click.option("--metric", help="Per-sample metric (default: the task's, e.g. prompt_level_strict_acc for ifeval).")
@click.option("--filter", help="lm-eval filter (default: the task's, e.g. strict-match for gsm8k_cot*).")
@click.option(
    "--threshold",
    type=float,
    help="Continuous metrics (eq_bench): pass = score >= THRESHOLD, giving buckets and McNemar.",
)
@click.option(
    "--allow-partial", is_flag=True, help="Pair the common docs when the doc sets differ (the drop is recorded)."
)
@click.option(
    "--same-protocol", is_flag=True, help="Refuse runs whose protocols differ (chat template, few-shot, limit, ...)."
)
@click.option("--tokenizer", help="Tokenizer (folder, hub id or 'default') to count response tokens for truncation.")
@click.option("--max-gen-toks", type=int, help="Generation limit, when the samples do not record it.")
@click.option(
    "--effect",
    type=float,
    metavar="SIZE",
    help="The difference whose power and documents needed are reported: points for a 0/1 metric or a pass rate "
    "(--threshold), else the metric's unit (default: 5% of the metric's range, 5 points for a 0/1 metric).",
)
@click.option(
    "--repeat",
    metavar="RUN",
    help="A second run of the reference under the same protocol: the flip rate between the two, and how many "
    "regressions it alone would explain.",
)
@click.option(
    "--bootstrap",
    "n_bootstrap",
    type=int,
    default=10_000,
    help="Bootstrap resamples for a continuous metric's interval and IFEval's instruction-level one (a 0/1 "
    "interval is exact).",
)
@click.option("--confidence", type=float, default=0.95)
@click.option("--seed", type=int, default=0, help="Bootstrap seed.")
@click.option(
    "--failure-kinds/--no-failure-kinds", default=True, help="IFEval: classify regressions with lm-eval's checker."
)
@_path_option("--output", help="Folder for buckets.json, buckets.md, prompts.csv and PNGs (default: print only).")
@_force("Overwrite an existing --output folder.")
@_quiet_option()
def buckets(
    reference, candidate, task, checkpoint, tokenizer, same_protocol, repeat, output, force, quiet, **settings
) -> Iterable[str]:
    """Per-prompt regression buckets of CANDIDATE vs REFERENCE (lm-eval runs: results JSON, samples JSONL, output
    folder, a sweep's evals/NAME folder, or a sweep's output folder with --checkpoint)."""
    from lm_eval_sink.buckets.settings import BucketSettings
    from lm_eval_sink.commands.buckets import CompareOptions, run_buckets

    bucket_settings = BucketSettings(**settings)
    options = CompareOptions(tokenizer=tokenizer, same_protocol=same_protocol, repeat=repeat, progress=not quiet)
    _, lines = run_buckets(
        reference, candidate, task, bucket_settings, output, options, checkpoint=checkpoint, force=force
    )
    return lines


# --- recovery (issue 50) ---
@cli.command()
@click.option("--reference", required=True, help="The reference run (the LLM), as `buckets` takes a run.")
@click.option("--candidate", required=True, help="The candidate run (the VLM backbone), as `buckets` takes a run.")
@click.argument("controls", nargs=-1, metavar="NAME=RUN [NAME=RUN ...]")
@click.option("--confidence", type=float, default=0.95)
@_path_option(
    "--output", help="Folder for recovery.json, recovery.md, recovery.png and prompts.parquet (default: print only)."
)
@_force("Overwrite an existing --output folder.")
def recovery(reference, candidate, controls, confidence, output, force) -> Iterable[str]:
    """Did each control (a merge) recover what CANDIDATE lost against REFERENCE, prompt by prompt? Paired tests per
    task with Holm's correction across every control x task, the recovered share and a verdict in words."""
    from lm_eval_sink.buckets.settings import BucketSettings
    from lm_eval_sink.commands.recovery import run_recovery

    settings = BucketSettings(confidence=confidence, failure_kinds=False)
    _, lines = run_recovery(reference, candidate, controls, settings, output, force=force)
    return lines


# --- merging controls (issue 7) ---


@cli.group()
def configs() -> None:
    """Bundled merge controls: list them, render one to mergekit YAML, validate a mergekit YAML."""


@configs.command("list")
def configs_list() -> Iterable[str]:
    """The bundled merge controls (NAME = file stem in merge_configs/)."""
    from lm_eval_sink.merging.configs import list_templates

    return [f"{t.name:<16} {t.method:<16} {t.paper_setting}: {t.summary}" for t in list_templates()]


@configs.command("render")
@click.argument("name")
@click.option("--reference", required=True, help="The text LLM (folder).")
@click.option("--candidate", required=True, help="The extracted VLM language backbone (folder).")
@click.option(
    "--base", help="A pretrained ancestor of both (siblings lineage); default: base = reference (chain lineage)."
)
@click.option(
    "--tokenizer-source",
    help="Output vocabulary: base, union, reference, candidate or a model folder (default: "
    "mergekit's rule, the base_model's tokenizer).",
)
@_path_option("-o", "--output", required=True, help="The mergekit YAML to write.")
@_force("Overwrite an existing file.")
def configs_render(name, reference, candidate, base, tokenizer_source, output, force) -> Iterable[str]:
    """Fill a bundled control (NAME) for one model pair and write plain mergekit YAML."""
    from lm_eval_sink.commands.configs import run_configs_render

    warnings, lines = run_configs_render(
        name, reference, candidate, output, base=base, tokenizer_source=tokenizer_source, force=force
    )
    for warning in warnings:
        click.echo(f"warning: {warning}", err=True)
    return lines


@configs.command("validate")
@click.argument("config_file", type=_PATH)
def configs_validate(config_file) -> Iterable[str]:
    """Check a mergekit YAML against its merge method's declared parameters (reads no weights)."""
    from lm_eval_sink.merging.configs import validate_file

    vc = validate_file(config_file)
    return [
        f"{config_file}: ok (merge_method {vc.method}, {len(vc.inputs)} inputs, base_model {vc.base_model or 'none'})"
    ]


@cli.command("merge")
@click.argument("config_file", type=_PATH)
@click.argument("out", type=_PATH)
@click.option("--random-seed", type=int, help="Seed for random methods (DARE): bit-identical reruns.")
@click.option("--device", default="cpu", callback=_device, help="mergekit's math device, or auto.")
@_force("Replace an existing OUT folder.")
@_quiet_option()
def merge(config_file, out, random_seed, device, force, quiet) -> Iterable[str]:
    """Validate a mergekit YAML, then merge it in-process into a verified OUT folder."""
    from lm_eval_sink.commands.merge import run_merge

    return run_merge(config_file, out, random_seed=random_seed, device=device, force=force, quiet=quiet)


@cli.command("sweep")
@click.argument("sweep_file", type=_PATH)
@_path_option("--output", help="Output folder (default: the YAML's 'output').")
@_force("Redo every step, replacing earlier outputs.")
@click.option(
    "--redo",
    multiple=True,
    metavar="KIND|NAME",
    help="Redo the finished units of a kind (merge, eval, strength) or of a checkpoint; repeatable.",
)
@click.option(
    "--delete-merged", is_flag=True, default=None, help="Delete merged weights once their checkpoint is evaluated."
)
@click.option(
    "--in-memory/--on-disk",
    "in_memory",
    default=None,
    help="Merge into one resident model and evaluate it in this process (default: the file's merge.in_memory).",
)
@_quiet_option("A line per step instead of progress bars; no library warnings.")
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    help="Where units run (default: the file's engine.kind, else local).",
)
@click.option(
    "--ray-address",
    help="Ray cluster: auto, ray://host:port (default: the file's engine.address; none starts Ray here).",
)
@_lm_eval_python("the file's eval.python")
@click.option(
    "--fresh-engine",
    is_flag=True,
    help="backend vllm: one engine per checkpoint (an lm_eval process each), not one resident engine whose "
    "weights are swapped in place (eval.engine_reuse: false).",
)
def sweep(sweep_file, force, redo, quiet, lm_eval_python, **overrides) -> Iterator[str]:
    """Merge, evaluate (lm-eval) and measure S for every checkpoint of SWEEP.yaml; resumable."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    spec = load_sweep(sweep_file, python=str(lm_eval_python) if lm_eval_python else None, **overrides)
    report = run_sweep(spec, force=force, progress=not quiet, redo=redo, announce=click.echo)
    yield from report.lines()
    report.raise_for_failures()


@cli.command("report", cls=_ManyValues)
@_path_option(
    "--strength",
    multiple=True,
    metavar="PATH",
    help="Given twice, reference then candidate: a strength JSON or folder (of `strength`, or a sweep's "
    "strength/NAME), or an lm-eval run of the sink_strength task.",
)
@_path_option("--margin", help="Output folder (or margin.json) of `margin`.")
@_path_option(
    "--buckets",
    multiple=True,
    help="Output folder (or buckets.json) of `buckets`; repeatable (the headline: the IFEval one, else the first).",
)
@_path_option("--attribution", help="Output folder (or attribution.json) of `attribute`.")
@_path_option(
    "--recovery", help="Output folder (or recovery.json) of `recovery` (a --sweep folder brings its recovery/)."
)
@_path_option("--sweep", help="Output folder (or table.json) of `sweep`.")
@click.option("--title", help="Page title (default: the two models).")
@_path_option("-o", "--output", required=True, help="The HTML file to write.")
@_force("Overwrite an existing file.")
def report(output, force, **inputs) -> Iterable[str]:
    """One self-contained HTML page for a reference/candidate pair from this project's outputs (works offline)."""
    from lm_eval_sink.commands.report import run_report

    return run_report(output, force=force, **inputs)


@cli.command("protect-plan")
@click.argument("model_name", metavar="MODEL")
@click.option("--last-k", default="10", help="Heads of the last K layers are candidates, or 'all'.")
@click.option("--threshold", type=float, default=0.0, help="Protect heads whose median sink log-odds exceeds this.")
@click.option(
    "--min-pos0-fraction",
    type=float,
    default=0.8,
    help="...and whose sink is position 0 in at least this share of rows.",
)
@click.option(
    "--tau",
    type=float,
    default=0.0,
    help="Share of |k_s|^2 Rule Q may leave unprotected (0: the sink logit cannot move through W_q).",
)
@_CALIBRATION_OPTIONS
@_path_option("-o", "--output", required=True, help="The plan JSON to write.")
def protect_plan(model_name, last_k, threshold, min_pos0_fraction, tau, output, **calibration) -> Iterable[str]:
    """Choose the sink heads to protect during training (MODEL: folder, hub id or 'default'); see docs/training.md."""
    from lm_eval_sink.commands.protect_plan import run_protect_plan
    from lm_eval_sink.training.protection import ProtectSettings

    settings, options = _measuring(last_k, **calibration)
    protect = ProtectSettings(threshold=threshold, min_pos0_fraction=min_pos0_fraction, tau=tau)
    return run_protect_plan(model_name, settings, output, protect, options)


def _our_name(e: click.ClickException) -> str:
    """For an lm-eval option name given to a command that calls it otherwise, the name it has here."""
    ours, ctx = _OUR_NAMES.get(getattr(e, "option_name", None) or ""), getattr(e, "ctx", None)
    if ours is None or ctx is None or not any(ours in p.opts for p in ctx.command.params):
        return ""
    return f" (fix: this command takes {ours}; `{ctx.command_path} --help` lists the options)"


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors are one line and exit 2; Ctrl-C exits 130."""
    try:
        cli.main(args=argv, prog_name="lm-eval-sink", standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e.line()}", err=True)
        return 2
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}{_our_name(e)}", err=True)
        return 2
    except (click.exceptions.Abort, KeyboardInterrupt):  # click's Abort is its Ctrl-C
        click.echo("interrupted", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
