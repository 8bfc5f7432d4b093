"""Screening: QK-norm class detection on real configs/weights, `screen` on hand-set tiny models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from helpers import make_tokenizer, save_sink_llama

from lm_eval_sink.cli import main
from lm_eval_sink.commands.fit import read_pairs
from lm_eval_sink.commands.screen import detect_qk_norm
from lm_eval_sink.errors import UserError
from lm_eval_sink.predict import fit_pairs
from lm_eval_sink.screen import classify_qk_norm

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
}


@pytest.mark.parametrize(
    ("config_name", "model_name", "expected"),
    [
        ("LlamaConfig", "LlamaForCausalLM", "none"),
        ("Qwen3Config", "Qwen3ForCausalLM", "per_head"),
        ("Olmo2Config", "Olmo2ForCausalLM", "layerwise"),
    ],
)
def test_qk_norm_class_of_tiny_llama_qwen3_olmo2(tmp_path, config_name, model_name, expected):
    import torch
    import transformers

    torch.manual_seed(0)
    folder = tmp_path / "m"
    getattr(transformers, model_name)(getattr(transformers, config_name)(**TINY)).save_pretrained(folder)
    found = detect_qk_norm(str(folder))
    assert found.qk_norm == expected and found.source == "table"
    # the table agrees with the real module: the same checkpoint, its model type hidden, is
    # classified from the size of layer 0's q-norm weight in the safetensors header
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "not_in_the_table"
    (folder / "config.json").write_text(json.dumps(config))
    from_weights = detect_qk_norm(str(folder))
    assert from_weights.qk_norm == expected and from_weights.source.startswith("weights")


def test_qk_norm_switches_and_composite_configs(tmp_path):
    from transformers import CohereConfig, Qwen3VLConfig

    assert classify_qk_norm(CohereConfig(use_qk_norm=True).to_dict()).qk_norm == "per_head"
    off = classify_qk_norm(CohereConfig(use_qk_norm=False).to_dict())
    assert off.qk_norm == "none" and off.source == "table (use_qk_norm = false)"
    vl = classify_qk_norm(Qwen3VLConfig().to_dict())  # a VLM: its text_config decides
    assert vl.qk_norm == "per_head" and vl.model_type == "qwen3_vl_text"
    assert classify_qk_norm({"model_type": "molmo2_text", "qk_norm_type": "olmo"}).qk_norm == "layerwise"
    assert classify_qk_norm({"model_type": "molmo2_text", "qk_norm_type": "qwen3"}).qk_norm == "per_head"
    with pytest.raises(UserError, match="'mystery' is not in"):
        classify_qk_norm({"model_type": "mystery"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery"}))
    with pytest.raises(UserError, match="could not be inspected"):
        detect_qk_norm(str(tmp_path))


# ---------------------------------------------------------------------------- screen


@pytest.fixture(scope="module")
def screen_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("screen_models")
    tok = make_tokenizer()
    strong = save_sink_llama(base / "strong", [[5.0, 5.0], [5.0, 5.0]], tok)
    weak = save_sink_llama(base / "weak", [[2.5, 2.5], [2.5, 2.5]], tok)
    return strong, weak, tok


def _expected_s(c: float, tok) -> float:
    from lm_eval_sink.calibration import builtin_prompts, encode_prompts

    enc = encode_prompts(tok, builtin_prompts())
    t = np.concatenate([np.arange(1, len(ids)) for ids in enc.input_ids])
    return float(np.median(c - np.log(t)))


def test_screen_ranks_predicts_with_the_paper_line_on_request_and_warns(screen_models, tmp_path, capsys, monkeypatch):
    from helpers import change_code

    strong, weak, tok = screen_models
    out = tmp_path / "screen"
    assert main(["screen", str(weak), str(strong), "--paper-line", "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "screen.json").read_text())
    fit = fit_pairs(read_pairs()).tasks["ifeval"]
    models = data["models"]
    assert [m["slug"] for m in models] == ["strong", "weak"] and [m["rank"] for m in models] == [1, 2]
    assert {m["setting"] for m in models} == {"A"} and data["comparison"]["comparable"]
    for m, c in zip(models, (5.0, 2.5), strict=True):
        s = _expected_s(c, tok)
        assert m["sink_strength"] == pytest.approx(s, abs=1e-4)
        assert m["qk_norm"] == "none" and m["last_k"] == 2 and m["n_layers"] == 2 and m["k_share"] == 1.0
        pred = m["predictions"]["ifeval"]
        assert pred["predicted_delta"] == pytest.approx(fit.slope * s + fit.intercept, abs=1e-3)
        assert pred["interval"] == pytest.approx(list(fit.prediction_interval(s)), abs=1e-3)
        assert pred["same_setting"] is False and "paper's own prompts" in pred["caveat"]
        assert pred["outside_fitted_range"] == (not fit.s_min <= s <= fit.s_max)
        assert (out / "strength" / f"{m['slug']}.strength.json").is_file()
    assert models[0]["predictions"]["ifeval"]["outside_fitted_range"]
    assert "outside the fitted range" in models[0]["warnings"][0]
    assert not models[1]["predictions"]["ifeval"]["outside_fitted_range"] and models[1]["warnings"] == []
    # the caveat beside each number, never a bare "delta +- error"
    rows = [line for line in printed.splitlines() if line.startswith("| A |")]
    assert len(rows) == 2 and all("(paper's line, another setting)" in r and "±" not in r for r in rows)
    assert "; outside the fitted range" in rows[0] and "; outside the fitted range" not in rows[1]
    assert "leave-one-pair-out MAE 2.6 points" in printed and "not an interval" in printed
    assert data["predictions_from"] == "paper_line" and data["fits"]["ifeval"]["spearman_rho"] == pytest.approx(
        fit.spearman_rho
    )
    assert "warning: strong: ifeval: S = " in printed
    for name in ("screen.md", "screen.csv", "screen.png"):
        assert (out / name).stat().st_size > 0
    csv_head = (out / "screen.csv").read_text().splitlines()[0]
    assert csv_head.startswith("setting,rank,model,sink_strength") and "ifeval_across_settings" in csv_head
    before = (out / "screen.json").read_bytes()
    assert main(["screen", str(weak), "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: output already exists") and len(err.strip().splitlines()) == 1
    assert "lm_eval_sink/capture.py" in data["provenance"]["key_versions"]["code"]
    change_code(monkeypatch, "lm_eval_sink/capture.py")
    assert main(["screen", str(weak), "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "made by other versions (code changed: lm_eval_sink/capture.py)" in err
    assert len(err.strip().splitlines()) == 1
    assert (out / "screen.json").read_bytes() == before


def _pairs_of_strength_files(tmp_path, tok, capsys, *options) -> tuple:
    """Three reference models measured with `strength` (and `options`) and a PAIRS file naming their strength
    files, with made-up deltas: (the PAIRS file, the pairs' S, their deltas)."""
    refs = [save_sink_llama(tmp_path / f"ref{c}", [[c, c], [c, c]], tok) for c in (2.0, 3.0, 4.5)]
    out = tmp_path / "pairs_strength"
    assert main(["strength", *map(str, refs), "--last-k", "2", "--output", str(out), "--quiet", *options]) == 0
    capsys.readouterr()
    deltas = [-12.0, -7.5, -2.0]
    pairs = [
        {
            "name": f"p{i}",
            "reference": f"ref{i}",
            "candidate": f"vlm{i}",
            "source": "test",
            "sink_strength": f"pairs_strength/{r.name}.strength.json",
            "deltas": {"ifeval": d},
        }
        for i, (r, d) in enumerate(zip(refs, deltas, strict=True))
    ]
    path = tmp_path / "pairs.yaml"
    path.write_text(yaml.safe_dump(pairs))
    s = [json.loads((out / f"{r.name}.strength.json").read_text())["sink_strength"] for r in refs]
    return path, s, deltas


def test_screen_predicts_from_pairs_of_its_own_setting_with_intervals_that_widen(screen_models, tmp_path, capsys):
    from scipy import stats

    strong, weak, tok = screen_models
    pairs, s, d = _pairs_of_strength_files(tmp_path, tok, capsys)
    assert main(["screen", str(weak), str(strong), "--pairs", str(pairs), "--quiet"]) == 0
    printed = capsys.readouterr().out
    cells = {line.split("|")[3].strip(): line.split("|")[7].strip() for line in printed.splitlines() if "| A |" in line}
    # an independent line and interval: scipy's regression, the residual variance, the t quantile with n - 2 df
    reg = stats.linregress(s, d)
    resid = np.array(d) - (reg.slope * np.array(s) + reg.intercept)
    se = math.sqrt((resid**2).sum() / (len(s) - 2))
    sxx = ((np.array(s) - np.mean(s)) ** 2).sum()
    widths = []
    for slug, c in (("strong", 5.0), ("weak", 2.5)):
        x = _expected_s(c, tok)
        half = stats.t.ppf(0.975, len(s) - 2) * se * math.sqrt(1 + 1 / len(s) + (x - np.mean(s)) ** 2 / sxx)
        y = reg.slope * x + reg.intercept
        assert cells[slug].startswith(f"{y:+.1f} [{y - half:+.1f}, {y + half:+.1f}]"), cells[slug]
        assert "another setting" not in cells[slug]  # the pairs were measured like these models
        widths.append((abs(x - np.mean(s)), half))
    assert sorted(widths)[0][1] < sorted(widths)[1][1]  # farther from the pairs' mean S, a wider interval
    assert "note: fit ifeval: 3 pairs measured in one setting" in printed


def test_no_prediction_across_settings_without_the_paper_line(screen_models, tmp_path, capsys, monkeypatch):
    strong, _, tok = screen_models
    other, _, _ = _pairs_of_strength_files(tmp_path, tok, capsys, "--n-prompts", "5")  # other prompts: another setting
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for args in (["--pairs", str(other)], []):
        assert main(["screen", str(strong), *args, "--quiet"]) == 0
        printed = capsys.readouterr().out
        assert "| A | 1 | strong |" in printed and "not saved" in printed and not any((tmp_path / "cwd").iterdir())
        row = next(line for line in printed.splitlines() if "| strong |" in line)
        assert "[" not in row and "±" not in row, row  # no predicted number beside the model
        if args:
            assert "not predicted (see the notes)" in row
            assert (
                "ifeval not predicted for strong: the pairs were measured in another setting: calibration prompts"
                in printed
            )
        else:
            assert "no predicted deltas" in printed and "--paper-line" in printed
    assert main(["screen", str(strong), "--pairs", str(other), "--paper-line", "--quiet"]) == 2
    assert "--pairs and --paper-line" in capsys.readouterr().err


def test_screen_reuses_strength_files_written_elsewhere_in_its_setting_and_refuses_others(
    screen_models, tmp_path, capsys, user_error
):
    """`strength` results passed to `screen` in place of their models are reused when measured in the run's setting
    (said per model, nothing measured again); another setting or --dtype is one line, before anything is written."""
    strong, weak, _ = screen_models
    made = tmp_path / "made"
    assert main(["strength", str(weak), "--output", str(made), "--quiet"]) == 0
    file, out = made / "weak.strength.json", tmp_path / "screen"
    before = file.read_bytes()
    capsys.readouterr()
    assert main(["screen", str(file), str(strong), "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert f"weak: reused {file} (same model content, setting and versions)" in printed
    by_slug = {m["slug"]: m for m in json.loads((out / "screen.json").read_text())["models"]}
    assert by_slug["weak"]["sink_strength"] == json.loads(before)["sink_strength"]
    assert by_slug["weak"]["strength_file"] == str(file) and by_slug["weak"]["path"] == str(weak)
    assert by_slug["weak"]["setting"] == by_slug["strong"]["setting"] == "A"
    assert sorted(p.name for p in (out / "strength").glob("*.strength.json")) == ["strong.strength.json"]
    assert file.read_bytes() == before  # an input, never touched
    line = user_error(["screen", file, "--last-k", "1", "--output", tmp_path / "s2"], tmp_path / "s2")
    assert f"{file}: measured in another setting: last_k 10 (this run: 1)" in line
    line = user_error(["screen", file, "--dtype", "bfloat16", "--output", tmp_path / "s3"], tmp_path / "s3")
    assert "measured in another setting: --dtype auto (this run: bfloat16)" in line
    # made by other code: the file that changed is named (main: both runs' whole code records, 28 hashes, in one line)
    old = json.loads(before)
    old["provenance"]["key_versions"]["code"]["lm_eval_sink/capture.py"] = "0" * 64
    file.write_text(json.dumps(old))
    line = user_error(["screen", file, "--output", tmp_path / "s4"], tmp_path / "s4")
    assert f"{file}: made by other versions (code changed: lm_eval_sink/capture.py)" in line and len(line) < 400


def test_screen_checks_the_pairs_file_before_measuring(screen_models, tmp_path, user_error):
    strong, _, _ = screen_models
    bad = tmp_path / "pairs.yaml"
    bad.write_text(
        "- name: only-one\n  reference: r\n  candidate: c\n  sink_strength: 1.0\n  deltas: {ifeval: -1}\n  source: me\n"
    )
    out = tmp_path / "out"
    assert "1 pair(s); a fit needs at least 3" in user_error(["screen", strong, "--pairs", bad, "--output", out], out)


@pytest.mark.slow
def test_a_gguf_file_is_screened_and_measured_like_its_converted_folder(default_model, tmp_path, capsys, user_error):
    """The default model screened (its S, QK-norm class, predicted IFEval delta) beside the GGUF file it was
    converted from. `screen` and `strength` read a GGUF file with transformers' loader, dequantized to the chosen
    dtype: every head's value and S equal the converted folder's, and the result's provenance names the file's
    quantization. Commands that need a folder refuse it naming `models convert`."""
    from lm_eval_sink.models import _gguf_path

    gguf, out = _gguf_path(), tmp_path / "screen"
    argv = ["--n-prompts", "5", "--dtype", "float32", "--output", out, "--quiet"]
    capsys.readouterr()
    assert main([str(a) for a in ["screen", "default", gguf, *argv]]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| A | 1 |"))  # ties keep the order given
    cells = [c.strip() for c in row.strip("|").split("|")]
    s = float(cells[3])
    assert cells[2] == "SmolLM2-135M-Instruct" and cells[5] == "none"
    assert 1.0 < s < 2.5  # 1.7321 with all 15 builtin prompts (fp32)
    assert cells[0] == "A" and cells[4].startswith("10/30 (33%)") and "no predicted deltas" in printed
    by_slug = {m["slug"]: m for m in json.loads((out / "screen.json").read_text())["models"]}
    assert by_slug[gguf.name]["sink_strength"] == by_slug[default_model.name]["sink_strength"]
    results = {n: json.loads((out / "strength" / f"{n}.strength.json").read_text()) for n in by_slug}
    folder, file = results[default_model.name], results[gguf.name]
    assert file["sink_strength_layer_head"] == folder["sink_strength_layer_head"]
    model = file["provenance"]["model"]
    assert model["gguf_quantization"] == {
        "file_type": "MOSTLY_Q4_1",
        "tensor_types": {"F32": 61, "Q4_1": 210, "Q8_0": 1},
    }
    assert model["dtype"] == "float32" and list(model["files"]) == [gguf.name]
    capsys.readouterr()
    assert main([str(a) for a in ["strength", gguf, *argv[:4], "--output", out / "strength", "--quiet"]]) == 0
    assert f"{gguf.name}: reused " in capsys.readouterr().out  # the same file is the same input key
    for refused in (
        ["eval", gguf, "--protocol", "instruct", "--tasks", "ifeval", "--output", tmp_path / "e"],
        ["configs", "render", "tsv", "--reference", default_model, "--candidate", gguf, "-o", tmp_path / "t.yaml"],
    ):
        line = user_error(refused, tmp_path / "e", tmp_path / "t.yaml")
        assert f"{gguf}: a GGUF file" in line and f"lm-eval-sink models convert {gguf} FOLDER" in line
    config = default_model / "config.json"
    assert f"{config}: not a GGUF file" in user_error(["models", "convert", config, tmp_path / "c"], tmp_path / "c")
