"""The knobs of a bucket comparison: one frozen `BucketSettings`, validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lm_eval_sink.errors import UserError


@dataclass(frozen=True, slots=True)
class BucketSettings:
    """Every knob of a bucket comparison (one source of truth for the defaults)."""

    metric: str | None = None  # None: the task table's, else the first metric of the samples
    filter: str | None = None  # None: the task table's, else the only filter of the samples
    threshold: float | None = None  # continuous metrics: pass = score >= threshold
    allow_partial: bool = False  # pair the common docs when the doc sets differ (records the drop)
    n_bootstrap: int = 10_000
    confidence: float = 0.95
    seed: int = 0
    failure_kinds: bool = True  # IFEval: re-run lm-eval's checker on regressions
    max_gen_toks: int | None = None  # None: read from each candidate sample's generation kwargs
    # the difference whose power and documents needed are reported: points for a 0/1 outcome, else the metric's unit;
    # None: power.default_effect, 5% of the metric's range
    effect: float | None = None

    def __post_init__(self) -> None:
        if self.effect is not None and not (np.isfinite(self.effect) and self.effect > 0):
            raise UserError(
                f"--effect must be a positive number (points, or the metric's unit), got {self.effect}",
                "use e.g. --effect 5, or leave it out for 5% of the metric's range",
            )
        if self.n_bootstrap < 100:
            raise UserError(f"--bootstrap must be at least 100, got {self.n_bootstrap}", "use e.g. --bootstrap 10000")
        if not 0.5 <= self.confidence < 1:
            raise UserError(f"--confidence must be in [0.5, 1), got {self.confidence}", "use e.g. --confidence 0.95")
        if self.max_gen_toks is not None and self.max_gen_toks <= 0:
            raise UserError(
                f"--max-gen-toks must be positive, got {self.max_gen_toks}",
                "pass the run's generation limit, e.g. --max-gen-toks 1280",
            )
        if self.threshold is not None and not np.isfinite(self.threshold):
            raise UserError(f"--threshold must be a finite number, got {self.threshold}", "use e.g. --threshold 50")
