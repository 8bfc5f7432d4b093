"""Figures and HTML of a report: one self-contained file, its figures redrawn by plots.py from the loaded JSON and
embedded as PNG, the template rendered by Jinja2 with autoescape on (prompts and responses are untrusted text)."""

from __future__ import annotations

import base64
from typing import Any

from lm_eval_sink.report.view import ReportInputs, build_view


def _png(draw, *args, **kwargs) -> str:
    """A data: URI of the PNG a plots.py function draws (its bytes, no file)."""
    return "data:image/png;base64," + base64.b64encode(draw(*args, path=None, **kwargs)).decode("ascii")


def figures(view: dict[str, Any]) -> dict[str, str]:
    """The report's figures, keyed by section."""
    from lm_eval_sink import plots

    out: dict[str, str] = {}
    h = view["headline"]
    if h is not None and h["counts_raw"]:
        out["buckets"] = _png(
            plots.bucket_bars, h["counts_raw"], h["figure_title"], regression_kinds=h["kinds_raw"] or None
        )
    m = view["margin"]
    if m is not None and m["matrix"]:
        out["margin"] = _png(
            plots.layer_head_heatmap,
            m["matrix"],
            m["layers"],
            "sink margin G_base - B_gap per layer and head",
            label="margin",
        )
    s = view["sweep"]
    if s is not None and len(s["series"]["checkpoints"]) >= 2:
        out["sweep"] = _png(
            plots.sweep_chart,
            s["series"]["checkpoints"],
            s["series"]["drawn"],
            note=s["series"]["note"],
            strength=s["series"]["s"],
            unit=s["series"]["unit"],
        )
    if view["recovery"] is not None:
        out["recovery"] = _png(plots.recovery_forest, view["recovery"]["data"])
    return out


def render_html(inputs: ReportInputs) -> str:
    """The report's HTML text."""
    from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

    env = Environment(
        loader=PackageLoader("lm_eval_sink.report", "templates"),
        autoescape=select_autoescape(["html", "j2"], default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    view = build_view(inputs)
    return env.get_template("report.html.j2").render(v=view, fig=figures(view))
