"""peft adapters where users measure S: `strength ADAPTER_FOLDER`, `--model_args ...,peft=ADAPTER`, the callback.

The adapter is a real rank-1 LoRA made by peft on the hand-set sink Llama (helpers.save_sink_llama): on
q_proj it adds DELTA / (beta * H / sqrt(D)) to each head's query weight, so it raises every head's sink
logit gap by DELTA, every row's sink log-odds by DELTA, and S (a median of them) by exactly DELTA.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import sinkmodels as sm
from helpers import save_sink_llama
from lm_eval_sink.errors import SinkWarning
from lm_eval_sink.strength import StrengthSettings

GAPS = [[3.0, 4.0], [5.0, 6.0], [2.5, 3.5]]  # [layer][head] sink logit gap of the base
DELTA = 1.0
SETTINGS = StrengthSettings(n_prompts=5)


def _lora(model):
    """A rank-1 LoRA on q_proj raising every head's sink gap by DELTA (peft's own classes and weights)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        model, LoraConfig(r=1, lora_alpha=1, lora_dropout=0.0, target_modules=["q_proj"], init_lora_weights=False)
    )
    beta = sm.betas(len(GAPS))
    with torch.no_grad():
        for li, layer in enumerate(peft_model.base_model.model.model.layers):
            q = layer.self_attn.q_proj
            q.lora_A["default"].weight.zero_()
            q.lora_A["default"].weight[0, 1] = 1.0  # reads the embedding's dim 1, as the query weight does
            q.lora_B["default"].weight.zero_()
            for h in range(sm.N_HEADS):
                q.lora_B["default"].weight[h * sm.D + 1, 0] = DELTA / (beta[li] * sm.H * sm.D**-0.5)
    return peft_model


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapter")
    base = save_sink_llama(root / "base", GAPS, tiny_tokenizer)
    _lora(AutoModelForCausalLM.from_pretrained(base)).save_pretrained(root / "adapter")
    assert json.loads((root / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    return {"base": base, "adapter": root / "adapter"}


def test_strength_of_an_adapter_folder_measures_the_adapted_model(base_and_adapter, tmp_path, capsys):
    from lm_eval_sink.cli import main

    base, adapter = base_and_adapter["base"], base_and_adapter["adapter"]
    out = tmp_path / "out"
    assert main(["strength", str(base), str(adapter), "--n-prompts", "5", "--output", str(out), "--quiet"]) == 0
    got = {p: json.loads((out / f"{p}.strength.json").read_text()) for p in ("base", "adapter")}
    assert got["adapter"]["sink_strength"] == pytest.approx(got["base"]["sink_strength"] + DELTA, abs=1e-5)
    shifted = np.asarray(got["base"]["sink_strength_layer_head"]) + DELTA
    np.testing.assert_allclose(got["adapter"]["sink_strength_layer_head"], shifted, atol=1e-5)
    model = got["adapter"]["provenance"]["model"]
    assert model["base_model"] == str(base) and "base/model.safetensors" in model["files"]
    assert model["fingerprint"] != got["base"]["provenance"]["model"]["fingerprint"]


def test_an_adapter_whose_base_is_gone_is_one_line(base_and_adapter, tmp_path, user_error):
    import shutil

    adapter = shutil.copytree(base_and_adapter["adapter"], tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "./gone"}))
    line = user_error(["strength", adapter, "--output", tmp_path / "out"], tmp_path / "out")
    assert f"{adapter / 'adapter_config.json'}: gone: no such base model folder" in line


def _base_strength(base_and_adapter, tokenizer):
    from transformers import AutoModelForCausalLM

    from lm_eval_sink.strength import measure

    base = AutoModelForCausalLM.from_pretrained(base_and_adapter["base"])
    return base, measure(base, tokenizer, SETTINGS, progress=False).sink_strength


def test_an_adapter_where_a_whole_model_is_read_is_one_line(base_and_adapter, tmp_path, user_error):
    """lm-eval's `pretrained`, merges and extraction read the model's own files: an adapter folder is refused."""
    adapter = base_and_adapter["adapter"]
    line = user_error(["eval", adapter, "--protocol", "instruct", "--tasks", "ifeval", "--output", tmp_path / "o"])
    assert f"{adapter}: a peft adapter folder (adapter_config.json), where a whole model is needed" in line
    assert "pretrained=BASE,peft=ADAPTER" in line and not (tmp_path / "o").exists()


def test_lm_eval_peft_model_args_measure_the_adapter(base_and_adapter, tiny_tokenizer):
    """`sink_strength_n5` (SETTINGS' prompts) with peft=ADAPTER: the base's S (the same as the task's, tested
    elsewhere) + DELTA."""
    import lm_eval

    base, adapter = base_and_adapter["base"], base_and_adapter["adapter"]
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={base},peft={adapter}", tasks=["sink_strength_n5"], device="cpu"
    )
    want = _base_strength(base_and_adapter, tiny_tokenizer)[1] + DELTA
    assert res["results"]["sink_strength_n5"]["sink_strength,none"] == pytest.approx(want, abs=1e-5)
    assert res["configs"]["sink_strength_n5"]["metadata"]["capture"]["adapter"] == str(adapter)


def test_callback_measures_a_peft_model_through_its_adapter(base_and_adapter, tiny_tokenizer, tmp_path):
    """The callback's unwrap: the LoRA layers stay active; train mode and requires_grad are restored."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from lm_eval_sink.training import SinkStrengthCallback

    base, s_base = _base_strength(base_and_adapter, tiny_tokenizer)
    want = s_base + DELTA
    model = _lora(base).train()
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    cb = SinkStrengthCallback(tiny_tokenizer, SETTINGS, output_dir=tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.warns(SinkWarning, match="not attached to a trainer"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert cb.records[0]["sink_strength"] == pytest.approx(want, abs=1e-5)
    assert model.training and {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert any(grads.values()) and not all(grads.values())  # LoRA weights trainable, the base frozen
