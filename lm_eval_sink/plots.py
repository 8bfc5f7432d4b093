"""Figures (matplotlib PNG, Agg backend), drawn only from numbers already computed and saved.

Each function takes plain data and a path and writes the PNG atomically; with `path=None` it
returns the PNG bytes instead (the HTML report embeds them).
"""

from __future__ import annotations

import io as _io
from collections.abc import Sequence
from pathlib import Path

from lm_eval_sink.io import atomic_write_bytes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path | None) -> Path | bytes:
    """Render `fig` to PNG bytes and write them atomically to `path` (None: return them); closes the figure."""
    plt = _pyplot()
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue() if path is None else atomic_write_bytes(Path(path), buf.getvalue())


def layer_head_heatmap(
    matrix: Sequence[Sequence[float]],
    layers: Sequence[int],
    title: str,
    path: Path | None,
    label: str = "sink log-odds",
    center: float | None = 0.0,
) -> Path | bytes:
    """Heatmap of a [layer, head] matrix, layers on the y axis with their model indices."""
    import numpy as np

    plt = _pyplot()
    m = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * m.shape[1] + 2), max(3, 0.3 * m.shape[0] + 1.5)))
    if center is not None:
        span = float(np.nanmax(np.abs(m - center))) or 1.0
        im = ax.imshow(m, cmap="RdBu_r", vmin=center - span, vmax=center + span, aspect="auto")
    else:
        im = ax.imshow(m, cmap="viridis", aspect="auto")
    ax.set_yticks(range(len(layers)), [str(x) for x in layers])
    ax.set_xticks(range(m.shape[1]))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    return save_figure(fig, path)


def ranking_bars(
    names: Sequence[str], values: Sequence[float], title: str, path: Path | None, ylabel: str = "Sink Strength S"
) -> Path | bytes:
    """Bar chart of one number per model, in the given order."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(names) + 2), 3.5))
    ax.bar(range(len(names)), values, color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def gap_parts(bars: Sequence[dict], path: Path | None, title: str, footer: str = "") -> Path | bytes:
    """Stacked bars, one per comparison: its gap split into access, capacity, protocol and unsplit parts.

    `bars`: [{"label", "gap", "parts": {"access", "capacity", "protocol", "unsplit"}}] in points.
    Negative parts stack downwards from 0, positive ones upwards; a dot marks the total gap.
    """
    plt = _pyplot()
    colors = {"access": "tab:orange", "capacity": "tab:blue", "unsplit": "tab:gray", "protocol": "tab:purple"}
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(bars) + 2), 4.2))
    for i, bar in enumerate(bars):
        up = down = 0.0
        for name, color in colors.items():
            v = float(bar["parts"].get(name) or 0.0)
            if v == 0:
                continue
            base = up if v > 0 else down
            ax.bar(i, v, bottom=base, color=color, label=name, width=0.6)
            if v > 0:
                up += v
            else:
                down += v
        ax.plot(i, bar["gap"], "k.", ms=8)
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles, strict=True))
    if seen:
        ax.legend(seen.values(), seen.keys(), fontsize=8, loc="best")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(bars)), [b["label"] for b in bars], fontsize=7)
    ax.set_ylabel("points")
    ax.set_title(title, fontsize=9)
    if footer:
        fig.text(0.01, -0.02, footer, fontsize=6, color="dimgray", ha="left", va="top", wrap=True)
    return save_figure(fig, path)


_QK_COLORS = {"per_head": "tab:green", "layerwise": "tab:orange", "none": "tab:red", None: "tab:gray"}


def fit_scatter(
    names: Sequence[str],
    s: Sequence[float],
    deltas: Sequence[float],
    qk_norm: Sequence[str | None],
    slope: float,
    intercept: float,
    task: str,
    path: Path | None,
    screened: Sequence[tuple[str, float, float]] = (),
) -> Path | bytes:
    """Reference pairs (S vs delta, coloured by QK-norm class), the fitted line, and screened models.

    `screened` holds (label, S, predicted delta) triples, drawn as black stars on the line.
    """
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = list(s) + [x for _, x, _ in screened]
    grid = np.linspace(min(xs) - 0.2, max(xs) + 0.2, 50)
    ax.plot(grid, slope * grid + intercept, color="black", lw=0.8, label=f"fit: {slope:.2f} * S {intercept:+.2f}")
    for cls in dict.fromkeys(qk_norm):
        idx = [i for i, q in enumerate(qk_norm) if q == cls]
        ax.scatter(
            [s[i] for i in idx],
            [deltas[i] for i in idx],
            color=_QK_COLORS.get(cls, "tab:gray"),
            label=f"pairs, QK-norm: {cls or 'unknown'}",
            zorder=3,
        )
    for n, x, y in zip(names, s, deltas, strict=True):
        ax.annotate(n, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    for label, x, y in screened:
        ax.scatter([x], [y], marker="*", s=120, color="black", zorder=4)
        ax.annotate(label, (x, y), fontsize=7, xytext=(4, -10), textcoords="offset points")
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("Sink Strength S of the reference LLM")
    ax.set_ylabel(f"{task} delta (points)")
    ax.set_title(f"{task}: delta vs S" + (" (stars: screened models, predicted)" if screened else ""), fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


_BUCKET_COLORS = {"both_pass": "tab:green", "regression": "tab:red", "recovered": "tab:blue", "both_fail": "tab:gray"}
_KIND_COLORS = {
    "truncation": "#7f0000",
    "language": "#b30000",
    "phrase_marker": "#e34a33",
    "length": "#fc8d59",
    "format": "#fdbb84",
    "other": "#fdd49e",
}


def bucket_bars(
    counts: dict[str, int], title: str, path: Path | None, regression_kinds: dict[str, int] | None = None
) -> Path | bytes:
    """Bar chart of the four bucket counts; the regression bar stacked by failure kind when given."""
    plt = _pyplot()
    names = ["both_pass", "regression", "recovered", "both_fail"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for x, name in enumerate(names):
        if name == "regression" and regression_kinds and sum(regression_kinds.values()) == counts[name]:
            bottom = 0
            for kind, n in regression_kinds.items():
                if n:
                    ax.bar(x, n, bottom=bottom, color=_KIND_COLORS.get(kind, "tab:red"), label=f"regression: {kind}")
                    bottom += n
        else:
            ax.bar(x, counts[name], color=_BUCKET_COLORS[name])
        ax.text(x, counts[name], str(counts[name]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("prompts")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(top=max(max(counts[n] for n in names), 1) * 1.1)  # room for the count over the tallest bar
    if regression_kinds and any(regression_kinds.values()):  # beside the axes, where it hides no bar or count
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return save_figure(fig, path)


def instruction_type_bars(types: Sequence[dict], title: str, path: Path | None, top: int = 25) -> Path | bytes:
    """Horizontal bars per IFEval instruction type: regressions (left, red) and recoveries (right)."""
    plt = _pyplot()
    rows = list(types)[:top][::-1]
    fig, ax = plt.subplots(figsize=(7, max(2.5, 0.28 * len(rows) + 1.2)))
    y = range(len(rows))
    ax.barh(y, [-r["regression"] for r in rows], color="tab:red", label="regression")
    ax.barh(y, [r["recovered"] for r in rows], color="tab:blue", label="recovered")
    ax.set_yticks(list(y), [f"{r['instruction_id']} (n={r['n']})" for r in rows], fontsize=7)
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{abs(v):g}"))
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel("instructions (regressions left, recoveries right)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def sweep_chart(
    checkpoints: Sequence[str],
    series: dict[str, Sequence[float | None]],
    path: Path | None,
    note: str | None = None,
    strength: Sequence[float | None] | None = None,
    unit: str = "points",
) -> Path | bytes:
    """One compact figure: a labelled row per checkpoint, a marker per metric at its change vs the reference
    (the first checkpoint, the zero line), each metric a shape of its own a little above or below the row so that
    equal changes never hide one another; `strength` (S per checkpoint) in a narrow panel beside it. `unit`: what
    the values are in (the x label)."""
    plt = _pyplot()
    rows = list(checkpoints[1:])
    with_s = strength is not None and any(v is not None for v in strength)
    fig, axes = plt.subplots(
        1,
        2 if with_s else 1,
        figsize=(8.0 if with_s else 6.0, (0.3 + 0.06 * len(series)) * len(rows) + 1.6),
        sharey=True,
        squeeze=False,
        gridspec_kw={"width_ratios": [3, 1]} if with_s else None,
    )
    ax = axes[0, 0]
    step = min(0.2, 0.8 / max(len(series), 1))
    for k, (name, values) in enumerate(series.items()):
        ref, shift = values[0], (k - (len(series) - 1) / 2) * step
        points = [(i + shift, v - ref) for i, v in enumerate(values[1:]) if v is not None and ref is not None]
        ax.plot([d for _, d in points], [y for y, _ in points], "osD^vP*X"[k % 8], ms=5, ls="none", label=name)
    ax.axvline(0, color="black", lw=1)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(f"change vs {checkpoints[0]} ({unit})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    below = 0.6 / ((0.3 + 0.06 * len(series)) * len(rows) + 0.6)  # the tick labels and axis label: about 0.6 inch
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=4, frameon=False)
    if with_s:
        sax = axes[0, 1]
        points = [(i, v) for i, v in enumerate(strength[1:]) if v is not None]
        sax.plot([v for _, v in points], [i for i, _ in points], "o", color="tab:red")
        if strength[0] is not None:
            sax.axvline(strength[0], color="black", ls="--", lw=1)
        sax.grid(axis="x", alpha=0.3)
        sax.set_xlabel(f"S (dashed: {checkpoints[0]})", fontsize=8)
        sax.tick_params(axis="x", labelsize=7)
    fig.suptitle("Merging sweep" + (f" ({note})" if note else ""), fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
