"""Sink Strength: closed form, agreement with eager attention, bf16, determinism, batch size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_architectures import _build

import sinkmodels as sm
from lm_eval_sink.calibration import builtin_prompts, encode_prompts, load_prompts
from lm_eval_sink.capture import capture_prompts
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings, measure

FAMILIES = ["llama", "qwen3", "olmo2"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("statistic", ["median", "mean"])
@pytest.mark.parametrize(("last_k", "layers"), [(2, (1, 2)), (10, (0, 1, 2))], ids=["2", "10 clipped to 3"])
def test_closed_form(family, statistic, last_k, layers, tiny_tokenizer):
    model = sm.build(family, n_layers=3, bos_id=tiny_tokenizer.bos_token_id)
    res = measure(model, tiny_tokenizer, StrengthSettings(last_k=last_k, statistic=statistic), progress=False)
    k = len(layers)
    lengths = [len(x) for x in encode_prompts(tiny_tokenizer, load_prompts().prompts).input_ids]
    want, per = sm.expected_strength(family, 3, lengths, last_k=k, statistic=statistic)
    assert res.sink_strength == pytest.approx(want, abs=1e-5)
    np.testing.assert_allclose(np.array(res.sink_strength_layer_head), per, atol=1e-5)
    assert res.layers == layers and res.last_k == k and res.n_layers == 3 and res.n_heads == sm.N_HEADS
    if family == "qwen3":  # head 1 has g < 0: the argmax key leaves position 0 for every row with q >= 1
        g = sm.expected_gap("qwen3", 3)
        assert (g[:, 1] < 0).all() and (g[:, 0] > 0).all()
        assert res.pos0_argmax_fraction == pytest.approx(0.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_agrees_with_eager_attention_probabilities(family, tiny_tokenizer):
    model = _build(family, len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    enc = encode_prompts(tiny_tokenizer, builtin_prompts()[:3])
    caps = capture_prompts(model, enc, layers=[0, 1], progress=False)
    model.set_attn_implementation("eager")
    try:
        for ids, cap in zip(enc.input_ids, caps, strict=True):
            with torch.no_grad():
                out = model(torch.tensor([ids]), output_attentions=True)
            for li, layer in enumerate((0, 1)):
                att = out.attentions[layer][0].double().numpy()  # [head, query, key]
                for h in range(att.shape[0]):
                    for q in range(1, len(ids)):
                        row = att[h, q, : q + 1]
                        s = int(cap.sink_pos[li, h, q - 1])
                        assert s == int(np.argmax(row))
                        p = row[s]
                        assert cap.sink_logodds[li, h, q - 1] == pytest.approx(math.log(p / (1 - p)), abs=2e-4)
                        assert cap.pos0_mass[li, h, q - 1] == pytest.approx(row[0], abs=1e-5)
    finally:
        model.set_attn_implementation("sdpa")


def test_a_transformers_without_what_the_capture_uses_is_one_line_before_any_change(tiny_tokenizer, monkeypatch):
    """The capture registers through transformers' registry API and sets configs' `_attn_implementation_internal`
    back: a release without either is refused in one line naming transformers' version, the model untouched."""
    import transformers
    from transformers import AttentionInterface

    from lm_eval_sink.capture import sink_capture

    model = _build("llama", len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    monkeypatch.setattr(AttentionInterface, "register", None)
    with pytest.raises(UserError, match=f"transformers {transformers.__version__}: AttentionInterface is not a"):
        sink_capture(model, [0]).__enter__()
    monkeypatch.undo()
    monkeypatch.setattr(type(model.config), "_attn_implementation", "sdpa")  # a release that stores it plainly
    del model.config._attn_implementation_internal
    with pytest.raises(UserError, match="a config without _attn_implementation_internal"):
        sink_capture(model, [0]).__enter__()


def test_rows_content_and_template_split(tiny_tokenizer):
    model = sm.build("llama", n_layers=2, bos_id=tiny_tokenizer.bos_token_id)
    allr = measure(model, tiny_tokenizer, StrengthSettings(rows="all"), progress=False)
    cont = measure(model, tiny_tokenizer, StrengthSettings(rows="content"), progress=False)
    assert cont.sink_strength == pytest.approx(allr.sink_strength_content_rows)
    assert 0 < allr.template_row_fraction < 1
    assert cont.n_rows < allr.n_rows


def test_unsupported_architecture_is_a_user_error(tiny_tokenizer):
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(UserError, match="BloomForCausalLM"):
        measure(model, tiny_tokenizer, StrengthSettings(), progress=False)


def test_bad_settings():
    with pytest.raises(UserError, match="last-k"):
        StrengthSettings(last_k=0)
    with pytest.raises(UserError, match="statistic"):
        StrengthSettings(statistic="mode")


# ---- the real SmolLM2-135M-Instruct ----


@pytest.fixture(scope="module")
def smollm2(default_model):
    from lm_eval_sink.models import load_model

    return load_model(str(default_model), dtype="float32")


@pytest.mark.slow
def test_smollm2_values(smollm2):
    """S on the real model (figures in docs/sink-strength.md); finite, positive, and stable across N."""
    got = {}
    for k, n in ((10, 15), (10, 5), (None, 15)):
        r = measure(smollm2.model, smollm2.tokenizer, StrengthSettings(last_k=k, n_prompts=n), progress=False)
        assert math.isfinite(r.sink_strength)
        got[(k, n)] = r.sink_strength
    assert 1.0 < got[(10, 15)] < 2.5
    assert abs(got[(10, 5)] - got[(10, 15)]) < 0.2
    one = measure(smollm2.model, smollm2.tokenizer, StrengthSettings(batch_size=1), progress=False)  # 15 forwards
    assert one.sink_strength == pytest.approx(got[(10, 15)], abs=1e-5)  # the default: one padded forward


@pytest.mark.slow
def test_smollm2_bf16_finite_and_close_to_fp32(smollm2):
    fp32 = measure(smollm2.model, smollm2.tokenizer, StrengthSettings(n_prompts=5), progress=False)
    model16 = smollm2.model.to(torch.bfloat16)
    try:
        bf16 = measure(model16, smollm2.tokenizer, StrengthSettings(n_prompts=5), progress=False)
    finally:
        smollm2.model.to(torch.float32)
    assert all(math.isfinite(v) for row in bf16.sink_strength_layer_head for v in row)
    assert bf16.sink_strength == pytest.approx(fp32.sink_strength, abs=0.05)  # docs/sink-strength.md: bf16 tolerance
