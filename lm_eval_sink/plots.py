"""Figures (matplotlib PNG, Agg backend), drawn only from numbers already computed and saved: each function writes
the PNG atomically to its path, or returns its bytes with `path=None` (the HTML report embeds them)."""

from __future__ import annotations

import io as _io
from collections.abc import Mapping, Sequence
from pathlib import Path

from lm_eval_sink.io import atomic_write_bytes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False  # names, tasks and prompts are data: "$...$" is text, not TeX
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
) -> Path | bytes:
    """Heatmap of a [layer, head] matrix centred at 0, layers on the y axis with their model indices."""
    import numpy as np

    plt = _pyplot()
    m = np.asarray(matrix, dtype=float)
    fig, ax = plt.subplots(figsize=(max(4, 0.45 * m.shape[1] + 2), max(3, 0.3 * m.shape[0] + 1.5)))
    span = float(np.nanmax(np.abs(m))) or 1.0
    im = ax.imshow(m, cmap="RdBu_r", vmin=-span, vmax=span, aspect="auto")
    ax.set_yticks(range(len(layers)), [str(x) for x in layers])
    ax.set_xticks(range(m.shape[1]))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    return save_figure(fig, path)


_SETTING_COLORS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:olive", "tab:cyan")


def ranking_bars(
    names: Sequence[str],
    values: Sequence[float],
    title: str,
    path: Path | None,
    groups: Sequence[str],
    legend: Mapping[str, str] | None = None,
) -> Path | bytes:
    """Bar chart of one number per model, in the given order; `groups` (each model's setting letter,
    `comparability.compare`) colours the bars by setting and, when there are several, says so in the title, with
    `legend[letter]` (how that setting differs) beside its letter."""
    plt = _pyplot()
    letters = list(dict.fromkeys(groups))
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(names) + 2), 3.8))
    for i, (v, g) in enumerate(zip(values, groups, strict=True)):
        k = letters.index(g)
        label = f"setting {g}" + (f": {legend[g]}" if legend and legend.get(g) else "")
        ax.bar(i, v, color=_SETTING_COLORS[k % len(_SETTING_COLORS)], hatch="//" if k else None, label=label)
        if i and groups[i - 1] != g:
            ax.axvline(i - 0.5, color="gray", ls="--", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("Sink Strength S")
    if len(letters) > 1:
        title += f"\nmeasured in {len(letters)} settings: S compares only within one (see the notes)"
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles, strict=True))
        ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def _label_offsets(rings: int = 30, step: float = 7.0):
    """Offsets (points) to try for a label, nearest first: eight directions on rings of growing radius."""
    import math

    for ring in range(rings):
        r = 5.0 + step * ring
        for angle in (20, -20, 160, -160, 90, -90, 55, -55, 125, -125, 0, 180):
            a = math.radians(angle)
            yield ring, r * math.cos(a), r * math.sin(a)


def place_labels(ax, items: Sequence[tuple[float, float, str]], fontsize: float = 7, obstacles: Sequence = ()) -> list:
    """Annotate each (x, y, text) at the nearest offset around its point whose box overlaps no label placed before,
    no point of `items` and none of the `obstacles` (display-space Bboxes), inside the axes where such a place
    exists; a label off the nearest ring gets a thin leader line to its point. Call it once the axes limits are
    final. Returns the annotations, in order."""
    from matplotlib.transforms import Bbox

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    taken = list(obstacles)
    for x, y, _ in items:
        px, py = ax.transData.transform((x, y))
        taken.append(Bbox.from_extents(px - 4, py - 4, px + 4, py + 4))
    placed = []
    for x, y, text in items:
        fallback = None
        ann = ax.annotate(text, (x, y), **_label_style(0.0, 0.0, fontsize))  # drawn, measured and removed
        size = ann.get_window_extent(renderer)
        ann.remove()
        px, py = ax.transData.transform((x, y))
        for ring, dx, dy in _label_offsets():
            box = _moved(size, px, py, dx * ax.figure.dpi / 72, dy * ax.figure.dpi / 72).padded(2)  # margin at any dpi
            if any(box.overlaps(b) for b in taken):
                continue
            if frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1:
                fallback = (ring, dx, dy, box)
                break
            fallback = fallback or (ring, dx, dy, box)
        ring, dx, dy, box = fallback
        placed.append(
            ax.annotate(
                text,
                (x, y),
                **_label_style(dx, dy, fontsize),
                arrowprops=dict(arrowstyle="-", lw=0.4, color="gray", shrinkA=0, shrinkB=3) if ring else None,
            )
        )
        taken.append(box)
    return placed


def _label_style(dx: float, dy: float, fontsize: float) -> dict:
    """How a label sits at offset (dx, dy) points from its point: aligned away from it."""
    return dict(
        xytext=(dx, dy),
        textcoords="offset points",
        fontsize=fontsize,
        ha="left" if dx > 1 else "right" if dx < -1 else "center",
        va="bottom" if dy > 1 else "top" if dy < -1 else "center",
        annotation_clip=False,
    )


def _moved(size, px: float, py: float, dx: float, dy: float):
    """The display box of a label of `size` (its box at offset 0) at offset (dx, dy) pixels from its point (px, py),
    aligned as `_label_style` aligns it."""
    from matplotlib.transforms import Bbox

    w, h = size.width, size.height
    x0 = px + dx - (0 if dx > 1 else w if dx < -1 else w / 2)
    y0 = py + dy - (0 if dy > 1 else h if dy < -1 else h / 2)
    return Bbox.from_bounds(x0, y0, w, h)


def gap_parts(bars: Sequence[dict], path: Path | None, title: str, footer: str = "") -> Path | bytes:
    """Stacked bars, one per comparison (`bars`: [{"label", "gap", "parts": {name: points}}]): its gap split into
    access, capacity, protocol, unsplit and unexplained parts, negative ones downwards from 0; a dot marks the gap."""
    plt = _pyplot()
    colors = {
        "access": "tab:orange",
        "capacity": "tab:blue",
        "unsplit": "tab:gray",
        "protocol": "tab:purple",
        "unexplained": "white",
    }
    fig, ax = plt.subplots(figsize=(max(4.5, 1.1 * len(bars) + 2), 4.2))
    for i, bar in enumerate(bars):
        up = down = 0.0
        for name, color in colors.items():
            v = float(bar["parts"].get(name) or 0.0)
            if v == 0:
                continue
            base = up if v > 0 else down
            hatch = {"hatch": "//", "edgecolor": "dimgray"} if name == "unexplained" else {}
            ax.bar(i, v, bottom=base, color=color, label=name, width=0.6, **hatch)
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
    fit,
    qk_norm: Sequence[str | None],
    path: Path | None,
    screened: Sequence[tuple[str, float, float, float, float]] = (),
    note: str | None = None,
) -> Path | bytes:
    """A task's pairs (`fit`, a `predict.TaskFit`: S vs delta, coloured by QK-norm class), the fitted line with its
    prediction band, the S range outside the pairs shaded and named, and `screened` (label, S, predicted delta,
    interval low, high) as stars with error bars; no label overlaps another (`place_labels`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xs = [*fit.sink_strength, *(x for _, x, *_ in screened)]
    pad = 0.12 * (max(xs) - min(xs) or 1.0) + 0.1
    band = _fit_band(ax, fit, qk_norm, min(xs) - pad, max(xs) + pad)
    for _, x, y, lo, hi in screened:
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="*", ms=12, color="black", capsize=3, zorder=4)
    ys = [*band, *fit.deltas, *(v for *_, lo, hi in screened for v in (lo, hi))]
    ypad = 0.06 * (max(ys) - min(ys) or 1.0)
    ax.set_xlim(min(xs) - pad, max(xs) + pad)
    ax.set_ylim(min(ys) - ypad, max(ys) + ypad)
    _fit_labels(ax, fit, screened, _shade_outside(ax, fit.s_min, fit.s_max, min(xs) - pad, max(xs) + pad))
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("Sink Strength S of the reference LLM")
    ax.set_ylabel(f"{fit.task} delta (points)")
    extra = " (stars: screened models, predicted, with their interval)" if screened else ""
    ax.set_title(f"{fit.task}: delta vs S{extra}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if note:
        fig.text(0.01, -0.02, note, fontsize=7, color="dimgray", ha="left", va="top", wrap=True)
    return save_figure(fig, path)


def _fit_band(ax, fit, qk_norm: Sequence[str | None], x0: float, x1: float) -> list[float]:
    """The fitted line over [x0, x1] with its prediction band, and the pairs by QK-norm class; returns the band's
    values (for the y limits)."""
    import numpy as np

    from lm_eval_sink.predict import PI_LEVEL

    grid = np.linspace(x0, x1, 200)
    band = np.array([fit.prediction_interval(float(x)) for x in grid])
    label = f"{PI_LEVEL:.0%} prediction interval (OLS, t, n - 2 df)"
    ax.fill_between(grid, band[:, 0], band[:, 1], color="tab:blue", alpha=0.12, lw=0, label=label)
    line = f"fit: {fit.slope:.2f} * S {fit.intercept:+.2f}"
    ax.plot(grid, fit.slope * grid + fit.intercept, color="black", lw=0.8, label=line)
    for cls in dict.fromkeys(qk_norm):
        idx = [i for i, q in enumerate(qk_norm) if q == cls]
        ax.scatter(
            [fit.sink_strength[i] for i in idx],
            [fit.deltas[i] for i in idx],
            color=_QK_COLORS.get(cls, "tab:gray"),
            label=f"pairs, QK-norm: {cls or 'unknown'}",
            zorder=3,
        )
    return [float(v) for v in band.ravel()]


def _fit_labels(ax, fit, screened: Sequence[tuple[str, float, float, float, float]], obstacles: list) -> list:
    """Every pair's name and every screened model's delta with its interval (and "outside the fitted range" where
    it is), placed so that none overlaps another, a point, an error bar or the `obstacles`."""
    from matplotlib.transforms import Bbox

    items = [(x, y, n) for n, x, y in zip(fit.names, fit.sink_strength, fit.deltas, strict=True)]
    items += [
        (x, y, f"{label}: {y:+.1f} [{lo:+.1f}, {hi:+.1f}]" + ("\noutside the fitted range" if fit.outside(x) else ""))
        for label, x, y, lo, hi in screened
    ]
    bars = []
    for _, x, _, lo, hi in screened:
        (px, p_lo), (_, p_hi) = ax.transData.transform([(x, lo), (x, hi)])
        bars.append(Bbox.from_extents(px - 4, p_lo, px + 4, p_hi))
    return place_labels(ax, items, obstacles=[*obstacles, *bars])


def _shade_outside(ax, s_min: float, s_max: float, x0: float, x1: float) -> list:
    """Shade the S ranges left and right of the fitted pairs, each named "outside the fitted range"; returns the
    names' display boxes (for `place_labels` to avoid)."""
    renderer = ax.figure.canvas.get_renderer()
    top = ax.get_ylim()[1]
    boxes = []
    for lo, hi in ((x0, s_min), (s_max, x1)):
        if hi <= lo:
            continue
        ax.axvspan(lo, hi, color="0.88", lw=0, zorder=0)
        text = ax.text(
            (lo + hi) / 2, top, "outside the\nfitted range", ha="center", va="top", fontsize=6, color="dimgray"
        )
        boxes.append(text.get_window_extent(renderer))
    return boxes


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
    from lm_eval_sink.buckets.stats import BUCKETS

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for x, name in enumerate(BUCKETS):
        if name == "regression" and regression_kinds and sum(regression_kinds.values()) == counts[name]:
            bottom = 0
            for kind, n in regression_kinds.items():
                if n:
                    ax.bar(x, n, bottom=bottom, color=_KIND_COLORS.get(kind, "tab:red"), label=f"regression: {kind}")
                    bottom += n
        else:
            ax.bar(x, counts[name], color=_BUCKET_COLORS[name])
        ax.text(x, counts[name], str(counts[name]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(BUCKETS)), BUCKETS)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # prompt counts: whole numbers only
    ax.set_ylabel("prompts")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(top=max(max(counts[n] for n in BUCKETS), 1) * 1.1)  # room for the count over the tallest bar
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
    if series:
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


def recovery_forest(data: Mapping, path: Path | None) -> Path | bytes:
    """The forest plot of `recovery`: each control's recovered share with its interval, a row per control x task,
    0 (none recovered) and 1 (all of the gap) marked; a withheld share is said in words on its row."""
    plt = _pyplot()
    rows = [(c, task, cell) for c, cells in data["controls"].items() for task, cell in cells.items()]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.35 * max(len(rows), 1)))
    for y, (_, _, cell) in enumerate(rows):
        share, ci = cell["recovered_share"], cell["recovered_share_ci"]
        if share is None:
            ax.text(0.5, y, "no share: " + cell["recovered_share_note"][:70], ha="center", va="center", fontsize=7)
            continue
        if ci is not None:
            ax.plot(ci, [y, y], color="tab:blue", lw=1.5)
        else:
            ax.text(share, y - 0.25, "interval unbounded", ha="center", va="bottom", fontsize=6)
        ax.plot([share], [y], "o", color="tab:blue", ms=5)
    for x, label in ((0.0, "0: none"), (1.0, "1: all of the gap")):
        ax.axvline(x, color="grey", ls="--", lw=0.8)
        ax.text(x, 1.01, label, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7, color="grey")
    ax.set_yticks(range(len(rows)), [f"{c} / {task}: {cell['verdict']}" for c, task, cell in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.3, -0.7)
    ax.set_xlabel(
        f"recovered share [{round(100 * data['confidence'])}% CI]: (control - candidate) / (reference - candidate)"
    )
    few = [task for task, t in data["tasks"].items() if t.get("too_few_to_tell")]
    ax.set_title(
        ("too few to tell: " + ", ".join(few) + "; " if few else "") + "recovery of the candidate's gap",
        fontsize=9,
        pad=14,
    )
    return save_figure(fig, path)
