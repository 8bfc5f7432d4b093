"""peft adapters where users measure S: `strength ADAPTER_FOLDER`, `--model_args ...,peft=ADAPTER`, the callback.

A real rank-1 LoRA on the hand-set sink Llama raises S by exactly DELTA; real prompt-learning adapters put N_VIRTUAL
virtual tokens with key logit F * c before every prompt, giving S in closed form (`_virtual_strength`; the
derivation: docs/architectures.md, 'Adapters').
"""

from __future__ import annotations

import json
import math
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
N_VIRTUAL, F = 2, 0.5
PROMPT_LEARNING = ("prompt_tuning", "p_tuning", "prefix_tuning")


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


@pytest.mark.parametrize("damage", ["base gone", "weights cut short", "config not an object"])
def test_a_damaged_adapter_is_one_line_before_its_base_loads(base_and_adapter, tmp_path, user_error, damage):
    """A base that is gone is named by the adapter's config; a broken weights file (it loaded the base first, then
    failed in safetensors without a word of the adapter or its file) is named before the base loads."""
    import shutil

    adapter = shutil.copytree(base_and_adapter["adapter"], tmp_path / "adapter")
    config, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    if damage == "base gone":
        config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "./gone"}))
    elif damage == "config not an object":
        config.write_text("[]")
    else:
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = user_error(["strength", adapter, "--output", tmp_path / "out", "--quiet"], tmp_path / "out")
    want = {"base gone": f"{config}: gone: no such base model folder", "weights cut short": f"{weights}: is cut short"}
    assert want.get(damage, f"{config}: not a peft adapter config (a JSON object is expected)") in line


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


def _virtual_embedding() -> torch.Tensor:
    v = torch.zeros(sm.H)
    v[0], v[1] = F, math.sqrt(1 - F * F)
    return v


def _prompt_learning(model, method: str):
    """A real peft prompt-learning adapter whose every virtual token's key has logit F * c (module docstring)."""
    from peft import AdaptionPromptConfig, PrefixTuningConfig, PromptEncoderConfig, PromptTuningConfig, get_peft_model

    configs = {
        "prompt_tuning": PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRTUAL),
        "p_tuning": PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRTUAL, encoder_hidden_size=8),
        "prefix_tuning": PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRTUAL),
        "adaption_prompt": AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=N_VIRTUAL, adapter_layers=2),
    }
    peft_model = get_peft_model(model, configs[method])
    encoder = peft_model.prompt_encoder["default"] if method != "adaption_prompt" else None
    with torch.no_grad():
        if method == "prompt_tuning":
            encoder.embedding.weight.copy_(_virtual_embedding().expand(N_VIRTUAL, -1))
        elif method == "p_tuning":  # the encoder's last layer outputs its bias for every virtual token
            encoder.mlp_head[4].weight.zero_()
            encoder.mlp_head[4].bias.copy_(_virtual_embedding())
        elif method == "prefix_tuning":  # per layer: key then value of each virtual token; the key = BOS's x F
            encoder.embedding.weight.zero_()
            for li, beta in enumerate(sm.betas(len(GAPS))):
                encoder.embedding.weight[:, 2 * li * sm.N_KV * sm.D + 1] = beta * sm.H**0.5 * F
    return peft_model


def _virtual_strength(tokenizer) -> float:
    """S of the prompt-learning adapters in closed form: the median over layers, heads and rows t >= 1."""
    from lm_eval_sink.calibration import encode_prompts, load_prompts

    encoded = encode_prompts(tokenizer, load_prompts(None, SETTINGS.n_prompts).prompts)
    c = np.asarray(GAPS)[..., None]
    rows = [c - np.log(N_VIRTUAL * np.exp(F * c) + np.arange(1, len(ids))) for ids in encoded.input_ids]
    base = [c - np.log(np.arange(1, len(ids))) for ids in encoded.input_ids]
    want = float(np.median(np.concatenate(rows, axis=-1)))
    assert float(np.median(np.concatenate(base, axis=-1))) - want > 1.0  # the base's S is far from it
    return want


@pytest.fixture(scope="module")
def virtual_adapters(base_and_adapter) -> dict[str, Path]:
    """Each prompt-learning adapter and an adaption prompt saved beside the base (peft's own folders)."""
    from transformers import AutoModelForCausalLM

    root = base_and_adapter["adapter"].parent
    for method in (*PROMPT_LEARNING, "adaption_prompt"):
        _prompt_learning(AutoModelForCausalLM.from_pretrained(base_and_adapter["base"]), method).save_pretrained(
            root / method
        )
    return {method: root / method for method in (*PROMPT_LEARNING, "adaption_prompt")}


def test_strength_of_prompt_learning_adapters_counts_their_virtual_tokens(virtual_adapters, tiny_tokenizer, tmp_path):
    """`strength` loads each through peft and measures it with its virtual tokens: the closed form, the sink at
    position N_VIRTUAL (BOS after them), and the provenance saying where position 0 is and which rows count."""
    from lm_eval_sink.cli import main

    out = tmp_path / "out"
    folders = [str(virtual_adapters[m]) for m in PROMPT_LEARNING]
    assert main(["strength", *folders, "--n-prompts", "5", "--output", str(out), "--quiet"]) == 0
    want = _virtual_strength(tiny_tokenizer)
    for method in PROMPT_LEARNING:
        got = json.loads((out / f"{method}.strength.json").read_text())
        assert got["sink_strength"] == pytest.approx(want, abs=1e-5), method
        assert got["pos0_argmax_fraction"] == 0.0  # the sink is BOS, after the virtual tokens
        virtual = got["provenance"]["virtual_tokens"]
        assert virtual["method"] == method.upper() and virtual["n_virtual_tokens"] == N_VIRTUAL
        assert "first virtual token" in virtual["position_0"] and "1..L-1" in virtual["rows"]


@pytest.mark.parametrize("method", ["lora", "prompt_tuning"])
def test_lm_eval_peft_model_args_measure_the_adapter(method, base_and_adapter, virtual_adapters, tiny_tokenizer):
    """`sink_strength_n5` (SETTINGS' prompts) with peft=ADAPTER: the base's S (the same as the task's, tested
    elsewhere) + DELTA for the LoRA, the closed form with its virtual tokens for prompt tuning."""
    import lm_eval

    base = base_and_adapter["base"]
    adapter = base_and_adapter["adapter"] if method == "lora" else virtual_adapters[method]
    res = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={base},peft={adapter}", tasks=["sink_strength_n5"], device="cpu"
    )
    want = (
        _base_strength(base_and_adapter, tiny_tokenizer)[1] + DELTA
        if method == "lora"
        else _virtual_strength(tiny_tokenizer)
    )
    assert res["results"]["sink_strength_n5"]["sink_strength,none"] == pytest.approx(want, abs=1e-5)
    capture = res["configs"]["sink_strength_n5"]["metadata"]["capture"]
    assert capture["adapter"] == str(adapter)
    assert method == "lora" or capture["virtual_tokens"]["n_virtual_tokens"] == N_VIRTUAL


@pytest.mark.parametrize("method", ["lora", "prompt_tuning"])
def test_callback_measures_a_peft_model_through_its_adapter(method, base_and_adapter, tiny_tokenizer, tmp_path):
    """The callback's unwrap: the LoRA layers stay active, prompt tuning's virtual tokens are counted; train mode and
    requires_grad are restored."""
    from transformers import AutoModelForCausalLM, TrainerControl, TrainerState, TrainingArguments

    from lm_eval_sink.training import SinkStrengthCallback

    if method == "lora":
        base, s_base = _base_strength(base_and_adapter, tiny_tokenizer)
        model, want = _lora(base).train(), s_base + DELTA
    else:
        base = AutoModelForCausalLM.from_pretrained(base_and_adapter["base"])
        model, want = _prompt_learning(base, method).train(), _virtual_strength(tiny_tokenizer)
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    cb = SinkStrengthCallback(tiny_tokenizer, SETTINGS, output_dir=tmp_path)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    with pytest.warns(SinkWarning, match="not attached to a trainer"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert cb.records[0]["sink_strength"] == pytest.approx(want, abs=1e-5)
    assert model.training and {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert any(grads.values()) and not all(grads.values())  # the adapter's weights trainable, the base frozen


def test_adaption_prompts_and_virtual_tokens_in_margin_are_one_line(
    base_and_adapter, virtual_adapters, tmp_path, user_error
):
    """An adaption prompt is refused the same way by `strength`, the lm-eval task's check and the callback
    (before anything is loaded where it is a folder); `margin` refuses virtual tokens (keys the other lacks)."""
    from transformers import AutoModelForCausalLM

    from lm_eval_sink.errors import UserError
    from lm_eval_sink.harness.task import check_capturable
    from lm_eval_sink.training.callback import measure_in_training

    adaption = virtual_adapters["adaption_prompt"]
    line = user_error(["strength", adaption, "--output", tmp_path / "out"], tmp_path / "out")
    assert f"{adaption / 'adapter_config.json'}: an adaption-prompt adapter" in line
    model = _prompt_learning(AutoModelForCausalLM.from_pretrained(base_and_adapter["base"]), "adaption_prompt")
    for check in (check_capturable, lambda m: measure_in_training(m, None, SETTINGS)):
        with pytest.raises(UserError, match="an adaption-prompt adapter") as e:
            check(model)
        assert "\n" not in str(e.value)
    line = user_error(
        ["margin", base_and_adapter["base"], virtual_adapters["prefix_tuning"], "--output", tmp_path / "m"],
        tmp_path / "m",
    )
    assert "a PREFIX_TUNING adapter puts 2 virtual tokens before every prompt" in line


def test_protect_plan_on_a_prompt_learning_adapter_is_one_line(
    base_and_adapter, virtual_adapters, tmp_path, user_error
):
    """`protect-plan` refuses a prompt-tuning or prefix-tuning folder before it loads anything (it would capture the
    base without the virtual tokens and plan for a position 0 that the adapter makes virtual), and the core refuses
    such a peft model the same way."""
    from transformers import AutoModelForCausalLM

    from lm_eval_sink.errors import UserError
    from lm_eval_sink.training.protection import select_sink_heads

    for method, n in (("prompt_tuning", N_VIRTUAL), ("prefix_tuning", N_VIRTUAL)):
        plan = tmp_path / f"{method}.json"
        line = user_error(["protect-plan", virtual_adapters[method], "-o", plan], plan)
        assert f"a {method.upper()} adapter puts {n} virtual tokens before every prompt" in line
        assert "position 0 is a virtual token" in line and "protect-plan BASE" in line
    model = _prompt_learning(AutoModelForCausalLM.from_pretrained(base_and_adapter["base"]), "prompt_tuning")
    with pytest.raises(UserError, match="a PROMPT_TUNING adapter puts 2 virtual tokens") as e:
        select_sink_heads(model, None, SETTINGS, progress=False)
    assert "\n" not in str(e.value)
