"""Sink Strength during training: a transformers `TrainerCallback` that records S every N optimizer steps.

Which steps, the measurement (on every rank; the main process writes), the files in `output_dir` and resuming are in
docs/training.md ("SinkStrengthCallback"). `cb.attach(trainer)` also logs each measurement through `trainer.log`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from lm_eval_sink.adapters import adapted, unwrap_parallel
from lm_eval_sink.devices import check_not_tensor_parallel
from lm_eval_sink.errors import SinkWarning, UserError
from lm_eval_sink.io import atomic_write_text, json_lines, read_text
from lm_eval_sink.strength import SinkStrength, StrengthSettings, measure

TRAJECTORY_JSONL = "sink_trajectory.jsonl"
TRAJECTORY_PNG = "sink_trajectory.png"
LOGGED_KEYS = (
    "sink_strength",
    "sink_strength_content_rows",
    "sink_strength_template_rows",
    "pos0_argmax_fraction",
    "pos0_mass_median",
)


def unwrap_model(model: Any) -> Any:
    """The module whose weights are trained: strip DDP-style `.module` and peft wrappers (for weight access; the
    measurement runs a peft model as `adapters.adapted` says)."""
    model = unwrap_parallel(model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def measure_in_training(model: Any, tokenizer: Any, settings: StrengthSettings) -> SinkStrength:
    """`strength.measure` on a model that is being trained, restoring train mode and requires_grad. Torch's FSDP1
    wrapper is refused (its flat parameters hide the model class the capture switches), as is tensor parallelism."""
    model = unwrap_parallel(model)
    module = adapted(model).module
    check_not_tensor_parallel(module)
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in module.modules()):
        raise UserError(
            "SinkStrengthCallback cannot measure through torch's FSDP1 wrapper (FullyShardedDataParallel)",
            "shard with FSDP2 (fully_shard; Trainer fsdp_config version 2), or train with DDP",
        )
    was_training = model.training
    grads = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    try:
        with torch.no_grad():
            return measure(model, tokenizer, settings, progress=False)
    finally:
        model.train(was_training)
        for p, flag in grads:
            p.requires_grad_(flag)


def read_trajectory(path: Path) -> list[dict[str, Any]]:
    """The records of a `sink_trajectory.jsonl` (empty when absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [r for _, r in json_lines(read_text(path), str(path), "delete the broken line or the file")]


def trajectory_plot(points: list[tuple[int, float]], path: Path) -> Path:
    """S against optimizer step."""
    from lm_eval_sink.plots import _pyplot, save_figure

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3, label="S")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("Sink Strength S")
    ax.set_title("Sink Strength during training", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


class SinkStrengthCallback(TrainerCallback):
    """Measure Sink Strength every `every_n_steps` optimizer steps (docs/training.md, "SinkStrengthCallback")."""

    def __init__(
        self,
        tokenizer: Any,
        settings: StrengthSettings = StrengthSettings(),
        every_n_steps: int = 100,
        output_dir: str | Path | None = None,
    ) -> None:
        if every_n_steps <= 0:
            raise UserError(f"every_n_steps must be positive, got {every_n_steps}", "pass e.g. every_n_steps=100")
        self.tokenizer = tokenizer
        self.settings = settings
        self.every_n_steps = int(every_n_steps)
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.trainer: Any = None
        self.records: list[dict[str, Any]] = []  # on the main process
        self._steps: set[int] = set()  # steps measured (or resumed at) in this process: the same on every rank
        self._warned = False

    def attach(self, trainer: Any) -> SinkStrengthCallback:
        """Add this callback to `trainer` and log each measurement through `trainer.log`."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def _folder(self, args: Any) -> Path:
        return self.output_dir if self.output_dir is not None else Path(args.output_dir)

    def _measure(self, args: Any, state: Any, model: Any) -> None:
        """Measure on every rank (sharded weights need all of them), write on the main process."""
        step = int(state.global_step)
        if step in self._steps:
            return
        if model is None:
            raise UserError(
                "SinkStrengthCallback got no model from the Trainer",
                "add it to a transformers.Trainer (callbacks=[...] or cb.attach(trainer))",
            )
        self._steps.add(step)
        result = measure_in_training(model, self.tokenizer, self.settings)
        if state.is_world_process_zero:
            self._write(args, state, step, result)

    def _write(self, args: Any, state: Any, step: int, result: SinkStrength) -> None:
        body = {k: v for k, v in result.to_json().items() if k != "provenance"}
        record = {"step": step, "epoch": None if state.epoch is None else float(state.epoch), **body}
        self.records.append(record)
        text = "".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in self.records)
        atomic_write_text(self._folder(args) / TRAJECTORY_JSONL, text)
        logs = {k: record[k] for k in LOGGED_KEYS if record.get(k) is not None}
        if self.trainer is not None:
            self.trainer.log(logs)
        else:
            state.log_history.append(
                {**logs, "step": step, **({"epoch": state.epoch} if state.epoch is not None else {})}
            )
            if not self._warned:
                warnings.warn(
                    "SinkStrengthCallback is not attached to a trainer: Sink Strength goes to the JSONL and "
                    "state.log_history only, not to report_to (use cb.attach(trainer))",
                    SinkWarning,
                    stacklevel=2,
                )
                self._warned = True

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        step = int(state.global_step)
        self._steps = {step} if step > 0 else set()  # a resumed step was measured before its checkpoint
        if state.is_world_process_zero:
            old = read_trajectory(self._folder(args) / TRAJECTORY_JSONL) if step > 0 else []
            self.records = [r for r in old if r["step"] <= step]
        self._measure(args, state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self._measure(args, state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._measure(args, state, model)
        if state.is_world_process_zero and self.records:
            points = [(r["step"], r["sink_strength"]) for r in self.records]
            trajectory_plot(points, self._folder(args) / TRAJECTORY_PNG)
