"""`lm-eval-sink protect-plan`: load the model, choose the sink heads to protect, write the plan JSON."""

from __future__ import annotations

from pathlib import Path

from lm_eval_sink.options import MeasureOptions
from lm_eval_sink.strength import StrengthSettings
from lm_eval_sink.training.protection import ProtectSettings, check_no_virtual_tokens, select_sink_heads


def run_protect_plan(
    name: str,
    settings: StrengthSettings,
    output: str | Path,
    protect: ProtectSettings = ProtectSettings(),
    options: MeasureOptions = MeasureOptions(),
) -> list[str]:
    """`lm-eval-sink protect-plan`: load the model, choose the heads, write the plan JSON; returns lines to print."""
    from lm_eval_sink.adapters import folder_virtual_tokens
    from lm_eval_sink.calibration import load_prompts
    from lm_eval_sink.io import atomic_write_json
    from lm_eval_sink.outputs import new_files
    from lm_eval_sink.provenance import provenance
    from lm_eval_sink.models import load_model, resolve_model

    output = Path(output)  # a folder is refused by `new_files`, before the model loads
    options.check_in_process("protect-plan")
    load_prompts(settings.prompts_file, settings.n_prompts)  # fail before loading the model
    planned = resolve_model(name, allow_gguf=True, convert=False)  # `default` is converted by load_model, after
    if Path(planned).is_dir():
        check_no_virtual_tokens(folder_virtual_tokens(planned), name)  # before the model loads
    with new_files([output], options.force, "-o", inputs=[planned, settings.prompts_file]):
        loaded = load_model(name, dtype=options.dtype, device=options.device)
        plan = select_sink_heads(loaded.model, loaded.tokenizer, settings, protect, progress=options.progress)
        doc = plan.to_json()
        doc["provenance"] = {
            **plan.provenance,
            **provenance(command="protect-plan", model=loaded.info, dtype=options.dtype),
        }
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
