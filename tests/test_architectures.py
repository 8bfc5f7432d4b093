"""Sink Strength on many transformers families against an independent fp32 eager computation.

Each family is a tiny random model (hidden 32, 2-4 layers) built from its transformers config. The
reference is independent of the capture: an eager copy of the same weights run with
output_attentions=True, sink log-odds log(p / (1 - p)) of each row's largest probability, and, for
learned sinks (gpt-oss), the virtual key's mass taken as 1 - the sum of the eager weights. Random
weights are fine here: the comparison is against that computation, not a closed form.
"""

from __future__ import annotations

import copy
import inspect
import json
import re

import numpy as np
import pytest
import torch
import transformers

from lm_eval_sink.calibration import Batching, encode_prompts, load_prompts
from lm_eval_sink.capture import (
    attention_layers_from_config,
    attn_implementation_for,
    capture_prompts,
    check_supported_class,
    sink_capture,
)
from lm_eval_sink.errors import SinkWarning, UserError
from lm_eval_sink.screen import classify_qk_norm
from lm_eval_sink.strength import StrengthSettings, measure

QK_SCALE = 8.0
WINDOW = 6  # sliding windows shorter than every calibration prompt
SETTINGS = StrengthSettings(n_prompts=5, batch_size=2, last_k=10)  # batch 2: left padding is exercised
MOE = dict(num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# family: (config class, model class, extra config, QK-norm class that `screen` must give)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "none"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}, "none"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**MOE, "sliding_window": WINDOW}, "none"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "none"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, "per_head"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", MOE, "per_head"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, "none"),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 8},
        "none",
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 8},
        "per_head",
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, "layerwise"),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        "layerwise",
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", MOE, "layerwise"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}, "none"),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"attention_multiplier": 0.2}, "none"),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"use_qk_norm": True}, "per_head"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {}, "none"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {}, "none"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": WINDOW}, "none"),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {**MOE, "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        "none",
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **MOE,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 8,
            "v_head_dim": 8,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "num_key_value_heads": 4,
        },
        "none",
    ),
    "gemma4_text": (  # the last 3 layers reuse the keys and values of the last unshared layer of their type
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            "num_hidden_layers": 5,
            "num_kv_shared_layers": 3,
            "sliding_window": WINDOW,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
                "full_attention",
            ],
            "hidden_size_per_layer_input": 4,
            "global_head_dim": 8,  # full-attention layers' head_dim (default 512); a config kwarg, not a field
        },
        "per_head",
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
        "per_head",
    ),  # hybrid
}
LEARNED_SINKS = {"gpt_oss"}
EAGER_ONLY = {"gemma2", "gpt_oss"}  # no sdpa: attention soft-capping, learned sinks


def _config(family: str, **common):
    """The family's config of `common` and its extra fields (those its class takes)."""
    cfg_cls = getattr(transformers, FAMILIES[family][0])
    accepted = set(inspect.signature(cfg_cls.__init__).parameters) | {"global_head_dim"}
    return cfg_cls(**{k: v for k, v in {**common, **FAMILIES[family][2]}.items() if k in accepted})


def _build(family: str, vocab_size: int, pad_id: int):
    model_cls = getattr(transformers, FAMILIES[family][1])
    config = _config(
        family,
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        pad_token_id=pad_id,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        vocab_size_per_layer_input=vocab_size,  # Gemma 4's per-layer embeddings (its default: 262,144 rows)
    )
    torch.manual_seed(0)
    model = model_cls._from_config(config, attn_implementation=attn_implementation_for(model_cls, config)).eval()
    with torch.no_grad():  # larger query/key weights: peaked rows, and Gemma 2's soft-capping (at 1.0) bites
        for name, p in model.named_parameters():
            if re.search(r"self_attn\.(q_proj|k_proj)\.weight$", name):
                p.mul_(QK_SCALE)
    if family in LEARNED_SINKS:  # strong learned sinks on some heads, weak on others: both kinds of row occur
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.tensor([4.0, -3.0, 0.5, 2.0]))
    return model


def _windowed(family: str) -> bool:
    return "sliding_window" in FAMILIES[family][2]


def _measure(model, tokenizer, settings, windowed: bool):
    """`measure`, with the one SinkWarning a window shorter than the prompts gives (and none otherwise)."""
    if not windowed:
        return measure(model, tokenizer, settings, progress=False)
    with pytest.warns(SinkWarning, match=r"rows cannot attend position 0") as record:
        res = measure(model, tokenizer, settings, progress=False)
    assert len([w for w in record if issubclass(w.category, SinkWarning)]) == 1
    return res


def _eager_reference(model, encoded, layers, learned: bool) -> dict[str, float]:
    """S and companions from eager attention probabilities (float64), independent of the capture."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    att_layers = [
        i
        for i, t in enumerate(
            getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
        )
        if "attention" in t
    ]
    logodds, mass0, virtual, is_virtual = [], [], [], []
    with torch.no_grad():
        for ids in encoded.input_ids:
            att = ref(torch.tensor([ids]), output_attentions=True, use_cache=False).attentions
            index = {x: (x if len(att) == model.config.num_hidden_layers else att_layers.index(x)) for x in layers}
            rows = np.stack([att[index[x]][0].double().numpy() for x in layers])[
                :, :, 1:, :
            ]  # [layer, head, query >= 1, key]
            v = 1.0 - rows.sum(-1) if learned else np.zeros(rows.shape[:-1])
            both = np.concatenate([rows, v[..., None]], axis=-1)
            p = both.max(-1)
            logodds.append(np.log(p / (1 - p)))
            mass0.append(rows[..., 0])
            virtual.append(v)
            is_virtual.append(both.argmax(-1) == rows.shape[-1])
    cat = lambda xs: np.concatenate(xs, axis=2)  # noqa: E731
    lo = cat(logodds)
    return {
        "S": float(np.median(lo)),
        "pos0_mass_median": float(np.median(cat(mass0))),
        "learned_fraction": float(cat(is_virtual).mean()),
        "learned_mass_median": float(np.median(cat(virtual))),
        "median_is_mean_of_middle": float(np.mean(np.sort(lo.ravel())[[(lo.size - 1) // 2, lo.size // 2]])),
    }


@pytest.fixture(scope="module")
def encoded(tiny_tokenizer):
    enc = encode_prompts(tiny_tokenizer, load_prompts(None, SETTINGS.n_prompts).prompts)
    assert min(len(x) for x in enc.input_ids) > WINDOW  # the windows really cut the prompts
    return enc


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sink_strength_equals_eager_reference(family, tiny_tokenizer, encoded):
    model = _build(family, len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    assert model.config._attn_implementation == ("eager" if family in EAGER_ONLY else "sdpa")
    res = _measure(model, tiny_tokenizer, SETTINGS, _windowed(family))
    # rows 1..L-1; with window W (key > query - W) rows >= W cannot see position 0: L - W per prompt
    beyond = sum(max(0, len(ids) - WINDOW) for ids in encoded.input_ids) if _windowed(family) else 0
    assert res.rows_beyond_window == beyond and (beyond > 0) == _windowed(family)
    assert model.config._attn_implementation == ("eager" if family in EAGER_ONLY else "sdpa")  # restored
    want_att = attention_layers_from_config(model.config) or tuple(range(model.config.num_hidden_layers))
    assert (
        res.attention_layers == want_att and res.layers == want_att and res.n_layers == model.config.num_hidden_layers
    )
    ref = _eager_reference(model, encoded, res.layers, family in LEARNED_SINKS)
    assert ref["S"] == pytest.approx(ref["median_is_mean_of_middle"], abs=1e-12)
    assert res.sink_strength == pytest.approx(ref["S"], abs=1e-4)
    assert res.pos0_mass_median == pytest.approx(ref["pos0_mass_median"], abs=1e-4)
    if family in LEARNED_SINKS:
        assert 0.05 < res.learned_sink_argmax_fraction < 0.95
        assert res.learned_sink_argmax_fraction == pytest.approx(ref["learned_fraction"], abs=1e-9)
        assert res.learned_sink_mass_median == pytest.approx(ref["learned_mass_median"], abs=1e-4)
    else:
        assert res.learned_sink_argmax_fraction is None and res.learned_sink_mass_median is None


def _outputs_unchanged(model, encoded, pad_id: int, layers) -> None:
    """A padded batch's logits under the capture of `layers` equal those without it, and every layer reached it."""
    from lm_eval_sink.capture import _batch

    ids, mask, pos, first = _batch(encoded.input_ids[:2], pad_id, torch.device("cpu"))
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        with sink_capture(model, layers) as collector:
            collector.first_real = first
            during = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    assert set(collector.records) == set(layers)
    assert torch.equal(before, during)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capture_leaves_padded_outputs_bit_identical(family, tiny_tokenizer, encoded):
    model = _build(family, len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    layers = attention_layers_from_config(model.config) or range(model.config.num_hidden_layers)
    _outputs_unchanged(model, encoded, tiny_tokenizer.pad_token_id, layers)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qk_norm_class_from_screen(family, tiny_tokenizer):
    config = _config(family, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert classify_qk_norm(json.loads(config.to_json_string())).qk_norm == FAMILIES[family][3]


def test_learned_sink_keys_round_trip_and_margin_refusal_without_learned_sinks(
    tiny_tokenizer, encoded, tmp_path, capsys
):
    from lm_eval_sink.cli import main

    gpt = _build("gpt_oss", len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    caps = capture_prompts(gpt, encoded, [0, 1], Batching(batch_size=2), progress=False)
    assert any((c.sink_pos == -1).any() for c in caps)
    fixed = capture_prompts(
        gpt, encoded, [0, 1], Batching(batch_size=2), progress=False, sink_keys=[c.sink_pos for c in caps]
    )
    for a, b in zip(caps, fixed, strict=True):
        np.testing.assert_allclose(b.sink_logodds, a.sink_logodds, atol=1e-6)
        np.testing.assert_array_equal(b.sink_pos, a.sink_pos)
    for name, model in (("gpt_oss", gpt), ("llama", _build("llama", len(tiny_tokenizer), tiny_tokenizer.pad_token_id))):
        model.save_pretrained(tmp_path / name)
        tiny_tokenizer.save_pretrained(tmp_path / name)
    capsys.readouterr()
    with pytest.warns(SinkWarning, match="cannot attend position 0"):  # gpt-oss's window is shorter than prompts
        rc = main(["margin", str(tmp_path / "gpt_oss"), str(tmp_path / "llama"), "--n-prompts", "5", "--quiet"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error")]  # besides transformers' weight-loading bars
    assert (
        rc == 2
        and "Traceback" not in err
        and len(lines) == 1
        and re.match(r"error: .*learned \(virtual\) sink key .* no learned sinks", lines[0])
    ), err


def test_built_mask_matches_the_models_own_4d_mask(tiny_tokenizer, encoded):
    """The mask the capture builds for flash / flex delegates equals the eager one (causal, left padding, window)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from lm_eval_sink.capture import _allowed_keys, _batch

    model = _build("mistral", len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    model.set_attn_implementation("eager")
    ids, mask, pos, first = _batch(encoded.input_ids[:3], tiny_tokenizer.pad_token_id, torch.device("cpu"))
    emb = model.model.embed_tokens(ids)
    n = ids.shape[1]
    for make, window in ((create_causal_mask, None), (create_sliding_window_causal_mask, WINDOW)):
        own = make(model.config, emb, mask, None, position_ids=pos)  # no cache: its keyword became `cache` in 5.24
        want = _allowed_keys(own, first, n, n, window, emb.device)
        built = _allowed_keys(mask, first, n, n, window, emb.device)  # a 2-D mask, as flash receives it
        real_rows = torch.arange(n)[None, :] >= first[:, None]  # padded query rows are never read
        assert want.shape[1] == 1 and not want[:, 0][real_rows].all()  # the mask has masked keys to compare
        assert torch.equal(built.expand_as(want)[:, 0][real_rows], want[:, 0][real_rows])


def test_hybrids_and_bypassing_classes_are_refused_with_one_line():
    with pytest.raises(UserError, match="FalconH1ForCausalLM does not route attention") as e:
        check_supported_class(transformers.FalconH1ForCausalLM)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="hybrid are not plain softmax attention"):
        attention_layers_from_config(transformers.FalconH1Config(num_hidden_layers=2))


@pytest.mark.parametrize("family", sorted(EAGER_ONLY))
def test_cli_strength_on_eager_only_families(family, tiny_tokenizer, tmp_path, capsys):
    from lm_eval_sink.cli import main

    d = tmp_path / family
    _build(family, len(tiny_tokenizer), tiny_tokenizer.pad_token_id).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    with pytest.warns(SinkWarning, match=r"rows cannot attend position 0"):  # both have windows of 6
        rc = main(["strength", str(d), "--n-prompts", "5", "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc in (0, None) and "Traceback" not in err
    data = json.loads((tmp_path / "out" / f"{family}.strength.json").read_text())
    assert data["attention_layers"] == [0, 1] and re.match(
        r"eager ", data["provenance"]["model"]["attn_implementation"]
    )
    assert (data["learned_sink_argmax_fraction"] is not None) == (family in LEARNED_SINKS)
    assert data["rows_beyond_window"] > 0


def test_lm_eval_task_reports_attention_layers_and_learned_sinks(tiny_tokenizer, tmp_path):
    import lm_eval

    d = tmp_path / "gpt_oss"
    model = _build("gpt_oss", len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    api = _measure(model, tiny_tokenizer, StrengthSettings(n_prompts=5), windowed=True)
    with pytest.warns(SinkWarning, match="cannot attend position 0"):  # once, from the aggregation
        res = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={d}", tasks=["sink_strength_n5"], device="cpu"
        )
    got = res["results"]["sink_strength_n5"]
    assert got["rows_beyond_window,none"] == api.rows_beyond_window > 0
    assert got["sink_strength,none"] == pytest.approx(api.sink_strength, abs=1e-5)
    assert got["attention_layers,none"] == [0, 1]
    assert got["learned_sink_argmax_fraction,none"] == pytest.approx(api.learned_sink_argmax_fraction, abs=1e-9)
    assert got["learned_sink_mass_median,none"] == pytest.approx(api.learned_sink_mass_median, abs=1e-5)


def test_data_parallel_items_of_learned_sinks_reduce_to_the_single_process_result(tiny_tokenizer, encoded):
    """Each prompt's item (as one rank builds it, JSON round-tripped as lm-eval gathers and logs it),
    in shuffled order, reduces on 'rank 0' to what `measure` gives: learned-sink figures and attention layers too."""
    import random

    from lm_eval_sink.harness.task import PromptRows, _result

    model = _build("gpt_oss", len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    want = _measure(model, tiny_tokenizer, SETTINGS, windowed=True)
    att = attention_layers_from_config(model.config)
    captures = capture_prompts(model, encoded, SETTINGS.layers_for(att), SETTINGS.batching(), progress=False)
    items = [
        json.loads(json.dumps(PromptRows.build(i, c, SETTINGS, 2, att, False, None).payload))
        for i, c in enumerate(captures)
    ]
    random.Random(0).shuffle(items)
    got = _result(items)
    assert got.attention_layers == want.attention_layers == (0, 1)
    assert got.rows_beyond_window == want.rows_beyond_window > 0
    assert got.learned_sink_argmax_fraction == want.learned_sink_argmax_fraction is not None
    assert got.learned_sink_mass_median == pytest.approx(want.learned_sink_mass_median, abs=1e-7)
    assert got.sink_strength == pytest.approx(want.sink_strength, abs=1e-7) and got.per_prompt == pytest.approx(
        want.per_prompt, abs=1e-7
    )
    np.testing.assert_allclose(got.sink_strength_layer_head, want.sink_strength_layer_head, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])  # sdpa, and eager for a class without sdpa
def test_flash_attention_is_captured_through_sdpa_and_restored(family, tiny_tokenizer):
    """No flash kernel on CPU: the implementation name is set directly, as a flash-loaded model carries it.
    S equals the model's own S, the result records how it was captured, and the config names flash again
    afterwards, also after a capture that raised."""
    model = _build(family, len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    own = model.config._attn_implementation
    windowed = family == "gpt_oss"  # its window of 6 is shorter than the prompts
    want = _measure(model, tiny_tokenizer, SETTINGS, windowed)
    model.config._attn_implementation_internal = "flash_attention_2"
    got = _measure(model, tiny_tokenizer, SETTINGS, windowed)
    assert got.sink_strength == want.sink_strength and got.per_prompt == want.per_prompt
    assert got.sink_strength_layer_head == want.sink_strength_layer_head
    assert want.provenance["captured_with"] == own
    assert got.provenance["captured_with"] == f"{own} (model: flash_attention_2)"
    assert model.config._attn_implementation == "flash_attention_2"
    during = []

    def capture_that_raises() -> None:
        with sink_capture(model, [0]):
            during.append(model.config._attn_implementation)
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        capture_that_raises()
    assert during == [f"lm_eval_sink_{own}"]
    assert model.config._attn_implementation == model.model.config._attn_implementation == "flash_attention_2"


def test_flex_attention_on_cpu_equals_eager_and_keeps_outputs(tiny_tokenizer, encoded):
    """flex_attention passes a BlockMask, so the capture builds its own mask (causal, left padding,
    Mistral's window 6 < every prompt). Runs through torch.compile on CPU (about 35 s cold)."""
    model = _build("mistral", len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    model.set_attn_implementation("flex_attention")
    res = _measure(model, tiny_tokenizer, SETTINGS, windowed=True)
    assert res.rows_beyond_window == sum(len(ids) - WINDOW for ids in encoded.input_ids)  # the built mask's window
    assert model.config._attn_implementation == "flex_attention"  # restored
    ref = _eager_reference(model, encoded, res.layers, learned=False)
    assert res.sink_strength == pytest.approx(ref["S"], abs=1e-4)
    assert res.pos0_mass_median == pytest.approx(ref["pos0_mass_median"], abs=1e-4)
    _outputs_unchanged(model, encoded, tiny_tokenizer.pad_token_id, range(model.config.num_hidden_layers))
