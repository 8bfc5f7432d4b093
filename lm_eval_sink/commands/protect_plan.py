"""`lm-eval-sink protect-plan`: load the model, choose the sink heads to protect, write the plan JSON."""

from __future__ import annotations

from pathlib import Path

from lm_eval_sink.devices import DEFAULT_DEVICE
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings
from lm_eval_sink.training.protection import select_sink_heads


def run_protect_plan(
    name: str,
    settings: StrengthSettings,
    output: str | Path,
    threshold: float = 0.0,
    min_pos0_fraction: float = 0.8,
    tau: float = 0.0,
    dtype: str = "auto",
    device: str = DEFAULT_DEVICE,
    force: bool = False,
    progress: bool = True,
) -> list[str]:
    """`lm-eval-sink protect-plan`: load the model, choose the heads, write the plan JSON; returns lines to print."""
    from lm_eval_sink.calibration import load_prompts
    from lm_eval_sink.io import atomic_write_json, new_files, provenance
    from lm_eval_sink.models import load_model, resolve_model

    output = Path(output)
    if output.is_dir():
        raise UserError(f"-o {output} is a folder", "pass a file path, e.g. -o plan.json")
    if not 0.0 <= tau < 1.0:
        raise UserError(f"--tau must lie in [0, 1), got {tau}", "use 0 to keep the sink logit exactly, or e.g. 0.05")
    if not 0.0 <= min_pos0_fraction <= 1.0:
        raise UserError(f"--min-pos0-fraction must lie in [0, 1], got {min_pos0_fraction}", "use e.g. 0.8")
    load_prompts(settings.prompts_file, settings.n_prompts)  # fail before loading the model
    planned = resolve_model(name, allow_gguf=True, convert=False)  # `default` is converted by load_model, after
    with new_files([output], force, "-o", inputs=[planned, settings.prompts_file]):
        loaded = load_model(name, dtype=dtype, device=device)
        plan = select_sink_heads(
            loaded.model,
            loaded.tokenizer,
            settings,
            threshold=threshold,
            min_pos0_fraction=min_pos0_fraction,
            tau=tau,
            progress=progress,
        )
        doc = plan.to_json()
        doc["provenance"] = {**plan.provenance, **provenance(command="protect-plan", model=loaded.info, dtype=dtype)}
        atomic_write_json(output, doc)
        n_sel = sum(h.selected for h in plan.heads)
        lines = [
            f"{n_sel} of {len(plan.heads)} heads selected in {len(plan.layers)} layers (qk-norm: "
            f"{plan.qk_norm}, tau {plan.tau}) -> {output}"
        ]
        lines += [
            f"layer {lp.layer}: heads {list(lp.heads)}, KV heads {list(lp.kv_heads)}, rank of U "
            f"{lp.max_u_rank} of {plan.head_dim}"
            for lp in plan.layers
        ]
        return lines
