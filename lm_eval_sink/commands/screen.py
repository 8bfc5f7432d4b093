"""`lm-eval-sink screen`: resolve models, read their QK-norm class, measure S, rank and predict, write the output
folder.

With `--output DIR`: each model's Sink Strength goes through `commands.strength.run_strength`
into `DIR/strength/` (resumable by key there), then `screen.json`, `.md`, `.csv` and `.png` into
`DIR` (refused before any work when they exist, unless `--force`); the folder is held with
`locks.hold` for the run. Without it nothing is written. Predicted deltas need `--pairs` (pairs measured in the
models' setting) or `--paper-line` (the paper's pairs, with the caveat beside each number); without either the
screen is the ranking alone.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.options import MeasureOptions, ScreenOptions
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
from lm_eval_sink.strength import StrengthSettings

SCREEN_FILES = ("screen.json", "screen.md", "screen.csv", "screen.png")


def _safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (no weights are read)."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _prod(shape: list[int]) -> int:
    out = 1
    for x in shape:
        out *= int(x)
    return out


def detect_qk_norm(model_path: str) -> QKNorm:
    """QK-norm class of a local model folder (config.json, then the safetensors header if needed),
    or of a hub id (when the hub is reachable) or a GGUF file through transformers' AutoConfig."""
    folder = Path(model_path)
    if not folder.is_dir():  # a hub id, or a GGUF file
        from transformers import AutoConfig

        from lm_eval_sink.models import pretrained_args

        source, args = pretrained_args(model_path)
        return classify_qk_norm(AutoConfig.from_pretrained(source, **args).to_dict())
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(
            f"{folder}/config.json cannot be read ({e})", "pass a model folder written by save_pretrained"
        ) from None
    if text_config(config).get("model_type") in qk_norm_table()["model_types"]:
        return classify_qk_norm(config)
    shapes = _safetensors_shapes(folder)
    if not shapes:
        return classify_qk_norm(config)  # raises: unknown type and no safetensors to inspect
    suffixes = qk_norm_table()["weight_rule"]["layer0_suffixes"]
    size = next((int(_prod(v)) for k, v in sorted(shapes.items()) if any(k.endswith(s) for s in suffixes)), None)
    return classify_qk_norm(config, size)


def _measured_in_order(paths: list[str], finished: Any) -> list[Any]:
    """The results `measure_all` yields as (path, result, error) in completion order, in `paths` order;
    with no --output nothing is kept, so the first failed model ends the screen."""
    results = {}
    for path, res, error in finished:
        if error is not None:
            raise UserError(f"{path}: {error}", "fix the cause and rerun (pass --output DIR to keep finished models)")
        results[path] = res
    return [results[p] for p in paths]


def run_screen(
    names: list[str],
    slugs: list[str],
    settings: StrengthSettings,
    output: Path | None,
    options: MeasureOptions = MeasureOptions(),
    predict: ScreenOptions = ScreenOptions(),
) -> list[str]:
    """Screen `names`; with `output` write screen.json/.md/.csv/.png and strength/<slug>.* there (holding its lock).

    Predicted deltas come from `predict`: a fit of its pairs file, where its pairs were measured in a model's setting,
    or with `paper_line` from the paper's pairs with the caveat beside each number; neither: the ranking alone.
    `options.measure_all`: see `commands.strength.run_strength` (e.g. one Ray task per model). Returns the lines to
    print."""
    fit = _fit(predict)  # a bad PAIRS file fails before any model is loaded
    if output is None:
        return _run(names, slugs, settings, None, options, predict, fit)
    from lm_eval_sink.io import check_not_inputs, check_writable
    from lm_eval_sink.locks import hold
    from lm_eval_sink.models import resolve_model

    check_writable(Path(output))
    planned = [resolve_model(n, allow_gguf=True, convert=False) for n in names]
    check_not_inputs([output], inputs=[*planned, predict.pairs_file, settings.prompts_file], option="--output")
    with hold(Path(output)):
        return _run(names, slugs, settings, Path(output), options, predict, fit)


def _fit(predict: ScreenOptions) -> Any:
    """The fit predictions come from: of the PAIRS file, of the paper's table on request, else None."""
    from lm_eval_sink.commands.fit import read_pairs
    from lm_eval_sink.predict import fit_pairs

    if predict.pairs_file is None and not predict.paper_line:
        return None
    return fit_pairs(read_pairs(predict.pairs_file))


def _run(
    names: list[str],
    slugs: list[str],
    settings: StrengthSettings,
    output: Path | None,
    options: MeasureOptions,
    predict: ScreenOptions,
    fit: Any,
) -> list[str]:
    """Measure each model (its result kept in `output/strength` when saving), rank and predict (from `fit`, made as
    `predict` says, or None), then return the lines to print, having written the screen's files when saving."""
    from lm_eval_sink.calibration import load_prompts
    from lm_eval_sink.commands.strength import check_output, unique_slugs
    from lm_eval_sink.models import resolve_model

    load_prompts(Path(settings.prompts_file) if settings.prompts_file else None, settings.n_prompts)
    slugs = unique_slugs(slugs)
    if output is not None:  # before `default` is converted
        planned = [resolve_model(n, allow_gguf=True, convert=False) for n in names]
        files = _check_outputs(output, planned, predict.pairs_file, settings, options.force)
        check_output(output / "strength", names, slugs, settings, options.force)
    paths = [resolve_model(n, allow_gguf=True) for n in names]
    classes = [detect_qk_norm(p) for p in paths]
    if output is not None:
        lines, strength_files, strengths = _measure_saved(names, slugs, settings, output, options)
    else:
        lines, strength_files, strengths = [], [None] * len(names), _measure_here(paths, settings, options)
    files_saved = [None if f is None else str(f) for f in strength_files]
    result = screen(names, slugs, paths, strengths, classes, fit, files_saved, predict.paper_line)
    md = screen_table_markdown(result)
    out_lines = md.rstrip("\n").splitlines() + [f"warning: {m.slug}: {w}" for m in result.models for w in m.warnings]
    if output is None:
        return [*out_lines, "not saved (pass --output DIR to write screen.json, tables and the plot)"]
    _write(result, md, files, settings, options)
    lines = [line for line in lines if line not in out_lines]  # the setting lines once, under the table
    return lines + out_lines + ["wrote " + ", ".join(str(p) for p in files)]


def _measure_here(paths: list[str], settings: StrengthSettings, options: MeasureOptions) -> list[Any]:
    """Each model's Sink Strength, kept nowhere (no --output): through `options.measure_all` when given, else here,
    in turn."""
    from lm_eval_sink.strength import measure_model

    if options.measure_all is not None:
        return _measured_in_order(paths, options.measure_all(paths, settings, options.dtype, options.device))
    return [
        measure_model(p, settings, dtype=options.dtype, device=options.device, progress=options.progress) for p in paths
    ]


def _check_outputs(
    output: Path, paths: list[str], pairs_file: Path | str | None, settings: StrengthSettings, force: bool
) -> list[Path]:
    """The screen's files in `output`, checked before any work: `output` is a folder, and the files are new (or
    `force`), made by the same versions, and none of the inputs."""
    from lm_eval_sink.io import check_new_outputs, check_same_versions
    from lm_eval_sink.strength import key_versions

    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file", "pass a folder")
    files = [output / name for name in SCREEN_FILES]
    check_same_versions(files[0], key_versions(), force)
    check_new_outputs(files, force, inputs=[*paths, pairs_file, settings.prompts_file])
    return files


def _measure_saved(
    names: list[str], slugs: list[str], settings: StrengthSettings, output: Path, options: MeasureOptions
) -> tuple[list[str], list[Path], list[Any]]:
    """Each model's Sink Strength through `run_strength` into `output/strength` (resumable by key there): its lines,
    the result files and the results read back from them."""
    from lm_eval_sink.commands.strength import run_strength
    from lm_eval_sink.io import read_json
    from lm_eval_sink.strength import SinkStrength

    lines = run_strength(names, slugs, settings, output / "strength", options)
    strength_files = [output / "strength" / f"{s}.strength.json" for s in slugs]
    return lines, strength_files, [SinkStrength.from_json(read_json(f)) for f in strength_files]


def _write(
    result: ScreenResult, md: str, files: list[Path], settings: StrengthSettings, options: MeasureOptions
) -> None:
    """screen.json (with its provenance), screen.md, screen.csv and the figure."""
    from lm_eval_sink.io import atomic_write_json, atomic_write_text, provenance
    from lm_eval_sink.strength import key_versions

    data = {
        **result.to_json(),
        "provenance": provenance(
            models=[m.path for m in result.models],
            settings=asdict(settings),
            dtype=options.dtype,
            device=options.device,
            seed=settings.seed,
            key_versions=key_versions(),
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
