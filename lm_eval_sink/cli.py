"""The `lm-eval-sink` command line: thin click commands over the Python API.

This is the only place that catches `UserError` (one `error:` line on stderr, exit 2) and picks
exit codes. Heavy packages are imported inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from lm_eval_sink.errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lm-eval-sink")
def cli() -> None:
    """Sink Strength, regression buckets and merging controls for lm-evaluation-harness."""


@cli.group()
def models() -> None:
    """The embedded default model."""


@models.command("default")
def models_default() -> None:
    """Print the converted SmolLM2-135M-Instruct folder, creating it if needed."""
    from lm_eval_sink.models import default_model_dir

    click.echo(str(default_model_dir()))


def _slug(name: str) -> str:
    from lm_eval_sink.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    if name == DEFAULT_MODEL:
        return DEFAULT_MODEL_NAME
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(name.rstrip("/")).name or name)


@cli.command()
@click.argument("model_names", metavar="MODEL [MODEL ...]", nargs=-1, required=True)
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None, help="JSONL with a 'prompt' field, or text with one prompt a line.")
@click.option("--n-prompts", type=int, default=None, help="First N prompts (builtin set: 5 or 15; default all).")
@click.option("--last-k", default="10", show_default=True, help="Number of last layers, or 'all'.")
@click.option("--statistic", type=click.Choice(["median", "mean"]), default="median", show_default=True)
@click.option("--rows", type=click.Choice(["all", "content"]), default="all", show_default=True, help="Rows S is taken over: every query position >= 1, or the user message's tokens only.")
@click.option("--chat-template/--no-chat-template", default=True, show_default=True, help="Render prompts through the tokenizer's chat template.")
@click.option("--system-prompt", default=None, help="System message to put before each prompt (chat template only).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--batch-size", type=int, default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--output", type=click.Path(path_type=Path), required=True, help="Folder for the JSON, tables and heatmaps.")
@click.option("--force", is_flag=True, help="Overwrite earlier results.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def strength(model_names, prompts_file, n_prompts, last_k, statistic, rows, chat_template, system_prompt, dtype, device, batch_size, seed, output, force, quiet) -> None:
    """Sink Strength S of one or more models (MODEL: a folder, a hub id when online, or 'default')."""
    from lm_eval_sink.strength import StrengthSettings, run_strength

    if last_k == "all":
        k = None
    else:
        try:
            k = int(last_k)
        except ValueError:
            raise UserError(f"--last-k must be a number or 'all', got {last_k!r}", "use e.g. --last-k 10") from None
    settings = StrengthSettings(last_k=k, statistic=statistic, rows=rows, n_prompts=n_prompts, prompts_file=str(prompts_file) if prompts_file else None,
                                use_chat_template=chat_template, system_prompt=system_prompt, batch_size=batch_size, seed=seed)
    names = list(model_names)
    report = run_strength(names, [_slug(n) for n in names], settings, output, dtype=dtype, device=device, force=force, progress=not quiet)
    for line in report:
        click.echo(line)


@cli.command("tasks-dir")
def tasks_dir_cmd() -> None:
    """Print the folder of this project's lm-eval tasks (for lm_eval --include_path)."""
    from lm_eval_sink.harness import tasks_dir

    click.echo(str(tasks_dir()))


# --- screening, fits and sink margins (issue 9) ---


def _calibration_options(f):
    """Options shared by `screen` and `margin`: the calibration of a Sink Strength measurement."""
    for opt in reversed([
        click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None, help="JSONL with a 'prompt' field, or text with one prompt a line."),
        click.option("--n-prompts", type=int, default=None, help="First N prompts (builtin set: 5 or 15; default all)."),
        click.option("--rows", type=click.Choice(["all", "content"]), default="all", show_default=True, help="Rows used: every query position >= 1, or the user message's tokens only."),
        click.option("--chat-template/--no-chat-template", default=True, show_default=True, help="Render prompts through the chat template."),
        click.option("--system-prompt", default=None, help="System message before each prompt (chat template only)."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True),
        click.option("--device", default="cpu", show_default=True),
        click.option("--batch-size", type=int, default=1, show_default=True),
        click.option("--force", is_flag=True, help="Overwrite earlier results."),
        click.option("--quiet", is_flag=True, help="No progress bars."),
    ]):
        f = opt(f)
    return f


def _last_k(value: str) -> int | None:
    if value == "all":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"--last-k must be a number or 'all', got {value!r}", "use e.g. --last-k 10") from None


@cli.command()
@click.argument("model_names", metavar="MODEL [MODEL ...]", nargs=-1, required=True)
@click.option("--pairs", "pairs_file", type=click.Path(path_type=Path), default=None, help="PAIRS.yaml to fit the predictor on (default: the paper's six pairs).")
@click.option("--last-k", default="10", show_default=True, help="S over the last K layers, or 'all'.")
@_calibration_options
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Folder for screen.json/.md/.csv/.png and per-model strength files (default: print only).")
def screen(model_names, pairs_file, last_k, prompts_file, n_prompts, rows, chat_template, system_prompt, dtype, device, batch_size, force, quiet, output) -> None:
    """Rank backbones by Sink Strength S and predict their post-VL deltas (MODEL: folder, hub id or 'default')."""
    from lm_eval_sink.screen import run_screen
    from lm_eval_sink.strength import StrengthSettings

    settings = StrengthSettings(last_k=_last_k(last_k), rows=rows, n_prompts=n_prompts, prompts_file=str(prompts_file) if prompts_file else None,
                                use_chat_template=chat_template, system_prompt=system_prompt, batch_size=batch_size)
    names = list(model_names)
    for line in run_screen(names, [_slug(n) for n in names], settings, pairs_file, output, dtype=dtype, device=device, force=force, progress=not quiet):
        click.echo(line)


@cli.command()
@click.argument("pairs_file", metavar="[PAIRS.yaml]", required=False, type=click.Path(path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Folder for fit.json, fit.md and fit_<task>.png (default: print only).")
@click.option("--force", is_flag=True, help="Overwrite earlier results.")
def fit(pairs_file, output, force) -> None:
    """Fit S -> delta per task: Spearman rho, exact permutation p, line, leave-one-pair-out errors (no file: the paper's table)."""
    from lm_eval_sink.predict import run_fit

    for line in run_fit(pairs_file, output, force=force):
        click.echo(line)


@cli.command()
@click.argument("reference")
@click.argument("candidate")
@click.option("--quantile", type=float, default=0.95, show_default=True, help="Quantile of the per-row shift for the second B_gap.")
@click.option("--last-k", default="all", show_default=True, help="Layers of the margin table: the last K, or 'all'.")
@click.option("--strength-last-k", default="10", show_default=True, help="K of both models' own Sink Strength S.")
@_calibration_options
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Folder for margin.json/.md/.csv, margin_rows.npz and margin_heatmap.png (default: print only).")
def margin(reference, candidate, quantile, last_k, strength_last_k, prompts_file, n_prompts, rows, chat_template, system_prompt, dtype, device, batch_size, force, quiet, output) -> None:
    """Per-head sink margins G_base - B_gap of CANDIDATE (e.g. a VLM backbone) against REFERENCE (its LLM)."""
    from lm_eval_sink.margin import MarginSettings, run_margin
    from lm_eval_sink.strength import StrengthSettings

    st = StrengthSettings(last_k=_last_k(strength_last_k), rows=rows, n_prompts=n_prompts, prompts_file=str(prompts_file) if prompts_file else None,
                          use_chat_template=chat_template, system_prompt=system_prompt, batch_size=batch_size)
    settings = MarginSettings(strength=st, last_k=_last_k(last_k), quantile=quantile)
    for line in run_margin(reference, candidate, settings, output, dtype=dtype, device=device, force=force, progress=not quiet):
        click.echo(line)


# --- VLM backbone extraction (issue 6) ---


def _echo_extraction(report) -> None:
    """Print an extract/inject report; a failed verification becomes the one error line (exit 2)."""
    what = "extracted" if report.operation == "extract" else "injected"
    head = "tied head" if report.tied_embeddings else "untied head"
    click.echo(f"{what} {report.family} ({report.source_class}) <-> {report.target_class}: {report.tensors_written} tensors, "
               f"{report.bytes_written / 1e6:.1f} MB in {len(report.shards)} shard(s), {report.dtype}, {head}, {report.seconds:.1f} s")
    if report.operation == "extract":
        click.echo(f"chat template: {report.chat_template_source or 'none found'}" + ("" if report.tokenizer else " (no tokenizer in the VLM folder)"))
    v = report.verification
    if v is None:
        click.echo("verification: skipped (--no-verify); structural checks only")
    elif v.passed:
        click.echo(f"verification: max |logit difference| {v.max_abs_diff:.3g} <= {v.tolerance:.3g} ({v.dtype}, {v.probe_tokens} probe tokens): passed")
    marker = "COMPLETE.json" if report.ok else "FAILED.json"
    report_file = "extraction.json" if report.operation == "extract" else "injection.json"
    click.echo(f"wrote {report.output} ({report_file}, {marker})")
    if not report.ok:
        raise UserError(f"verification failed: {v.reason}; the output is kept at {report.output} and marked failed (FAILED.json, no COMPLETE.json)",
                        f"see {report_file} for the tensor mapping; the architecture rules do not reproduce this VLM's text path")


@cli.command()
@click.argument("vlm_path", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["keep", "bf16", "fp32"]), default="keep", show_default=True, help="Dtype of the written tensors (keep: as stored in the VLM).")
@click.option("--verify/--no-verify", default=True, show_default=True, help="Compare the VLM's text path and the backbone's logits on a fixed probe (loads both, one after the other).")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def extract(vlm_path, out_dir, dtype, verify, force, quiet) -> None:
    """Write VLM_PATH's language backbone to OUT_DIR as a standalone causal LM (AutoModelForCausalLM)."""
    from lm_eval_sink.extract import extract_backbone

    _echo_extraction(extract_backbone(vlm_path, out_dir, dtype=dtype, verify=verify, force=force, progress=not quiet))


@cli.command()
@click.argument("backbone", type=click.Path(path_type=Path))
@click.argument("vlm_path", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--verify/--no-verify", default=True, show_default=True, help="Compare the new VLM's text path with BACKBONE's logits on a fixed probe.")
@click.option("--force", is_flag=True, help="Replace an existing OUT_DIR.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def inject(backbone, vlm_path, out_dir, verify, force, quiet) -> None:
    """Write a copy of VLM_PATH to OUT_DIR whose language model is BACKBONE (e.g. a merged backbone)."""
    from lm_eval_sink.extract import inject_backbone

    _echo_extraction(inject_backbone(backbone, vlm_path, out_dir, verify=verify, force=force, progress=not quiet))


# --- buckets (issue 5) ---
@cli.command()
@click.argument("reference")
@click.argument("candidate")
@click.option("--task", default=None, help="Task whose samples to pair (default: the one task both runs share).")
@click.option("--metric", default=None, help="Per-sample metric (default: the task's, e.g. prompt_level_strict_acc for ifeval).")
@click.option("--filter", "filter_name", default=None, help="lm-eval filter (default: the task's, e.g. strict-match for gsm8k_cot*).")
@click.option("--threshold", type=float, default=None, help="Continuous metrics (eq_bench): pass = score >= THRESHOLD, giving buckets and McNemar.")
@click.option("--allow-partial", is_flag=True, help="Pair the common docs when the doc sets differ (the drop is recorded).")
@click.option("--same-protocol", is_flag=True, help="Refuse runs whose protocols differ (chat template, few-shot, limit, ...).")
@click.option("--tokenizer", default=None, help="Tokenizer (folder, hub id or 'default') to count response tokens for truncation.")
@click.option("--max-gen-toks", type=int, default=None, help="Generation limit, when the samples do not record it.")
@click.option("--bootstrap", "n_bootstrap", type=int, default=10_000, show_default=True, help="Bootstrap resamples for the intervals.")
@click.option("--confidence", type=float, default=0.95, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Bootstrap seed.")
@click.option("--failure-kinds/--no-failure-kinds", default=True, show_default=True, help="IFEval: classify regressions with lm-eval's checker.")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Folder for buckets.json, buckets.md, prompts.csv and PNGs (default: print only).")
@click.option("--force", is_flag=True, help="Overwrite an existing --output folder.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def buckets(reference, candidate, task, metric, filter_name, threshold, allow_partial, same_protocol, tokenizer, max_gen_toks, n_bootstrap, confidence, seed, failure_kinds, output, force, quiet) -> None:
    """Per-prompt regression buckets of CANDIDATE vs REFERENCE (lm-eval runs: results JSON, samples JSONL or output folder)."""
    from lm_eval_sink.buckets import BucketSettings, run_buckets

    settings = BucketSettings(metric=metric, filter=filter_name, threshold=threshold, allow_partial=allow_partial, n_bootstrap=n_bootstrap,
                              confidence=confidence, seed=seed, failure_kinds=failure_kinds, max_gen_toks=max_gen_toks)
    _, lines = run_buckets(reference, candidate, task, settings, output, force=force, tokenizer=tokenizer, same_protocol=same_protocol, progress=not quiet)
    for line in lines:
        click.echo(line)
def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors are one line and exit 2; Ctrl-C exits 130."""
    try:
        cli.main(args=argv, prog_name="lm-eval-sink", standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e.line()}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("interrupted", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        return 2
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
