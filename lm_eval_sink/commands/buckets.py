"""`lm-eval-sink buckets`: resolve two lm-eval runs, bucket one task's samples, write the output folder."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.buckets.compare import BucketReport, bucket
from lm_eval_sink.buckets.noise import with_noise_floor
from lm_eval_sink.buckets.protocol import protocol_differences, protocol_record, with_runs
from lm_eval_sink.buckets.render import figure_title, rows_csv, summary_markdown
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.errors import UserError
from lm_eval_sink.keys import CONTENT, Work, key_of


@dataclass(frozen=True, slots=True)
class BucketsWork(Work):
    """What a bucket comparison reads (files, and the tokenizer folder, by content); its key is in the provenance."""

    CODE = (__name__,)
    PACKAGES = ("numpy", "scipy")

    files: dict[str, Path]  # samples and results of the reference, candidate and repeat run
    task: str
    settings: BucketSettings
    tokenizer: str | None = field(default=None, metadata=CONTENT)


def run_fingerprint(run) -> tuple[Any, str | None]:
    """(the run's protocol fingerprint, None), or (None, why the protocol is unknown)."""
    from lm_eval_sink.protocols import fingerprint
    from lm_eval_sink.runs import load_results

    if run.results is None:
        return None, "no results_<time>.json beside the samples: model and protocol unknown"
    results = load_results(run)
    try:
        return fingerprint(results, source=run.results), None
    except UserError as e:  # the samples are enough to bucket; the record says why the protocol is missing
        return None, f"{e.message}: protocol unknown"


def run_record(run, fp, reason: str | None, task: str, samples_path: Path, argument: str | Path) -> dict[str, Any]:
    """Model, protocol (the fingerprint's fields for `task`) and file fingerprints of one run; every path absolute,
    so another command reads them from any folder. `run` is the folder the run was named by (the argument)."""
    from lm_eval_sink.identity import local_identity
    from lm_eval_sink.io import sha256_file

    named = Path(os.path.abspath(argument))
    rec: dict[str, Any] = {
        "run": str(named if named.is_dir() else named.parent),
        "samples_file": os.path.abspath(samples_path),
        "samples_sha256": sha256_file(samples_path),
        "task": task,
        "results_file": None if run.results is None else os.path.abspath(run.results),
    }
    if run.results is not None:
        rec["results_sha256"] = sha256_file(run.results)
    if fp is None:
        rec.update(model=None, protocol=None, lm_eval_version=None, reason=reason)
        return rec
    rec.update(protocol_record(fp, task), model_identity=local_identity(fp.run["pretrained"]))
    return rec


def _pick_task(ref_run, cand_run, task: str | None) -> tuple[str, Path, Path]:
    if task is not None:
        return task, ref_run.samples_for(task)[1], cand_run.samples_for(task)[1]
    for run in (ref_run, cand_run):
        if not run.samples:
            run.samples_for(None)  # raises: the run has no samples files
    common = sorted(set(ref_run.samples) & set(cand_run.samples))
    if len(common) == 1:
        return common[0], ref_run.samples[common[0]], cand_run.samples[common[0]]
    if len(common) > 1:
        raise UserError(
            f"{ref_run.folder} and {cand_run.folder} both hold samples of several tasks ({', '.join(common)})",
            "choose one with --task",
        )
    if (
        len(ref_run.samples) == 1
        and len(cand_run.samples) == 1
        and (ref_run.timestamp is None or cand_run.timestamp is None)
    ):
        (rt, rp), (_, cp) = next(iter(ref_run.samples.items())), next(iter(cand_run.samples.items()))
        return rt, rp, cp  # a renamed samples file: its name says nothing; the docs are checked below
    raise UserError(
        f"the runs hold samples of different tasks: reference {ref_run.folder}: {', '.join(sorted(ref_run.samples))}; "
        f"candidate {cand_run.folder}: {', '.join(sorted(cand_run.samples))}",
        "pass two runs of the same task, or name it with --task",
    )


def _repeat_run(repeat: str | Path, task: str, runs: dict[str, Any], fps: dict[str, Any]) -> Path:
    """Resolve `--repeat` (a second run of the reference): its samples of `task`, its record in `runs["repeat"]`;
    a run of another model is refused, protocol differences from the reference are named in the record."""
    from lm_eval_sink.runs import resolve_run

    rep_run = resolve_run(repeat)
    _, rep_path = rep_run.samples_for(task)
    fp, reason = run_fingerprint(rep_run)
    rec = run_record(rep_run, fp, reason, task, rep_path, repeat)
    ref_model = runs["reference"].get("model")
    if rec.get("model") and ref_model and rec["model"] != ref_model:
        raise UserError(
            f"--repeat {repeat} is a run of {rec['model']}, the reference is a run of {ref_model}",
            "pass a second run of the reference model under the same protocol",
        )
    rec["protocol_differences_from_reference"] = protocol_differences(fps["reference"][0], fp, task)
    runs["repeat"] = rec
    return rep_path


def _require_same_protocol(fps: dict[str, tuple[Any, str | None]], diffs: dict[str, Any]) -> None:
    """--same-protocol: refuse runs whose protocol is unknown or differs (naming the runs or the fields)."""
    unknown = [f"{side}: {reason}" for side, (fp, reason) in fps.items() if fp is None]
    if unknown:
        raise UserError(
            f"--same-protocol cannot be checked ({'; '.join(unknown)})",
            "pass runs with their lm-eval results files, or drop --same-protocol",
        )
    if diffs:
        shown = "; ".join(f"{k}: {v['reference']!r} vs {v['candidate']!r}" for k, v in diffs.items())
        raise UserError(
            f"the runs differ in protocol ({shown[:300]})",
            "re-run one model with the other's protocol, or drop --same-protocol",
        )


@dataclass(frozen=True, slots=True)
class CompareOptions:
    """How `buckets` compares two runs besides what it computes (`BucketSettings`): `tokenizer` counts the
    candidate's generated tokens for the failure kinds (None: the run's own counts where it has them),
    `same_protocol` refuses runs whose protocols differ, `repeat` is a second run of the reference under the same
    protocol (the comparison's noise floor), `progress` shows progress bars."""

    tokenizer: str | None = None
    same_protocol: bool = False
    repeat: str | Path | None = None
    progress: bool = False


def compare_runs(
    reference: str | Path,
    candidate: str | Path,
    task: str | None = None,
    settings: BucketSettings = BucketSettings(),
    options: CompareOptions = CompareOptions(),
) -> BucketReport:
    """Resolve two lm-eval runs, bucket one task's samples, attach both runs' provenance; with `options.repeat` (a
    second run of the reference under the same protocol), the noise floor of the comparison."""
    from lm_eval_sink.provenance import provenance
    from lm_eval_sink.runs import read_samples, resolve_run

    ref_run, cand_run = resolve_run(reference), resolve_run(candidate)
    task, ref_path, cand_path = _pick_task(ref_run, cand_run, task)
    fps = {"reference": run_fingerprint(ref_run), "candidate": run_fingerprint(cand_run)}
    runs = {
        "reference": run_record(ref_run, *fps["reference"], task, ref_path, reference),
        "candidate": run_record(cand_run, *fps["candidate"], task, cand_path, candidate),
    }
    diffs = protocol_differences(fps["reference"][0], fps["candidate"][0], task)
    if options.same_protocol:
        _require_same_protocol(fps, diffs)
    rep_path = _repeat_run(options.repeat, task, runs, fps) if options.repeat is not None else None
    count_tokens = None
    if options.tokenizer is not None:
        from lm_eval_sink.failure_kinds import tokenizer_counter

        count_tokens = tokenizer_counter(options.tokenizer)
    fallbacks = tuple(runs[side].get("default_max_gen_toks") for side in ("reference", "candidate"))
    report = bucket(
        read_samples(ref_path),
        read_samples(cand_path),
        task,
        settings,
        count_tokens=count_tokens,
        fallback_max_gen_toks=tuple((f["value"], f["source"]) if f else None for f in fallbacks),
        labels=(f"reference samples {ref_path}", f"candidate samples {cand_path}"),
        progress=options.progress,
    )
    if rep_path is not None:
        labels = (f"reference samples {ref_path}", f"repeat samples {rep_path}")
        report = with_noise_floor(report, read_samples(ref_path), read_samples(rep_path), settings, labels)
    files = {
        f"{k} {f}": Path(v[f"{f}_file"]) for k, v in runs.items() for f in ("samples", "results") if v[f"{f}_file"]
    }
    key = key_of(BucketsWork(files, task, settings, options.tokenizer))
    prov = provenance(
        command="buckets",
        key=key.key,
        inputs_key=key.inputs_key,
        key_versions=key.versions,
        tokenizer=options.tokenizer,
    )
    return with_runs(report, runs, diffs, prov)


def write_outputs(report: dict[str, Any], output: Path, force: bool = False) -> list[Path]:
    """Write the JSON, Markdown, CSV and PNGs of a report into the folder `output` (staged, atomic)."""
    from lm_eval_sink.io import atomic_write_json, atomic_write_text
    from lm_eval_sink.outputs import staged_dir
    from lm_eval_sink.plots import bucket_bars, instruction_type_bars

    output = Path(output)
    with staged_dir(output, force=force) as tmp:
        atomic_write_json(tmp / "buckets.json", dict(report))
        atomic_write_text(tmp / "buckets.md", summary_markdown(report))
        atomic_write_text(tmp / "prompts.csv", rows_csv(report))
        what = f"{report['task']}: {report['metric']} ({report['filter']})"
        if report.get("counts"):
            kinds = (report.get("failure_kinds") or {}).get("counts")
            bucket_bars(report["counts"], figure_title(report), tmp / "buckets.png", regression_kinds=kinds)
        if report.get("instruction_types"):
            instruction_type_bars(
                report["instruction_types"], f"{what}: instruction types by regressions", tmp / "instruction_types.png"
            )
        names = sorted(p.name for p in tmp.iterdir())
    return [output / n for n in names]


def sweep_runs(reference: str | Path, candidate: str | Path | None, checkpoint: str | None) -> tuple[Path, Path]:
    """REFERENCE and CANDIDATE with a sweep's output folder standing for one of its evaluated checkpoints: the
    reference for REFERENCE, `checkpoint` (default: the candidate) for CANDIDATE, which defaults to REFERENCE."""
    from lm_eval_sink.io import read_json
    from lm_eval_sink.schema import did_you_mean

    def sweep(arg: str | Path | None) -> Path | None:
        return Path(arg) if arg is not None and (Path(arg) / "sweep.json").is_file() else None

    if candidate is None and sweep(reference) is None:
        raise UserError("missing CANDIDATE", "pass two lm-eval runs, or a sweep's output folder with --checkpoint NAME")
    candidate = reference if candidate is None else candidate
    if checkpoint is not None and sweep(candidate) is None:
        raise UserError(
            f"--checkpoint {checkpoint}: {candidate} is not a sweep's output folder (no sweep.json)",
            "pass the sweep's --output folder as CANDIDATE, or drop --checkpoint",
        )
    out = []
    for arg, name in ((reference, "reference"), (candidate, checkpoint or "candidate")):
        folder = sweep(arg)
        if folder is None:
            out.append(Path(arg))
            continue
        units = (read_json(folder / "sweep.json") or {}).get("units") or {}
        evaluated = sorted(u.partition(":")[2] for u in units if u.startswith("eval:"))
        if name not in evaluated or not (folder / "evals" / name).is_dir():
            raise UserError(
                f"{folder}: the sweep has no evaluated checkpoint {name!r}{did_you_mean(name, evaluated)}; "
                f"it has {', '.join(evaluated) or 'none'}",
                "name one with --checkpoint NAME (finished eval units only)",
            )
        out.append(folder / "evals" / name)
    return out[0], out[1]


def run_buckets(
    reference: str | Path,
    candidate: str | Path | None,
    task: str | None,
    settings: BucketSettings,
    output: Path | None = None,
    options: CompareOptions = CompareOptions(),
    *,
    checkpoint: str | None = None,
    force: bool = False,
) -> tuple[BucketReport, list[str]]:
    """The `buckets` command: compare, then write the output folder when `output` is given; returns the report and the
    lines to print. A sweep's output folder stands for one of its checkpoints (`sweep_runs`)."""
    reference, candidate = sweep_runs(reference, candidate, checkpoint)
    if output is not None:
        from lm_eval_sink.outputs import check_output_dir

        output = Path(output)
        check_output_dir(output, force, inputs=[reference, candidate, options.repeat, options.tokenizer])
    report = compare_runs(reference, candidate, task, settings, options)
    data = report.to_json()
    lines = [summary_markdown(data)]
    if output is not None:
        written = write_outputs(data, output, force=force)
        lines.append("wrote " + ", ".join(str(p) for p in written))
    return report, lines
