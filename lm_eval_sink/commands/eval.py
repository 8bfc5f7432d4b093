"""`lm-eval-sink eval`: lm-eval on one model under a named protocol, then the run's protocol check.

The output is lm-eval's own `--output_path` folder, added to with `force`, held while lm-eval writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lm_eval_sink.errors import UserError
from lm_eval_sink.protocols import RunRequest


@dataclass(frozen=True, slots=True)
class EvalOptions:
    """The `eval` command's options: what to run (`model` under the named `protocol`, from `protocol_file` or the
    built-in ones), where (`output`, added to only with `force`), and the run's own settings (`run`)."""

    model: str
    protocol: str
    output: Path
    run: RunRequest
    protocol_file: Path | None = None
    force: bool = False


def parse_model_args(text: str | None) -> dict[str, str]:
    """`--model-args K=V,...` as a dict (a part without `=` is the one-line error)."""
    margs = {}
    for part in (text or "").split(","):
        if part.strip():
            if "=" not in part:
                raise UserError(
                    f"--model-args {part!r} is not KEY=VALUE",
                    "e.g. --model-args tensor_parallel_size=2,max_model_len=4096",
                )
            k, v = part.split("=", 1)
            margs[k.strip()] = v.strip()
    return margs


def _check_output(output: Path, inputs: list, force: bool) -> None:
    """The output folder overlaps no input, is no file, and is new or empty unless `force` (lm-eval adds to it)."""
    from lm_eval_sink.outputs import check_not_inputs, check_writable

    check_not_inputs([output], inputs=inputs, option="--output")
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file, not a folder", "pass a folder path as --output")
    check_writable(output)
    if output.exists() and any(output.iterdir()) and not force:
        raise UserError(
            f"output already exists: {output}", "pass --force to add this run to it, or choose another --output"
        )


def _report(run, settings, protocol) -> list[str]:
    """The lines printed after the run: its files, the interpreter and versions, the protocol check, a subset's note."""
    from lm_eval_sink.harness.runner import eval_versions
    from lm_eval_sink.keys import versions_text
    from lm_eval_sink.protocols import fingerprint_run, limit_lines

    fp = fingerprint_run(run)
    off = protocol.mismatches(fp)
    versions = versions_text(eval_versions(settings))
    lines = [f"results: {run.results}", f"lm-eval ran in {settings.interpreter()}: {versions}"]
    lines += [f"samples {task}: {path}" for task, path in sorted(run.samples.items())]
    lines.append(
        f"protocol {protocol.name}: "
        + ("recorded settings match" if not off else "recorded settings DIFFER: " + ", ".join(off))
    )
    return lines + limit_lines(fp)


def run_eval(options: EvalOptions) -> list[str]:
    """The `eval` command: check the inputs and the output folder, run lm-eval, return the lines to print."""
    from lm_eval_sink.harness.checks import check_lengths, check_tasks
    from lm_eval_sink.harness.runner import EvalSettings, check_interpreter, run_lm_eval
    from lm_eval_sink.harness.vllm_preflight import check_engine_start
    from lm_eval_sink.locks import hold
    from lm_eval_sink.models import resolve_model
    from lm_eval_sink.protocols import get_protocol, settings_fields

    protocol = get_protocol(options.protocol, options.protocol_file)
    output = Path(options.output)
    planned = resolve_model(options.model, allow_adapter=False, convert=False)  # `default`: its folder, unconverted
    _check_output(output, [planned, options.protocol_file, options.run.include_path], options.force)
    settings = EvalSettings(**settings_fields(protocol, options.run))
    check_interpreter(settings)  # before `default` is converted
    check_engine_start(settings)  # the vLLM engine's start-up, as `lm_eval --model vllm` asks it
    lengths = check_tasks(settings)  # unknown tasks, overridden gen_kwargs keys: before `default` is converted
    model_path = resolve_model(options.model, allow_adapter=False)
    check_lengths(lengths, settings, [model_path])  # a generation longer than the model: before lm-eval runs
    with hold(output):
        run = run_lm_eval(model_path, settings, output)
    return _report(run, settings, protocol)
