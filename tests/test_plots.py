"""Figures: labels that never overlap (their boxes from matplotlib's renderer), the fitted range named, settings
shown, whole numbers on count axes."""

from __future__ import annotations

import itertools

import pytest
from matplotlib.text import Text

import lm_eval_sink.plots as plots
from lm_eval_sink.commands.fit import read_pairs
from lm_eval_sink.predict import fit_task, task_arrays


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [t.get_text() for t in fig.texts]


@pytest.fixture
def figures(monkeypatch):
    """Each plots function returns its open figure instead of writing it."""
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: fig)


def test_fit_figure_labels_never_overlap_and_say_outside_the_fitted_range(figures):
    table = read_pairs()  # the paper's six pairs (fitted without the slow rounding envelope)
    fit = fit_task("ifeval", *task_arrays(table, "ifeval"))
    qk = {p.name: p.qk_norm for p in table.pairs}
    # crowded on purpose: two screened models on the tied S = 2.36 pairs, two almost on one point, one far out
    screened = [
        (name, s, fit.predict(s), *fit.prediction_interval(s))
        for name, s in (("twin-a", 2.36), ("twin-b", 2.36), ("near-1", 1.18), ("near-2", 1.19), ("far", 4.4))
    ]
    fig = plots.fit_scatter(fit, [qk[n] for n in fit.names], None, screened, note="a note")
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text() and not t.get_text().startswith("outside the\n")]
    assert len(labels) == len(fit.names) + len(screened)
    for dpi in (fig.dpi, 120):  # as placed, and as save_figure writes the PNG
        fig.set_dpi(dpi)
        fig.canvas.draw()  # every annotation at its drawn place
        renderer = fig.canvas.get_renderer()
        boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text's own box (no leader line)
        for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
            overlap = min(a.x1, b.x1) - max(a.x0, b.x0), min(a.y1, b.y1) - max(a.y0, b.y0)
            assert min(overlap) <= 0, (dpi, labels[i].get_text(), labels[j].get_text())
    texts = _texts(fig)
    assert "outside the\nfitted range" in texts  # the shaded S ranges are named in the figure
    far = next(t for t in texts if t.startswith("far: "))
    lo, hi = fit.prediction_interval(4.4)
    assert far == f"far: {fit.predict(4.4):+.1f} [{lo:+.1f}, {hi:+.1f}]\noutside the fitted range"
    assert not next(t for t in texts if t.startswith("near-1: ")).endswith("range")
    assert any("prediction interval" in t.get_text() for t in ax.get_legend().get_texts())
    plots._pyplot().close(fig)


def test_ranking_figure_shows_the_settings(figures):
    fig = plots.ranking_bars(
        ["a", "b", "c"],
        [2.0, 1.0, 3.0],
        "ranking",
        None,
        groups=["A", "A", "B"],
        legend={"A": "", "B": "differs from A in chat template applied"},
    )
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["setting A", "setting B: differs from A in chat template applied"]
    assert "measured in 2 settings" in fig.axes[0].get_title()
    plots._pyplot().close(fig)


@pytest.mark.parametrize(
    "counts",
    [
        {"both_pass": 1, "regression": 2, "recovered": 0, "both_fail": 1},
        {"both_pass": 3, "regression": 1, "recovered": 1, "both_fail": 0},
    ],
)
def test_count_axes_have_whole_numbers(figures, counts):
    fig = plots.bucket_bars(counts, "buckets", None, regression_kinds={"format": counts["regression"]})
    ticks = [t for t in fig.axes[0].get_yticks() if 0 <= t <= fig.axes[0].get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    types = [{"instruction_id": "x", "n": 2, "regression": 1, "recovered": 1}]
    fig2 = plots.instruction_type_bars(types, "types", None)
    assert all(float(t).is_integer() for t in fig2.axes[0].get_xticks())
    plots._pyplot().close(fig)
    plots._pyplot().close(fig2)
