"""`lm-eval-sink strength` and the foundation contracts: outputs, --force, resume, bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import sinkmodels as sm
from lm_eval_sink.calibration import builtin_prompts, encode_prompts
from lm_eval_sink.cli import main
from lm_eval_sink.identity import FINGERPRINT_RULE


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_tokenizer):
    """Two hand-set models on disk (llama, olmo2) with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for fam in ("llama", "olmo2"):
        d = root / fam
        sm.build(fam, n_layers=3, bos_id=tiny_tokenizer.bos_token_id).save_pretrained(d)
        tiny_tokenizer.save_pretrained(d)
        out[fam] = d
    return out


def _run(capsys, *args):
    capsys.readouterr()  # drop what fixtures printed
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_strength_cli_writes_s_provenance_and_ranking(tiny_models, tiny_tokenizer, tmp_path, capsys, user_error):
    """(Each model's heatmap and the ranking files: test_first_hour.py's README quick start 2.)"""
    out = tmp_path / "out"
    models = (tiny_models["llama"], tiny_models["olmo2"])
    assert _run(capsys, "strength", *models, "--last-k", "2", "--output", out, "--quiet")[0] == 0
    data = json.loads((out / "llama.strength.json").read_text())
    lengths = [len(x) for x in encode_prompts(tiny_tokenizer, builtin_prompts()).input_ids]
    want, _ = sm.expected_strength("llama", 3, lengths, last_k=2)
    assert data["sink_strength"] == pytest.approx(want, abs=1e-5)
    prov = data["provenance"]
    for key in ("versions", "model", "settings", "prompt_set", "protocol", "seed", "input_key"):
        assert key in prov
    assert prov["model"]["fingerprint"].startswith("sha256:") and prov["model"]["fingerprint_rule"] == FINGERPRINT_RULE
    assert prov["protocol"]["chat_template_applied"] is True and prov["protocol"]["chat_template_sha256"]
    assert set(prov["versions"]) >= {"lm_eval", "transformers", "torch", "mergekit"}
    ranking = (out / "ranking.csv").read_text().splitlines()
    assert ranking[0].startswith("rank,model,sink_strength") and len(ranking) == 3
    assert not list(out.glob(".*tmp*"))  # atomic writes leave no temp files
    before = (out / "llama.strength.json").read_text()  # other settings need --force
    line = user_error(["strength", tiny_models["llama"], "--last-k", "3", "--output", out, "--quiet"])
    assert re.search("already exists with other inputs.*--force", line)
    assert (out / "llama.strength.json").read_text() == before
    rc, _, _ = _run(capsys, "strength", tiny_models["llama"], "--last-k", "3", "--output", out, "--quiet", "--force")
    assert rc == 0 and json.loads((out / "llama.strength.json").read_text())["last_k"] == 3


def test_batching_and_device_are_in_no_key_and_another_version_or_key_rule_recomputes(
    tiny_models, tmp_path, capsys, monkeypatch
):
    """S does not depend on --batch-size, --batch-tokens, --query-chunk or --device: a result made one prompt at a
    time on the CPU is reused by the default run (all prompts in one forward), which, forced, gives the same S. One
    made with another torch, or keyed before keys were derived from the work's values (no `key rule` in its versions,
    or none at all), is recomputed saying why, not refused (other code on the S path: test_code_key.py; other
    settings are refused: the first test)."""
    from helpers import set_package_version

    out, model = tmp_path / "out", tiny_models["llama"]
    path, args = out / "llama.strength.json", ("strength", model, "--last-k", "2", "--output", out, "--quiet")
    assert _run(capsys, *args, "--batch-size", "1", "--query-chunk", "4", "--device", "cpu")[0] == 0
    text = path.read_text()
    first = json.loads(text)
    assert first["provenance"]["settings"]["batch_size"] == 1  # recorded, not keyed
    assert set(first["provenance"]["key_versions"]) == {"key rule", "code", "torch", "transformers", "peft"}
    assert "vllm" in first["provenance"]["versions"]  # recorded (None when not installed), not keyed here
    for extra in ((), ("--batch-tokens", "64"), ("--batch-size", "3", "--query-chunk", "1000")):
        rc, stdout, _ = _run(capsys, *args, *extra)
        assert rc == 0 and "llama: reused" in stdout and "recomputed" not in stdout
    assert path.read_text() == text
    assert _run(capsys, *args, "--force")[0] == 0
    again = json.loads(path.read_text())
    assert again["provenance"]["settings"]["batch_size"] is None
    assert again["sink_strength"] == pytest.approx(first["sink_strength"], abs=1e-5)

    torch_version = set_package_version(monkeypatch, "torch", "99.0")
    rc, stdout, _ = _run(capsys, *args)
    assert rc == 0 and f"llama: recomputed: torch {torch_version} -> 99.0" in stdout
    assert json.loads(path.read_text())["provenance"]["key_versions"]["torch"] == "99.0"
    assert "reused" in _run(capsys, *args)[1]
    data = json.loads(path.read_text())
    for old in ({"torch": "2.9.0"}, None):
        data["provenance"].update(key_versions=old, input_key="0" * 64)  # keyed otherwise: another key
        path.write_text(json.dumps(data))
        rc, stdout, _ = _run(capsys, *args)
        assert (
            rc == 0 and "llama: recomputed: made before results were keyed by the values their work receives" in stdout
        )


def test_prompt_files_text_and_jsonl(tiny_models, tmp_path, capsys):
    txt = tmp_path / "p.txt"
    txt.write_text("Write two words.\nList three colors.\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "Write two words."}\n{"prompt": "List three colors."}\n')
    vals = []
    for f in (txt, jsonl):
        out = tmp_path / f.suffix.strip(".")
        rc, _, _ = _run(capsys, "strength", tiny_models["llama"], "--prompts", f, "--output", out, "--quiet")
        assert rc == 0
        d = json.loads((out / "llama.strength.json").read_text())
        assert d["n_prompts"] == 2
        vals.append(d["sink_strength"])
    assert vals[0] == vals[1]


def _save_bloom(d: Path, llama: Path) -> None:
    """A model whose attention does not go through transformers' AttentionInterface, with llama's tokenizer."""
    from transformers import BloomConfig, BloomForCausalLM

    BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=16, n_layer=1, n_head=2)).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama / name, d / name)


@pytest.mark.parametrize(
    ("model", "extra", "pattern"),
    [
        ("empty", [], "not a model folder.*config.json"),
        ("bloom", [], "BloomForCausalLM.*AttentionInterface"),
        ("gguf", [], r"\(fix: pass the GGUF file itself: .*/gguf/model\.Q4\.gguf\)$"),  # a folder holding only one
        ("llama", ["--prompts", "e.txt"], "empty"),
        ("llama", ["--prompts", "m.jsonl"], r"m.jsonl:2: not valid JSON"),
        ("llama", ["--last-k", "0"], "last-k must be positive"),
        ("llama", ["--output", "a_file"], "is a file"),
        ("llama", ["--n-prompts", "7"], "n-prompts 7"),
        ("llama", ["--limit", "0"], "this command takes --n-prompts"),
        ("llama", ["--batch-tokens", "0"], "batch-tokens must be positive"),
    ],
)
def test_bad_input_one_line_exit_2(model, extra, pattern, tiny_models, tmp_path, user_error):
    (tmp_path / "empty").mkdir()
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "model.Q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "e.txt").write_text("\n\n")
    (tmp_path / "m.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    (tmp_path / "a_file").write_text("x")
    if model == "bloom":
        _save_bloom(tmp_path / "bloom", tiny_models["llama"])
    path = tiny_models["llama"] if model == "llama" else tmp_path / model
    extra = [tmp_path / a if a in ("e.txt", "m.jsonl", "a_file") else a for a in extra]
    argv = ["strength", path, "--output", tmp_path / "out", "--quiet", *extra]
    assert re.search(pattern, user_error(argv, tmp_path / "out"))


def test_models_default_prints_converted_folder(default_model, capsys):
    rc, out, _ = _run(capsys, "models", "default")
    assert rc == 0
    folder = Path(out.strip())
    assert folder == default_model and (folder / "config.json").is_file() and (folder / "COMPLETE.json").is_file()


def test_calibration_prompts_share_no_8gram_with_ifeval(shared_data):
    def grams(text):
        words = re.findall(r"\w+", text.lower())
        return {tuple(words[i : i + 8]) for i in range(len(words) - 7)}

    ifeval = set()
    lines = (shared_data / "ifeval" / "input_data.jsonl").read_text().splitlines()
    assert len(lines) == 541
    for line in lines:
        ifeval |= grams(json.loads(line)["prompt"])
    prompts = builtin_prompts()
    assert len(prompts) == 15
    for p in prompts:
        assert not grams(p) & ifeval, p


def test_one_bos_and_positions_from_first_real_token(default_model, tiny_tokenizer):
    from transformers import AutoTokenizer

    enc = encode_prompts(tiny_tokenizer, builtin_prompts()[:3])
    for ids in enc.input_ids:
        assert ids.count(tiny_tokenizer.bos_token_id) == 1 and ids[0] == tiny_tokenizer.bos_token_id
    real = AutoTokenizer.from_pretrained(default_model)
    enc = encode_prompts(real, builtin_prompts()[:3])
    direct = real.apply_chat_template(
        [{"role": "user", "content": builtin_prompts()[0]}], tokenize=True, add_generation_prompt=True
    )
    direct = direct["input_ids"] if isinstance(direct, dict) or hasattr(direct, "keys") else direct
    assert list(enc.input_ids[0]) == list(direct)
    assert enc.chat_template_applied and sum(enc.content_mask[0]) > 0
