"""`lm-eval-sink report`: read and check a report's inputs (the project's own output files; no model is loaded),
render the page (report/), write the HTML file. Each check (the output each input claims to be, one reference and
candidate throughout, the buckets' samples files unchanged) is a one-line UserError before anything is written
(docs/reports.md)."""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.report.view import BucketsInput, Doc, PromptText, ReportInputs, get, sink_tasks

ROLES = ("reference", "candidate")
# each input: (the file its folder stands for, a key its JSON holds, the command that writes it)
INPUTS = {
    "strength": ("strength JSON", "sink_strength", "strength"),
    "margin": ("margin.json", "margin", "margin"),
    "buckets": ("buckets.json", "counts", "buckets"),
    "attribution": ("attribution.json", "benchmarks", "attribute"),
    "sweep": ("table.json", "rows", "sweep"),
    "recovery": ("recovery.json", "controls", "recovery"),
}


def _file(arg: Path, what: str) -> Path:
    p = Path(arg)
    if what == "strength" and p.is_dir():
        return _strength_file(p)
    if p.is_dir():
        p = p / INPUTS[what][0]
    if not p.is_file():
        raise UserError(
            f"--{what} {arg}: no {INPUTS[what][0]} there",
            f"pass the output folder (or file) of `lm-eval-sink {INPUTS[what][2]}`",
        )
    return p


def _strength_file(folder: Path) -> Path:
    """The strength input a folder stands for: a sweep unit's strength.json, the one `<name>.strength.json` of a
    `strength` output, or the results file of an lm-eval run (its folder, or a sweep's evals/<checkpoint>)."""
    from lm_eval_sink.runs import resolve_run

    if (folder / "strength.json").is_file():
        return folder / "strength.json"
    found = sorted(folder.glob("*.strength.json"))
    if len(found) > 1:
        raise UserError(
            f"--strength {folder}: holds {len(found)} models ({', '.join(p.name for p in found)})",
            "pass one <name>.strength.json per --strength (reference first, then candidate)",
        )
    if found:
        return found[0]
    try:
        run = resolve_run(folder)
    except UserError:
        run = None
    if run is None or run.results is None:
        raise UserError(
            f"--strength {folder}: no strength JSON or lm-eval results file there",
            "pass an output of `lm-eval-sink strength` or an lm-eval run with the sink_strength task",
        )
    return run.results


def _doc(path: Path, what: str, out_dir: Path) -> Doc:
    from lm_eval_sink.io import read_json, sha256_bytes

    raw = path.read_bytes()
    data = read_json(path)
    if what == "strength" and isinstance(data, dict) and "sink_strength" not in data:
        _check_sink_tasks(path, data)
    elif not isinstance(data, dict) or INPUTS[what][1] not in data:
        raise UserError(
            f"{path}: not a {what} output (no '{INPUTS[what][1]}' key)",
            f"pass a file written by `lm-eval-sink {INPUTS[what][2]}`",
        )
    return Doc(rel=_relative(path, out_dir), data=data, sha256=sha256_bytes(raw))


def _check_sink_tasks(path: Path, data: dict[str, Any]) -> None:
    """Refuse a JSON that is neither a strength output nor lm-eval results with one Sink Strength task to show."""
    tasks = sink_tasks(data)
    if not tasks or "config" not in data:
        raise UserError(
            f"{path}: not a strength output (no 'sink_strength' key) nor lm-eval results of a sink_strength task",
            "pass a <name>.strength.json of `lm-eval-sink strength`, or the results of lm_eval --tasks sink_strength",
        )
    if len(tasks) > 1 and "sink_strength" not in tasks:
        raise UserError(
            f"{path}: holds several Sink Strength tasks ({', '.join(tasks)})", "pass a run with one of them"
        )


def _relative(path: Path, out_dir: Path) -> str:
    """A path as the report shows it: relative to the report's folder."""
    return Path(os.path.relpath(Path(path).resolve(), out_dir.resolve())).as_posix()


def _norm(name: Any) -> str | None:
    if not isinstance(name, str) or not name:
        return None
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name.rstrip("/")


def _identities(what: str, doc: Doc, role_hint: str | None = None) -> list[tuple[str, str, str | None, str | None]]:
    """(input label, role, fingerprint, name) records that input makes about the two models."""
    d, label = doc.data, f"{what} {doc.rel}"
    if what == "strength" and "sink_strength" not in d:  # lm-eval results: the model lm-eval loaded
        args = get(d, "config", "model_args")
        if isinstance(args, str):
            args = dict(part.split("=", 1) for part in args.split(",") if "=" in part)
        return [(label, role_hint or "", None, _norm((args or {}).get("pretrained")))]
    if what == "strength":
        m = get(d, "provenance", "model") or {}
        return [(label, role_hint or "", m.get("fingerprint"), _norm(m.get("model")))]
    if what == "margin":
        return [(label, r, get(d, "provenance", r, "fingerprint"), _norm(d.get(r))) for r in ROLES]
    if what == "buckets":
        return [(label, r, None, _norm(get(d, "runs", r, "model"))) for r in ROLES if get(d, "runs", r, "model")]
    if what == "attribution":
        return [
            (label, m["role"], None, _norm(m.get("model_key")))
            for m in d.get("measurements") or []
            if m.get("role") in ROLES and m.get("model_key")
        ]
    if what == "sweep":
        return [(label, r, None, _norm(get(d, "models", r))) for r in ROLES if get(d, "models", r)]
    if what == "recovery":
        models = {r: [t.get("model") for t in (get(d, "runs", r, "tasks") or {}).values()] for r in ROLES}
        return [(label, r, None, _norm(m[0])) for r, m in models.items() if m and m[0]]
    return []


def check_same_pair(records: Sequence[tuple[str, str, str | None, str | None]]) -> dict[str, str]:
    """Role -> shown name; the records of one role must agree (fingerprints where both have one, else names)."""
    shown: dict[str, str] = {}
    for role in ROLES:
        rs = [r for r in records if r[1] == role]
        for i, a in enumerate(rs):
            for b in rs[i + 1 :]:
                if a[2] and b[2]:
                    same, ka, kb = a[2] == b[2], a[2], b[2]
                elif a[3] and b[3]:
                    same, ka, kb = a[3] == b[3], a[3], b[3]
                else:
                    continue
                if not same:
                    raise UserError(
                        f"the inputs name different {role} models: {a[0]} has {ka}, {b[0]} has {kb}",
                        "pass outputs of one reference/candidate pair (one report per pair)",
                    )
        names = [r[3] for r in rs if r[3]]
        if names:
            shown[role] = Path(names[0]).name or names[0]
    return shown


def _samples_path(recorded: str, buckets_file: Path) -> Path:
    """A samples file buckets.json names: absolute, or relative to buckets.json's folder (an older record relative
    to where buckets ran is tried last)."""
    p = Path(recorded)
    if p.is_absolute() or (buckets_file.parent / p).exists() or not p.exists():
        return p if p.is_absolute() else buckets_file.parent / p
    return p


def _text(sample: dict[str, Any]) -> tuple[str, str]:
    doc = sample.get("doc") or {}
    prompt = doc.get("prompt") if isinstance(doc, dict) and isinstance(doc.get("prompt"), str) else None
    if prompt is None:
        prompt = str(get(sample, "arguments", "gen_args_0", "arg_0") or "")
    resp = sample.get("filtered_resps")
    if isinstance(resp, list) and resp:
        resp = resp[0]
    if isinstance(resp, list) and resp:
        resp = resp[0]
    return prompt, resp if isinstance(resp, str) else json.dumps(resp, ensure_ascii=False)


def _failed(sample: dict[str, Any]) -> tuple[str, ...]:
    ids, ok = get(sample, "doc", "instruction_id_list"), sample.get("inst_level_strict_acc")
    if isinstance(ids, list) and isinstance(ok, list) and len(ids) == len(ok):
        return tuple(i for i, passed in zip(ids, ok, strict=True) if not passed)
    return ()


def _buckets_input(doc: Doc, path: Path, out_dir: Path) -> BucketsInput:
    from lm_eval_sink.io import sha256_file
    from lm_eval_sink.runs import read_samples

    by_role: dict[str, dict[int, dict[str, Any]]] = {}
    shown: dict[str, tuple[str, str]] = {}
    for role in ROLES:
        run = get(doc.data, "runs", role) or {}
        recorded, want = run.get("samples_file"), run.get("samples_sha256")
        if not recorded or not want:
            raise UserError(
                f"{path}: no {role} samples file recorded", "re-run `lm-eval-sink buckets` with this version"
            )
        p = _samples_path(recorded, path)
        if not p.is_file():
            raise UserError(
                f"{path}: the {role} samples file {p} is missing",
                "restore it, or re-run `lm-eval-sink buckets` on the runs you have",
            )
        got = sha256_file(p)
        if got != want:
            raise UserError(
                f"{path}: the {role} samples file {p} changed since buckets ran (sha256 {got[:12]}..., "
                f"recorded {want[:12]}...)",
                "re-run `lm-eval-sink buckets` on the current runs",
            )
        by_role[role] = {int(s["doc_id"]): s for s in read_samples(p)}
        shown[role] = (_relative(p, out_dir), got)
    texts = {}
    for doc_id, ref in by_role["reference"].items():
        cand = by_role["candidate"].get(doc_id)
        if cand is None:
            continue
        prompt, r_resp = _text(ref)
        _, c_resp = _text(cand)
        texts[doc_id] = PromptText(prompt=prompt, reference=r_resp, candidate=c_resp, failed_instructions=_failed(cand))
    return BucketsInput(doc=doc, texts=texts, samples=shown)


def _paths(what: str, given: Mapping[str, Any]) -> list[Path]:
    """The paths given for the input `what` (strength and buckets take several)."""
    value = given.get(what)
    return list(value or ()) if what in ("strength", "buckets") else [] if value is None else [value]


def load_inputs(out: Path, *, title: str | None = None, **given: Any) -> ReportInputs:
    """Read, validate and cross-check every input (`given`: a path per INPUTS name, a sequence for strength and
    buckets); paths in the report are relative to `out`'s folder."""
    from lm_eval_sink.provenance import package_versions

    out_dir = Path(out).parent
    if set(given) - set(INPUTS):
        raise TypeError(f"load_inputs got unknown inputs {sorted(set(given) - set(INPUTS))}; known: {list(INPUTS)}")
    if not any(_paths(what, given) for what in INPUTS):
        raise UserError("nothing to report", "pass at least one of " + ", ".join(f"--{what}" for what in INPUTS))
    brought = None if given.get("sweep") is None else Path(given["sweep"]) / "recovery"
    if given.get("recovery") is None and brought is not None and (brought / INPUTS["recovery"][0]).is_file():
        given["recovery"] = brought  # a sweep folder brings its recovery
    if given.get("strength") and len(given["strength"]) != 2:
        raise UserError(
            f"--strength takes two inputs (reference, candidate), got {len(given['strength'])}",
            "pass --strength REF --strength CAND (strength JSONs or folders, or lm-eval runs with sink_strength)",
        )
    docs: dict[str, list[tuple[Doc, Path]]] = {}
    records = []
    for what in sorted(INPUTS, key=lambda w: w == "buckets"):  # buckets last: the others' names show first
        docs[what] = [(_doc(path, what, out_dir), path) for path in (_file(a, what) for a in _paths(what, given))]
        roles = ROLES[: len(docs[what])] if what == "strength" else [None] * len(docs[what])
        records += [r for (d, _), role in zip(docs[what], roles, strict=True) for r in _identities(what, d, role)]
    identities = check_same_pair(records)
    return ReportInputs(
        title=title,
        strength=tuple(d for d, _ in docs["strength"]) or None,
        buckets=tuple(_buckets_input(d, p, out_dir) for d, p in docs["buckets"]),
        **{what: docs[what][0][0] if docs[what] else None for what in ("margin", "attribution", "sweep", "recovery")},
        identities=identities,
        versions=package_versions(),
        created_utc=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )


def run_report(output: Path, *, force: bool = False, **inputs: Any) -> list[str]:
    """The `report` command: refuse `output` early, load the inputs (load_inputs's), write the page atomically."""
    from lm_eval_sink.io import atomic_write_text
    from lm_eval_sink.outputs import new_files
    from lm_eval_sink.report.render import render_html

    output = Path(output)
    if output.is_dir():
        raise UserError(f"-o {output} is a folder", "pass a file path, e.g. -o report.html")
    files = [path for what in INPUTS for path in _paths(what, inputs)]
    with new_files([output], force, "-o", inputs=files):
        return [f"wrote {atomic_write_text(output, render_html(load_inputs(output, **inputs)))}"]
