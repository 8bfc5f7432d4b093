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


# --- merging controls (issue 7) ---


@cli.group()
def configs() -> None:
    """Bundled merge controls: list them, render one to mergekit YAML, validate a mergekit YAML."""


@configs.command("list")
def configs_list() -> None:
    """The bundled merge controls (NAME = file stem in merge_configs/)."""
    from lm_eval_sink.merging.configs import list_templates

    for t in list_templates():
        click.echo(f"{t.name:<16} {t.method:<16} {t.paper_setting}: {t.summary}")


@configs.command("render")
@click.argument("name")
@click.option("--reference", required=True, help="The text LLM (folder).")
@click.option("--candidate", required=True, help="The extracted VLM language backbone (folder).")
@click.option("--base", default=None, help="A pretrained ancestor of both (siblings lineage); default: base = reference (chain lineage).")
@click.option("--tokenizer-source", default=None, help="Output vocabulary: base, union, reference, candidate or a model folder (default: mergekit's rule, the base_model's tokenizer).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="The mergekit YAML to write.")
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def configs_render(name, reference, candidate, base, tokenizer_source, output, force) -> None:
    """Fill a bundled control (NAME) for one model pair and write plain mergekit YAML."""
    from lm_eval_sink.io import atomic_write_text, check_new_outputs
    from lm_eval_sink.merging.configs import render

    if output.is_dir():
        raise UserError(f"-o {output} is a folder", "pass a file path, e.g. -o tsv.yaml")
    check_new_outputs([output], force)
    rendered = render(name, reference, candidate, base=base, tokenizer_source=tokenizer_source)
    atomic_write_text(output, rendered.text)
    for warning in rendered.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"{rendered.name} ({rendered.lineage} lineage: {rendered.formula}) -> {output}")


@configs.command("validate")
@click.argument("config_file", type=click.Path(path_type=Path))
def configs_validate(config_file) -> None:
    """Check a mergekit YAML against its merge method's declared parameters (reads no weights)."""
    from lm_eval_sink.merging.configs import validate_file

    vc = validate_file(config_file)
    click.echo(f"{config_file}: ok (merge_method {vc.method}, {len(vc.inputs)} inputs, base_model {vc.base_model or 'none'})")


@cli.command("merge")
@click.argument("config_file", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--random-seed", type=int, default=None, help="Seed for random methods (DARE): bit-identical reruns.")
@click.option("--device", default="cpu", show_default=True, help="mergekit's math device.")
@click.option("--force", is_flag=True, help="Replace an existing OUT folder.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def merge(config_file, out, random_seed, device, force, quiet) -> None:
    """Validate a mergekit YAML, then merge it in-process into a verified OUT folder."""
    from lm_eval_sink.merging.merge import merge_config

    result = merge_config(config_file, out, random_seed=random_seed, device=device, force=force, quiet=quiet)
    click.echo(f"{result.method}: {result.n_tensors} tensors verified -> {result.out}")


@cli.command("sweep")
@click.argument("sweep_file", type=click.Path(path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Output folder (default: the YAML's 'output').")
@click.option("--force", is_flag=True, help="Redo every step, replacing earlier outputs.")
@click.option("--delete-merged", is_flag=True, default=None, help="Delete merged weights once their checkpoint is evaluated.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def sweep(sweep_file, output, force, delete_merged, quiet) -> None:
    """Merge, evaluate (lm-eval) and measure S for every checkpoint of SWEEP.yaml; resumable."""
    from lm_eval_sink.merging.sweep import load_sweep, run_sweep

    spec = load_sweep(sweep_file, output=output, delete_merged=delete_merged)
    report = run_sweep(spec, force=force, progress=not quiet)
    for line in report.lines():
        click.echo(line)
    report.raise_for_failures()


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
