"""The capture at scale: query chunks, batches under a token budget, last-position logits only, tensors on
the data's device, and batching knobs that are in no result key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_architectures import _build

import sinkmodels as sm
from lm_eval_sink.calibration import Batching, builtin_prompts, encode_prompts, load_prompts
from lm_eval_sink.capture import capture_prompts
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings


@pytest.fixture(scope="module")
def encoded(tiny_tokenizer):
    return encode_prompts(tiny_tokenizer, load_prompts(None, 5).prompts)


def test_batches_fill_the_token_budget_shortest_first():
    lengths = [30, 5, 12, 6, 100, 7]
    assert Batching(batch_tokens=24).batches(lengths) == [[1, 3, 5], [2], [0], [4]]  # 3 x 7 <= 24 < 4 x 12
    assert Batching(batch_size=2, batch_tokens=10**6).batches(lengths) == [[1, 3], [5, 2], [0, 4]]
    assert Batching().batches([50] * 15) == [list(range(15))]  # the builtin set: one forward
    with pytest.raises(UserError, match="--batch-tokens must be positive"):
        Batching(batch_tokens=0)
    with pytest.raises(UserError, match="--query-chunk must be positive"):
        StrengthSettings(query_chunk=0)


@pytest.mark.parametrize("family", ["gpt_oss", "gemma2", "mistral", "qwen3"])
def test_query_chunks_and_batches_give_the_same_rows(family, tiny_tokenizer, encoded):
    """Chunks of 3 query rows in padded batches of 3 give the rows of one chunk per prompt at batch 1: learned
    sinks, soft-capping, sliding windows (sdpa's and eager's masks), GQA; fixed sink keys too."""
    model = _build(family, len(tiny_tokenizer), tiny_tokenizer.pad_token_id)
    layers = [0, 1]
    whole = capture_prompts(model, encoded, layers, Batching(batch_size=1, query_chunk=10**6), progress=False)
    chunked = capture_prompts(model, encoded, layers, Batching(batch_size=3, query_chunk=3), progress=False)
    fixed = capture_prompts(
        model, encoded, layers, Batching(query_chunk=4), progress=False, sink_keys=[c.sink_pos for c in whole]
    )
    assert min(len(x) for x in encoded.input_ids) > 4 and len({len(x) for x in encoded.input_ids}) > 1
    for a, b, f in zip(whole, chunked, fixed, strict=True):
        for c in (b, f):
            np.testing.assert_allclose(c.sink_logodds, a.sink_logodds, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(c.sink_pos, a.sink_pos)
            np.testing.assert_allclose(c.pos0_mass, a.pos0_mass, atol=1e-6)
            np.testing.assert_array_equal(c.pos0_visible, a.pos0_visible)
            assert (c.learned_sink_mass is None) == (a.learned_sink_mass is None) == (family != "gpt_oss")
            if a.learned_sink_mass is not None:
                np.testing.assert_allclose(c.learned_sink_mass, a.learned_sink_mass, atol=1e-6)


def test_log_odds_are_never_saturated(tiny_tokenizer):
    """A sink with nearly all the mass (1 - a below 1e-11, so a rounds to 1 in float32, and the logsumexp of all
    keys rounds to the sink's own logit) still gives its exact log-odds c - log(t), in every query chunk."""
    model = sm.build("llama", n_layers=1, bos_id=tiny_tokenizer.bos_token_id)
    gaps = (30.0, 45.0)
    with torch.no_grad():
        for h, c in enumerate(gaps):  # sinkmodels' Llama: c = alpha * beta * H / sqrt(D)
            model.model.layers[0].self_attn.q_proj.weight[h * sm.D + 1, 1] = c / (sm.betas(1)[0] * sm.H * sm.D**-0.5)
    enc = encode_prompts(tiny_tokenizer, builtin_prompts()[:2])
    caps = capture_prompts(model, enc, [0], Batching(query_chunk=5), progress=False)
    for ids, cap in zip(enc.input_ids, caps, strict=True):
        t = np.arange(1, len(ids))
        for h, c in enumerate(gaps):
            assert float(np.float32(c) + np.log1p(np.float32(t.max() * math.exp(-c)))) == np.float32(c)
            np.testing.assert_allclose(cap.sink_logodds[0, h], c - np.log(t), rtol=1e-6)
            assert (cap.pos0_mass[0, h] == 1.0).all() and (cap.sink_pos[0, h] == 0).all()


def test_the_capture_asks_for_the_last_positions_logits_only(tiny_tokenizer, encoded):
    """The vocabulary projection sees one position per prompt ([batch, 1, hidden]), not every position."""
    model = sm.build("llama", n_layers=2, bos_id=tiny_tokenizer.bos_token_id)
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape)))
    try:
        capture_prompts(model, encoded, [0, 1], Batching(batch_size=2), progress=False)
    finally:
        handle.remove()
    assert seen == [(2, 1, sm.H), (2, 1, sm.H), (1, 1, sm.H)]


def test_capture_builds_its_tensors_on_the_models_device(tiny_tokenizer, encoded):
    """Under torch.device("meta") a tensor built without a device lands on meta and cannot meet the CPU model's;
    the capture builds each of its own (padded ids, masks, fixed keys, the probe) on the model's device."""
    from lm_eval_sink.capture import attention_layers

    model = sm.build("llama", n_layers=2, bos_id=tiny_tokenizer.bos_token_id)
    model.config.layer_types = None  # the probe forward finds the attention layers
    batching = Batching(batch_size=3, query_chunk=4)
    want = capture_prompts(model, encoded, [0, 1], batching, progress=False)
    with torch.device("meta"):
        assert attention_layers(model, encoded.input_ids[0][:2]) == (0, 1)
        got = capture_prompts(model, encoded, [0, 1], batching, progress=False)
        fixed = capture_prompts(model, encoded, [0, 1], batching, progress=False, sink_keys=[c.sink_pos for c in want])
    for a, b, f in zip(want, got, fixed, strict=True):
        assert np.array_equal(a.sink_logodds, b.sink_logodds) and np.array_equal(a.sink_logodds, f.sink_logodds)


def test_batching_is_in_no_settings_an_lm_eval_task_item_compares():
    """The lm-eval task's per-prompt items ignore the batching knobs (S does not depend on them); that no key holds
    them is `tests/test_keys.py`'s."""
    from lm_eval_sink.harness.task import settings_from_metadata

    meta = settings_from_metadata({"batch_size": 2, "batch_tokens": 64, "query_chunk": 8})
    assert (meta.batch_size, meta.batch_tokens, meta.query_chunk) == (2, 64, 8)
    assert (
        meta.key_fields()
        == settings_from_metadata({"batch_size": "all"}).key_fields()
        == StrengthSettings().key_fields()
    )
