"""VLM backbone extraction and injection (lm_eval_sink.extract) on tiny real VLMs: every shipped family is built
tiny from its transformers config (several sharded), extracted, reloaded with AutoModelForCausalLM and compared with
the VLM's own forward on a text probe, then injected back and compared tensor by tensor with the original.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lm_eval_sink.cli import main
from lm_eval_sink.extract import (
    FAILED_FILE,
    REPORT_FILE,
    extract_backbone,
    inject_backbone,
    load_families,
    parse_family,
)
from lm_eval_sink.errors import UserError
from lm_eval_sink.outputs import COMPLETE

from helpers import CHILD_ENV, REPO, make_tokenizer

TASK_DIR = REPO / "tests" / "data" / "extract_task"
TEXT_VOCAB = 128  # text vocabulary of every tiny VLM; the tiny tokenizer uses ids < 96
IMAGE_IDS = dict(image_token_id=120, video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)


def _text(**kw):
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TEXT_VOCAB,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return base


_IDEFICS_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
_CLIP = dict(model_type="clip_vision_model", **_IDEFICS_VISION)
_SIGLIP = dict(model_type="siglip_vision_model", **_IDEFICS_VISION)
_QWEN3_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=32,
    deepstack_visual_indexes=[0],
    num_position_embeddings=16,
)
_MOLMO2_VISION = {
    **_IDEFICS_VISION,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "image_size": [28, 28],
}
_MOLMO2_ADAPTER = dict(
    vision_feature_layer=[-1],
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    text_hidden_size=32,
)
_MOLMO2_IDS = dict(
    image_start_token_id=128,
    low_res_image_start_token_id=129,
    image_end_token_id=130,
    image_patch_id=131,
    frame_start_token_id=132,
    frame_end_token_id=133,
)


def _configs():
    """family name -> a tiny VLM config (head_dim differs from hidden/heads where a family allows it)."""
    import transformers as T

    mrope8 = {"rope_type": "default", "mrope_section": [2, 1, 1], "type": "mrope"}
    mrope16 = {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    idefics = dict(
        text_config=dict(model_type="llama", **_text()),
        vision_config=_IDEFICS_VISION,
        image_token_id=120,
        scale_factor=1,
    )
    return {
        "qwen2_vl": lambda: T.Qwen2VLConfig(
            text_config=_text(rope_scaling=mrope8),
            vision_config=dict(
                depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2
            ),
            **IMAGE_IDS,
        ),
        "qwen2_5_vl": lambda: T.Qwen2_5_VLConfig(
            text_config=_text(rope_scaling=mrope8),
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
                window_size=28,
            ),
            **IMAGE_IDS,
        ),
        "qwen3_vl": lambda: T.Qwen3VLConfig(
            text_config=_text(head_dim=16, rope_scaling=mrope16), vision_config=_QWEN3_VISION, **IMAGE_IDS
        ),
        "qwen3_vl_moe": lambda: T.Qwen3VLMoeConfig(
            text_config=_text(
                head_dim=16,
                moe_intermediate_size=24,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                rope_scaling=mrope16,
            ),
            vision_config=_QWEN3_VISION,
            **IMAGE_IDS,
        ),
        "llava": lambda: T.LlavaConfig(
            text_config=dict(model_type="llama", **_text()), vision_config=_CLIP, image_token_index=120
        ),
        "llava_next": lambda: T.LlavaNextConfig(
            text_config=dict(model_type="mistral", **_text()),
            vision_config=_CLIP,
            image_token_index=120,
            image_grid_pinpoints=[[28, 28]],
        ),
        "llava_onevision": lambda: T.LlavaOnevisionConfig(
            text_config=dict(model_type="qwen2", **_text()),
            vision_config=_SIGLIP,
            image_token_index=120,
            video_token_index=121,
            image_grid_pinpoints=[[28, 28]],
        ),
        "internvl": lambda: T.InternVLConfig(
            text_config=dict(model_type="qwen2", **_text()),
            vision_config={**_IDEFICS_VISION, "image_size": [28, 28], "patch_size": [14, 14]},
            image_token_id=120,
        ),
        "idefics3": lambda: T.Idefics3Config(**idefics),
        "smolvlm": lambda: T.SmolVLMConfig(**idefics),  # Idefics3's layout
        "gemma3": lambda: T.Gemma3Config(
            text_config=dict(model_type="gemma3_text", head_dim=16, sliding_window=8, **_text()),
            vision_config=_SIGLIP,
            mm_tokens_per_image=4,
            image_token_index=120,
            boi_token_index=121,
            eoi_token_index=122,
        ),
        "molmo2": lambda: T.Molmo2Config(
            text_config=dict(head_dim=16, additional_vocab_size=8, qk_norm_type="qwen3", **_text()),
            vision_config=_MOLMO2_VISION,
            adapter_config=_MOLMO2_ADAPTER,
            **_MOLMO2_IDS,
        ),
        "molmo2_olmo": lambda: T.Molmo2Config(
            text_config=dict(head_dim=8, additional_vocab_size=8, qk_norm_type="olmo", norm_after=True, **_text()),
            vision_config=_MOLMO2_VISION,
            adapter_config=_MOLMO2_ADAPTER,
            **_MOLMO2_IDS,
        ),
    }


# Target class per built model; the families saved sharded exercise cross-shard streaming.
EXPECTED_TARGET = {
    "qwen2_vl": "Qwen2ForCausalLM",
    "qwen2_5_vl": "Qwen2ForCausalLM",
    "qwen3_vl": "Qwen3ForCausalLM",
    "qwen3_vl_moe": "Qwen3MoeForCausalLM",
    "llava": "LlamaForCausalLM",
    "llava_next": "MistralForCausalLM",
    "llava_onevision": "Qwen2ForCausalLM",
    "internvl": "Qwen2ForCausalLM",
    "idefics3": "LlamaForCausalLM",
    "smolvlm": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "molmo2": "Qwen3ForCausalLM",
    "molmo2_olmo": "Olmo2ForCausalLM",
}
SHARDED = {"qwen2_vl", "qwen3_vl_moe", "llava_onevision", "internvl", "gemma3", "molmo2", "smolvlm"}


def _save_vlm(name: str, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(_configs()[name]()).to(dtype)
    model.save_pretrained(folder, max_shard_size="40KB" if name in SHARDED else "50GB")
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny matrices: one thread avoids OpenMP spin contention on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """Build (once per session) and return the saved tiny VLM of a family."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = _save_vlm(name, tmp_path_factory.mktemp(f"vlm_{name}"))
        return built[name]

    return get


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _probe(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (2, 12), generator=g)  # text ids only: image ids are >= 120


def _logits(folder: Path, ids: torch.Tensor, model_class: str = "AutoModelForCausalLM") -> torch.Tensor:
    """float32 logits of `ids` through the model in `folder`, loaded with the transformers class named."""
    import transformers

    model = getattr(transformers, model_class).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# ----------------------------------------------------------------------------------------------
# Architecture data
# ----------------------------------------------------------------------------------------------


def test_every_shipped_family_is_tested_and_names_real_transformers_classes():
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    families = load_families()
    built_families = {n.split("_olmo")[0] for n in EXPECTED_TARGET}
    assert set(families) == built_families
    for fam in families.values():
        assert all(mt in CONFIG_MAPPING_NAMES for mt in fam.model_types), fam.name
        assert hasattr(transformers, fam.vlm_class), fam.vlm_class
        assert fam.file == f"architectures/{fam.name}.json"


def test_architecture_file_with_a_typo_is_rejected_naming_the_key():
    text = (REPO / "lm_eval_sink" / "architectures" / "qwen2_vl.json").read_text()
    bad = text.replace('"ignore"', '"ignroe"')
    with pytest.raises(UserError, match="ignroe"):
        parse_family(bad, "architectures/qwen2_vl.json")
    bad_template = text.replace('"to": "model.{rest}"', '"to": "model.{layer}"', 1)
    with pytest.raises(UserError, match="layer"):
        parse_family(bad_template, "architectures/qwen2_vl.json")


# ----------------------------------------------------------------------------------------------
# Every family: extract, reload, compare logits, inject back exactly
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_TARGET))
def test_extract_reload_compare_and_inject_back(name, vlm_dir, tmp_path):
    src = vlm_dir(name)
    out = tmp_path / "backbone"
    report = extract_backbone(src, out)
    assert report.status == "complete", report.verification
    assert report.target_class == EXPECTED_TARGET[name]
    assert report.verification.max_abs_diff <= 1e-5
    assert (out / COMPLETE).is_file() and not (out / FAILED_FILE).exists()
    assert json.loads((out / REPORT_FILE).read_text())["provenance"]["versions"]["transformers"]
    assert json.loads((out / "config.json").read_text())["architectures"] == [EXPECTED_TARGET[name]]
    if name in SHARDED:
        assert len(list(src.glob("*.safetensors"))) > 1

    # An independent check with another probe, the default attention and a batch of two.
    from transformers import AutoTokenizer

    fam = load_families()[report.family]
    ids = _probe()
    diff = (_logits(src, ids, fam.vlm_class) - _logits(out, ids)).abs().max().item()
    assert diff <= 1e-5
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == make_tokenizer().chat_template
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()

    # Extract then inject gives back the VLM's tensors exactly, in the same shard files.
    back = tmp_path / "vlm_again"
    rep2 = inject_backbone(out, src, back, verify=False)  # exact tensor equality is the stronger check here
    assert rep2.status == "unverified"
    original, again = _tensors(src), _tensors(back)
    assert original.keys() == again.keys()
    for key, value in original.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key
    assert sorted(p.name for p in back.glob("*.safetensors")) == sorted(p.name for p in src.glob("*.safetensors"))


def test_qwen2_vl_in_memory_layout_extracts_to_the_same_tensors(vlm_dir, tmp_path):
    """Qwen2-VL saves the legacy layout (model.layers.*); checkpoints in the transformers 5
    in-memory layout (model.language_model.*, model.visual.*) must give the same backbone."""
    src = vlm_dir("qwen2_vl")
    assert "model.layers.0.mlp.up_proj.weight" in _tensors(src)
    renamed = tmp_path / "renamed"
    shutil.copytree(src, renamed)

    def new_name(k: str) -> str:
        if k.startswith("model."):
            return "model.language_model." + k.removeprefix("model.")
        return "model." + k if k.startswith("visual.") else k

    for f in renamed.glob("*.safetensors"):
        save_file({new_name(k): v for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    index = json.loads((renamed / "model.safetensors.index.json").read_text())
    index["weight_map"] = {new_name(k): v for k, v in index["weight_map"].items()}
    (renamed / "model.safetensors.index.json").write_text(json.dumps(index))
    a = extract_backbone(src, tmp_path / "a", verify=False)
    b = extract_backbone(renamed, tmp_path / "b")
    assert a.status == "unverified" and b.status == "complete"
    ta, tb = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_qwen3_vl_moe_hub_layout_with_transposed_experts(vlm_dir, tmp_path):
    """Released Qwen3-VL-MoE checkpoints store experts as [E, hidden, 2*inter] and [E, inter,
    hidden]; transformers saves [E, 2*inter, hidden] / [E, hidden, inter]. Both give the same
    per-expert Qwen3-MoE backbone, and inject restores each layout as stored."""
    src = vlm_dir("qwen3_vl_moe")
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    experts = ("experts.gate_up_proj", "experts.down_proj")
    for f in hub.glob("*.safetensors"):
        sd = load_file(f)
        if any(k.endswith(experts) for k in sd):
            sd = {k: v.transpose(1, 2).contiguous() if k.endswith(experts) else v for k, v in sd.items()}
            save_file(sd, f, metadata={"format": "pt"})
    shapes = {k: tuple(v.shape) for k, v in _tensors(hub).items() if "layers.0.mlp.experts" in k}
    assert shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (4, 32, 48)
    extract_backbone(src, tmp_path / "a", verify=False)
    b = extract_backbone(hub, tmp_path / "b")
    assert b.status == "complete"
    ta, tb = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in tb
    assert tb["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (24, 32)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    back = inject_backbone(tmp_path / "b", hub, tmp_path / "hub_again")
    assert back.status == "complete"
    original, again = _tensors(hub), _tensors(tmp_path / "hub_again")
    assert all(torch.equal(original[k], again[k]) for k in original)


def test_dtype_keep_bf16_fp32(tmp_path):
    src = _save_vlm("qwen3_vl", tmp_path / "vlm_bf16", dtype=torch.bfloat16)
    kept = extract_backbone(src, tmp_path / "keep")
    assert kept.dtype == "bfloat16" and kept.status == "complete"
    assert {v.dtype for v in _tensors(tmp_path / "keep").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "keep" / "config.json").read_text())["dtype"] == "bfloat16"
    up = extract_backbone(src, tmp_path / "fp32", dtype="fp32")
    assert up.status == "complete" and up.verification.max_abs_diff <= 1e-5
    assert {v.dtype for v in _tensors(tmp_path / "fp32").values()} == {torch.float32}
    down = extract_backbone(_save_vlm("llava", tmp_path / "vlm_fp32"), tmp_path / "bf16", dtype="bf16")
    assert down.status == "complete" and down.verification.dtype == "bfloat16"
    assert {v.dtype for v in _tensors(tmp_path / "bf16").values()} == {torch.bfloat16}


def test_output_sharding_and_processor_chat_template(vlm_dir, tmp_path):
    src = tmp_path / "vlm"
    shutil.copytree(vlm_dir("llava_onevision"), src)
    tok = make_tokenizer()
    template = tok.chat_template
    tok.chat_template = None
    for f in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
        (src / f).unlink(missing_ok=True)
    tok.save_pretrained(src)
    (src / "chat_template.jinja").unlink(missing_ok=True)
    (src / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    report = extract_backbone(src, tmp_path / "out", max_shard_bytes=20_000)
    assert report.status == "complete"
    assert report.chat_template_source == "processor (chat_template.json)"
    assert len(report.shards) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    from transformers import AutoTokenizer

    out_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert out_tok.chat_template == template
    assert "<|assistant|>" in out_tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )


# ----------------------------------------------------------------------------------------------
# Verification is a real guard; failures keep the output, marked failed
# ----------------------------------------------------------------------------------------------


def test_mis_mapped_tensors_fail_verification_and_are_marked_failed(vlm_dir, tmp_path):
    text = (REPO / "lm_eval_sink" / "architectures" / "qwen2_vl.json").read_text()
    rules = json.loads(text)
    swap = [  # gate_proj and up_proj have the same shape: only the logits can tell
        {"from": r"model\.layers\.(?P<l>\d+)\.mlp\.gate_proj\.weight", "to": "model.layers.{l}.mlp.up_proj.weight"},
        {"from": r"model\.layers\.(?P<l>\d+)\.mlp\.up_proj\.weight", "to": "model.layers.{l}.mlp.gate_proj.weight"},
    ]
    rules["rules"] = swap + rules["rules"]
    family = parse_family(json.dumps(rules), "architectures/qwen2_vl.json")
    out = tmp_path / "bad"
    report = extract_backbone(vlm_dir("qwen2_vl"), out, family=family)
    assert report.status == "failed" and not report.ok
    assert report.verification.max_abs_diff > 1e-3
    assert (out / FAILED_FILE).is_file() and not (out / COMPLETE).exists()
    assert json.loads((out / REPORT_FILE).read_text())["status"] == "failed"


def test_cli_failed_verification_exits_nonzero_and_keeps_the_output(vlm_dir, tmp_path, user_error):
    src = tmp_path / "vlm_nan"
    shutil.copytree(vlm_dir("qwen2_vl"), src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"]["model.norm.weight"]
    sd = load_file(shard)
    sd["model.norm.weight"] = torch.full_like(sd["model.norm.weight"], float("nan"))
    save_file(sd, shard, metadata={"format": "pt"})
    out = tmp_path / "out"
    assert "verification failed" in user_error(["extract", src, out, "--quiet"])
    assert (out / FAILED_FILE).is_file() and not (out / COMPLETE).exists()


# ----------------------------------------------------------------------------------------------
# Bad input: one error line, exit 2, nothing written
# ----------------------------------------------------------------------------------------------


def test_bad_input_is_one_line_and_writes_nothing(vlm_dir, tmp_path, user_error, monkeypatch):
    """An unsupported architecture (the supported ones listed), a folder without weights, a missing folder, a hub id
    offline, a text-only model, a bad dtype, and for inject a backbone of another size or not a backbone."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    unsupported, no_weights, text_only, wrong = (tmp_path / n for n in ("paligemma", "noweights", "qwen2", "wrong"))
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "paligemma", "text_config": {}}))
    save_file({"x": torch.zeros(1)}, unsupported / "model.safetensors")
    no_weights.mkdir()
    shutil.copy(vlm_dir("qwen2_vl") / "config.json", no_weights / "config.json")
    Qwen2ForCausalLM(Qwen2Config(**_text())).save_pretrained(text_only)
    Qwen2ForCausalLM(Qwen2Config(**_text(vocab_size=160))).save_pretrained(wrong)
    qwen2_vl, out = vlm_dir("qwen2_vl"), tmp_path / "out"
    for argv, needles in [
        (["extract", unsupported, out], ("'paligemma'", "qwen2_vl", "molmo2")),
        (["extract", no_weights, out], ("no weights",)),
        (["extract", tmp_path / "missing", out], ("no such VLM folder",)),
        (["extract", "Qwen/Qwen2-VL-2B-Instruct", out], ("hub is offline",)),
        (["extract", text_only, out], ("text-only causal LM",)),
        (["extract", qwen2_vl, out, "--dtype", "fp8"], ("fp8",)),
        (["inject", wrong, qwen2_vl, out], ("model.embed_tokens.weight has shape [160, 32]",)),
        (["inject", qwen2_vl, qwen2_vl, out], ("does not match the VLM's language model",)),
    ]:
        line = user_error([*argv, "--quiet"], out)
        assert all(n in line for n in needles), line
        assert not list(tmp_path.glob("out.partial-*"))


def test_existing_output_without_force_is_left_alone(vlm_dir, tmp_path, user_error, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier result")
    assert "already exists" in user_error(["extract", vlm_dir("llava"), out, "--quiet"])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not list(tmp_path.glob("out.partial-*"))
    assert main(["extract", str(vlm_dir("llava")), str(out), "--force", "--no-verify", "--quiet"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert not (out / "keep.txt").exists()
    marker = json.loads((out / COMPLETE).read_text())
    assert marker["verified"] is False
    assert {"lm_eval_sink/extract/rules.py", "lm_eval_sink/architectures/llava.json"} <= set(
        marker["code_versions"]["code"]
    )


# ----------------------------------------------------------------------------------------------
# The extracted folder works with the real lm-eval and mergekit; a merge goes back into the VLM
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_extracted_backbone_evaluates_with_lm_eval(vlm_dir, tmp_path):
    out = tmp_path / "backbone"
    assert extract_backbone(vlm_dir("qwen3_vl"), out).status == "complete"
    lm_eval = Path(sys.executable).parent / "lm_eval"
    results = tmp_path / "results"
    cmd = [
        str(lm_eval),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={out},dtype=float32",
        "--tasks",
        "extract_tiny_choice",
        "--include_path",
        str(TASK_DIR),
        "--device",
        "cpu",
        "--limit",
        "2",
        "--batch_size",
        "1",
        "--output_path",
        str(results),
    ]
    proc = subprocess.run(
        cmd, cwd=TASK_DIR, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = list(results.rglob("results_*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert 0.0 <= data["results"]["extract_tiny_choice"]["acc,none"] <= 1.0
    assert data["config"]["model_args"]["pretrained"] == str(out)


def test_merge_with_mergekit_then_inject_into_the_vlm(vlm_dir, tmp_path):
    import yaml
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge
    from transformers import AutoConfig, AutoModelForCausalLM

    src = vlm_dir("qwen2_vl")
    backbone = tmp_path / "backbone"
    assert extract_backbone(src, backbone).status == "complete"
    text_llm = tmp_path / "text_llm"  # a matching text LLM: same config, other weights
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(backbone)).save_pretrained(text_llm)
    make_tokenizer().save_pretrained(text_llm)
    config_text = yaml.safe_dump(
        {
            "merge_method": "linear",
            "dtype": "float32",
            "models": [
                {"model": str(backbone), "parameters": {"weight": 0.5}},
                {"model": str(text_llm), "parameters": {"weight": 0.5}},
            ],
        }
    )
    merged = tmp_path / "merged"
    run_merge(
        MergeConfiguration.model_validate(yaml.safe_load(config_text)),
        str(merged),
        options=MergeOptions(copy_tokenizer=True, quiet=True),
        config_source=config_text,
    )
    a, b, m = _tensors(backbone), _tensors(text_llm), _tensors(merged)
    key = "model.layers.1.self_attn.q_proj.weight"
    assert torch.allclose(m[key], 0.5 * a[key] + 0.5 * b[key], atol=1e-6)
    assert not torch.equal(m[key], a[key])

    vlm_merged = tmp_path / "vlm_merged"
    report = inject_backbone(merged, src, vlm_merged)
    assert report.status == "complete" and report.verification.max_abs_diff <= 1e-5
    original, new = _tensors(src), _tensors(vlm_merged)
    assert all(torch.equal(original[k], new[k]) for k in original if k.startswith("visual."))
    assert torch.allclose(new[key], m[key])
    ids = _probe(2)
    diff = (_logits(vlm_merged, ids, "Qwen2VLForConditionalGeneration") - _logits(merged, ids)).abs().max().item()
    assert diff <= 1e-5
