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
