"""`lm-eval-sink recovery`: read the reference, the candidate and the controls' runs, pair them per task as `buckets`
does, run the statistics (recovery.py) and write recovery.json, recovery.md, recovery.png and prompts.parquet."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.errors import UserError
from lm_eval_sink.keys import Key, Work, key_of

OUTPUTS = ("recovery.json", "recovery.md", "recovery.png", "prompts.parquet")


@dataclass(frozen=True, slots=True)
class RecoveryWork(Work):
    """What `recovery` reads (files by content); its key is in the provenance, and a sweep recomputes its recovery/
    only when it changes."""

    CODE = (__name__,)
    PACKAGES = ("numpy", "scipy", "pyarrow", "matplotlib")

    files: dict[str, Path]
    settings: BucketSettings


@dataclass(frozen=True, slots=True)
class NamedRun:
    """One run of the call: its name (a control's NAME, or its role), role and the path it was given as."""

    name: str
    role: str
    path: Path


def named_runs(reference: str | Path, candidate: str | Path, controls: Sequence[str]) -> list[NamedRun]:
    """The runs of a call: NAME=RUN pairs, or a bare RUN named after its folder (a sweep's evals/<name>, an lm-eval
    output folder) or file; two runs of one name are refused."""
    runs = [NamedRun("reference", "reference", Path(reference)), NamedRun("candidate", "candidate", Path(candidate))]
    for arg in controls:
        name, eq, path = str(arg).partition("=")
        if not eq:
            path = name
            p = Path(path)
            name = p.name if p.is_dir() else p.parent.name
        if not name or not path:
            raise UserError(f"control {arg!r}: empty name or run", "pass NAME=RUN, e.g. ties=sweep_out/evals/ties")
        runs.append(NamedRun(name, "control", Path(path)))
    names = [r.name for r in runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(
            f"two runs are named {', '.join(twice)} (the reference and candidate take their roles as names)",
            "name each control NAME=RUN with a name of its own",
        )
    if len(runs) < 3:
        raise UserError("no control given", "pass one or more controls as NAME=RUN after the options")
    return runs


def _tasks(files: Mapping[str, Any]) -> list[str]:
    """The tasks whose samples every run holds, less this project's Sink Strength tasks (no score per doc: S is in
    the sweep's table and `protocol`)."""
    from lm_eval_sink.harness.discovery import own_task_names

    for run in files.values():
        if not run.samples:
            run.samples_for(None)  # raises: this run has no samples files
    common = sorted(set.intersection(*(set(run.samples) for run in files.values())) - own_task_names())
    if not common:
        held = "; ".join(f"{n}: {', '.join(sorted(r.samples))}" for n, r in files.items())
        raise UserError(f"the runs share no task ({held})", "pass runs of the same tasks")
    return common


def _metrics(samples: Sequence[Mapping[str, Any]], task: str, settings) -> list[str | None]:
    """The metrics to compare: the task's primary one (data/benchmarks.yaml), else each metric its samples carry."""
    from lm_eval_sink.benchmarks import benchmark_of, load_benchmarks

    spec = benchmark_of(task, load_benchmarks())
    if settings.metric is not None or (spec is not None and spec.metric is not None):
        return [settings.metric]
    first = samples[0] if samples else {}
    listed = [m for m in first.get("metrics", []) if isinstance(m, str) and not isinstance(first.get(m), list)]
    return listed or [None]


@dataclass(frozen=True, slots=True)
class PairedTask:
    """One task and metric over the docs every run shares: the outcomes the statistics read, the filter, and each
    run's sample per doc (`rows[name][doc_id]`) for the prompt lists and prompts.parquet."""

    outcomes: Any  # recovery.TaskOutcomes
    task: str
    filter: str
    rows: dict[str, dict[int, Mapping[str, Any]]]
    pairing: dict[str, Any]


def _pair_task(task: str, runs: list[NamedRun], samples: Mapping[str, list], settings, declared) -> list[PairedTask]:
    """Per metric: every run paired with the reference as `buckets` pairs two runs (the same refusals), under the
    filter and metric of the reference-candidate pair; a task with several metrics is keyed `task:metric`. The
    metric's direction: `declared` (the reference's results JSON's higher_is_better of the task), else higher for a
    0/1 outcome (a pass), else unknown."""
    from lm_eval_sink.buckets.compare import metric_kind
    from lm_eval_sink.buckets.paired import pair
    from lm_eval_sink.recovery import TaskOutcomes

    metrics, out = _metrics(samples["reference"], task, settings), []
    label = {r.name: f"{r.name} samples of {task} ({r.path})" for r in runs}
    for metric in metrics:
        paired, fixed = {}, replace(settings, metric=metric)
        for r in runs[1:]:  # the candidate first: its pair fixes the filter and metric of the rest
            labels, sides = (label["reference"], label[r.name]), ("reference", r.name)
            paired[r.name] = pair(samples["reference"], samples[r.name], task, fixed, labels, sides)
            fixed = replace(settings, metric=paired[r.name].metric, filter=paired[r.name].filter)
        first = paired["candidate"]
        kind = metric_kind(first.ids, first.ref_v, first.cand_v, first.metric, first.spec, fixed)
        values = {"reference": first.ref_v, **{name: p.cand_v for name, p in paired.items()}}
        rows = {"reference": first.ref_rows, **{name: p.cand_rows for name, p in paired.items()}}
        key = task if len(metrics) == 1 else f"{task}:{first.metric}"
        higher = declared.get(first.metric)
        higher = higher if isinstance(higher, bool) else (True if kind == "binary" else None)
        outcomes = TaskOutcomes(key, first.metric, kind, first.ids, values, higher)
        out.append(PairedTask(outcomes, task, first.filter, rows, first.pairing))
    return out


def _protocol_notes(task: str, diffs: Mapping[str, Mapping[str, Any]], records: Mapping[str, Any]) -> list[str]:
    """What `buckets` says of two runs' protocols, for each run against the reference on one task (`diffs`: its
    protocol_differences), and the runs made with --limit (non-final)."""
    from lm_eval_sink.buckets.protocol import by_effect, limit_notes

    notes = []
    for name, d in diffs.items():
        can, _ = by_effect(d)
        if can:
            notes.append(
                f"{task}: {name} and the reference differ in {', '.join(can)}: its deltas mix model and protocol"
            )
    return notes + [f"{task}: {note}" for note in limit_notes(records)]


def read_runs(runs: list[NamedRun], settings) -> tuple[list[PairedTask], dict[str, Any], list[str]]:
    """Resolve and pair every run per shared task; each run's records (model, protocol, files) and the notes on
    protocols that differ from the reference's."""
    from lm_eval_sink.buckets.protocol import protocol_differences
    from lm_eval_sink.commands.buckets import run_fingerprint, run_record
    from lm_eval_sink.runs import load_results, read_samples, resolve_run

    files = {r.name: resolve_run(r.path) for r in runs}
    ref = files["reference"]
    declared = (load_results(ref).get("higher_is_better") or {}) if ref.results is not None else {}
    fps = {name: run_fingerprint(f) for name, f in files.items()}
    records: dict[str, Any] = {r.name: {"role": r.role, "tasks": {}} for r in runs}
    tasks = _tasks(files)
    left = sorted(set().union(*(f.samples for f in files.values())) - set(tasks))
    paired, notes = [], [f"left out, not in every run: {', '.join(left)}"] if left else []
    for task in tasks:
        samples = {name: read_samples(f.samples[task]) for name, f in files.items()}
        paired += _pair_task(task, runs, samples, settings, declared.get(task) or {})
        for r in runs:
            rec = run_record(files[r.name], *fps[r.name], task, files[r.name].samples[task], r.path)
            records[r.name]["tasks"][task] = rec
        diffs = {r.name: protocol_differences(fps["reference"][0], fps[r.name][0], task) for r in runs[1:]}
        notes += _protocol_notes(task, diffs, {n: r["tasks"][task] for n, r in records.items()})
    return paired, records, notes


def prompt_records(t: PairedTask, control: str, lists: Mapping[str, list[int]] | None) -> dict[str, list] | None:
    """The recovered and broken docs of `control`: doc id, prompt, the candidate's and the control's responses."""
    from lm_eval_sink.buckets.paired import response_text
    from lm_eval_sink.report.view import get

    if lists is None:
        return None
    cand, ctrl = t.rows["candidate"], t.rows[control]
    return {
        what: [
            {
                "doc_id": i,
                "prompt": get(cand[i], "arguments", "gen_args_0", "arg_0"),  # what the model saw
                "candidate_response": response_text(cand[i], filtered=True),
                "control_response": response_text(ctrl[i], filtered=True),
            }
            for i in ids
        ]
        for what, ids in lists.items()
    }


def _metric_values(row: Mapping[str, Any]) -> dict[str, float]:
    """A sample's scalar metric values (booleans as 0/1)."""
    names = [m for m in row.get("metrics", []) if isinstance(m, str)]
    return {m: float(row[m]) for m in names if isinstance(row.get(m), bool | int | float)}


def prompts_table(paired: Sequence[PairedTask], roles: Mapping[str, str]):
    """prompts.parquet as a pyarrow table: one row per run, task and doc (the first metric's pairing of a task)."""
    import pyarrow as pa

    from lm_eval_sink.buckets.paired import response_text

    rows, seen, metrics = [], set(), set()
    for t in paired:
        if t.task in seen:
            continue
        seen.add(t.task)
        for name, docs in t.rows.items():
            for i in t.outcomes.ids:
                row = docs[i]
                values = _metric_values(row)
                metrics |= set(values)
                rows.append(
                    {
                        "run": name,
                        "role": roles[name],
                        "task": t.task,
                        "doc_id": i,
                        "prompt_hash": row.get("prompt_hash"),
                        "filter": t.filter,
                        **values,
                        "filtered_response": response_text(row, filtered=True),
                    }
                )
    schema = [("run", pa.string()), ("role", pa.string()), ("task", pa.string()), ("doc_id", pa.int64())]
    schema += [("prompt_hash", pa.string()), ("filter", pa.string()), *((m, pa.float64()) for m in sorted(metrics))]
    schema += [("filtered_response", pa.string())]
    return pa.Table.from_pylist(rows, schema=pa.schema(schema))


def recovery_record(paired: Sequence[PairedTask], runs: list[NamedRun], settings, records, notes) -> dict[str, Any]:
    """recovery.json, less its provenance."""
    from lm_eval_sink.power import MIN_N, too_few
    from lm_eval_sink.recovery import FAMILIES, SCHEMA_VERSION, SHARE_METHOD, UNITS, recover

    controls = [r.name for r in runs if r.role == "control"]
    tasks, cells = recover([t.outcomes for t in paired], controls, settings)
    for t in paired:
        key = t.outcomes.task
        n = len(t.outcomes.ids)
        tasks[key].update(task=t.task, filter=t.filter, pairing=t.pairing)
        tasks[key]["too_few_to_tell"] = too_few(n) if n < MIN_N else None
        for c in controls:
            cells[c][key]["prompts"] = prompt_records(t, c, cells[c][key]["prompts"])
    return {
        "schema_version": SCHEMA_VERSION,
        "units": UNITS,
        "confidence": settings.confidence,
        "share_method": SHARE_METHOD,
        "holm_families": list(FAMILIES),
        "runs": records,
        "tasks": tasks,
        "controls": cells,
        "notes": notes,
    }


def write_outputs(data: dict[str, Any], table, output: Path, force: bool = False) -> list[Path]:
    """recovery.json, recovery.md, recovery.png and prompts.parquet in the folder `output` (staged, atomic)."""
    import pyarrow.parquet as pq

    from lm_eval_sink.io import atomic_write_json, atomic_write_text
    from lm_eval_sink.outputs import staged_dir
    from lm_eval_sink.plots import recovery_forest
    from lm_eval_sink.recovery import summary_markdown

    output = Path(output)
    with staged_dir(output, force=force) as tmp:
        atomic_write_json(tmp / "recovery.json", data)
        atomic_write_text(tmp / "recovery.md", summary_markdown(data))
        recovery_forest(data, tmp / "recovery.png")
        pq.write_table(table, tmp / "prompts.parquet")
    return [output / n for n in OUTPUTS]


def recovery_key(runs: list[NamedRun], settings: BucketSettings) -> Key:
    """The key of a recovery over `runs`: their samples and results files by content, the settings, the code."""
    from lm_eval_sink.runs import resolve_run

    files = {}
    for r in runs:
        run = resolve_run(r.path)
        files.update({f"{r.name} samples {task}": path for task, path in run.samples.items()})
        if run.results is not None:
            files[f"{r.name} results"] = run.results
    return key_of(RecoveryWork(files, settings))


def compute(runs: list[NamedRun], settings: BucketSettings, command: str = "recovery") -> tuple[dict[str, Any], Any]:
    """recovery.json's record with its provenance, and prompts.parquet's table, from the runs (no model loaded)."""
    from lm_eval_sink.provenance import provenance

    key = recovery_key(runs, settings)  # before the reads: a run that changes meanwhile is recomputed next time
    paired, records, notes = read_runs(runs, settings)
    data = recovery_record(paired, runs, settings, records, notes)
    data["provenance"] = provenance(command=command, key=key.key, inputs_key=key.inputs_key, key_versions=key.versions)
    return data, prompts_table(paired, {r.name: r.role for r in runs})


def run_recovery(
    reference: str | Path,
    candidate: str | Path,
    controls: Sequence[str],
    settings,
    output: Path | None = None,
    force: bool = False,
) -> tuple[dict[str, Any], list[str]]:
    """The `recovery` command: recovery.json's record and the lines to print; writes `output` when given."""
    from lm_eval_sink.recovery import summary_markdown

    runs = named_runs(reference, candidate, controls)
    if output is not None:
        from lm_eval_sink.outputs import check_output_dir

        check_output_dir(Path(output), force, inputs=[r.path for r in runs])
    data, table = compute(runs, settings)
    lines = [summary_markdown(data)]
    if output is not None:
        lines.append("wrote " + ", ".join(str(p) for p in write_outputs(data, table, Path(output), force)))
    return data, lines
