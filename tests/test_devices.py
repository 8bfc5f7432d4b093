"""Every tensor made on the device of the data it meets, shown on the CPU.

Inside `with torch.device("meta"):` a factory call without a device (torch.tensor, as_tensor, zeros, ...)
makes a meta tensor, and mixing it with the CPU inputs raises: the same mistake that mixes a CPU tensor
with a CUDA model's. A path that runs there with CPU inputs, and gives the same values as outside it,
builds every tensor where its data lives. Moving a model to `meta` stands for moving it to a GPU.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

import sinkmodels as sm
from lm_eval_sink.extract.verify import logits
from lm_eval_sink.merging.methods import star_delta, tsv_delta
from lm_eval_sink.strength import StrengthSettings
from lm_eval_sink.training import SinkProtection, select_sink_heads


def _tasks(n: int = 2, shape: tuple[int, int] = (6, 5)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


# ---------------------------------------------------------------------------- merging


@pytest.mark.parametrize("method", ["tsv", "star"])
def test_merge_methods_keep_the_task_vectors_device(method):
    # star_delta truncates each 2-D task vector (star_truncate); a zero one takes the all-zero branch of each method
    tasks = [*_tasks(2), torch.zeros(6, 5)]
    merge = (lambda d: tsv_delta(d)) if method == "tsv" else (lambda d: star_delta(d, 0.4))
    want = [merge(tasks[:2]), merge(tasks[2:])]
    with torch.device("meta"):
        got = [merge(tasks[:2]), merge(tasks[2:])]
    assert all(g.device.type == "cpu" and torch.equal(g, w) for g, w in zip(got, want, strict=True))


# ---------------------------------------------------------------------------- extraction


def test_verification_probe_goes_to_the_models_device():
    model = sm.build("llama", n_layers=2)
    ids = [1, 5, 6, 7, 8]
    want = logits(model, ids)
    with torch.device("meta"):
        got = logits(model, ids)
    assert got.device.type == "cpu" and torch.equal(got, want)


# ---------------------------------------------------------------------------- protection


FAMILIES = ("llama", "qwen3")  # Llama with q/k biases; Qwen3 with per-head QK-norm, whose `report` uses the forward


@pytest.fixture(scope="module")
def plans(tiny_tokenizer):
    """Per family, the plan of the last 2 layers of the hand-set selective model that `_model` builds."""
    settings = StrengthSettings(last_k=2, n_prompts=5)
    out = {f: select_sink_heads(_model(tiny_tokenizer, f), tiny_tokenizer, settings, progress=False) for f in FAMILIES}
    assert all(len(p.layers) == 2 for p in out.values())  # both layers protected: the paths below run
    return out


def _model(tokenizer, family: str):
    vocab, bos = len(tokenizer), tokenizer.bos_token_id
    return sm.build_selective(family, n_layers=3, vocab=vocab, bos_id=bos, noise=0.05, bias=family == "llama")


def _step(model, seed: int) -> None:
    """A fixed random update of every trainable parameter, as an optimizer step makes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape, generator=gen))


def _bound_and_stepped(tokenizer, plan, family: str, on_meta: bool):
    """A model protected by `plan` after one update and projection; both calls under the meta device or not."""
    model, protection = _model(tokenizer, family), SinkProtection(plan)
    with torch.device("meta") if on_meta else nullcontext():
        protection.freeze(model)
    _step(model, 0)
    with torch.device("meta") if on_meta else nullcontext():
        protection.project_(model)
    return model, protection


@pytest.mark.parametrize("family", FAMILIES)
def test_protection_projects_with_tensors_on_the_models_device(tiny_tokenizer, plans, family):
    want, _ = _bound_and_stepped(tiny_tokenizer, plans[family], family, on_meta=False)
    got, _ = _bound_and_stepped(tiny_tokenizer, plans[family], family, on_meta=True)
    for (name, a), b in zip(want.state_dict().items(), got.state_dict().values(), strict=True):
        assert b.device.type == "cpu" and torch.equal(a, b), name


def test_protection_report_feeds_the_prompt_to_the_models_device(tiny_tokenizer, plans):
    model, protection = _bound_and_stepped(tiny_tokenizer, plans["qwen3"], "qwen3", on_meta=False)
    prompt = [[tiny_tokenizer.bos_token_id, 5, 6, 7]]
    want = protection.report(model, prompt)
    with torch.device("meta"):
        got = protection.report(model, prompt)
    assert got == want and all(r["q_norm_ratio"] is not None for r in got.values())


def test_protection_follows_the_model_moved_after_freeze(tiny_tokenizer, plans):
    model, protection = _model(tiny_tokenizer, "llama"), SinkProtection(plans["llama"])
    protection.freeze(model)  # bound on the CPU, as before a Trainer places the model on its GPU
    model.to("meta")
    protection.project_(model)  # raises if the CPU start weights or bases meet the meta weights
