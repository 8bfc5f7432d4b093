"""Screen candidate backbones before VL training: S, QK-norm class and predicted deltas.

`screen` ranks models by their Sink Strength (measured with the Sink Strength API by
commands/screen.py: `commands.strength.run_strength` / `strength.measure_model`; S is never
computed another way), classifies their QK norm from the config (the table
`data/qk_norm_classes.json`; unknown model types from the layer-0 q-norm tensor's size, which
commands/screen.py reads from the safetensors header) and predicts each task's delta from a fit of
a PAIRS table (`predict.py`; default: the paper's six pairs) with the fit's leave-one-pair-out mean
absolute error as its uncertainty. Takes configs, results and fits, returns data and text; the one file it reads is
its own packaged table.
S depends on the calibration prompts and on K (the last K layers) relative to depth: the
project's prompts are not the paper's, so a predicted delta from the shipped table is only
indicative; fits of pairs measured with one setting are comparable among themselves.
No torch at module level.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.tables import csv_text, markdown_lines

SCHEMA_VERSION = 1
QK_NORM_DATA = "data/qk_norm_classes.json"
CALIBRATION_NOTE = (
    "S depends on the calibration prompts and on K relative to depth; this project's 15 prompts are not the paper's, "
    "so absolute S values (and deltas predicted from the paper's table) are comparable only within one setting"
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
    """One screened model: S, QK-norm class, predicted deltas per fitted task, warnings."""

    rank: int  # 1 = highest S (least predicted damage)
    model: str  # the argument as given
    slug: str
    path: str
    sink_strength: float
    last_k: int
    n_layers: int
    qk_norm: str
    qk_norm_source: str
    model_type: str
    predictions: dict[str, dict[str, Any]]  # task -> predicted_delta, loo_mae, extrapolated, fit_s_range
    warnings: tuple[str, ...]
    strength_file: str | None


@dataclass(frozen=True, slots=True)
class ScreenResult:
    models: tuple[ScreenedModel, ...]
    fit: Any  # predict.FitResult
    notes: tuple[str, ...]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "models": [{**asdict(m), "warnings": list(m.warnings)} for m in self.models],
            "fits": {
                t: {
                    k: getattr(f, k)
                    for k in (
                        "spearman_rho",
                        "permutation_p",
                        "slope",
                        "intercept",
                        "loo_mae",
                        "baseline_mae",
                        "n_pairs",
                        "s_min",
                        "s_max",
                    )
                }
                for t, f in sorted(self.fit.tasks.items())
            },
            "pairs_file": self.fit.table.source,
            "pairs_sha256": self.fit.table.sha256,
            "notes": list(self.notes),
            "provenance": self.provenance,
        }


def predictions_for(s: float, fit: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Predicted delta per fitted task, with the fit's leave-one-out MAE; warnings for extrapolation."""
    out, warnings = {}, []
    for task, f in sorted(fit.tasks.items()):
        outside = not (f.s_min <= s <= f.s_max)
        out[task] = {
            "predicted_delta": f.predict(s),
            "loo_mae": f.loo_mae,
            "extrapolated": outside,
            "fit_s_range": [f.s_min, f.s_max],
        }
        if outside:
            warnings.append(
                f"{task}: S = {s:.4f} lies outside the fitted range {f.s_min:.2f}..{f.s_max:.2f}; the "
                "predicted delta is an extrapolation"
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
) -> ScreenResult:
    """Rank the models by S (highest first), predict each fitted task's delta, and add the calibration notes.

    `strengths` are SinkStrength results in the order of `names`; `strength_files` where each is saved (None: not
    saved)."""
    order = sorted(range(len(names)), key=lambda i: -strengths[i].sink_strength)
    models = []
    for rank, i in enumerate(order, 1):
        st = strengths[i]
        preds, warnings = predictions_for(st.sink_strength, fit)
        models.append(
            ScreenedModel(
                rank=rank,
                model=names[i],
                slug=slugs[i],
                path=paths[i],
                sink_strength=st.sink_strength,
                last_k=st.last_k,
                n_layers=st.n_layers,
                qk_norm=classes[i].qk_norm,
                qk_norm_source=classes[i].source,
                model_type=classes[i].model_type,
                predictions=preds,
                warnings=tuple(warnings),
                strength_file=strength_files[i],
            )
        )
    prompt_set = strengths[0].provenance.get("prompt_set", {})
    notes = [
        CALIBRATION_NOTE,
        f"calibration prompts: {prompt_set.get('source')} ({prompt_set.get('n_prompts')} prompts, "
        f"sha256 {str(prompt_set.get('sha256'))[:12]})",
    ]
    notes += [f"{m.slug}: K = {m.last_k} of {m.n_layers} layers ({m.last_k / m.n_layers:.0%} of depth)" for m in models]
    return ScreenResult(models=tuple(models), fit=fit, notes=tuple(notes))


def screen_table_markdown(result: ScreenResult) -> str:
    """The ranking with predicted deltas as a Markdown table, then the notes."""
    tasks = sorted(result.fit.tasks)
    head = (
        ["rank", "model", "S", "last_k/layers", "qk_norm"]
        + [f"predicted {t} delta (± LOO MAE)" for t in tasks]
        + ["warnings"]
    )
    rows = []
    for m in result.models:
        cells = [str(m.rank), m.slug, f"{m.sink_strength:.4f}", f"{m.last_k}/{m.n_layers}", m.qk_norm]
        for t in tasks:
            p = m.predictions[t]
            cells.append(
                f"{p['predicted_delta']:+.1f} ± {p['loo_mae']:.1f}" + (" (extrapolated)" if p["extrapolated"] else "")
            )
        rows.append([*cells, str(len(m.warnings))])
    return "\n".join([*markdown_lines(head, rows), "", *(f"note: {n}" for n in result.notes)]) + "\n"


def screen_csv(result: ScreenResult) -> str:
    """One CSV record per model: S, QK-norm class and each task's predicted delta, LOO MAE, extrapolated flag."""
    tasks = sorted(result.fit.tasks)
    head = ["rank", "model", "sink_strength", "last_k", "n_layers", "qk_norm", "qk_norm_source"] + [
        f"{t}_{k}" for t in tasks for k in ("predicted_delta", "loo_mae", "extrapolated")
    ]
    rows = [
        [str(m.rank), m.slug, f"{m.sink_strength:.6f}", str(m.last_k), str(m.n_layers), m.qk_norm, m.qk_norm_source]
        + [
            str(v) if not isinstance(v, float) else f"{v:.6f}"
            for t in tasks
            for v in (
                m.predictions[t]["predicted_delta"],
                m.predictions[t]["loo_mae"],
                m.predictions[t]["extrapolated"],
            )
        ]
        for m in result.models
    ]
    return csv_text(head, rows)
