"""`lm-eval-sink strength`: measure each model (or reuse its finished result), write JSON, heatmaps and the ranking.

A model's `<slug>.strength.json` is the unit of resume: reused when its `provenance.input_key` is the key of what
`measure_model` receives (`strength.StrengthWork`), recomputed when other versions made it, refused when other
inputs did (without `--force`). The folder is held with `locks.hold` for the whole run (one writer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.options import MeasureOptions
from lm_eval_sink.comparability import (
    RANKING_HEAD,
    compare,
    rank_strengths,
    ranking_json,
    ranking_markdown,
    ranking_table,
    setting_of,
)
from lm_eval_sink.strength import (
    S_MEANING,
    SinkStrength,
    StrengthSettings,
    StrengthWork,
    fmt_optional,
    measure_model,
)
from lm_eval_sink.keys import Key, key_of


def unique_slugs(slugs: list[str]) -> list[str]:
    """The slugs as given, or all of them numbered when two are equal (file names must differ)."""
    return slugs if len(set(slugs)) == len(slugs) else [f"{i + 1:02d}-{s}" for i, s in enumerate(slugs)]


def run_strength(
    names: list[str], slugs: list[str], settings: StrengthSettings, output, options: MeasureOptions = MeasureOptions()
) -> list[str]:
    """Measure each model (or reuse its result) into `<slug>.strength.json` + `<slug>.heatmap.png` in `output`, and
    with several the `ranking.*` files (`options.measure_all`: all at once); the lines to print."""
    from lm_eval_sink.calibration import load_prompts
    from lm_eval_sink.locks import hold
    from lm_eval_sink.models import resolve_model

    output = Path(output)
    slugs = unique_slugs(slugs)
    load_prompts(settings.prompts_file, settings.n_prompts)  # fail before loading models
    check_output(output, names, slugs, settings, options.force)
    paths = [resolve_model(n, allow_gguf=True) for n in names]  # `default` is converted here, after every check
    with hold(output):
        return _run_locked(list(zip(names, paths, slugs, strict=True)), settings, output, options)


def check_output(output: Path, names: list[str], slugs: list[str], settings: StrengthSettings, force: bool) -> None:
    """Refuse, before any model is resolved (converted) or loaded, an output folder that is a file, cannot be written
    or overlaps an input, and (without `force`) an earlier result in it that cannot be read."""
    from lm_eval_sink.io import read_earlier_output
    from lm_eval_sink.outputs import check_not_inputs, check_writable
    from lm_eval_sink.models import resolve_model

    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file", "pass a folder")
    check_writable(output)
    planned = [resolve_model(n, allow_gguf=True, convert=False) for n in names]
    check_not_inputs([output], inputs=[*planned, settings.prompts_file], option="--output")
    for slug in [] if force else slugs:
        if (output / f"{slug}.strength.json").exists():
            read_earlier_output(output / f"{slug}.strength.json")


def saved_stands(prov: dict[str, Any], identity: dict[str, Any], key: Key, where: Path) -> tuple[bool, str | None]:
    """Whether the S saved at `where` with provenance `prov` stands for the work keyed `key`, else what changed when
    other versions made it from the same inputs (None: other inputs); a model whose `identity` changed is refused."""
    from lm_eval_sink.identity import check_same_identity

    check_same_identity(prov.get("model"), identity, where)
    changed = key.change(prov)  # its recorded versions, not only its key: a file edited by hand is not trusted
    return changed is None and prov.get("input_key") == key.key, changed


@dataclass(frozen=True, slots=True)
class _Model:
    """One model of a run: its names, key and result file, and the finished result there to reuse (None: measure)."""

    name: str
    path: str
    slug: str
    key: Key
    json_path: Path
    reuse: dict[str, Any] | None


def _run_locked(
    models: list[tuple[str, str, str]], settings: StrengthSettings, output: Path, options: MeasureOptions
) -> list[str]:
    """Plan reuse per (name, path, slug), measure the rest, then report each model with its heatmap and the ranking."""
    from tqdm.auto import tqdm

    from lm_eval_sink.plots import layer_head_heatmap

    plan, lines = _plan(models, settings, output, options)
    saved = {} if options.measure_all is None else _measure_todo(plan, settings, options, output)
    results = []
    for m in tqdm(plan, desc="models", disable=not options.progress or len(plan) == 1):
        if m.reuse is not None:
            res = SinkStrength.from_json(m.reuse)
            lines.append(f"{m.slug}: reused {m.json_path}")
        elif str(m.json_path) in saved:
            res = saved[str(m.json_path)]
        else:
            measured = measure_model(
                m.path, settings, dtype=options.dtype, device=options.device, progress=options.progress
            )
            res = _save(measured, m)
        png = layer_head_heatmap(
            res.sink_strength_layer_head,
            res.layers,
            f"{m.slug}: sink log-odds ({res.statistic}, rows={res.rows}), S = {res.sink_strength:.4f} "
            + setting_of(res.to_json()).measured_in(),
            output / f"{m.slug}.heatmap.png",
        )
        results.append((m.slug, res))
        lines += _model_lines(m, res, png)
    lines += compare([s for s, _ in results], [setting_of(r.to_json()) for _, r in results]).lines()
    lines.append(f"({S_MEANING})")
    if len(models) > 1:
        lines.append(_write_ranking(results, output))
    return lines


def _plan(
    models: list[tuple[str, str, str]], settings: StrengthSettings, output: Path, options: MeasureOptions
) -> tuple[list[_Model], list[str]]:
    """Each model's key, result file and finished result to reuse; a line per model recomputed because other versions
    made it; a result of other inputs is refused."""
    from lm_eval_sink.io import read_earlier_output
    from lm_eval_sink.models import model_fingerprint

    plan, lines = [], []
    for name, path, slug in models:
        key = key_of(StrengthWork(path, settings, options.dtype))
        json_path = output / f"{slug}.strength.json"
        old, same, changed = None, False, None
        if not options.force and json_path.exists():
            old = read_earlier_output(json_path)
            same, changed = saved_stands(old.get("provenance", {}), model_fingerprint(path), key, json_path)
            if not same and changed is None:
                raise UserError(
                    f"output already exists with other inputs: {json_path}",
                    "pass --force to overwrite, or choose another --output",
                )
        plan.append(_Model(name, path, slug, key, json_path, old if same else None))
        if changed:
            lines.append(f"{slug}: recomputed: {changed}")
    return plan, lines


def _save(res: SinkStrength, m: _Model) -> SinkStrength:
    """`res` with its key and model argument in its provenance, written to the model's JSON at once."""
    from lm_eval_sink.io import atomic_write_json

    keyed = {"input_key": m.key.key, "inputs_key": m.key.inputs_key, "key_versions": m.key.versions}
    res = replace(res, provenance={**res.provenance, **keyed, "model_argument": m.name})
    atomic_write_json(m.json_path, res.to_json())
    return res


def _measure_todo(
    plan: list[_Model], settings: StrengthSettings, options: MeasureOptions, output: Path
) -> dict[str, SinkStrength]:
    """Every model to (re)do measured by `options.measure_all`, each saved as it finishes (json path -> result); a
    failed model is an error raised once the others are saved."""
    todo = list(dict.fromkeys(m.path for m in plan if m.reuse is None))
    saved: dict[str, SinkStrength] = {}
    failed: dict[str, str] = {}
    for path, res, error in options.measure_all(todo, settings, options.dtype, options.device) if todo else ():
        if error is not None:
            failed[path] = error
        for m in plan:
            if m.path == path and m.reuse is None and error is None:
                saved[str(m.json_path)] = _save(res, m)
    if failed:
        first = next(iter(failed.items()))
        raise UserError(
            f"{len(failed)} of {len(todo)} model(s) failed; first: {first[0]}: {first[1]}",
            f"fix the cause and rerun: the {len(saved)} measured ones are kept in {output} and reused",
        )
    return saved


def _model_lines(m: _Model, res: SinkStrength, png: Path) -> list[str]:
    """What a run prints for one model: S with how it was measured and where it went, and its note if any."""
    depth = len(res.attention_layers) or res.n_layers
    line = (
        f"{m.slug}: S = {res.sink_strength:.4f} {setting_of(res.to_json()).measured_in()} (last {res.last_k} of "
        f"{depth} attention layers ({res.last_k / depth:.0%}), {res.statistic}, rows={res.rows}; content rows "
        f"{fmt_optional(res.sink_strength_content_rows)}, template rows {fmt_optional(res.sink_strength_template_rows)}"
        f", template share {res.template_row_fraction:.2f}) -> {m.json_path}, {png}"
    )
    return [line, f"{m.slug}: note: {res.sink_note}"] if res.sink_note else [line]


def _write_ranking(results: list[tuple[str, SinkStrength]], output: Path) -> str:
    """ranking.md/.csv/.json/.png of several models, by falling S within each setting; the line naming them."""
    from lm_eval_sink.io import atomic_write_json, atomic_write_text
    from lm_eval_sink.plots import ranking_bars
    from lm_eval_sink.tables import csv_text, markdown_table

    ranking = rank_strengths(results)
    rows = ranking_table(ranking)
    files = [output / f"ranking.{ext}" for ext in ("md", "csv", "json", "png")]
    atomic_write_text(files[0], ranking_markdown(ranking) + markdown_table(RANKING_HEAD, rows))
    atomic_write_text(files[1], csv_text(RANKING_HEAD, rows))
    atomic_write_json(files[2], ranking_json(ranking))
    ranking_bars(
        [s for s, _ in ranking.rows],
        [r.sink_strength for _, r in ranking.rows],
        "Sink Strength ranking",
        files[3],
        groups=ranking.labels,
        legend=ranking.comparison.legend(),
    )
    return "ranking -> " + ", ".join(str(f) for f in files)
