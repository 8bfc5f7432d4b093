"""Screen candidate backbones before VL training: S, QK-norm class and predicted deltas.

`screen` measures each model's Sink Strength with the Sink Strength API (`strength.run_strength`
/ `strength.measure_model`; S is never computed another way here), detects its QK-norm class from
its config (the table `data/qk_norm_classes.json`; unknown model types from the layer-0 q-norm
tensor's size in the safetensors header), ranks the models by S and predicts each task's delta
from a fit of a PAIRS table (`predict.py`; default: the paper's six pairs) with the fit's
leave-one-pair-out mean absolute error as its uncertainty.
S depends on the calibration prompts and on K (the last K layers) relative to depth: the
project's prompts are not the paper's, so a predicted delta from the shipped table is only
indicative; fits of pairs measured with one setting are comparable among themselves.
No torch at module level.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError

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
        raise UserError(f"model type {model_type!r} is not in {QK_NORM_DATA} and its weights could not be inspected", f"add it to the table (known: {known})")
    if layer0_q_norm_size is None:
        return QKNorm("none", model_type, "weights (no layer-0 q-norm tensor)")
    heads = int(cfg.get("num_attention_heads") or 0)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
    if layer0_q_norm_size == head_dim:
        return QKNorm("per_head", model_type, f"weights (layer-0 q-norm size {head_dim} = head_dim)")
    if layer0_q_norm_size == heads * head_dim:
        return QKNorm("layerwise", model_type, f"weights (layer-0 q-norm size {layer0_q_norm_size} = heads x head_dim)")
    raise UserError(f"model type {model_type!r}: layer-0 q-norm size {layer0_q_norm_size} is neither head_dim {head_dim} nor heads x head_dim {heads * head_dim}", f"add the model type to {QK_NORM_DATA}")


def _safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers (no weights are read)."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def detect_qk_norm(model_path: str) -> QKNorm:
    """QK-norm class of a local model folder (config.json, then the safetensors header if needed),
    or of a hub id through transformers' AutoConfig when the hub is reachable."""
    folder = Path(model_path)
    if not folder.is_dir():
        from transformers import AutoConfig

        return classify_qk_norm(AutoConfig.from_pretrained(model_path).to_dict())
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{folder}/config.json cannot be read ({e})", "pass a model folder written by save_pretrained") from None
    if text_config(config).get("model_type") in qk_norm_table()["model_types"]:
        return classify_qk_norm(config)
    shapes = _safetensors_shapes(folder)
    if not shapes:
        return classify_qk_norm(config)  # raises: unknown type and no safetensors to inspect
    suffixes = qk_norm_table()["weight_rule"]["layer0_suffixes"]
    size = next((int(_prod(v)) for k, v in sorted(shapes.items()) if any(k.endswith(s) for s in suffixes)), None)
    return classify_qk_norm(config, size)


def _prod(shape: list[int]) -> int:
    out = 1
    for x in shape:
        out *= int(x)
    return out


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
            "fits": {t: {k: getattr(f, k) for k in ("spearman_rho", "permutation_p", "slope", "intercept", "loo_mae", "baseline_mae", "n_pairs", "s_min", "s_max")} for t, f in sorted(self.fit.tasks.items())},
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
        out[task] = {"predicted_delta": f.predict(s), "loo_mae": f.loo_mae, "extrapolated": outside, "fit_s_range": [f.s_min, f.s_max]}
        if outside:
            warnings.append(f"{task}: S = {s:.4f} lies outside the fitted range {f.s_min:.2f}..{f.s_max:.2f}; the predicted delta is an extrapolation")
    return out, warnings


def screen_table_markdown(result: ScreenResult) -> str:
    tasks = sorted(result.fit.tasks)
    head = ["rank", "model", "S", "last_k/layers", "qk_norm"] + [f"predicted {t} delta (± LOO MAE)" for t in tasks] + ["warnings"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in result.models:
        cells = [str(m.rank), m.slug, f"{m.sink_strength:.4f}", f"{m.last_k}/{m.n_layers}", m.qk_norm]
        for t in tasks:
            p = m.predictions[t]
            cells.append(f"{p['predicted_delta']:+.1f} ± {p['loo_mae']:.1f}" + (" (extrapolated)" if p["extrapolated"] else ""))
        cells.append(str(len(m.warnings)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"note: {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def _unique_slugs(slugs: list[str]) -> list[str]:
    return slugs if len(set(slugs)) == len(slugs) else [f"{i + 1:02d}-{s}" for i, s in enumerate(slugs)]


def run_screen(names: list[str], slugs: list[str], settings: Any, pairs_file: Path | str | None, output: Path | None, dtype: str = "auto", device: str = "cpu", force: bool = False, progress: bool = True,
               measure_all: Any = None) -> list[str]:
    """Screen `names`; with `output` write screen.json/.md/.csv/.png and strength/<slug>.* there (holding its lock).

    `measure_all`: see `strength.run_strength` (e.g. one Ray task per model)."""
    if output is None:
        return _run_screen(names, slugs, settings, pairs_file, None, dtype, device, force, progress, measure_all)
    from lm_eval_sink.locks import hold

    with hold(Path(output)):
        return _run_screen(names, slugs, settings, pairs_file, Path(output), dtype, device, force, progress, measure_all)


def _run_screen(names: list[str], slugs: list[str], settings: Any, pairs_file: Path | str | None, output: Path | None, dtype: str, device: str, force: bool, progress: bool,
                measure_all: Any) -> list[str]:
    from lm_eval_sink.io import atomic_write_json, atomic_write_text, check_new_outputs, provenance
    from lm_eval_sink.models import resolve_model
    from lm_eval_sink.commands.fit import read_pairs
    from lm_eval_sink.predict import fit_pairs
    from lm_eval_sink.strength import SinkStrength, measure_model, run_strength

    fit = fit_pairs(read_pairs(pairs_file))  # a bad PAIRS file fails before any model is loaded
    slugs = _unique_slugs(slugs)
    paths = [resolve_model(n) for n in names]
    classes = [detect_qk_norm(p) for p in paths]
    files = []
    if output is not None:
        output = Path(output)
        if output.exists() and not output.is_dir():
            raise UserError(f"--output {output} is a file", "pass a folder")
        files = [output / f"screen.{ext}" for ext in ("json", "md", "csv", "png")]
        check_new_outputs(files, force)
        lines = run_strength(names, slugs, settings, output / "strength", dtype=dtype, device=device, force=force, progress=progress, measure_all=measure_all)
        strengths = [SinkStrength.from_json(json.loads((output / "strength" / f"{s}.strength.json").read_text(encoding="utf-8"))) for s in slugs]
    else:
        lines = []
        strengths = measure_all(paths, settings, dtype, device) if measure_all is not None else [measure_model(p, settings, dtype=dtype, device=device, progress=progress) for p in paths]
    order = sorted(range(len(names)), key=lambda i: -strengths[i].sink_strength)
    models = []
    for rank, i in enumerate(order, 1):
        st = strengths[i]
        preds, warnings = predictions_for(st.sink_strength, fit)
        models.append(ScreenedModel(
            rank=rank, model=names[i], slug=slugs[i], path=paths[i], sink_strength=st.sink_strength, last_k=st.last_k, n_layers=st.n_layers,
            qk_norm=classes[i].qk_norm, qk_norm_source=classes[i].source, model_type=classes[i].model_type, predictions=preds, warnings=tuple(warnings),
            strength_file=str(output / "strength" / f"{slugs[i]}.strength.json") if output is not None else None,
        ))
    prompt_set = strengths[0].provenance.get("prompt_set", {})
    notes = [CALIBRATION_NOTE, f"calibration prompts: {prompt_set.get('source')} ({prompt_set.get('n_prompts')} prompts, sha256 {str(prompt_set.get('sha256'))[:12]})"]
    notes += [f"{m.slug}: K = {m.last_k} of {m.n_layers} layers ({m.last_k / m.n_layers:.0%} of depth)" for m in models]
    result = ScreenResult(models=tuple(models), fit=fit, notes=tuple(notes))
    md = screen_table_markdown(result)
    out_lines = md.rstrip("\n").splitlines() + [f"warning: {m.slug}: {w}" for m in models for w in m.warnings]
    if output is None:
        return out_lines + ["not saved (pass --output DIR to write screen.json, tables and the plot)"]
    from lm_eval_sink.plots import fit_scatter

    data = {**result.to_json(), "provenance": provenance(models=[m.path for m in models], settings=asdict(settings), dtype=dtype, device=device, seed=settings.seed)}
    atomic_write_json(files[0], data)
    atomic_write_text(files[1], md)
    tasks = sorted(fit.tasks)
    head = ["rank", "model", "sink_strength", "last_k", "n_layers", "qk_norm", "qk_norm_source"] + [f"{t}_{k}" for t in tasks for k in ("predicted_delta", "loo_mae", "extrapolated")]
    rows = [[str(m.rank), m.slug, f"{m.sink_strength:.6f}", str(m.last_k), str(m.n_layers), m.qk_norm, m.qk_norm_source] + [str(v) if not isinstance(v, float) else f"{v:.6f}" for t in tasks for v in (m.predictions[t]["predicted_delta"], m.predictions[t]["loo_mae"], m.predictions[t]["extrapolated"])] for m in models]
    atomic_write_text(files[2], csv_text([head, *rows]))
    first = tasks[0] if "ifeval" not in tasks else "ifeval"
    f = fit.tasks[first]
    qk = {p.name: p.qk_norm for p in fit.table.pairs}
    fit_scatter(f.names, f.sink_strength, f.deltas, [qk[n] for n in f.names], f.slope, f.intercept, first, files[3], screened=[(m.slug, m.sink_strength, m.predictions[first]["predicted_delta"]) for m in models])
    return lines + out_lines + ["wrote " + ", ".join(str(p) for p in files)]


def csv_text(rows: list[list[str]]) -> str:
    """Rows as CSV text (stdlib quoting, '\\n' line ends)."""
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()
