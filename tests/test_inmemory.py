"""Merging into a resident model gives the on-disk merge's weights, for every bundled control."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lm_eval_sink.merging.configs import bundled_names, render
from lm_eval_sink.merging.inmemory import merge_into
from lm_eval_sink.merging.merge import run_mergekit


def _on_disk(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _resident(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


@pytest.mark.parametrize("lineage", ["chain", "siblings"])
def test_every_bundled_control_in_memory_equals_on_disk(tmp_path, tiny_trio, lineage):
    """One resident model takes every control in turn (seeded DARE included): each equals its on-disk merge."""
    resident = _resident(tiny_trio["reference"])
    base = tiny_trio["base"] if lineage == "siblings" else None
    for name in bundled_names():
        text = render(name, tiny_trio["reference"], tiny_trio["candidate"], base=base).text
        out = tmp_path / name
        run_mergekit(text, out, random_seed=7)
        disk = _on_disk(out)
        done = merge_into(resident, text, name, random_seed=7)
        state = resident.state_dict()
        assert done.n_tensors == len(disk), name
        for key, tensor in disk.items():
            assert torch.equal(state[key], tensor.to(torch.float32)), (name, key)


def test_in_memory_merge_leaves_rng_state_and_is_repeatable(tiny_trio):
    """A seeded DARE merge in memory is bit-identical twice and does not move the caller's RNG."""
    text = render("dare_linear", tiny_trio["reference"], tiny_trio["candidate"]).text
    resident = _resident(tiny_trio["reference"])
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    merge_into(resident, text, "dare_linear", random_seed=3)
    first = {k: v.clone() for k, v in resident.state_dict().items()}
    merge_into(resident, text, "dare_linear", random_seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(first[k], v) for k, v in resident.state_dict().items())


def test_a_tokenizer_surgery_is_refused_in_memory(tiny_trio):
    from lm_eval_sink.errors import UserError

    text = render("linear_uniform", tiny_trio["reference"], tiny_trio["candidate"], tokenizer_source="union").text
    with pytest.raises(UserError) as err:
        merge_into(_resident(tiny_trio["reference"]), text, "linear_uniform")
    assert err.value.line().startswith("control 'linear_uniform' rebuilds the tokenizer (tokenizer_source)")
    assert err.value.line().endswith("(fix: set merge: {in_memory: false} for this sweep)")


def test_a_resident_model_of_another_architecture_is_refused(tmp_path, tiny_trio):
    """A resident model whose parameters mergekit does not write (a Qwen2 for a Llama merge) is refused."""
    from helpers import make_tiny_lm

    from lm_eval_sink.errors import UserError

    text = render("linear_uniform", tiny_trio["reference"], tiny_trio["candidate"]).text
    other = _resident(make_tiny_lm(tmp_path / "qwen2", "qwen2"))
    with pytest.raises(UserError) as err:
        merge_into(other, text, "linear_uniform")
    assert err.value.line().startswith("control 'linear_uniform': mergekit writes no tensor for the resident parameter")
