"""Per-head sink margins G_base - B_gap between a reference LLM and a candidate (its VLM backbone).

Each row's sink key is the reference's argmax, so a collapsed sink is measured where it was; the per-row and per-head
quantities and Lemma 1 (arXiv 2609.00746) are in docs/screening.md ("margin"). numpy and scipy, no file I/O:
commands/margin.py loads and captures both models and writes the output folder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
from scipy.special import expit

from lm_eval_sink.errors import UserError
from lm_eval_sink.keys import MODEL, Work
from lm_eval_sink.strength import StrengthSettings
from lm_eval_sink.tables import csv_text, markdown_lines

SCHEMA_VERSION = 1
DEFAULT_QUANTILE = 0.95


# ---------------------------------------------------------------------------- Lemma 1


def lemma1_bound(g_base: Any, b_gap: Any) -> Any:
    """Upper bound on the non-sink mass after a perturbation moving the sink gap by <= b_gap."""
    return expit(np.asarray(b_gap, dtype=np.float64) - np.asarray(g_base, dtype=np.float64))


def lemma1_required_margin(eta: float) -> float:
    """The margin G_base - B_gap needed to keep the sink mass at least 1 - eta."""
    if not 0.0 < eta < 1.0:
        raise UserError(
            f"eta must lie strictly between 0 and 1, got {eta}", "use e.g. eta = 0.1 for a sink level of 0.9"
        )
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
    """The paper's tightness check (docs/screening.md): seeded other logits, the sink's gap g_base, and the worst-case
    perturbation, the sink logit down by b_gap / 2 and every other up by b_gap / 2."""
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
    return Lemma1Case(
        g_base=g_base, b_gap=b_gap, n_keys=n_keys, non_sink_mass=non_sink, bound=bound, ratio=non_sink / bound
    )


# ---------------------------------------------------------------------------- margins from arrays


def captured_rows(captures: list, quantity: str, rows: str) -> np.ndarray:
    """`quantity` [layer, head, query] of every prompt capture, rows concatenated (content rows only if asked)."""
    g = np.concatenate([getattr(c, quantity) for c in captures], axis=2)
    if rows == "content":
        g = g[:, :, np.concatenate([c.content for c in captures])]
    return g


def margin_arrays(g_base: np.ndarray, g_cand: np.ndarray, quantile: float = DEFAULT_QUANTILE) -> dict[str, np.ndarray]:
    """Per-(layer, head) margin quantities from per-row gaps [layer, head, row] (docs/screening.md, "margin")."""
    g_base = np.asarray(g_base, dtype=np.float64)
    g_cand = np.asarray(g_cand, dtype=np.float64)
    if g_base.shape != g_cand.shape or g_base.ndim != 3 or g_base.shape[2] == 0:
        raise UserError(
            f"gap arrays of shapes {g_base.shape} and {g_cand.shape} do not match as [layer, head, row] with rows",
            "capture both models on the same token ids and layers",
        )
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
        "measured_nonsink_mass_median": np.median(expit(-g_cand), axis=2),
    }


Matrix = tuple[tuple[float, ...], ...]  # [layer, head]


@dataclass(frozen=True, slots=True)
class SinkMargin:
    """Per-head margins of a candidate against its reference; its `Matrix` fields are `margin_arrays`' matrices."""

    reference: str
    candidate: str
    layers: tuple[int, ...]
    n_heads: int
    n_prompts: int
    n_rows: int
    quantile: float
    g_base_median: Matrix
    candidate_gap_median: Matrix
    b_gap: Matrix
    b_gap_quantile: Matrix
    margin: Matrix
    margin_quantile: Matrix
    predicted_nonsink_mass: Matrix
    measured_nonsink_mass_median: Matrix
    negative_margin_heads: tuple[dict[str, Any], ...]  # {layer, head, margin, g_base_median, b_gap, ...}
    reference_pos0_argmax_fraction: float
    reference_sink_strength: float
    candidate_sink_strength: float
    summary: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "schema_version": SCHEMA_VERSION}


_MATRICES = tuple(f.name for f in fields(SinkMargin) if f.type in ("Matrix", Matrix))  # in margin_arrays' order


@dataclass(frozen=True, slots=True)
class MarginRows:
    """Both models' sink log-odds [layer, head, row] on the same rows at the reference's sink key per row (`sink_pos`,
    from the first real token), the layers they cover and how many prompts the rows come from."""

    layers: tuple[int, ...]
    g_base: np.ndarray
    g_cand: np.ndarray
    sink_pos: np.ndarray
    n_prompts: int

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-row arrays a margin result keeps (margin_rows.npz)."""
        return {
            "sink_logodds_reference": self.g_base.astype(np.float32),
            "sink_logodds_candidate": self.g_cand.astype(np.float32),
            "sink_logodds_shift": (self.g_base - self.g_cand).astype(np.float32),
            "sink_pos": self.sink_pos.astype(np.int64),
            "layers": np.asarray(self.layers, dtype=np.int64),
        }


def build_margin(
    reference: str,
    candidate: str,
    rows: MarginRows,
    sink_strengths: tuple[float, float],
    quantile: float,
    provenance: dict[str, Any] | None = None,
) -> SinkMargin:
    """A SinkMargin from the rows of both models, with their own Sink Strengths (reference, candidate) beside it."""
    m = margin_arrays(rows.g_base, rows.g_cand, quantile)
    negative = _negative_heads(m, rows.layers)
    return SinkMargin(
        reference=reference,
        candidate=candidate,
        layers=tuple(int(x) for x in rows.layers),
        n_heads=int(m["margin"].shape[1]),
        n_prompts=rows.n_prompts,
        n_rows=int(np.asarray(rows.g_base).shape[2]),
        quantile=quantile,
        negative_margin_heads=negative,
        reference_pos0_argmax_fraction=float((rows.sink_pos == 0).mean()),
        reference_sink_strength=sink_strengths[0],
        candidate_sink_strength=sink_strengths[1],
        summary=_summary(m, negative),
        provenance=provenance or {},
        **{k: tuple(tuple(float(x) for x in row) for row in v) for k, v in m.items()},
    )


_HEAD_FIELDS = (
    "margin",
    "margin_quantile",
    "g_base_median",
    "b_gap",
    "predicted_nonsink_mass",
    "measured_nonsink_mass_median",
)


def _negative_heads(m: dict[str, np.ndarray], layers: tuple[int, ...]) -> tuple[dict[str, Any], ...]:
    """One record per head whose margin is negative, in (layer, head) order, with the figures the report shows."""
    return tuple(
        {
            "layer": int(layers[li]),
            "head": int(h),
            "reference_has_sink": bool(m["g_base_median"][li, h] > 0),
            **{k: float(m[k][li, h]) for k in _HEAD_FIELDS},
        }
        for li, h in zip(*np.nonzero(m["margin"] < 0), strict=True)
    )


def _summary(m: dict[str, np.ndarray], negative: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """Counts and medians over all heads: how many margins are negative, and why (collapse or no sink to lose)."""
    return {
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


@dataclass(frozen=True, slots=True)
class MarginWork(Work):
    """What `measure_margin` receives: both models (by content), the settings (a prompt file by content), the dtype;
    keyed with the margin and S code, the command that chooses them, and the packages that compute (`keys.key_of`)."""

    CODE = (__name__, "lm_eval_sink.strength", "lm_eval_sink.commands.margin")
    PACKAGES = ("torch", "transformers", "peft", "scipy")

    reference: str = field(metadata=MODEL)
    candidate: str = field(metadata=MODEL)
    settings: MarginSettings
    dtype: str


def check_same_vocab(ref_vocab: dict[str, int], cand_vocab: dict[str, int]) -> None:
    """The candidate must map every token of the reference to the same id (extra tokens allowed)."""
    missing = [t for t in ref_vocab if t not in cand_vocab]
    moved = [t for t in ref_vocab if t in cand_vocab and cand_vocab[t] != ref_vocab[t]]
    if missing or moved:
        t = (missing or moved)[0]
        what = f"token {t!r} (id {ref_vocab[t]} in the reference) is " + (
            "missing from the candidate" if missing else f"id {cand_vocab[t]} in the candidate"
        )
        raise UserError(
            f"the vocabularies differ: {len(missing)} reference token(s) missing and {len(moved)} with "
            f"another id in the candidate; {what}",
            "margin needs identical token ids: compare a VLM backbone with the LLM it was built from",
        )


# ---------------------------------------------------------------------------- reports


def margin_table_markdown(m: SinkMargin, heads: bool = True) -> str:
    """Summary, per-layer rows and (with `heads`) one row per negative-margin head."""
    lines = [*_summary_lines(m), "", *_layer_table(m)]
    if heads and m.negative_margin_heads:
        lines += ["", *_head_table(m)]
    return "\n".join(lines) + "\n"


def _summary_lines(m: SinkMargin) -> list[str]:
    """The report's head: both models' S, what was measured, and the count of negative margins."""
    from lm_eval_sink.comparability import setting_of_margin

    s, data = m.summary, {"provenance": m.provenance}
    ref, cand = (setting_of_margin(data, role).measured_in() for role in ("reference", "candidate"))
    return [
        f"reference: {m.reference} (S = {m.reference_sink_strength:.4f} {ref}); candidate: {m.candidate} "
        f"(S = {m.candidate_sink_strength:.4f} {cand})",
        f"{m.n_prompts} prompts, {m.n_rows} rows per head, layers {m.layers[0]}..{m.layers[-1]}, "
        f"{m.n_heads} heads; reference sink key at position 0 in "
        f"{m.reference_pos0_argmax_fraction:.1%} of rows",
        f"negative margin (B_gap = max shift): {s['n_negative_margin']} of {s['n_heads_total']} "
        f"heads ({s['n_sink_collapse']} sink collapses with G_base > 0; "
        f"{s['n_no_sink_in_reference']} heads have G_base <= 0, no sink in the reference); with "
        f"B_gap = q{m.quantile:g} shift: {s['n_negative_margin_quantile']}",
    ]


def _layer_table(m: SinkMargin) -> list[str]:
    """One row per layer: medians over its heads, its smallest margin and its negative-margin heads."""
    return markdown_lines(
        ["layer", "median G_base", "median B_gap", "median margin", "min margin", "negative heads"],
        [
            [
                layer,
                f"{np.median(m.g_base_median[li]):.3f}",
                f"{np.median(m.b_gap[li]):.3f}",
                f"{np.median(m.margin[li]):.3f}",
                f"{min(m.margin[li]):.3f}",
                ", ".join(str(h["head"]) for h in m.negative_margin_heads if h["layer"] == layer) or "-",
            ]
            for li, layer in enumerate(m.layers)
        ],
    )


_HEAD_COLUMNS = {  # margin.md's columns of a negative-margin head after layer and head: its record's keys
    "G_base": "g_base_median",
    "B_gap": "b_gap",
    "margin": "margin",
    "sink in reference": "reference_has_sink",
    "predicted non-sink mass": "predicted_nonsink_mass",
    "measured non-sink mass (median)": "measured_nonsink_mass_median",
}


def _head_table(m: SinkMargin) -> list[str]:
    """One row per negative-margin head: its gaps, margin and Lemma 1's predicted against the measured mass."""
    return markdown_lines(
        ["layer", "head", *_HEAD_COLUMNS],
        [[h["layer"], h["head"], *(_cell(h[k]) for k in _HEAD_COLUMNS.values())] for h in m.negative_margin_heads],
    )


def _cell(value: float | bool) -> str:
    return ("yes" if value else "no") if isinstance(value, bool) else f"{value:.3f}"


def margin_csv(m: SinkMargin) -> str:
    """margin.csv: one row per layer and head with every per-head matrix."""
    return csv_text(
        ["layer", "head", *_MATRICES],
        (
            [str(layer), str(h)] + [f"{getattr(m, k)[li][h]:.6f}" for k in _MATRICES]
            for li, layer in enumerate(m.layers)
            for h in range(m.n_heads)
        ),
    )
