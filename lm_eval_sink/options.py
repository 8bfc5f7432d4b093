"""How the measuring commands run: `MeasureOptions` (load, device, overwrite, progress) and `ScreenOptions` (where
`screen`'s predictions come from). What a measurement computes is its settings, which go into result keys; each
object is checked where it is built, before any model is resolved. Pure: no I/O, no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.devices import DEFAULT_DEVICE, DEFAULT_DTYPE, check_device, check_dtype
from lm_eval_sink.errors import UserError
from lm_eval_sink.keys import CONTENT


@dataclass(frozen=True, slots=True)
class MeasureOptions:
    """How models are measured: load dtype, device, `force` (overwrite earlier results), `progress` (bars), and
    `measure_all(paths, settings, dtype, device)` measuring several models at once (e.g. one Ray task each:
    `merging.engines.ray_measure_all`; None: each here in turn; `margin` and `protect-plan` refuse it)."""

    dtype: str = DEFAULT_DTYPE
    device: str = DEFAULT_DEVICE
    force: bool = False
    progress: bool = True
    measure_all: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        check_device(self.device)
        if self.measure_all is not None and not callable(self.measure_all):
            raise UserError(f"measure_all is {type(self.measure_all).__name__}, not a function", "pass one, or None")

    def check_in_process(self, command: str) -> None:
        """Refuse `measure_all` for a command that measures its model(s) here, in this process."""
        if self.measure_all is not None:
            raise UserError(f"{command} measures its models in this process", "pass MeasureOptions without measure_all")


@dataclass(frozen=True, slots=True)
class ScreenOptions:
    """Where `screen`'s predicted deltas come from: a fit of `pairs_file` (pairs measured in the models' setting),
    or with `paper_line` the paper's pairs (with the caveat beside each number); neither: the ranking alone."""

    pairs_file: Path | str | None = field(default=None, metadata=CONTENT)
    paper_line: bool = False

    def __post_init__(self) -> None:
        if self.pairs_file is not None and self.paper_line:
            raise UserError(
                "--pairs and --paper-line both name the fit to predict from",
                "pass one: your pairs, or the paper's line",
            )
