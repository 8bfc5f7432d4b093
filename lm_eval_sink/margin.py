"""Per-head sink margins G_base - B_gap between a reference LLM and a candidate (its VLM backbone).

Both models see the same token ids (the reference's tokenizer and chat template; the candidate's
vocabulary must contain the reference's id for id). Each row's sink key is fixed from the
reference (its argmax key), so a collapsed sink is measured where it was, not where the
candidate's argmax moved. Per row (layer l, head h, query q >= 1, all prompts concatenated):
    g_base[layer, head, row]   the reference's aggregate logit gap at its sink key (= its sink log-odds)
    g_cand[layer, head, row]   the candidate's aggregate logit gap at the SAME key
    shift[layer, head, row]    g_base - g_cand (nats; > 0 where the candidate's sink got weaker)
Per layer and head (arrays [layer, head]):
    g_base_median              median over rows of g_base (the paper's G_base)
    b_gap                      max over rows of shift (the paper's measured B_gap; negative when
                               every row's gap grew)
    b_gap_quantile             the `quantile` of shift over rows (a less extreme B_gap)
    margin, margin_quantile    g_base_median - b_gap (resp. - b_gap_quantile); < 0: sink collapse
    predicted_nonsink_mass     Lemma 1: sigmoid(b_gap - g_base_median)
    measured_nonsink_mass_median   median over rows of the candidate's 1 - a[sink key] = sigmoid(-g_cand)
Lemma 1 (arXiv 2609.00746): if a perturbation moves the gap by at most B_gap, the non-sink mass
is at most sigmoid(B_gap - G_base); keeping sink mass >= 1 - eta needs
G_base - B_gap >= log((1 - eta) / eta). The math here is pure numpy; `measure_margin` loads the
models (torch is imported inside it, never at module level).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings

SCHEMA_VERSION = 1
DEFAULT_QUANTILE = 0.95


def sigmoid(x: Any) -> Any:
    """Logistic function, stable for large |x| (float64)."""
    x = np.asarray(x, dtype=np.float64)
    out = 0.5 * (1.0 + np.tanh(0.5 * x))
    return float(out) if out.ndim == 0 else out


# ---------------------------------------------------------------------------- Lemma 1


def lemma1_bound(g_base: Any, b_gap: Any) -> Any:
    """Upper bound on the non-sink mass after a perturbation moving the sink gap by <= b_gap."""
    return sigmoid(np.asarray(b_gap, dtype=np.float64) - np.asarray(g_base, dtype=np.float64))


def lemma1_required_margin(eta: float) -> float:
    """The margin G_base - B_gap needed to keep the sink mass at least 1 - eta."""
    if not 0.0 < eta < 1.0:
        raise UserError(f"eta must lie strictly between 0 and 1, got {eta}", "use e.g. eta = 0.1 for a sink level of 0.9")
    return math.log((1.0 - eta) / eta)


def lemma1_keeps_sink(g_base: float, b_gap: float, eta: float) -> bool:
    """True when Lemma 1 guarantees sink mass >= 1 - eta."""
    return g_base - b_gap >= lemma1_required_margin(eta)


@dataclass(frozen=True, slots=True)
class Lemma1Case:
    """A synthetic row: one sink key and n_keys - 1 others, gap g_base, worst-case perturbation."""

    g_base: float
    b_gap: float
    n_keys: int
    non_sink_mass: float  # measured on the perturbed softmax row
    bound: float  # sigmoid(b_gap - g_base)
    ratio: float  # non_sink_mass / bound (1.0: the bound is tight)


def lemma1_synthetic(g_base: float = 3.0, b_gap: float = 0.4, n_keys: int = 64, seed: int = 0) -> Lemma1Case:
    """The paper's tightness check: G = 3.0, B_gap = 0.4, N = 64 keys -> non-sink mass 0.069 = bound.

    Other keys' logits are seeded normals; the sink logit is set so that its aggregate gap is
    g_base. The worst-case perturbation (each logit moved by at most b_gap / 2) lowers the sink
    logit by b_gap / 2 and raises every other logit by b_gap / 2, moving the gap by exactly b_gap.
    """
    if n_keys < 2:
        raise UserError(f"n_keys must be at least 2, got {n_keys}", "use e.g. 64")
    rng = np.random.default_rng(seed)
    others = rng.normal(size=n_keys - 1)
    lse = float(np.log(np.exp(others - others.max()).sum()) + others.max())
    logits = np.concatenate([[g_base + lse], others])
    perturbed = logits + np.concatenate([[-b_gap / 2], np.full(n_keys - 1, b_gap / 2)])
    p = np.exp(perturbed - perturbed.max())
    p /= p.sum()
    non_sink = float(p[1:].sum())
    bound = float(lemma1_bound(g_base, b_gap))
    return Lemma1Case(g_base=g_base, b_gap=b_gap, n_keys=n_keys, non_sink_mass=non_sink, bound=bound, ratio=non_sink / bound)


# ---------------------------------------------------------------------------- margins from arrays


def margin_arrays(g_base: np.ndarray, g_cand: np.ndarray, quantile: float = DEFAULT_QUANTILE) -> dict[str, np.ndarray]:
    """Per-(layer, head) margin quantities from per-row gaps [layer, head, row] (see module doc)."""
    g_base = np.asarray(g_base, dtype=np.float64)
    g_cand = np.asarray(g_cand, dtype=np.float64)
    if g_base.shape != g_cand.shape or g_base.ndim != 3 or g_base.shape[2] == 0:
        raise UserError(f"gap arrays of shapes {g_base.shape} and {g_cand.shape} do not match as [layer, head, row] with rows", "capture both models on the same token ids and layers")
    if not 0.0 <= quantile <= 1.0:
        raise UserError(f"--quantile must lie in [0, 1], got {quantile}", "use e.g. 0.95")
    shift = g_base - g_cand
    g_med = np.median(g_base, axis=2)
    b_gap = shift.max(axis=2)
    b_q = np.quantile(shift, quantile, axis=2)
    return {
        "g_base_median": g_med,
        "candidate_gap_median": np.median(g_cand, axis=2),
        "b_gap": b_gap,
        "b_gap_quantile": b_q,
        "margin": g_med - b_gap,
        "margin_quantile": g_med - b_q,
        "predicted_nonsink_mass": lemma1_bound(g_med, b_gap),
        "measured_nonsink_mass_median": np.median(sigmoid(-g_cand), axis=2),
    }


_MATRICES = ("g_base_median", "candidate_gap_median", "b_gap", "b_gap_quantile", "margin", "margin_quantile", "predicted_nonsink_mass", "measured_nonsink_mass_median")


@dataclass(frozen=True, slots=True)
class SinkMargin:
    """Per-head margins of a candidate against its reference; [layer, head] matrices as nested tuples."""

    reference: str
    candidate: str
    layers: tuple[int, ...]
    n_heads: int
    n_prompts: int
    n_rows: int
    quantile: float
    g_base_median: tuple[tuple[float, ...], ...]
    candidate_gap_median: tuple[tuple[float, ...], ...]
    b_gap: tuple[tuple[float, ...], ...]
    b_gap_quantile: tuple[tuple[float, ...], ...]
    margin: tuple[tuple[float, ...], ...]
    margin_quantile: tuple[tuple[float, ...], ...]
    predicted_nonsink_mass: tuple[tuple[float, ...], ...]
    measured_nonsink_mass_median: tuple[tuple[float, ...], ...]
    negative_margin_heads: tuple[dict[str, Any], ...]  # {layer, head, margin, g_base_median, b_gap, ...}
    reference_pos0_argmax_fraction: float
    reference_sink_strength: float
    candidate_sink_strength: float
    summary: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        for k in _MATRICES:
            d[k] = [list(r) for r in getattr(self, k)]
        d["negative_margin_heads"] = [dict(h) for h in self.negative_margin_heads]
        d["schema_version"] = SCHEMA_VERSION
        return d


def build_margin(reference: str, candidate: str, layers: tuple[int, ...], g_base: np.ndarray, g_cand: np.ndarray, quantile: float, n_prompts: int,
                 pos0_fraction: float, reference_s: float, candidate_s: float, provenance: dict[str, Any] | None = None) -> SinkMargin:
    """A SinkMargin from per-row gaps [layer, head, row] (pure)."""
    m = margin_arrays(g_base, g_cand, quantile)
    tup = {k: tuple(tuple(float(x) for x in row) for row in m[k]) for k in _MATRICES}
    negative = tuple(
        {"layer": int(layers[li]), "head": int(h), "reference_has_sink": bool(m["g_base_median"][li, h] > 0),
         **{k: float(m[k][li, h]) for k in ("margin", "margin_quantile", "g_base_median", "b_gap", "predicted_nonsink_mass", "measured_nonsink_mass_median")}}
        for li, h in zip(*np.nonzero(m["margin"] < 0))
    )
    summary = {
        "n_heads_total": int(m["margin"].size),
        "n_negative_margin": len(negative),
        "n_sink_collapse": sum(h["reference_has_sink"] for h in negative),  # G_base > 0 and margin < 0
        "n_no_sink_in_reference": int((m["g_base_median"] <= 0).sum()),  # margin < 0 trivially when B_gap >= 0
        "negative_margin_fraction": len(negative) / m["margin"].size,
        "n_negative_margin_quantile": int((m["margin_quantile"] < 0).sum()),
        "margin_median": float(np.median(m["margin"])),
        "margin_min": float(m["margin"].min()),
        "g_base_median_median": float(np.median(m["g_base_median"])),
        "b_gap_median": float(np.median(m["b_gap"])),
        "b_gap_max": float(m["b_gap"].max()),
    }
    return SinkMargin(reference=reference, candidate=candidate, layers=tuple(int(x) for x in layers), n_heads=int(m["margin"].shape[1]), n_prompts=n_prompts,
                      n_rows=int(np.asarray(g_base).shape[2]), quantile=quantile, negative_margin_heads=negative, reference_pos0_argmax_fraction=pos0_fraction,
                      reference_sink_strength=reference_s, candidate_sink_strength=candidate_s, summary=summary, provenance=provenance or {}, **tup)


# ---------------------------------------------------------------------------- measuring two models


@dataclass(frozen=True, slots=True)
class MarginSettings:
    """Calibration (the Sink Strength settings, also used for both models' own S) + margin knobs."""

    strength: StrengthSettings = StrengthSettings()
    last_k: int | None = None  # layers of the margin table: None = all layers
    quantile: float = DEFAULT_QUANTILE

    def __post_init__(self) -> None:
        if not 0.0 <= self.quantile <= 1.0:
            raise UserError(f"--quantile must lie in [0, 1], got {self.quantile}", "use e.g. 0.95")
        if self.last_k is not None and self.last_k <= 0:
            raise UserError(f"--last-k must be positive, got {self.last_k}", "use e.g. --last-k 10, or --last-k all")


def check_same_vocab(ref_vocab: dict[str, int], cand_vocab: dict[str, int]) -> None:
    """The candidate must map every token of the reference to the same id (extra tokens allowed)."""
    missing = [t for t in ref_vocab if t not in cand_vocab]
    moved = [t for t in ref_vocab if t in cand_vocab and cand_vocab[t] != ref_vocab[t]]
    if missing or moved:
        t = (missing or moved)[0]
        what = f"token {t!r} (id {ref_vocab[t]} in the reference) is " + ("missing from the candidate" if missing else f"id {cand_vocab[t]} in the candidate")
        raise UserError(f"the vocabularies differ: {len(missing)} reference token(s) missing and {len(moved)} with another id in the candidate; {what}", "margin needs identical token ids: compare a VLM backbone with the LLM it was built from")


def _shape_of(config: Any) -> tuple[int, int]:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


def _concat_rows(captures: list, quantity: str, rows: str) -> np.ndarray:
    """`quantity` [layer, head, query] of every prompt, rows concatenated (content rows only if asked)."""
    g = np.concatenate([getattr(c, quantity) for c in captures], axis=2)
    if rows == "content":
        g = g[:, :, np.concatenate([c.content for c in captures])]
    return g


def _strength_summary(s: Any) -> dict[str, Any]:
    return {k: getattr(s, k) for k in ("sink_strength", "statistic", "rows", "last_k", "n_layers", "sink_strength_content_rows", "sink_strength_template_rows", "pos0_argmax_fraction")}


def measure_margin(reference: str, candidate: str, settings: MarginSettings = MarginSettings(), dtype: str = "auto", device: str = "cpu", progress: bool = True) -> tuple[SinkMargin, dict[str, np.ndarray]]:
    """Capture both models on the reference's token ids; return the margins and the per-row arrays.

    Checks layer/head shapes and vocabularies before loading any weights. Models are loaded one
    after the other (peak memory: one model).
    """
    import gc

    from transformers import AutoConfig, AutoTokenizer

    from lm_eval_sink.calibration import encode_prompts, load_prompts
    from lm_eval_sink.capture import attention_layers_from_config, capture_prompts
    from lm_eval_sink.io import provenance
    from lm_eval_sink.models import load_model, resolve_model
    from lm_eval_sink.strength import measure

    st = settings.strength
    ref_path, cand_path = resolve_model(reference), resolve_model(candidate)
    configs = []
    for role, path in (("reference", ref_path), ("candidate", cand_path)):
        try:
            configs.append(AutoConfig.from_pretrained(path))
        except (OSError, ValueError) as e:
            raise UserError(f"{role} {path}: cannot read the model config ({str(e).splitlines()[0]})", "pass a folder written by save_pretrained") from None
    shapes = [_shape_of(c) for c in configs]
    if shapes[0] != shapes[1]:
        raise UserError(f"the reference has {shapes[0][0]} layers x {shapes[0][1]} heads, the candidate {shapes[1][0]} x {shapes[1][1]}", "margin compares the same heads of two models of one architecture (a VLM backbone and its LLM)")
    ref_tok, cand_tok = AutoTokenizer.from_pretrained(ref_path), AutoTokenizer.from_pretrained(cand_path)
    check_same_vocab(ref_tok.get_vocab(), cand_tok.get_vocab())
    prompt_set = load_prompts(Path(st.prompts_file) if st.prompts_file else None, st.n_prompts)
    encoded = encode_prompts(ref_tok, prompt_set.prompts, st.use_chat_template, st.system_prompt)
    cand_vocab_size = int(getattr(configs[1].get_text_config(), "vocab_size", 0) or 0)
    top = max(max(x) for x in encoded.input_ids)
    if cand_vocab_size and top >= cand_vocab_size:
        raise UserError(f"the prompts use token id {top} but the candidate's embedding has {cand_vocab_size} rows", "the vocabularies differ: use the LLM the VLM was built from")
    att = attention_layers_from_config(configs[0]) or tuple(range(shapes[0][0]))  # hybrids: their attention layers
    layers = att if settings.last_k is None else att[len(att) - min(settings.last_k, len(att)) :]

    ref = load_model(ref_path, dtype=dtype, device=device)
    ref_caps = capture_prompts(ref.model, encoded, layers, st.batch_size, progress=progress, desc="reference capture")
    ref_s = measure(ref.model, ref.tokenizer, st, progress=progress)
    ref_info = ref.info
    del ref
    gc.collect()
    cand = load_model(cand_path, dtype=dtype, device=device)
    cand_caps = capture_prompts(cand.model, encoded, layers, st.batch_size, progress=progress, desc="candidate capture", sink_keys=[c.sink_pos for c in ref_caps])
    cand_s = measure(cand.model, cand.tokenizer, st, progress=progress)
    cand_info = cand.info
    del cand
    gc.collect()

    g_base, g_cand = _concat_rows(ref_caps, "sink_logodds", st.rows), _concat_rows(cand_caps, "sink_logodds", st.rows)
    if g_base.shape[2] == 0:
        raise UserError("no rows to compare (the prompts have no content tokens)", "use --rows all")
    sink_pos = _concat_rows(ref_caps, "sink_pos", st.rows)
    prov = provenance(
        reference=ref_info, candidate=cand_info, settings={"strength": asdict(st), "last_k": settings.last_k, "quantile": settings.quantile},
        prompt_set={"source": prompt_set.source, "n_prompts": len(prompt_set.prompts), "sha256": prompt_set.sha256},
        protocol={"tokenizer": "reference", "chat_template_applied": encoded.chat_template_applied, "chat_template_sha256": encoded.chat_template_sha256, "system_prompt": encoded.system_prompt},
        sink_keys="the reference's argmax key per row, positions from the first real token", capture_dtype="float32", dtype=dtype, device=device, seed=st.seed,
        reference_sink_strength=_strength_summary(ref_s), candidate_sink_strength=_strength_summary(cand_s),
    )
    result = build_margin(reference, candidate, layers, g_base, g_cand, settings.quantile, len(encoded), float((sink_pos == 0).mean()), ref_s.sink_strength, cand_s.sink_strength, prov)
    arrays = {"sink_logodds_reference": g_base.astype(np.float32), "sink_logodds_candidate": g_cand.astype(np.float32), "sink_logodds_shift": (g_base - g_cand).astype(np.float32),
              "sink_pos": sink_pos.astype(np.int64), "layers": np.asarray(layers, dtype=np.int64)}
    return result, arrays


# ---------------------------------------------------------------------------- reports


def margin_table_markdown(m: SinkMargin, heads: bool = True) -> str:
    """Summary, per-layer rows and (with `heads`) one row per negative-margin head."""
    s = m.summary
    lines = [
        f"reference: {m.reference} (S = {m.reference_sink_strength:.4f}); candidate: {m.candidate} (S = {m.candidate_sink_strength:.4f})",
        f"{m.n_prompts} prompts, {m.n_rows} rows per head, layers {m.layers[0]}..{m.layers[-1]}, {m.n_heads} heads; reference sink key at position 0 in {m.reference_pos0_argmax_fraction:.1%} of rows",
        f"negative margin (B_gap = max shift): {s['n_negative_margin']} of {s['n_heads_total']} heads ({s['n_sink_collapse']} sink collapses with G_base > 0; "
        f"{s['n_no_sink_in_reference']} heads have G_base <= 0, no sink in the reference); with B_gap = q{m.quantile:g} shift: {s['n_negative_margin_quantile']}",
        "",
        "| layer | median G_base | median B_gap | median margin | min margin | negative heads |",
        "|---|---|---|---|---|---|",
    ]
    neg_by_layer: dict[int, list[int]] = {}
    for h in m.negative_margin_heads:
        neg_by_layer.setdefault(h["layer"], []).append(h["head"])
    for li, layer in enumerate(m.layers):
        lines.append(f"| {layer} | {np.median(m.g_base_median[li]):.3f} | {np.median(m.b_gap[li]):.3f} | {np.median(m.margin[li]):.3f} | {min(m.margin[li]):.3f} | {', '.join(map(str, neg_by_layer.get(layer, []))) or '-'} |")
    if heads and m.negative_margin_heads:
        lines += ["", "| layer | head | G_base | B_gap | margin | sink in reference | predicted non-sink mass | measured non-sink mass (median) |", "|---|---|---|---|---|---|---|---|"]
        for h in m.negative_margin_heads:
            lines.append(f"| {h['layer']} | {h['head']} | {h['g_base_median']:.3f} | {h['b_gap']:.3f} | {h['margin']:.3f} | {'yes' if h['reference_has_sink'] else 'no'} | {h['predicted_nonsink_mass']:.3f} | {h['measured_nonsink_mass_median']:.3f} |")
    return "\n".join(lines) + "\n"


def run_margin(reference: str, candidate: str, settings: MarginSettings, output: Path | None, dtype: str = "auto", device: str = "cpu", force: bool = False, progress: bool = True) -> list[str]:
    """Measure and report; with `output` write margin.json/.md/.csv, margin_rows.npz, margin_heatmap.png."""
    import io as _io

    from lm_eval_sink.io import atomic_write_bytes, atomic_write_json, atomic_write_text, check_new_outputs

    files: list[Path] = []
    if output is not None:
        output = Path(output)
        if output.exists() and not output.is_dir():
            raise UserError(f"--output {output} is a file", "pass a folder")
        files = [output / n for n in ("margin.json", "margin.md", "margin.csv", "margin_rows.npz", "margin_heatmap.png")]
        check_new_outputs(files, force)
    result, arrays = measure_margin(reference, candidate, settings, dtype=dtype, device=device, progress=progress)
    md = margin_table_markdown(result)
    lines = margin_table_markdown(result, heads=False).rstrip("\n").splitlines()
    if output is None:
        return lines + ["not saved (pass --output DIR to write margin.json, tables, arrays and the heatmap)"]
    from lm_eval_sink.plots import layer_head_heatmap
    from lm_eval_sink.screen import csv_text

    atomic_write_json(files[0], result.to_json())
    atomic_write_text(files[1], md)
    rows = [["layer", "head", *_MATRICES]] + [[str(layer), str(h)] + [f"{getattr(result, k)[li][h]:.6f}" for k in _MATRICES] for li, layer in enumerate(result.layers) for h in range(result.n_heads)]
    atomic_write_text(files[2], csv_text(rows))
    buf = _io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(files[3], buf.getvalue())
    layer_head_heatmap(result.margin, result.layers, f"margin G_base - B_gap (nats): {result.summary['n_negative_margin']} of {result.summary['n_heads_total']} heads < 0", files[4], label="margin (nats)")
    return lines + ["wrote " + ", ".join(str(p) for p in files)]
