"""Sink margins and Lemma 1: closed forms, hand-set tiny Llamas with known shifts, CLI errors."""

from __future__ import annotations

import json
import math
import numpy as np
import pytest
from helpers import make_tokenizer, save_sink_llama

from lm_eval_sink.cli import main
from lm_eval_sink.errors import UserError
from lm_eval_sink.margin import (
    lemma1_bound,
    lemma1_keeps_sink,
    lemma1_required_margin,
    lemma1_synthetic,
    margin_arrays,
)

REF_GAPS = [[6.0, 4.0], [5.0, 3.0]]  # c[layer][head]: logit of key 0 in the reference
CAND_GAPS = [[5.5, -1.0], [5.0, 3.5]]  # the candidate: shifts 0.5, 5.0 (collapse), 0.0, -0.5


# ---------------------------------------------------------------------------- Lemma 1


def test_lemma1_closed_form():
    assert lemma1_bound(3.0, 0.4) == pytest.approx(1 / (1 + math.exp(2.6)), abs=1e-15)
    assert lemma1_bound(0.0, 0.0) == pytest.approx(0.5)
    assert lemma1_required_margin(0.1) == pytest.approx(math.log(9.0))
    assert lemma1_required_margin(0.5) == 0.0
    # exactly at the required margin the sink level 1 - eta is kept, just below it is not
    assert lemma1_keeps_sink(math.log(9.0) + 1.0, 1.0, 0.1)
    assert not lemma1_keeps_sink(math.log(9.0) + 0.99, 1.0, 0.1)
    # the bound at the required margin equals eta
    assert lemma1_bound(lemma1_required_margin(0.05) + 0.3, 0.3) == pytest.approx(0.05)
    with pytest.raises(UserError, match="eta"):
        lemma1_required_margin(1.0)


def test_lemma1_synthetic_tightness_case():
    case = lemma1_synthetic(3.0, 0.4, 64)
    assert round(case.non_sink_mass, 3) == 0.069
    assert round(case.bound, 3) == 0.069
    assert case.ratio == pytest.approx(1.0, abs=1e-12)
    assert lemma1_synthetic(3.0, 0.4, 64, seed=7).non_sink_mass == pytest.approx(case.non_sink_mass, abs=1e-12)


def test_lemma1_bound_holds_for_random_admissible_perturbations():
    rng = np.random.default_rng(1)
    g, b, n = 3.0, 0.4, 64
    others = rng.normal(size=n - 1)
    sink = g + np.log(np.exp(others).sum())
    logits = np.concatenate([[sink], others])
    bound = lemma1_bound(g, b)
    worst = 0.0
    for k in range(4000):  # each logit moves by <= b/2, so the gap moves by <= b
        delta = rng.uniform(-b / 2, b / 2, size=n) if k % 2 else rng.choice([-b / 2, b / 2], size=n)
        p = np.exp(logits + delta)
        worst = max(worst, 1 - p[0] / p.sum())
    assert worst <= bound + 1e-12  # the worst corner reaching it: test_lemma1_synthetic_tightness_case


# ---------------------------------------------------------------------------- margins from arrays


def test_margin_arrays_by_hand():
    g_base = np.array([[[3.0, 2.0, 1.0, 4.0]]])
    g_cand = np.array([[[2.0, 2.5, -2.0, 4.0]]])  # shifts 1.0, -0.5, 3.0, 0.0
    m = margin_arrays(g_base, g_cand, quantile=0.5)
    assert m["g_base_median"][0, 0] == 2.5
    assert m["b_gap"][0, 0] == 3.0
    assert m["b_gap_quantile"][0, 0] == 0.5
    assert m["margin"][0, 0] == -0.5
    assert m["margin_quantile"][0, 0] == 2.0
    assert m["predicted_nonsink_mass"][0, 0] == pytest.approx(1 / (1 + math.exp(-0.5)))
    assert m["measured_nonsink_mass_median"][0, 0] == pytest.approx(np.median(1 / (1 + np.exp(g_cand[0, 0]))))
    with pytest.raises(UserError, match="do not match"):
        margin_arrays(g_base, g_cand[:, :, :2])


# ---------------------------------------------------------------------------- tiny hand-set models


@pytest.fixture(scope="module")
def sink_models(tmp_path_factory):
    base = tmp_path_factory.mktemp("margin_models")
    tok = make_tokenizer()
    ref = save_sink_llama(base / "ref", REF_GAPS, tok)
    cand = save_sink_llama(base / "cand", CAND_GAPS, tok)
    three = save_sink_llama(base / "three_layers", [*CAND_GAPS, [1.0, 1.0]], tok)
    other_vocab = save_sink_llama(base / "other_vocab", CAND_GAPS, make_tokenizer(vocab_size=30))
    return {"ref": ref, "cand": cand, "three": three, "other_vocab": other_vocab, "tokenizer": tok}


def _query_positions(tok) -> np.ndarray:
    """t (query position from the first token) of every row, prompts concatenated."""
    from lm_eval_sink.calibration import builtin_prompts, encode_prompts

    enc = encode_prompts(tok, builtin_prompts())
    return np.concatenate([np.arange(1, len(ids)) for ids in enc.input_ids]).astype(np.float64)


@pytest.fixture(scope="module")
def margin_run(sink_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("margin_out") / "m"
    code = main(
        [
            "margin",
            str(sink_models["ref"]),
            str(sink_models["cand"]),
            "--output",
            str(out),
            "--quiet",
            "--strength-last-k",
            "2",
        ]
    )
    assert code == 0
    return out


def test_margin_matches_closed_form(margin_run, sink_models):
    t = _query_positions(sink_models["tokenizer"])
    log_t = np.log(t)
    rows = np.load(margin_run / "margin_rows.npz")
    data = json.loads((margin_run / "margin.json").read_text())
    assert list(rows["layers"]) == [0, 1] and data["layers"] == [0, 1]
    assert rows["sink_logodds_reference"].shape == (2, 2, len(t))
    assert (rows["sink_pos"] == 0).all()  # the reference's sink is BOS in every row
    assert data["reference_pos0_argmax_fraction"] == 1.0
    for li in range(2):
        for h in range(2):
            c, c2 = REF_GAPS[li][h], CAND_GAPS[li][h]
            # per row: G_base = c - log t; the candidate measured at the reference's key: c' - log t,
            # also for the collapsed head, whose own argmax has moved away from key 0
            np.testing.assert_allclose(rows["sink_logodds_reference"][li, h], c - log_t, atol=2e-5)
            np.testing.assert_allclose(rows["sink_logodds_candidate"][li, h], c2 - log_t, atol=2e-5)
            np.testing.assert_allclose(rows["sink_logodds_shift"][li, h], c - c2, atol=5e-5)
            assert data["b_gap"][li][h] == pytest.approx(c - c2, abs=1e-4)
            assert data["b_gap_quantile"][li][h] == pytest.approx(c - c2, abs=1e-4)
            g_med = np.median(c - log_t)
            assert data["g_base_median"][li][h] == pytest.approx(g_med, abs=1e-4)
            assert data["margin"][li][h] == pytest.approx(g_med - (c - c2), abs=1e-4)
            assert data["predicted_nonsink_mass"][li][h] == pytest.approx(1 / (1 + np.exp(g_med - (c - c2))), abs=1e-5)
            # every row moved by exactly B_gap: Lemma 1 is tight, measured = predicted
            assert data["measured_nonsink_mass_median"][li][h] == pytest.approx(
                np.median(1 / (1 + np.exp(c2 - log_t))), abs=1e-5
            )
            assert data["measured_nonsink_mass_median"][li][h] == pytest.approx(
                data["predicted_nonsink_mass"][li][h], abs=1e-3
            )
    assert [(x["layer"], x["head"]) for x in data["negative_margin_heads"]] == [(0, 1)]
    assert data["summary"]["n_negative_margin"] == 1 and data["summary"]["n_heads_total"] == 4
    assert data["summary"]["n_sink_collapse"] == 1 and data["summary"]["n_no_sink_in_reference"] == 0
    assert data["negative_margin_heads"][0]["reference_has_sink"] is True
    # both models' own S through the Sink Strength API: median over all rows, heads, layers
    ref_rows = np.concatenate([c - log_t for layer in REF_GAPS for c in layer])
    assert data["reference_sink_strength"] == pytest.approx(np.median(ref_rows), abs=1e-4)
    assert data["candidate_sink_strength"] != pytest.approx(data["reference_sink_strength"], abs=1e-2)
    assert data["provenance"]["protocol"]["tokenizer"] == "reference"
    assert data["schema_version"] == 1
    for name in ("margin.md", "margin.csv", "margin_heatmap.png"):
        assert (margin_run / name).stat().st_size > 0
    csv_lines = (margin_run / "margin.csv").read_text().splitlines()
    assert csv_lines[0].startswith("layer,head,g_base_median") and len(csv_lines) == 5
    md = (margin_run / "margin.md").read_text()
    assert "| 0 | 1 |" in md and md.count(" in float32)") == 2  # each S with the dtype its model was loaded in


def test_margin_refuses_to_overwrite(margin_run, sink_models, capsys, monkeypatch):
    """An existing output is refused; one made by other versions (here another torch) is refused naming them."""
    from helpers import set_package_version

    before = (margin_run / "margin.json").read_bytes()
    prov = json.loads(before)["provenance"]
    assert {"lm_eval_sink/margin.py", "lm_eval_sink/capture.py"} <= set(prov["key_versions"]["code"])
    assert prov["input_key"] and prov["inputs_key"] and prov["key_versions"]["torch"]
    argv = ["margin", str(sink_models["ref"]), str(sink_models["cand"]), "--output", str(margin_run), "--quiet"]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: output already exists") and len(err.strip().splitlines()) == 1
    installed = set_package_version(monkeypatch, "torch", "99.0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"made by other versions (torch {installed} -> 99.0)" in err and len(err.strip().splitlines()) == 1
    assert (margin_run / "margin.json").read_bytes() == before


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        (["three"], "the reference has 2 layers x 2 heads, the candidate 3 x 2"),
        (["other_vocab"], "the vocabularies differ"),
        (["cand", "--quantile", "1.5"], "--quantile must lie in [0, 1]"),
        (["nope"], "no such model folder"),
    ],
)
def test_margin_bad_inputs_are_one_line(sink_models, tmp_path, user_error, candidate, message):
    model, out = sink_models.get(candidate[0], tmp_path / candidate[0]), tmp_path / "out"
    assert message in user_error(["margin", sink_models["ref"], model, *candidate[1:], "--output", out, "--quiet"], out)


# ---------------------------------------------------------------------------- capture with fixed keys


def test_fixed_sink_keys_at_the_argmax_reproduce_the_default_capture(sink_models):
    from lm_eval_sink.calibration import Batching, builtin_prompts, encode_prompts
    from lm_eval_sink.capture import capture_prompts
    from lm_eval_sink.models import load_model

    loaded = load_model(str(sink_models["cand"]), dtype="float32")
    enc = encode_prompts(loaded.tokenizer, builtin_prompts()[:4])
    default = capture_prompts(loaded.model, enc, [0, 1], Batching(batch_size=2), progress=False)
    fixed = capture_prompts(
        loaded.model, enc, [0, 1], Batching(batch_size=2), progress=False, sink_keys=[c.sink_pos for c in default]
    )
    for a, b in zip(default, fixed, strict=True):
        assert np.array_equal(a.sink_logodds, b.sink_logodds) and np.array_equal(a.sink_pos, b.sink_pos)
    # the collapsed head (layer 0, head 1) has its own argmax elsewhere; at key 0 its gap is c' - log t
    at_bos = capture_prompts(
        loaded.model,
        enc,
        [0, 1],
        Batching(batch_size=2),
        progress=False,
        sink_keys=[np.zeros_like(c.sink_pos) for c in default],
    )
    t = np.arange(1, len(enc.input_ids[0]))
    assert (default[0].sink_pos[0, 1] != 0).any()
    np.testing.assert_allclose(at_bos[0].sink_logodds[0, 1], -1.0 - np.log(t), atol=2e-5)
    with pytest.raises(UserError, match="shape"):
        capture_prompts(loaded.model, enc, [0, 1], progress=False, sink_keys=[c.sink_pos[:1] for c in default])
    with pytest.raises(UserError, match="outside"):
        capture_prompts(loaded.model, enc, [0, 1], progress=False, sink_keys=[c.sink_pos + 1 for c in default])
