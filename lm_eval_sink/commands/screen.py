"""`lm-eval-sink screen`: resolve models, read their QK-norm class, measure S, rank and predict, write the output
folder (each S through `commands.strength.run_strength` into `DIR/strength/`, resumable; the folder held with
`locks.hold`). A `*.strength.json` passed in place of its model is reused or refused in one line (`reused_strength`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lm_eval_sink.calibration import load_prompts
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json, atomic_write_text, read_json
from lm_eval_sink.keys import MODEL, Work, check_same_versions, key_of, key_versions
from lm_eval_sink.locks import hold
from lm_eval_sink.devices import DTYPES
from lm_eval_sink.models import check_config, model_fingerprint, pretrained_args, resolve_model
from lm_eval_sink.options import MeasureOptions, ScreenOptions
from lm_eval_sink.outputs import check_new_outputs, check_not_inputs, check_writable
from lm_eval_sink.predict import fit_pairs
from lm_eval_sink.screen import (
    PAPER_LINE_CAVEAT,
    QKNorm,
    ScreenResult,
    classify_qk_norm,
    qk_norm_table,
    screen,
    screen_csv,
    screen_table_markdown,
    text_config,
)
from lm_eval_sink.strength import SinkStrength, StrengthSettings, StrengthWork, measure_model
from lm_eval_sink.weights import checkpoint_tensors


@dataclass(frozen=True, slots=True)
class ScreenWork(Work):
    """What a screen's table is made from: the models (by content; each S keyed as `strength.StrengthWork`), the
    settings, the dtype and where its predictions come from (a pairs file by content)."""

    CODE = (__name__,)
    PACKAGES = ("torch", "transformers", "numpy", "scipy")

    models: tuple[str, ...] = field(metadata=MODEL)
    settings: StrengthSettings
    dtype: str
    predict: ScreenOptions


SCREEN_FILES = ("screen.json", "screen.md", "screen.csv", "screen.png")
STRENGTH_SUFFIX = ".strength.json"  # what `strength` names a model's result


@dataclass(frozen=True, slots=True)
class Reused:
    """A `*.strength.json` passed to `screen` in place of its model: the file, the model it measured, its result."""

    file: Path
    path: str
    result: Any

    @property
    def slug(self) -> str:
        return self.file.name.removesuffix(STRENGTH_SUFFIX)


def reused_strength(file: Path, settings: StrengthSettings, dtype: str) -> Reused:
    """The result in `file` when `screen` with `settings` and `dtype` would measure the same S: made from its model's
    present content, in this setting (the settings that decide S, the calibration prompts, --dtype), by these
    versions; anything else is the one-line error naming what differs."""
    from lm_eval_sink.commands.strength import saved_stands

    data = read_json(file)
    prov = data.get("provenance") if isinstance(data, dict) else None
    model = (prov or {}).get("model") or {}
    if not isinstance(data, dict) or "sink_strength" not in data or "inputs_key" not in (prov or {}) or not model:
        raise UserError(f"{file}: not a result of `lm-eval-sink strength`", "pass a *.strength.json it wrote")
    path = str(model.get("model"))
    try:
        resolve_model(path, allow_gguf=True, convert=False)
    except UserError as e:
        raise UserError(
            f"{file}: its model cannot be read here (screen reads its config and checks its content): {e.message}",
            "screen the strength file where its model is, or pass the model itself",
        ) from None
    try:  # the model changed since: measure it again
        same, changed = saved_stands(prov, model_fingerprint(path), key_of(StrengthWork(path, settings, dtype)), file)
    except UserError as e:
        raise UserError(e.message, f"pass {path} to measure it again") from None
    if same:
        return Reused(file, path, SinkStrength.from_json(data))
    if changed:  # the packages, or the files of S's code
        raise UserError(f"{file}: made by other versions ({changed})", f"pass {path} to measure it again")
    differ = _setting_differences(prov, settings, load_prompts(settings.prompts_file, settings.n_prompts).sha256)
    made_with = [d for d in DTYPES if key_of(StrengthWork(path, settings, d)).inputs_key == prov["inputs_key"]]
    if not differ and made_with:
        differ = [f"--dtype {made_with[0]} (this run: {dtype})"]
    raise UserError(
        f"{file}: measured in another setting: {'; '.join(differ) or 'inputs that no longer match its model'}",
        f"screen with the options it was measured with, or pass {path} to measure it in this setting",
    )


def _setting_differences(prov: dict[str, Any], settings: StrengthSettings, prompt_sha: str) -> list[str]:
    """The settings that decide S in which a saved result differs from `settings`, in words."""
    known = {f.name for f in fields(StrengthSettings)}
    made = StrengthSettings(**{k: v for k, v in (prov.get("settings") or {}).items() if k in known}).key_fields()
    now = settings.key_fields()
    differ = [f"{k} {v!r} (this run: {now[k]!r})" for k, v in made.items() if v != now[k]]
    recorded = (prov.get("prompt_set") or {}).get("sha256")
    if recorded != prompt_sha:
        differ.append(f"calibration prompts sha256 {str(recorded)[:12]} (this run: {prompt_sha[:12]})")
    return differ


def detect_qk_norm(model_path: str) -> QKNorm:
    """QK-norm class of a local model folder (config.json, then the safetensors header if needed),
    or of a hub id (when the hub is reachable) or a GGUF file through transformers' AutoConfig."""
    folder = Path(model_path)
    if not folder.is_dir():  # a hub id, or a GGUF file
        from transformers import AutoConfig

        source, args = pretrained_args(model_path)
        return classify_qk_norm(AutoConfig.from_pretrained(source, **args).to_dict())
    config = check_config(folder / "config.json")
    known = text_config(config).get("model_type") in qk_norm_table()["model_types"]
    tensors = {} if known else checkpoint_tensors(folder)
    if not tensors:  # a type in the table, or (raises) an unknown type and no safetensors to inspect
        return classify_qk_norm(config)
    suffixes = qk_norm_table()["weight_rule"]["layer0_suffixes"]
    size = next((math.prod(t.shape) for k, t in sorted(tensors.items()) if any(k.endswith(s) for s in suffixes)), None)
    return classify_qk_norm(config, size)


def run_screen(
    names: list[str],
    slugs: list[str],
    settings: StrengthSettings,
    output: Path | None,
    options: MeasureOptions = MeasureOptions(),
    predict: ScreenOptions = ScreenOptions(),
) -> list[str]:
    """Screen `names`, predicting as `predict` says; with `output` write screen.json/.md/.csv/.png and
    strength/<slug>.* there (holding its lock). Returns the lines to print."""
    from lm_eval_sink.commands.fit import read_pairs

    asked = predict.pairs_file is not None or predict.paper_line  # a PAIRS file, else the paper's table (or no fit)
    fit = fit_pairs(read_pairs(predict.pairs_file)) if asked else None  # a bad file fails before any model loads
    reused = {
        i: reused_strength(Path(n), settings, options.dtype) for i, n in enumerate(names) if n.endswith(STRENGTH_SUFFIX)
    }
    if output is None:
        return _run(names, slugs, settings, None, options, (predict, fit, reused))
    check_writable(Path(output))
    planned = [resolve_model(n, allow_gguf=True, convert=False) for i, n in enumerate(names) if i not in reused]
    planned += [p for r in reused.values() for p in (str(r.file), r.path)]
    check_not_inputs([output], inputs=[*planned, predict.pairs_file, settings.prompts_file], option="--output")
    with hold(Path(output)):
        return _run(names, slugs, settings, Path(output), options, (predict, fit, reused))


def _run(
    names: list[str],
    slugs: list[str],
    settings: StrengthSettings,
    output: Path | None,
    options: MeasureOptions,
    how: tuple[ScreenOptions, Any, dict[int, Reused]],
) -> list[str]:
    """Measure each model but those of the strength files passed in (`how[2]`, by position), rank and predict from the
    fit `how[1]` (or None); write the screen's files when saving; return the lines to print."""
    from lm_eval_sink.commands.strength import check_output, unique_slugs

    predict, fit, reused = how
    load_prompts(settings.prompts_file, settings.n_prompts)
    slugs = unique_slugs([reused[i].slug if i in reused else s for i, s in enumerate(slugs)])
    todo = [i for i in range(len(names)) if i not in reused]
    if output is not None:  # before `default` is converted
        files = _check_outputs(output, options.force)
        check_output(output / "strength", [names[i] for i in todo], [slugs[i] for i in todo], settings, options.force)
    paths = [reused[i].path if i in reused else resolve_model(n, allow_gguf=True) for i, n in enumerate(names)]
    classes = [detect_qk_norm(p) for p in paths]
    lines, measured = _measure(todo, (names, slugs, paths), settings, output, options)
    measured |= {i: (str(r.file), r.result) for i, r in reused.items()}
    lines = [
        f"{reused[i].slug}: reused {reused[i].file} (same model content, setting and versions)" for i in reused
    ] + lines
    files_saved, strengths = [measured[i][0] for i in range(len(names))], [measured[i][1] for i in range(len(names))]
    result = screen(names, slugs, paths, strengths, classes, fit, files_saved, predict.paper_line)
    md = screen_table_markdown(result)
    out_lines = md.rstrip("\n").splitlines() + [f"warning: {m.slug}: {w}" for m in result.models for w in m.warnings]
    if output is None:
        return [*out_lines, "not saved (pass --output DIR to write screen.json, tables and the plot)"]
    _write(result, md, files, settings, options, predict)
    lines = [line for line in lines if line not in out_lines]  # the setting lines once, under the table
    return lines + out_lines + ["wrote " + ", ".join(str(p) for p in files)]


def _measure(
    todo: list[int],
    models: tuple[list[str], list[str], list[str]],
    settings: StrengthSettings,
    output: Path | None,
    options: MeasureOptions,
) -> tuple[list[str], dict[int, tuple[str | None, Any]]]:
    """The models at positions `todo` of `models` (names, slugs, paths) measured, kept in `output/strength` when
    saving: the lines to print and, by position, (the result file or None, the result)."""
    names, slugs, paths = ([m[i] for i in todo] for m in models)
    if not todo:
        return [], {}
    if output is not None:  # through `run_strength` into `output/strength` (resumable by key there), read back
        from lm_eval_sink.commands.strength import run_strength

        lines = run_strength(names, slugs, settings, output / "strength", options)
        files = [output / "strength" / f"{s}.strength.json" for s in slugs]
        return lines, {i: (str(f), SinkStrength.from_json(read_json(f))) for i, f in zip(todo, files, strict=True)}
    return [], {i: (None, r) for i, r in zip(todo, _measure_here(paths, settings, options), strict=True)}


def _measure_here(paths: list[str], settings: StrengthSettings, options: MeasureOptions) -> list[Any]:
    """Each model's Sink Strength, kept nowhere (no --output): through `options.measure_all` when given (the first
    failed model ends the screen), else here, in turn."""
    if options.measure_all is not None:
        results = {}
        for path, res, error in options.measure_all(paths, settings, options.dtype, options.device):
            if error is not None:
                raise UserError(
                    f"{path}: {error}", "fix the cause and rerun (pass --output DIR to keep finished models)"
                )
            results[path] = res
        return [results[p] for p in paths]
    return [
        measure_model(p, settings, dtype=options.dtype, device=options.device, progress=options.progress) for p in paths
    ]


def _check_outputs(output: Path, force: bool) -> list[Path]:
    """The screen's files in `output`, checked before any work: `output` is a folder, and the files are new (or
    `force`) and made by the same versions (`run_screen` refused an `output` overlapping an input)."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file", "pass a folder")
    files = [output / name for name in SCREEN_FILES]
    check_same_versions(files[0], key_versions(ScreenWork), force)
    check_new_outputs(files, force, inputs=())
    return files


def _write(
    result: ScreenResult,
    md: str,
    files: list[Path],
    settings: StrengthSettings,
    options: MeasureOptions,
    predict: ScreenOptions,
) -> None:
    """screen.json (with its provenance), screen.md, screen.csv and the figure."""
    from lm_eval_sink.provenance import provenance

    key = key_of(ScreenWork(tuple(m.path for m in result.models), settings, options.dtype, predict))
    data = {
        **result.to_json(),
        "provenance": provenance(
            models=[m.path for m in result.models],
            settings=asdict(settings),
            dtype=options.dtype,
            device=options.device,
            seed=settings.seed,
            key=key.key,
            inputs_key=key.inputs_key,
            key_versions=key.versions,
        ),
    }
    atomic_write_json(files[0], data)
    atomic_write_text(files[1], md)
    atomic_write_text(files[2], screen_csv(result))
    _plot(result, files[3])


def _plot(result: ScreenResult, path: Path) -> None:
    """With predictions: a task's pairs, line and prediction band with each predicted model at its delta and interval
    (IFEval when predicted, else the first task predicted); without: the ranking by setting."""
    from lm_eval_sink.plots import fit_scatter, ranking_bars

    tasks = sorted({t for m in result.models for t, p in m.predictions.items() if p["predicted"]})
    if not tasks:
        ranking_bars(
            [m.slug for m in result.models],
            [m.sink_strength for m in result.models],
            "Screened models by Sink Strength (no predicted deltas: see screen.md)",
            path,
            groups=[m.setting for m in result.models],
            legend=result.comparison.legend(),
        )
        return
    task = "ifeval" if "ifeval" in tasks else tasks[0]
    f = result.fit.tasks[task]
    qk = {p.name: p.qk_norm for p in result.fit.table.pairs}
    shown = [(m, m.predictions[task]) for m in result.models if m.predictions[task]["predicted"]]
    fit_scatter(
        f,
        [qk[n] for n in f.names],
        path,
        screened=[(m.slug, m.sink_strength, p["predicted_delta"], *p["interval"]) for m, p in shown],
        note=f"across settings: {PAPER_LINE_CAVEAT}" if result.paper_line else None,
    )
