"""`lm-eval-sink eval`: lm-eval on one model under a named protocol, then the run's protocol check.

The output is lm-eval's own `--output_path` folder (it names its files by model and time), so an
existing folder is added to with `force` rather than replaced; it is held (`<out>/.lock`) while
lm-eval writes, and refused when it overlaps an input (the model, the protocol file, the include
path). `--model-args K=V,...` is split here; `harness.runner` builds and runs the lm-eval command line.
"""

from __future__ import annotations

from pathlib import Path

from lm_eval_sink.errors import UserError


def _model_args(text: str | None) -> dict[str, str]:
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
    from lm_eval_sink.io import check_not_inputs, check_writable

    check_not_inputs([output], inputs=inputs, option="--output")
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file, not a folder", "pass a folder path as --output")
    check_writable(output)
    if output.exists() and any(output.iterdir()) and not force:
        raise UserError(
            f"output already exists: {output}", "pass --force to add this run to it, or choose another --output"
        )


def _report(run, settings, protocol, limit: float | None) -> list[str]:
    """The lines printed after the run: its files, the interpreter and versions, the protocol check, a subset's note."""
    from lm_eval_sink.harness.runner import eval_versions
    from lm_eval_sink.protocols import fingerprint_run, limit_text

    fp = fingerprint_run(run)
    off = protocol.mismatches(fp)
    versions = ", ".join(f"{k} {v}" for k, v in eval_versions(settings).items())
    lines = [f"results: {run.results}", f"lm-eval ran in {settings.interpreter()}: {versions}"]
    lines += [f"samples {task}: {path}" for task, path in sorted(run.samples.items())]
    lines.append(
        f"protocol {protocol.name}: "
        + ("recorded settings match" if not off else "recorded settings DIFFER: " + ", ".join(off))
    )
    if fp.harness.get("limit") is not None:
        lines.append(f"--limit {limit_text(fp.harness['limit'])}: scores are from a subset and are not final")
    return lines


def run_eval(
    model: str,
    protocol_name: str,
    protocol_file: Path | None,
    tasks: str,
    output: Path,
    *,
    limit: float | None = None,
    gen_kwargs: tuple[str, ...] = (),
    batch_size: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    device: str | None = None,
    backend: str = "hf",
    model_args: str | None = None,
    include_path: str | None = None,
    log_samples: bool = True,
    force: bool = False,
    python: str | None = None,
) -> list[str]:
    """The `eval` command: check the inputs and the output folder, run lm-eval, return the lines to print."""
    from lm_eval_sink.harness.checks import check_lengths, check_tasks
    from lm_eval_sink.harness.runner import EvalSettings, check_interpreter, run_lm_eval
    from lm_eval_sink.io import hold
    from lm_eval_sink.models import resolve_model
    from lm_eval_sink.protocols import get_protocol, parse_gen_kwargs, settings_fields

    if device is not None and backend != "hf":
        raise UserError(
            "--device is an HF-only flag",
            "drop --device with --backend vllm (vLLM places the model; pass --model-args tensor_parallel_size=N)",
        )
    margs = _model_args(model_args)
    protocol = get_protocol(protocol_name, protocol_file)
    output = Path(output)
    planned = resolve_model(model, allow_adapter=False, convert=False)  # `default`: its folder, not converted yet
    _check_output(output, [planned, protocol_file, include_path], force)
    limit = int(limit) if limit is not None and limit >= 1 and float(limit).is_integer() else limit
    fields = settings_fields(
        protocol,
        tasks=[t.strip() for t in tasks.split(",") if t.strip()],
        limit=limit,
        gen_kwargs=parse_gen_kwargs(gen_kwargs),
        batch_size=None if batch_size is None else int(batch_size) if str(batch_size).isdigit() else str(batch_size),
        dtype=dtype,
        seed=seed,
        device=device,
        include_path=include_path,
        log_samples=log_samples,
        backend=backend,
        model_args=margs,
        python=python,
    )
    settings = EvalSettings(**fields)
    check_interpreter(settings)  # before `default` is converted
    lengths = check_tasks(settings)  # unknown tasks, overridden gen_kwargs keys: before `default` is converted
    model_path = resolve_model(model, allow_adapter=False)
    check_lengths(lengths, settings, [model_path])  # a generation longer than the model: before lm-eval runs
    with hold(output):
        run = run_lm_eval(model_path, settings, output)
    return _report(run, settings, protocol, limit)
