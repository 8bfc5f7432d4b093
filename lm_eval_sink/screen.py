"""Screen candidate backbones before VL training: S, QK-norm class, a ranking within each setting, and predicted
deltas only where a fit allows them (docs/screening.md, "screen").

S is measured by commands/screen.py through the Sink Strength API, never computed here. Takes configs, results and
fits, returns data and text; the one file it reads is its own packaged table. No torch at module level.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from lm_eval_sink.comparability import Comparison, Setting, compare, rank_strengths
from lm_eval_sink.errors import UserError
from lm_eval_sink.predict import PI_LEVEL
from lm_eval_sink.tables import csv_text, markdown_lines

SCHEMA_VERSION = 2  # 2: ranks within each setting, predictions only within a setting (or --paper-line), intervals
QK_NORM_DATA = "data/qk_norm_classes.json"
PAPER_LINE_CAVEAT = "paper's line: its S from the paper's own prompts, this S from this project's (another setting)"
NO_FIT_NOTE = (
    "no predicted deltas: a prediction needs a fit of pairs measured in this setting (--pairs PAIRS.yaml whose "
    "sink_strength entries are *.strength.json files measured like these models; see `lm-eval-sink fit`), or "
    "--paper-line for the paper's line with its caveat beside each number"
)


# ---------------------------------------------------------------------------- QK-norm class


@dataclass(frozen=True, slots=True)
class QKNorm:
    """A model's QK-norm class and how it was decided."""

    qk_norm: str  # per_head | layerwise | none
    model_type: str
    source: str  # "table", "table (<key> = <value>)" or "weights (...)": never a silent guess


def qk_norm_table() -> dict[str, Any]:
    return json.loads(resources.files("lm_eval_sink").joinpath(QK_NORM_DATA).read_text(encoding="utf-8"))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal) config.json dict."""
    for key in ("text_config", "llm_config"):
        if isinstance(config.get(key), dict) and config[key].get("model_type"):
            return config[key]
    return config


def classify_qk_norm(config: dict[str, Any], layer0_q_norm_size: int | str | None = "unknown") -> QKNorm:
    """Class from a config dict; `layer0_q_norm_size` (size of layer 0's q-norm weight, None when
    the checkpoint has none) decides model types missing from the table."""
    cfg = text_config(config)
    model_type = cfg.get("model_type")
    if not model_type:
        raise UserError("config.json has no model_type", "pass a transformers model folder")
    table = qk_norm_table()
    entry = table["model_types"].get(model_type)
    if entry is not None:
        if "class" in entry:
            return QKNorm(entry["class"], model_type, "table")
        value = json.dumps(cfg.get(entry["switch"]))
        return QKNorm(entry["cases"].get(value, entry["default"]), model_type, f"table ({entry['switch']} = {value})")
    if layer0_q_norm_size == "unknown":
        known = ", ".join(sorted(table["model_types"]))
        raise UserError(
            f"model type {model_type!r} is not in {QK_NORM_DATA} and its weights could not be inspected",
            f"add it to the table (known: {known})",
        )
    if layer0_q_norm_size is None:
        return QKNorm("none", model_type, "weights (no layer-0 q-norm tensor)")
    heads = int(cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    if layer0_q_norm_size == head_dim:
        return QKNorm("per_head", model_type, f"weights (layer-0 q-norm size {head_dim} = head_dim)")
    if layer0_q_norm_size == heads * head_dim:
        return QKNorm("layerwise", model_type, f"weights (layer-0 q-norm size {layer0_q_norm_size} = heads x head_dim)")
    raise UserError(
        f"model type {model_type!r}: layer-0 q-norm size {layer0_q_norm_size} is neither head_dim "
        f"{head_dim} nor heads x head_dim {heads * head_dim}",
        f"add the model type to {QK_NORM_DATA}",
    )


# ---------------------------------------------------------------------------- screening


@dataclass(frozen=True, slots=True)
class ScreenedModel:
    """One screened model: S with its setting, QK-norm class, predicted deltas per fitted task, warnings."""

    rank: int  # 1 = highest S among the models of its setting (least predicted damage)
    setting: str  # its setting's letter (`comparability.compare`)
    model: str  # the argument as given
    slug: str
    path: str
    sink_strength: float
    last_k: int
    n_layers: int
    attention_layers: int | None
    k_share: float | None
    qk_norm: str
    qk_norm_source: str
    model_type: str
    predictions: dict[str, dict[str, Any]]  # task -> `prediction`
    warnings: tuple[str, ...]
    strength_file: str | None


@dataclass(frozen=True, slots=True)
class ScreenResult:
    """The screened models by setting, then rank; the fit predictions came from (None: no predictions asked) and
    whether it was the paper's line on request."""

    models: tuple[ScreenedModel, ...]
    fit: Any  # predict.FitResult or None
    comparison: Comparison
    paper_line: bool
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        fits = {} if self.fit is None else self.fit.to_json()["tasks"]
        keep = ("spearman_rho", "permutation_p", "slope", "intercept", "loo_mae", "baseline_mae", "n_pairs")
        keep += ("s_min", "s_max", "residual_se", "interval_level", "setting", "setting_unknown")
        return {
            "schema_version": SCHEMA_VERSION,
            "models": [{**asdict(m), "warnings": list(m.warnings)} for m in self.models],
            "comparison": self.comparison.to_json(),
            "predictions_from": None if self.fit is None else "paper_line" if self.paper_line else "pairs",
            "fits": {t: {k: f[k] for k in keep} for t, f in fits.items()},
            "pairs_file": None if self.fit is None else self.fit.table.source,
            "pairs_sha256": None if self.fit is None else self.fit.table.sha256,
            "notes": list(self.notes),
        }


def prediction(
    s: float, setting: Setting, f: Any, fit_setting: tuple[Setting | None, str | None], paper_line: bool
) -> dict[str, Any]:
    """A task's prediction for S measured in `setting`: with the fit's prediction interval when the fit's pairs were
    measured in that setting, or with the paper line's caveat when asked; else why none is made."""
    pairs, why = fit_setting
    both = None if pairs is None else compare(["pairs", "model"], [pairs, setting])
    same = both is not None and both.comparable
    if both is not None and not same:
        why = "the pairs were measured in another setting: " + "; ".join(both.differences("B"))
    if not same and not paper_line:
        return {"predicted": False, "why_not": why}
    lo, hi = f.prediction_interval(s)
    return {
        "predicted": True,
        "predicted_delta": f.predict(s),
        "interval": [lo, hi],
        "interval_level": PI_LEVEL,
        "outside_fitted_range": f.outside(s),
        "fit_s_range": [f.s_min, f.s_max],
        "same_setting": same,
        "caveat": None if same else PAPER_LINE_CAVEAT,
    }


def predictions_for(s: float, setting: Setting, fit: Any, paper_line: bool) -> tuple[dict[str, Any], list[str]]:
    """Each fitted task's `prediction`, with a warning for each predicted S outside the fitted range."""
    out, warnings = {}, []
    for task, f in sorted(({} if fit is None else fit.tasks).items()):
        out[task] = p = prediction(s, setting, f, fit.settings[task], paper_line)
        if p["predicted"] and p["outside_fitted_range"]:
            warnings.append(
                f"{task}: S = {s:.4f} lies outside the fitted range {f.s_min:.2f}..{f.s_max:.2f}: the predicted "
                "delta is an extrapolation"
            )
    return out, warnings


def screen(
    names: list[str],
    slugs: list[str],
    paths: list[str],
    strengths: list[Any],
    classes: list[QKNorm],
    fit: Any,
    strength_files: list[str | None],
    paper_line: bool = False,
) -> ScreenResult:
    """Rank the models by S (`strengths`, SinkStrength results in the order of `names`) within each setting, predict
    each fitted task's delta where `fit` (None: no predictions) allows it, and add the notes."""
    ranking = rank_strengths(list(zip(slugs, strengths, strict=True)))  # by setting, then falling S (unique slugs)
    models = []
    for (slug, st), rank, label in zip(ranking.rows, ranking.ranks, ranking.labels, strict=True):
        i = slugs.index(slug)
        setting, qk = ranking.comparison.settings[i], classes[i]
        preds, warnings = predictions_for(st.sink_strength, setting, fit, paper_line)
        models.append(
            ScreenedModel(
                *(rank, label, names[i], slug, paths[i], st.sink_strength, st.last_k),
                *(st.n_layers, setting.attention_layers, setting.k_share),
                *(qk.qk_norm, qk.source, qk.model_type, preds, tuple(warnings), strength_files[i]),
            )
        )
    notes = screen_notes(ranking.comparison, fit, paper_line) + unpredicted_notes(models)
    return ScreenResult(tuple(models), fit, ranking.comparison, paper_line, tuple(notes))


def unpredicted_notes(models: list[ScreenedModel]) -> list[str]:
    """One note per task and reason: which models got no predicted delta, and why."""
    why: dict[tuple[str, str], list[str]] = {}
    for m in models:
        for task, p in sorted(m.predictions.items()):
            if not p["predicted"]:
                why.setdefault((task, p["why_not"]), []).append(m.slug)
    return [f"note: {task} not predicted for {', '.join(slugs)}: {reason}" for (task, reason), slugs in why.items()]


def screen_notes(comparison: Comparison, fit: Any, paper_line: bool) -> list[str]:
    """The setting(s) of the screened S, where predictions come from, and what the intervals and errors are."""
    notes = list(comparison.lines())
    if fit is None:
        return [*notes, f"note: {NO_FIT_NOTE}"]
    if paper_line:
        notes.append(
            "note: --paper-line: predicted deltas from the paper's six pairs, whose S were measured with the paper's "
            "own prompts: these S were measured in another setting, so each number is indicative only"
        )
    for task, f in sorted(fit.tasks.items()):
        setting, why = fit.settings[task]
        where = "measured in one setting" if setting is not None else f"not in this setting ({why})"
        notes.append(
            f"note: fit {task}: {f.n_pairs} pairs {where}; leave-one-pair-out MAE {f.loo_mae:.1f} points (the line's "
            f"error on each pair left out: a check of the fit, not an interval); [a, b] = {PI_LEVEL:.0%} prediction "
            "interval (OLS, t with n - 2 df), wider the farther S lies from the pairs' mean S"
        )
    return notes


def _cell(p: dict[str, Any]) -> str:
    """One prediction as the table shows it: the delta and its interval with the caveats beside them."""
    if not p["predicted"]:
        return "not predicted (see the notes)"
    lo, hi = p["interval"]
    text = f"{p['predicted_delta']:+.1f} [{lo:+.1f}, {hi:+.1f}]"
    if p["caveat"]:
        text += " (paper's line, another setting)"
    return text + ("; outside the fitted range" if p["outside_fitted_range"] else "")


def screen_table_markdown(result: ScreenResult) -> str:
    """The ranking (by setting, then S) with predicted deltas as a Markdown table, then the notes."""
    tasks = sorted(result.fit.tasks) if result.fit is not None else []
    head = ["setting", "rank", "model", "S", "K (share of attention layers)", "qk_norm"]
    head += [f"predicted {t} delta, points [{PI_LEVEL:.0%} PI]" for t in tasks] + ["warnings"]
    setting = dict(zip(result.comparison.names, result.comparison.settings, strict=True))  # slug -> its S's setting
    rows = [
        [m.setting, str(m.rank), m.slug, f"{m.sink_strength:.4f}", setting[m.slug].k_cell(), m.qk_norm]
        + [_cell(m.predictions[t]) for t in tasks]
        + [str(len(m.warnings))]
        for m in result.models
    ]
    return "\n".join([*markdown_lines(head, rows), "", *result.notes]) + "\n"


def screen_csv(result: ScreenResult) -> str:
    """One CSV record per model: its setting, rank in it, S, K, QK-norm class and each task's prediction (empty
    where none is made), whether it crosses settings (the paper's line) and why none was made."""
    tasks = sorted(result.fit.tasks) if result.fit is not None else []
    fields = ("predicted_delta", "interval_low", "interval_high", "outside_fitted_range", "across_settings", "why_not")
    head = ["setting", "rank", "model", "sink_strength", "last_k", "n_layers", "attention_layers", "k_share"]
    head += ["qk_norm", "qk_norm_source"] + [f"{t}_{k}" for t in tasks for k in fields]
    rows = []
    for m in result.models:
        row = [m.setting, str(m.rank), m.slug, f"{m.sink_strength:.6f}", str(m.last_k), str(m.n_layers)]
        row += [str(m.attention_layers), "" if m.k_share is None else f"{m.k_share:.4f}", m.qk_norm, m.qk_norm_source]
        for t in tasks:
            p = m.predictions[t]
            if p["predicted"]:
                row += [f"{p['predicted_delta']:.6f}", *(f"{v:.6f}" for v in p["interval"])]
                row += [str(p["outside_fitted_range"]), str(not p["same_setting"]), ""]
            else:
                row += ["", "", "", "", "", p["why_not"] or ""]
        rows.append(row)
    return csv_text(head, rows)
