"""Sink Strength S: reduce captured sink log-odds to one scalar plus per-layer-per-head figures.

S = median (or mean) of `sink_logodds` over the last K attention layers, all heads, all query positions >= 1
(arXiv 2609.00746; definition, K shares and row sets: docs/sink-strength.md). `reduce_captures` is pure numpy;
`measure` runs the capture on a loaded model; commands/strength.py is `lm-eval-sink strength`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from lm_eval_sink.calibration import Batching
from lm_eval_sink.devices import DEFAULT_DEVICE, check_not_tensor_parallel
from lm_eval_sink.errors import SinkWarning, UserError
from lm_eval_sink.keys import CONTENT, MODEL, UNKEYED, Work

DEFAULT_LAST_K = 10
STATISTICS = ("median", "mean")
ROWS = ("all", "content")
_RUN = Batching()
# What S says, printed wherever this project shows S (strength, ranking.md, under lm_eval's table, the report).
S_MEANING = (
    "higher S = a stronger attention sink = a smaller predicted drop in format-sensitive scores after VL training "
    "(the paper: Spearman rho 0.97 with the IFEval drop over six LLM/VLM pairs; `lm-eval-sink fit`); "
    "low or negative S = a weak sink, a larger drop"
)
ABSENT_POS0_FRACTION = 0.25  # below this share of rows sinking at position 0, with S < 0, there is no sink to measure


def parse_last_k(value: int | str | None, *, shares: bool = True) -> int | str | None:
    """K as given: a count of last attention layers (the paper's), `"N%"` of each model's attention layers, or
    None / `"all"` for all of them; a count is returned as an int, a share as its canonical `"N%"` text.
    `shares=False` (margin's table layers) takes a count or all only."""
    if value is None or value == "all":
        return None
    if shares and isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise UserError(f"--last-k {value!r} is not a share of the layers", "use e.g. --last-k 33% (0 < N <= 100)")
        return f"{share:g}%"
    try:
        k = int(value)
    except (TypeError, ValueError):
        what, e_g = ("a number, a share or 'all'", "10, 33% or all") if shares else ("a number or 'all'", "10")
        raise UserError(f"--last-k must be {what}, got {value!r}", f"use e.g. --last-k {e_g}") from None
    if k <= 0:
        raise UserError(f"--last-k must be positive, got {k}", "use e.g. --last-k 10, or --last-k all")
    return k


def k_for(last_k: int | str | None, n_attention_layers: int) -> int:
    """How many of `n_attention_layers` the last K takes: a count clipped, a share rounded half up (>= 1), or all."""
    if last_k is None:
        return n_attention_layers
    if isinstance(last_k, str):
        return max(1, min(n_attention_layers, int(float(last_k[:-1]) * n_attention_layers / 100 + 0.5)))
    return min(last_k, n_attention_layers)


def absent_sink_note(sink_strength: float, pos0_argmax_fraction: float) -> str | None:
    """The note for a model with effectively no attention sink, whose S ranks nothing; None for any other model."""
    if sink_strength >= 0 or pos0_argmax_fraction >= ABSENT_POS0_FRACTION:
        return None
    return (
        f"no attention sink to measure: position 0 is the sink in {100 * pos0_argmax_fraction:.1f}% of rows "
        "and S < 0, so S ranks nothing here (random or broken weights?)"
    )


@dataclass(frozen=True, slots=True)
class StrengthSettings:
    """Every knob of a Sink Strength measurement, with its default; the batching ones (`calibration.Batching`'s)
    change memory and speed only, so no key holds them (`UNKEYED`)."""

    last_k: int | str | None = DEFAULT_LAST_K  # a count of last attention layers, "N%" of them, None = all
    statistic: str = "median"
    rows: str = "all"
    n_prompts: int | None = None  # None = all prompts of the set (15 builtin)
    prompts_file: str | None = field(default=None, metadata=CONTENT)
    use_chat_template: bool = True
    system_prompt: str | None = None
    batch_size: int | None = field(default=_RUN.batch_size, metadata=UNKEYED)  # None: as many as batch_tokens allows
    seed: int = 0
    batch_tokens: int = field(default=_RUN.batch_tokens, metadata=UNKEYED)
    query_chunk: int = field(default=_RUN.query_chunk, metadata=UNKEYED)

    def __post_init__(self) -> None:
        if self.last_k is not None and parse_last_k(self.last_k) != self.last_k:
            raise UserError(f"--last-k {self.last_k!r} is not canonical", f"use {parse_last_k(self.last_k)!r}")
        if self.statistic not in STATISTICS:
            raise UserError(f"unknown statistic {self.statistic!r}", f"use one of {', '.join(STATISTICS)}")
        if self.rows not in ROWS:
            raise UserError(f"unknown --rows {self.rows!r}", f"use one of {', '.join(ROWS)}")
        self.batching()  # its checks

    def batching(self) -> Batching:
        return Batching(self.batch_size, self.batch_tokens, self.query_chunk)

    def key_fields(self) -> dict[str, Any]:
        """The settings that decide S (not the batching ones, `RUN_FIELDS`), as given."""
        return {k: v for k, v in asdict(self).items() if k not in RUN_FIELDS}

    def layers_for(self, attention_layers: Sequence[int]) -> tuple[int, ...]:
        """The last K of the model's attention layers (`k_for`)."""
        att = tuple(attention_layers)
        return att[len(att) - k_for(self.last_k, len(att)) :]


RUN_FIELDS = tuple(f.name for f in fields(StrengthSettings) if f.metadata == UNKEYED)  # how S is computed, not what


@dataclass(frozen=True, slots=True)
class StrengthWork(Work):
    """What `strength` and `screen` hand to `measure_model` (one model's S), for its key (`keys.key_of`); peft applies
    an adapter."""

    CODE = (__name__, "lm_eval_sink.commands.strength", "lm_eval_sink.commands.screen")
    PACKAGES = ("torch", "transformers", "peft")

    model: str = field(metadata=MODEL)
    settings: StrengthSettings
    dtype: str


@dataclass(frozen=True, slots=True)
class SinkStrength:
    """One model's Sink Strength with its companion figures and provenance."""

    sink_strength: float
    statistic: str
    rows: str
    last_k: int
    n_layers: int
    layers: tuple[int, ...]
    n_heads: int
    sink_strength_layer_head: tuple[tuple[float, ...], ...]  # [layer, head]: per-(layer, head) statistic
    sink_strength_all_rows: float
    sink_strength_content_rows: float | None
    sink_strength_template_rows: float | None
    template_row_fraction: float
    pos0_argmax_fraction: float  # share of rows whose sink key is position 0
    pos0_mass_median: float
    per_prompt: tuple[float | None, ...]  # the statistic over each prompt's rows alone (None: no rows)
    n_prompts: int
    n_rows: int
    attention_layers: tuple[int, ...] = ()  # the model's attention layers (n_layers is the depth)
    learned_sink_argmax_fraction: float | None = None  # share of rows sinking at the virtual key; None: no learned sink
    learned_sink_mass_median: float | None = None  # median probability of the virtual key
    rows_beyond_window: int | None = None  # rows whose position 0 lies outside a measured layer's window; None: unknown
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def sink_note(self) -> str | None:
        """`absent_sink_note` of this result: why its S ranks nothing, or None."""
        return absent_sink_note(self.sink_strength, self.pos0_argmax_fraction)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        d["attention_layers"] = list(self.attention_layers)
        d["sink_strength_layer_head"] = [list(r) for r in self.sink_strength_layer_head]
        d["per_prompt"] = list(self.per_prompt)
        d["sink_note"] = self.sink_note  # derived: never read back
        d["schema_version"] = 1
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SinkStrength:
        d = {k: v for k, v in d.items() if k not in ("schema_version", "sink_note")}
        d["layers"] = tuple(d["layers"])
        d["attention_layers"] = tuple(d.get("attention_layers", ()))
        d["sink_strength_layer_head"] = tuple(tuple(r) for r in d["sink_strength_layer_head"])
        d["per_prompt"] = tuple(d["per_prompt"])
        return cls(**d)


def _stat(values: np.ndarray, statistic: str) -> float:
    return float(np.median(values) if statistic == "median" else np.mean(values, dtype=np.float64))


def prompt_statistic(capture: Any, settings: StrengthSettings) -> float | None:
    """The statistic over one prompt's selected rows alone (None: the prompt has none)."""
    rows = capture.content if settings.rows == "content" else np.ones_like(capture.content)
    return _stat(capture.sink_logodds[:, :, rows].ravel(), settings.statistic) if rows.any() else None


def reduce_captures(
    captures: list, settings: StrengthSettings, n_layers: int, attention_layers: Sequence[int] | None = None
) -> SinkStrength:
    """Reduce per-prompt captures of the selected layers to a SinkStrength (`attention_layers`: default all)."""
    from lm_eval_sink.capture import VIRTUAL_KEY

    if not captures:
        raise UserError("no calibration prompts were captured", "pass at least one prompt")
    layers = captures[0].layers
    n_heads = captures[0].sink_logodds.shape[1]
    # [layer, head, row] over all prompts' rows; rows are query positions >= 1.
    logodds = np.concatenate([c.sink_logodds for c in captures], axis=2).astype(np.float32)
    pos = np.concatenate([c.sink_pos for c in captures], axis=2)
    mass = np.concatenate([c.pos0_mass for c in captures], axis=2)
    content = np.concatenate([c.content for c in captures])
    learned = captures[0].learned_sink_mass is not None
    if learned:
        virtual_mass = np.concatenate([c.learned_sink_mass for c in captures], axis=2)
    if logodds.shape[2] == 0:
        raise UserError("the calibration prompts have no query position >= 1", "use prompts of at least two tokens")
    selected = content if settings.rows == "content" else np.ones_like(content)
    if not selected.any():
        raise UserError("no content rows: the template covers every token", "use --rows all")
    st = settings.statistic
    visible = [c.pos0_visible for c in captures]
    beyond = (
        None if any(v is None for v in visible) else int((~np.concatenate(visible, axis=1).all(axis=0))[selected].sum())
    )
    per_lh = tuple(tuple(_stat(logodds[li, h, selected], st) for h in range(n_heads)) for li in range(len(layers)))
    per_prompt = [prompt_statistic(c, settings) for c in captures]
    return SinkStrength(
        sink_strength=_stat(logodds[:, :, selected].ravel(), st),
        statistic=st,
        rows=settings.rows,
        last_k=len(layers),
        n_layers=n_layers,
        layers=tuple(int(x) for x in layers),
        n_heads=int(n_heads),
        sink_strength_layer_head=per_lh,
        sink_strength_all_rows=_stat(logodds.ravel(), st),
        sink_strength_content_rows=_stat(logodds[:, :, content].ravel(), st) if content.any() else None,
        sink_strength_template_rows=_stat(logodds[:, :, ~content].ravel(), st) if (~content).any() else None,
        template_row_fraction=float((~content).mean()),
        pos0_argmax_fraction=float((pos[:, :, selected] == 0).mean()),
        pos0_mass_median=float(np.median(mass[:, :, selected])),
        per_prompt=tuple(per_prompt),
        n_prompts=len(captures),
        n_rows=int(selected.sum()),
        attention_layers=tuple(int(x) for x in (range(n_layers) if attention_layers is None else attention_layers)),
        learned_sink_argmax_fraction=float((pos[:, :, selected] == VIRTUAL_KEY).mean()) if learned else None,
        learned_sink_mass_median=float(np.median(virtual_mass[:, :, selected])) if learned else None,
        rows_beyond_window=beyond,
    )


def warn_beyond_window(result: SinkStrength) -> None:
    """One SinkWarning when some rows could not see position 0 (their sink is then a key inside the window)."""
    if result.rows_beyond_window:
        warnings.warn(
            f"{result.rows_beyond_window} of {result.n_rows} rows cannot attend position 0 in a measured layer "
            "(their sliding window ends before it), so S there measures a sink inside the window: "
            "use calibration prompts shorter than the window (rows_beyond_window in the result)",
            SinkWarning,
            stacklevel=3,
        )


def measure(
    model: Any,
    tokenizer: Any,
    settings: StrengthSettings = StrengthSettings(),
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
) -> SinkStrength:
    """Sink Strength of a loaded model (a peft model as `adapters.adapted` says): encode the calibration prompts,
    capture, reduce."""
    from lm_eval_sink.adapters import adapted
    from lm_eval_sink.calibration import encoded_prompts
    from lm_eval_sink.capture import attention_layers, capture_prompts, captured_with, n_layers_of

    run = adapted(model)
    check_not_tensor_parallel(run.module)
    prompt_set, encoded = encoded_prompts(tokenizer, settings)
    depth = n_layers_of(run.module)
    att = attention_layers(run.module, encoded.input_ids[0][:2])
    captures = capture_prompts(model, encoded, settings.layers_for(att), settings.batching(), progress=progress)
    result = reduce_captures(captures, settings, depth, att)
    warn_beyond_window(result)
    fields = {
        "dtype": str(next(run.module.parameters()).dtype).removeprefix("torch."),
        "captured_with": captured_with(run.module),
        **({"virtual_tokens": run.virtual.record()} if run.virtual else {}),
    }
    return replace(result, provenance=measured_provenance(settings, prompt_set, encoded, provenance, fields))


def measured_provenance(
    settings: StrengthSettings, prompt_set: Any, encoded: Any, given: dict[str, Any] | None, fields: dict[str, Any]
) -> dict[str, Any]:
    """A measured S's provenance: `given` (the caller's), the settings asked, the prompt set, what was applied
    (`protocol`), how it was measured (`fields`: the model's dtype, `captured_with`, ...), statistics in float32."""
    return {
        **(given or {}),
        "settings": asdict(settings),
        "prompt_set": {"source": prompt_set.source, "n_prompts": len(prompt_set.prompts), "sha256": prompt_set.sha256},
        "protocol": {
            "chat_template_applied": encoded.chat_template_applied,
            "chat_template_sha256": encoded.chat_template_sha256,
            "system_prompt": encoded.system_prompt,
            "few_shot": 0,
            "add_generation_prompt": encoded.chat_template_applied,
        },
        **fields,
        "capture_dtype": "float32",
        "seed": settings.seed,
    }


def measure_model(
    name: str,
    settings: StrengthSettings = StrengthSettings(),
    dtype: str = "auto",
    device: str = DEFAULT_DEVICE,
    progress: bool = True,
) -> SinkStrength:
    """Load a model by path, hub id or `default`, and measure its Sink Strength."""
    from lm_eval_sink.provenance import provenance
    from lm_eval_sink.models import load_model

    loaded = load_model(name, dtype=dtype, device=device)
    return measure(
        loaded.model, loaded.tokenizer, settings, progress=progress, provenance=provenance(model=loaded.info)
    )


def fmt_optional(x: float | None) -> str:
    """A figure to 4 decimals, or `n/a` when the rows it needs are absent."""
    return "n/a" if x is None else f"{x:.4f}"
