"""Figures (matplotlib PNG, Agg backend), drawn only from numbers already computed and saved.

Each function takes plain data and a path and writes the PNG atomically.
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


def save_figure(fig, path: Path) -> Path:
    """Render `fig` to PNG bytes and write them atomically; closes the figure."""
    plt = _pyplot()
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(Path(path), buf.getvalue())


def layer_head_heatmap(matrix: Sequence[Sequence[float]], layers: Sequence[int], title: str, path: Path, label: str = "sink log-odds", center: float | None = 0.0) -> Path:
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


def ranking_bars(names: Sequence[str], values: Sequence[float], title: str, path: Path, ylabel: str = "Sink Strength S") -> Path:
    """Bar chart of one number per model, in the given order."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(names) + 2), 3.5))
    ax.bar(range(len(names)), values, color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def sweep_chart(checkpoints: Sequence[str], series: dict[str, Sequence[float | None]], path: Path, note: str | None = None) -> Path:
    """One panel per metric: merged checkpoints as points, the first two (reference, candidate) as lines."""
    plt = _pyplot()
    names = list(series)
    fig, axes = plt.subplots(len(names), 1, figsize=(max(5, 0.9 * len(checkpoints) + 2), 2.6 * len(names)), squeeze=False)
    merged = list(checkpoints[2:])
    for ax, name in zip(axes[:, 0], names):
        values = list(series[name])
        for value, label, style in ((values[0], checkpoints[0], "--"), (values[1], checkpoints[1], ":")):
            if value is not None:
                ax.axhline(value, color="black", ls=style, lw=1, label=f"{label} {value:.3f}")
        xs = [i for i, v in enumerate(values[2:]) if v is not None]
        ax.plot(xs, [values[2 + i] for i in xs], "o", color="tab:blue", label="merged")
        ax.set_xticks(range(len(merged)), merged, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(name, fontsize=8)
        ax.legend(fontsize=7, loc="best")
    axes[0, 0].set_title("Merging sweep" + (f" ({note})" if note else ""), fontsize=9)
    return save_figure(fig, path)
