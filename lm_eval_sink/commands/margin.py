"""`lm-eval-sink margin`: resolve and load both models, capture them on the reference's token ids, write the output
folder."""

from __future__ import annotations

import gc
import io
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_sink.adapters import check_same_keys
from lm_eval_sink.calibration import EncodedPrompts, PromptSet, encoded_prompts, load_prompts
from lm_eval_sink.capture import attention_layers_from_config, capture_prompts, text_config_of
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_bytes, atomic_write_json, atomic_write_text
from lm_eval_sink.keys import check_same_versions, key_of, key_versions
from lm_eval_sink.margin import (
    MarginRows,
    MarginSettings,
    MarginWork,
    SinkMargin,
    build_margin,
    captured_rows,
    check_same_vocab,
    margin_csv,
    margin_table_markdown,
)
from lm_eval_sink.models import load_model, pretrained_args, resolve_model
from lm_eval_sink.options import MeasureOptions
from lm_eval_sink.outputs import check_output_dir, staged_dir
from lm_eval_sink.strength import SinkStrength, StrengthSettings, measure

OUTPUT_FILES = ("margin.json", "margin.md", "margin.csv", "margin_rows.npz", "margin_heatmap.png")


def _shape_of(config: Any) -> tuple[int, int]:
    cfg = text_config_of(config)
    return int(cfg.num_hidden_layers), int(cfg.num_attention_heads)


def _strength_summary(s: SinkStrength) -> dict[str, Any]:
    """The figures of one model's own S and the dtype it was loaded in (its setting's, `comparability`)."""
    return {"dtype": s.provenance.get("dtype")} | {
        k: getattr(s, k)
        for k in (
            "sink_strength",
            "statistic",
            "rows",
            "last_k",
            "n_layers",
            "sink_strength_content_rows",
            "sink_strength_template_rows",
            "pos0_argmax_fraction",
        )
    }


@dataclass(frozen=True, slots=True)
class _Measured:
    """One model's captures on the shared token ids, its own Sink Strength and what was loaded."""

    captures: list
    strength: SinkStrength
    info: dict[str, Any]


def measure_margin(
    reference: str,
    candidate: str,
    settings: MarginSettings = MarginSettings(),
    options: MeasureOptions = MeasureOptions(),
) -> tuple[SinkMargin, dict[str, np.ndarray]]:
    """Capture both models on the reference's token ids, one after the other, after checking shapes and vocabularies;
    return the margins and the per-row arrays. Nothing is written (`options.force` is `run_margin`'s)."""
    options.check_in_process("margin")
    st = settings.strength
    ref_path, cand_path = (resolve_model(m, allow_gguf=True) for m in (reference, candidate))
    check_same_keys(ref_path, "reference")
    check_same_keys(cand_path, "candidate")
    configs = _read_configs(ref_path, cand_path)
    prompt_set, encoded = _encode_on_reference(ref_path, cand_path, configs[1], st)
    att = attention_layers_from_config(configs[0]) or tuple(range(_shape_of(configs[0])[0]))  # hybrids: attention only
    layers = replace(st, last_k=settings.last_k).layers_for(att)  # the last K attention layers, as S chooses
    ref = _capture(ref_path, encoded, layers, st, options, "reference")
    sink_keys = [c.sink_pos for c in ref.captures]
    cand = _capture(cand_path, encoded, layers, st, options, "candidate", sink_keys)
    g_base = captured_rows(ref.captures, "sink_logodds", st.rows)
    if g_base.shape[2] == 0:
        raise UserError("no rows to compare (the prompts have no content tokens)", "use --rows all")
    g_cand = captured_rows(cand.captures, "sink_logodds", st.rows)
    rows = MarginRows(layers, g_base, g_cand, captured_rows(ref.captures, "sink_pos", st.rows), len(encoded))
    result = build_margin(
        reference,
        candidate,
        rows,
        (ref.strength.sink_strength, cand.strength.sink_strength),
        settings.quantile,
        _provenance(settings, ref, cand, prompt_set, encoded, options),
    )
    return result, rows.arrays()


def _read_configs(ref_path: str, cand_path: str) -> list[Any]:
    """Both models' configs (no weights read); their layer and head counts must match."""
    from transformers import AutoConfig

    configs = []
    for role, path in (("reference", ref_path), ("candidate", cand_path)):
        try:
            source, args = pretrained_args(path)  # a GGUF file: its folder and name
            configs.append(AutoConfig.from_pretrained(source, **args))
        except (OSError, ValueError) as e:
            raise UserError(
                f"{role} {path}: cannot read the model config ({str(e).splitlines()[0]})",
                "pass a folder written by save_pretrained",
            ) from None
    shapes = [_shape_of(c) for c in configs]
    if shapes[0] != shapes[1]:
        raise UserError(
            f"the reference has {shapes[0][0]} layers x {shapes[0][1]} heads, the candidate "
            f"{shapes[1][0]} x {shapes[1][1]}",
            "margin compares the same heads of two models of one architecture (a VLM backbone and its LLM)",
        )
    return configs


def _encode_on_reference(
    ref_path: str, cand_path: str, cand_config: Any, st: StrengthSettings
) -> tuple[PromptSet, EncodedPrompts]:
    """(prompt set, its encoding by the reference's tokenizer), after checking that the candidate reads the same
    ids: same vocabulary, and every id used within its embedding."""
    from transformers import AutoTokenizer

    ref_tok, cand_tok = (AutoTokenizer.from_pretrained(s, **a) for s, a in map(pretrained_args, (ref_path, cand_path)))
    check_same_vocab(ref_tok.get_vocab(), cand_tok.get_vocab())
    prompt_set, encoded = encoded_prompts(ref_tok, st)
    cand_vocab_size = int(getattr(text_config_of(cand_config), "vocab_size", 0) or 0)
    top = max(max(x) for x in encoded.input_ids)
    if cand_vocab_size and top >= cand_vocab_size:
        raise UserError(
            f"the prompts use token id {top} but the candidate's embedding has {cand_vocab_size} rows",
            "the vocabularies differ: use the LLM the VLM was built from",
        )
    return prompt_set, encoded


def _capture(
    path: str,
    encoded: EncodedPrompts,
    layers: tuple[int, ...],
    st: StrengthSettings,
    options: MeasureOptions,
    role: str,
    sink_keys: list[np.ndarray] | None = None,
) -> _Measured:
    """Load one model, capture its rows (at `sink_keys` when given) and measure its own S, then free it, so that
    only one model is in memory at a time."""
    progress = options.progress
    loaded = load_model(path, dtype=options.dtype, device=options.device)
    captures = capture_prompts(
        loaded.model, encoded, layers, st.batching(), progress=progress, desc=f"{role} capture", sink_keys=sink_keys
    )
    measured = _Measured(captures, measure(loaded.model, loaded.tokenizer, st, progress=progress), loaded.info)
    del loaded
    gc.collect()
    return measured


def _provenance(
    settings: MarginSettings,
    ref: _Measured,
    cand: _Measured,
    prompt_set: PromptSet,
    encoded: EncodedPrompts,
    options: MeasureOptions,
) -> dict[str, Any]:
    """The result's provenance, keyed by what the measurement received (`MarginWork`)."""
    from lm_eval_sink.provenance import provenance

    key = key_of(MarginWork(ref.info["model"], cand.info["model"], settings, options.dtype))
    return provenance(
        input_key=key.key,
        inputs_key=key.inputs_key,
        key_versions=key.versions,
        reference=ref.info,
        candidate=cand.info,
        settings=asdict(settings),  # {"strength": ..., "last_k": ..., "quantile": ...}
        prompt_set={"source": prompt_set.source, "n_prompts": len(prompt_set.prompts), "sha256": prompt_set.sha256},
        protocol={
            "tokenizer": "reference",
            "chat_template_applied": encoded.chat_template_applied,
            "chat_template_sha256": encoded.chat_template_sha256,
            "system_prompt": encoded.system_prompt,
        },
        sink_keys="the reference's argmax key per row, positions from the first real token",
        capture_dtype="float32",
        dtype=options.dtype,
        device=options.device,
        seed=settings.strength.seed,
        reference_sink_strength=_strength_summary(ref.strength),
        candidate_sink_strength=_strength_summary(cand.strength),
    )


def run_margin(
    reference: str,
    candidate: str,
    settings: MarginSettings,
    output: Path | None,
    options: MeasureOptions = MeasureOptions(),
) -> list[str]:
    """The `margin` command: measure and report; with `output` write the folder of margin.json/.md/.csv,
    margin_rows.npz, margin_heatmap.png."""
    st = settings.strength
    load_prompts(st.prompts_file, st.n_prompts)
    # `default` is a folder in the cache, named here without converting it: every check runs before any work
    models = [resolve_model(m, allow_gguf=True, convert=False) for m in (reference, candidate)]
    if output is not None:
        output = Path(output)
        check_same_versions(output / OUTPUT_FILES[0], key_versions(MarginWork), options.force)
        check_output_dir(output, options.force, inputs=[*models, st.prompts_file])
    result, arrays = measure_margin(reference, candidate, settings, options)
    md = margin_table_markdown(result)
    lines = margin_table_markdown(result, heads=False).rstrip("\n").splitlines()
    if output is None:
        return [*lines, "not saved (pass --output DIR to write margin.json, tables, arrays and the heatmap)"]
    from lm_eval_sink.plots import layer_head_heatmap

    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    with staged_dir(output, force=options.force) as tmp:
        atomic_write_json(tmp / OUTPUT_FILES[0], result.to_json())
        atomic_write_text(tmp / OUTPUT_FILES[1], md)
        atomic_write_text(tmp / OUTPUT_FILES[2], margin_csv(result))
        atomic_write_bytes(tmp / OUTPUT_FILES[3], buf.getvalue())
        layer_head_heatmap(
            result.margin,
            result.layers,
            f"margin G_base - B_gap (nats): {result.summary['n_negative_margin']} of "
            f"{result.summary['n_heads_total']} heads < 0",
            tmp / OUTPUT_FILES[4],
            label="margin (nats)",
        )
    files = [output / n for n in OUTPUT_FILES]
    return [*lines, "wrote " + ", ".join(str(p) for p in files)]
