"""Regression buckets: hand-made runs with known buckets (scored by lm-eval's own code), real
SmolLM2 runs from the session fixtures, and every bad input through the CLI."""

from __future__ import annotations

import html
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bucket_logs as bl
from lm_eval_sink.buckets.compare import bucket
from lm_eval_sink.buckets.settings import BucketSettings
from lm_eval_sink.buckets.stats import BUCKETS, holm, resampled_sums
from lm_eval_sink.cli import main
from lm_eval_sink.failure_kinds import FAILURE_KINDS, ends_mid_sentence, is_truncated, tokenizer_counter

FAST = BucketSettings(n_bootstrap=2000)


def _binom_two_sided(b: int, c: int) -> float:
    """Closed form of the exact McNemar p-value (independent of scipy)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


# --- the designed IFEval pair -----------------------------------------------------------------------
# (instruction, variant of the reference, variant of the candidate, expected bucket, expected kind)
IFEVAL_DESIGN = [
    ("punctuation:no_comma", "pass", "pass", "both_pass", None),
    ("punctuation:no_comma", "pass", "fail", "regression", "format"),
    ("punctuation:no_comma", "pass", "fail", "regression", "format"),
    ("punctuation:no_comma", "fail", "pass", "recovered", None),
    ("startend:end_checker", "pass", "pass", "both_pass", None),
    ("startend:end_checker", "pass", "truncated", "regression", "truncation"),
    ("startend:end_checker", "pass", "fail", "regression", "phrase_marker"),
    ("startend:end_checker", "fail", "fail", "both_fail", None),
    ("detectable_content:postscript", "pass", "fail", "regression", "phrase_marker"),
    ("detectable_content:postscript", "pass", "pass", "both_pass", None),
    ("detectable_content:postscript", "fail", "fail", "both_fail", None),
    ("change_case:english_lowercase", "pass", "fail", "regression", "format"),
    ("change_case:english_lowercase", "pass", "pass", "both_pass", None),
    ("change_case:english_lowercase", "fail", "pass", "recovered", None),
    ("startend:quotation", "pass", "pass", "both_pass", None),
    ("startend:quotation", "pass", "fail", "regression", "format"),
    ("detectable_format:title", "fail", "pass", "recovered", None),
    ("detectable_format:title", "pass", "pass", "both_pass", None),
    ("language:response_language", "pass", "fail", "regression", "language"),
    ("detectable_format:json_format", "pass", "fail", "regression", "format"),
]
# one two-instruction prompt (no_comma + end_checker "in India."): the candidate adds commas only
TWO_INSTRUCTIONS = ("We visited many old places in India.", "We visited temples, markets and old places in India.")

# per instruction type: n, both_pass, regression, recovered, both_fail (by hand from the design)
EXPECTED_TYPES = {
    "punctuation:no_comma": (5, 1, 3, 1, 0),
    "startend:end_checker": (5, 2, 2, 0, 1),
    "detectable_content:postscript": (3, 1, 1, 0, 1),
    "change_case:english_lowercase": (3, 1, 1, 1, 0),
    "startend:quotation": (2, 1, 1, 0, 0),
    "detectable_format:title": (2, 1, 0, 1, 0),
    "language:response_language": (1, 0, 1, 0, 0),
    "detectable_format:json_format": (1, 0, 1, 0, 0),
}


@pytest.fixture(scope="module")
def ifeval_pair(shared_data, tmp_path_factory):
    """Reference (chat template) and candidate (no template) runs of 21 real IFEval prompts."""
    docs = bl.ifeval_docs(shared_data)
    used: dict[str, int] = {}
    ref, cand, expected = [], [], {}
    for iid, rv, cv, want_bucket, want_kind in IFEVAL_DESIGN:
        kw = {"language": "ko"} if iid.startswith("language") else {}
        pool = bl.find_single(docs, iid, used.get(iid, 0) + 1, **kw)
        idx = pool[used.get(iid, 0)]
        used[iid] = used.get(iid, 0) + 1
        r = bl.ifeval_sample(idx, docs[idx], bl.designed_response(docs[idx], rv), chat=True)
        c = bl.ifeval_sample(idx, docs[idx], bl.designed_response(docs[idx], cv), chat=False)
        assert (r["prompt_level_strict_acc"], c["prompt_level_strict_acc"]) == (rv == "pass", cv == "pass"), (
            f"designed response broken for {iid}"
        )
        ref.append(r)
        cand.append(c)
        expected[idx] = (want_bucket, want_kind)
    two = next(
        i for i, d in enumerate(docs) if d["instruction_id_list"] == ["punctuation:no_comma", "startend:end_checker"]
    )
    r, c = (
        bl.ifeval_sample(two, docs[two], TWO_INSTRUCTIONS[0], chat=True),
        bl.ifeval_sample(two, docs[two], TWO_INSTRUCTIONS[1], chat=False),
    )
    assert r["inst_level_strict_acc"] == [True, True] and c["inst_level_strict_acc"] == [False, True]
    ref.append(r)
    cand.append(c)
    expected[two] = ("regression", "format")
    root = tmp_path_factory.mktemp("ifeval_pair")
    ref_dir = bl.write_run(root / "ref", {"ifeval": ref}, model="ref-model", chat_template=True)
    cand_dir = bl.write_run(root / "cand", {"ifeval": cand}, model="cand-model", chat_template=False)
    return {"ref": ref, "cand": cand, "expected": expected, "ref_dir": ref_dir, "cand_dir": cand_dir, "root": root}


def test_ifeval_counts_mcnemar_and_kinds_are_exact(ifeval_pair):
    rep = bucket(ifeval_pair["ref"], ifeval_pair["cand"], "ifeval", FAST)
    exp = ifeval_pair["expected"]
    assert rep.counts == {"both_pass": 6, "regression": 10, "recovered": 3, "both_fail": 2}
    assert all(isinstance(v, int) for v in rep.counts.values())
    for b in BUCKETS:
        assert rep.prompts[b] == sorted(i for i, (eb, _) in exp.items() if eb == b)
    assert rep.mcnemar_p == pytest.approx(756 / 8192, rel=1e-12)  # 2 * sum_{k<=3} C(13, k) / 2^13
    assert rep.delta == pytest.approx((9 - 16) / 21)
    assert rep.delta_ci[0] <= rep.delta <= rep.delta_ci[1]
    kinds = {row["doc_id"]: row["failure_kind"] for row in rep.rows}
    assert {i: kinds[i] for i in exp} == {i: k for i, (_, k) in exp.items()}
    assert rep.failure_kinds["counts"] == {k: sum(kind == k for _, kind in exp.values()) for k in FAILURE_KINDS}
    assert rep.failure_kinds["checker_disagreements"] == 0
    assert rep.truncation["regressions_truncated"] == 1
    assert rep.pairing["prompt_hash_differs"]["count"] == 21


def test_a_collapsed_candidate_is_named_in_the_notes(ifeval_pair, shared_data):
    """One caption for every prompt (what the VL experiment's end models answered, docs/training.md), scored by the
    real checker: the note names the run, its distinct responses and the most common one; a run whose responses
    are more than a quarter distinct gets none (the designed reference: 10 of 21)."""
    docs = bl.ifeval_docs(shared_data)
    caption = "There are 4 large green hearts."
    collapsed = [bl.ifeval_sample(r["doc_id"], docs[r["doc_id"]], caption, chat=True) for r in ifeval_pair["ref"]]
    varied = [
        bl.ifeval_sample(r["doc_id"], docs[r["doc_id"]], f"Answer {i}: {caption}", chat=True)
        for i, r in enumerate(ifeval_pair["ref"])
    ]
    rep = bucket(ifeval_pair["ref"], collapsed, "ifeval", FAST)
    assert [n for n in rep.notes if "collapsed" in n] == [
        f"candidate samples: 1 distinct responses to 21 prompts (the most common, 21 times: {caption!r}): a collapsed "
        "output; its passes and failures measure the collapse, not the model's instruction following"
    ]
    assert rep.counts["regression"] + rep.counts["both_fail"] > 0  # the checker did score the caption
    assert not [n for n in bucket(collapsed[:19], collapsed[:19], "ifeval", FAST).notes if "collapsed" in n]
    assert not [n for n in bucket(varied, collapsed, "ifeval", FAST).notes if n.startswith("reference samples")]


def test_ifeval_instruction_table_and_level(ifeval_pair):
    rep = bucket(ifeval_pair["ref"], ifeval_pair["cand"], "ifeval", FAST)
    table = {t["instruction_id"]: t for t in rep.instruction_types}
    assert set(table) == set(EXPECTED_TYPES)
    for iid, (n, bp, reg, rec, bf) in EXPECTED_TYPES.items():
        t = table[iid]
        assert (t["n"], t["both_pass"], t["regression"], t["recovered"], t["both_fail"]) == (n, bp, reg, rec, bf), iid
        assert t["mcnemar_p"] == pytest.approx(_binom_two_sided(reg, rec), rel=1e-12), iid
        assert t["delta"] == pytest.approx((rec - reg) / n)
    assert [t["instruction_id"] for t in rep.instruction_types[:2]] == ["punctuation:no_comma", "startend:end_checker"]
    assert table["punctuation:no_comma"]["mcnemar_p"] == pytest.approx(0.625)
    ps = [t["mcnemar_p"] for t in rep.instruction_types]
    assert [t["holm_p"] for t in rep.instruction_types] == pytest.approx(holm(ps))
    il = rep.instruction_level
    assert il["n_instructions"] == 22
    assert il["counts"] == {"both_pass": 7, "regression": 10, "recovered": 3, "both_fail": 2}
    assert il["delta"] == pytest.approx((10 - 17) / 22)
    assert il["delta_ci"][0] <= il["delta"] <= il["delta_ci"][1]


def test_loose_metric_and_seeded_bootstrap(ifeval_pair):
    a = bucket(ifeval_pair["ref"], ifeval_pair["cand"], "ifeval", FAST)
    b = bucket(ifeval_pair["ref"], ifeval_pair["cand"], "ifeval", FAST)
    assert a.to_json() == b.to_json()
    cols = np.array([[r["candidate"] - r["reference"]] for r in a.rows])
    assert np.array_equal(resampled_sums(cols, 300, 0), resampled_sums(cols, 300, 0))
    assert not np.array_equal(resampled_sums(cols, 300, 0), resampled_sums(cols, 300, 1))
    loose = bucket(
        ifeval_pair["ref"],
        ifeval_pair["cand"],
        "ifeval",
        BucketSettings(n_bootstrap=2000, metric="prompt_level_loose_acc"),
    )
    assert loose.instruction_level["metric"] == "inst_level_loose_acc"
    assert "loose" in loose.failure_kinds["checker"]


def test_truncation_rule():
    assert ends_mid_sentence("and the text is cut") and ends_mid_sentence("the total is 18")
    assert (
        not ends_mid_sentence("A full sentence.") and not ends_mid_sentence('{"a": 1}') and not ends_mid_sentence("   ")
    )
    assert is_truncated(bl.TRUNCATED, 64) is True
    assert is_truncated(bl.TRUNCATED, 200) is False  # too few bytes to hold 200 tokens
    assert is_truncated("answer: yes", 8) is True and is_truncated("answer: yes", 64) is False
    assert is_truncated(bl.TRUNCATED, None) is None
    assert is_truncated("one two three four", 4, count_tokens=lambda s: len(s.split())) is True
    assert is_truncated("one two three four", 10, count_tokens=lambda s: len(s.split())) is False


# --- CLI on the designed pair ---------------------------------------------------------------------


def _buckets(ref: Path, cand: Path, out: Path, *options: str) -> int:
    """`lm-eval-sink buckets REF CAND --output OUT --quiet OPTIONS...`: its exit code."""
    return main(["buckets", str(ref), str(cand), "--output", str(out), "--quiet", *options])


def test_cli_writes_every_output(ifeval_pair, tmp_path, capsys):
    out = tmp_path / "out"
    rc = _buckets(ifeval_pair["ref_dir"], ifeval_pair["cand_dir"], out, "--bootstrap", "2000")
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "| regression | 10 |" in captured.out
    assert sorted(p.name for p in out.iterdir()) == [
        "buckets.json",
        "buckets.md",
        "buckets.png",
        "instruction_types.png",
        "prompts.csv",
    ]
    data = json.loads((out / "buckets.json").read_text())
    assert data["counts"] == {"both_pass": 6, "regression": 10, "recovered": 3, "both_fail": 2}
    assert data["mcnemar_p"] == pytest.approx(756 / 8192, rel=1e-12)
    assert isinstance(data["delta"], float) and len(data["delta_ci"]) == 2
    assert data["runs"]["reference"]["model"] == "ref-model" and data["runs"]["candidate"]["model"] == "cand-model"
    assert data["runs"]["reference"]["lm_eval_version"] == "0.4.13"
    assert data["runs"]["reference"]["samples_sha256"] and data["provenance"]["key"]
    code = data["provenance"]["key_versions"]["code"]
    assert {"lm_eval_sink/buckets/stats.py", "lm_eval_sink/power.py", "lm_eval_sink/pairing.py"} <= set(code)
    assert data["schema_version"] == 1
    csv_lines = (out / "prompts.csv").read_text().splitlines()
    assert len(csv_lines) == 22 and csv_lines[0].startswith("doc_id,key,bucket")
    assert sum(",regression," in line for line in csv_lines) == 10
    for png in ("buckets.png", "instruction_types.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "buckets.md").read_text()
    assert "| punctuation:no_comma | 5 | 3 | 1 |" in md and "protocols differ" in md
    # no overwrite without --force; --force replaces
    before = (out / "buckets.json").read_bytes()
    rc = _buckets(ifeval_pair["ref_dir"], ifeval_pair["cand_dir"], out)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: output already exists") and (out / "buckets.json").read_bytes() == before
    assert _buckets(ifeval_pair["ref_dir"], ifeval_pair["cand_dir"], out, "--force", "--bootstrap", "500") == 0
    assert json.loads((out / "buckets.json").read_text())["settings"]["n_bootstrap"] == 500


@pytest.mark.slow
def test_cli_tokenizer_counts_tokens(ifeval_pair, default_model, capsys, tmp_path):
    """With the real SmolLM2 tokenizer the cut response has far fewer than 64 tokens: no truncation."""
    out = tmp_path / "tok"
    rc = _buckets(
        ifeval_pair["ref_dir"], ifeval_pair["cand_dir"], out, "--tokenizer", str(default_model), "--bootstrap", "500"
    )
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "buckets.json").read_text())
    assert data["truncation"]["regressions_truncated"] == 0
    assert data["failure_kinds"]["counts"]["truncation"] == 0 and data["failure_kinds"]["counts"]["phrase_marker"] == 3
    count = tokenizer_counter(str(default_model))
    long_cut = " ".join(["word"] * 80) + " and then"
    assert count(bl.TRUNCATED) < 62 and is_truncated(long_cut, 64, count) is True


# --- GSM8K, EQ-Bench, generic --------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_pair(shared_data, tmp_path_factory):
    docs = bl.gsm8k_docs(shared_data)[:12]
    design = (
        [("right", "right")] * 4
        + [("right", "format")] * 3
        + [("right", "wrong")] * 2
        + [("wrong", "right")]
        + [("wrong", "wrong")] * 2
    )
    ref, cand = [], []
    for i, (doc, (rv, cv)) in enumerate(zip(docs, design, strict=True)):
        ref += bl.gsm8k_samples(i, doc, bl.gsm8k_response(doc, rv))
        cand += bl.gsm8k_samples(i, doc, bl.gsm8k_response(doc, cv))
    root = tmp_path_factory.mktemp("gsm8k_pair")
    return {
        "ref": ref,
        "cand": cand,
        "ref_dir": bl.write_run(root / "ref", {"gsm8k_cot_zeroshot": ref}, model="ref-model"),
        "cand_dir": bl.write_run(root / "cand", {"gsm8k_cot_zeroshot": cand}, model="cand-model"),
    }


def test_gsm8k_format_failures_vs_wrong_answers(gsm8k_pair, tmp_path, capsys):
    rep = bucket(gsm8k_pair["ref"], gsm8k_pair["cand"], "gsm8k_cot_zeroshot", FAST)
    assert rep.filter == "strict-match"
    assert rep.counts == {"both_pass": 4, "regression": 5, "recovered": 1, "both_fail": 2}
    assert rep.mcnemar_p == pytest.approx(14 / 64)
    fs = rep.format_split
    assert (fs["format_failure"], fs["wrong_answer"], fs["unknown"]) == (3, 2, 0)
    assert fs["format_failure_ids"] == [4, 5, 6] and fs["wrong_answer_ids"] == [7, 8]
    flex = bucket(
        gsm8k_pair["ref"],
        gsm8k_pair["cand"],
        "gsm8k_cot_zeroshot",
        BucketSettings(n_bootstrap=500, filter="flexible-extract"),
    )
    assert flex.counts == {"both_pass": 7, "regression": 2, "recovered": 1, "both_fail": 2}
    assert flex.format_split is None
    out = tmp_path / "g"
    assert _buckets(gsm8k_pair["ref_dir"], gsm8k_pair["cand_dir"], out, "--bootstrap", "500") == 0
    data = json.loads((out / "buckets.json").read_text())
    assert data["format_split"]["format_failure"] == 3
    # "So the result is 18" ends mid-sentence but is far shorter than the hf default of 256 tokens
    assert data["truncation"]["regressions_truncated"] == 0
    assert data["truncation"]["max_gen_toks"] == ["256 (lm-eval's hf backend default)"]
    assert "instruction_types.png" not in {p.name for p in out.iterdir()}
    assert (
        "Regressions split by the flexible-extract filter: format failures (lenient answer right, "
        "strict wrong) 3, wrong answers 2" in capsys.readouterr().out
    )


def _eqbench_pair(shared_data, n: int, mixed: bool = True):
    """EQ-Bench samples scored by lm-eval: the candidate off by 1 + i % 6 on doc i's first emotion (`mixed`: on some
    docs the reference is off instead, or both or neither)."""
    import ast

    ref, cand = [], []
    for i, doc in enumerate(bl.eqbench_docs(shared_data)[:n]):
        truth = ast.literal_eval(doc["reference_answer_fullscale"])
        exact = [int(truth[f"emotion{k}_score"]) for k in range(1, 5)]
        worse = list(exact)
        step = 1 + i % 6
        worse[0] = exact[0] + step if exact[0] + step <= 10 else exact[0] - step
        ref.append(bl.eqbench_sample(i, doc, exact if i % 4 or not mixed else worse))
        cand.append(bl.eqbench_sample(i, doc, worse if i % 3 or not mixed else exact))
    return ref, cand


def test_eqbench_paired_difference_and_threshold(shared_data):
    ref, cand = _eqbench_pair(shared_data, 6, mixed=False)  # a different error size per doc: no tied differences
    r = np.array([x["eqbench"] for x in ref], float)
    c = np.array([x["eqbench"] for x in cand], float)
    assert (c < r).all() and len(set(np.round(r - c, 9))) == 6
    rep = bucket(ref, cand, "eq_bench", FAST)
    assert rep.kind == "continuous" and rep.metric == "eqbench"
    assert rep.counts is None and rep.mcnemar_p is None and "--threshold" in rep.counts_reason
    assert rep.delta == pytest.approx(float((c - r).mean()))
    assert rep.wilcoxon_p == pytest.approx(2 / 2**6)  # exact signed-rank: all 6 differences negative
    from lm_eval_sink.buckets.render import summary_markdown

    md = summary_markdown(rep.to_json())  # a continuous metric in its own unit, named; 6 docs say nothing on power
    assert "| score (eqbench in its own unit) | reference |" in md and "(points)" not in md
    assert "Power: too few to tell: 6 paired docs (at least 10 are needed)" in md
    # 6 docs: too few to tell, said first; a continuous metric's interval is withheld with its reason
    assert rep.delta_ci is None and rep.delta_ci_method.startswith("withheld: 6 paired docs (at least 10 are needed)")
    assert f"| too few to tell: {rep.delta:.4g} [interval withheld] |" in md
    assert md.index("**Too few to tell: 6 paired docs") < md.index("| score (eqbench")
    thr = 95.0
    rep_t = bucket(ref, cand, "eq_bench", BucketSettings(n_bootstrap=500, threshold=thr))
    want = {
        "both_pass": int(((r >= thr) & (c >= thr)).sum()),
        "regression": int(((r >= thr) & (c < thr)).sum()),
        "recovered": int(((r < thr) & (c >= thr)).sum()),
        "both_fail": int(((r < thr) & (c < thr)).sum()),
    }
    assert rep_t.counts == want and want["regression"] > 0
    assert rep_t.pass_rate["delta"] == pytest.approx((want["recovered"] - want["regression"]) / 6)
    assert rep_t.mcnemar_p == pytest.approx(_binom_two_sided(want["regression"], want["recovered"]))


def _boolq_lines(shared_data, outcomes):
    docs = bl.read_jsonl(shared_data / "boolq" / "validation.jsonl")[: len(outcomes)]
    lines = []
    for i, (doc, ok) in enumerate(zip(docs, outcomes, strict=True)):
        prompt = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
        gold = 1 if doc["answer"] else 0
        ll = [-0.5, -2.0] if (gold == 0) == ok else [-2.0, -0.5]  # [no, yes]: the higher one is chosen
        line = bl.sample_line(i, doc, gold, prompt, " no", str(ll), str(ll), "none", {"acc": 1.0 if ok else 0.0})
        line["arguments"] = {
            "gen_args_0": {"arg_0": prompt, "arg_1": " no"},
            "gen_args_1": {"arg_0": prompt, "arg_1": " yes"},
        }
        line["resps"] = [[[str(ll[0]), "False"]], [[str(ll[1]), "False"]]]
        line["filtered_resps"] = [[str(ll[0]), "False"], [str(ll[1]), "False"]]
        lines.append(line)
    return lines


@pytest.mark.parametrize("task", ["boolq", "my_boolq_variant"])  # in the BoolQ family, and in no family
def test_a_binary_task_with_or_without_a_family(shared_data, task):
    ref = _boolq_lines(shared_data, [1, 1, 1, 0, 0, 1, 1, 0])
    cand = _boolq_lines(shared_data, [1, 0, 1, 1, 0, 0, 0, 0])
    rep = bucket(ref, cand, task, FAST)
    assert (rep.metric, rep.filter, rep.kind) == ("acc", "none", "binary")
    assert rep.counts == {"both_pass": 2, "regression": 3, "recovered": 1, "both_fail": 2}
    assert rep.prompts["regression"] == [1, 5, 6]
    assert rep.instruction_types is None and rep.failure_kinds is None and rep.format_split is None


def test_modules_import_no_torch():
    code = (
        "import sys, lm_eval_sink.buckets.noise, lm_eval_sink.buckets.protocol, lm_eval_sink.buckets.render; "
        "bad = [m for m in ('torch', 'transformers', 'lm_eval', 'click', 'lm_eval_sink.plots', "
        "'matplotlib') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# --- bad inputs: one line, exit 2, nothing written ---------------------------------------------------


def _cli_error(capsys, args, out: Path) -> str:
    rc = main([*args, "--output", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    assert not out.exists()
    assert not list(out.parent.glob(f"{out.name}.partial-*"))
    return lines[0]


def _copy_run(src: Path, dst: Path, edit=None) -> Path:
    """Copy a model folder; `edit(lines)` may change the samples lines before they are written."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name.startswith("samples_") and edit is not None:
            lines = bl.read_jsonl(p)
            p_text = edit(lines)
            (dst / p.name).write_text(
                p_text if isinstance(p_text, str) else "".join(json.dumps(x) + "\n" for x in p_text)
            )
        else:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_malformed_and_empty_samples(ifeval_pair, tmp_path, capsys):
    ref = str(ifeval_pair["ref_dir"])

    def garble(lines):
        text = [json.dumps(x) + "\n" for x in lines]
        text[2] = "{not json\n"
        return "".join(text)

    bad = _copy_run(ifeval_pair["cand_dir"], tmp_path / "bad", garble)
    msg = _cli_error(capsys, ["buckets", ref, str(bad)], tmp_path / "o1")
    assert ".jsonl:3: not valid JSON" in msg
    empty = _copy_run(ifeval_pair["cand_dir"], tmp_path / "empty", lambda lines: "")
    assert "empty samples file" in _cli_error(capsys, ["buckets", ref, str(empty)], tmp_path / "o2")
    nodoc = _copy_run(ifeval_pair["cand_dir"], tmp_path / "nodoc", lambda lines: [{"x": 1}])
    assert "no doc_id" in _cli_error(capsys, ["buckets", ref, str(nodoc)], tmp_path / "o3")
    dup = _copy_run(ifeval_pair["cand_dir"], tmp_path / "dup", lambda lines: lines + lines[:1])
    assert "appears twice" in _cli_error(capsys, ["buckets", ref, str(dup)], tmp_path / "o4")


def test_mismatched_docs_and_doc_sets(ifeval_pair, tmp_path, capsys):
    ref = str(ifeval_pair["ref_dir"])

    def swap_doc(lines):
        lines[5]["doc"] = lines[6]["doc"]
        lines[5]["doc_hash"] = lines[6]["doc_hash"]
        return lines

    swapped = _copy_run(ifeval_pair["cand_dir"], tmp_path / "swap", swap_doc)
    msg = _cli_error(capsys, ["buckets", ref, str(swapped)], tmp_path / "o1")
    assert (
        "1 of 21 paired doc_ids hold different documents in the two runs (e.g. doc_id "
        f"{ifeval_pair['cand'][5]['doc_id']}" in msg
    )
    short = _copy_run(ifeval_pair["cand_dir"], tmp_path / "short", lambda lines: lines[3:])
    msg = _cli_error(capsys, ["buckets", ref, str(short)], tmp_path / "o2")
    assert (
        "different doc sets: 3 doc_ids only in the reference, 0 only in the candidate" in msg
        and "--allow-partial" in msg
    )
    out = tmp_path / "partial"
    assert _buckets(ref, short, out, "--allow-partial", "--bootstrap", "500") == 0
    data = json.loads((out / "buckets.json").read_text())
    assert data["n"] == 18 and len(data["pairing"]["dropped_reference_only"]) == 3
    capsys.readouterr()


def test_bad_choices_and_runs(ifeval_pair, gsm8k_pair, tmp_path, capsys):
    ref, cand = str(ifeval_pair["ref_dir"]), str(ifeval_pair["cand_dir"])
    assert "did you mean 'prompt_level_strict_acc'" in _cli_error(
        capsys, ["buckets", ref, cand, "--metric", "prompt_level_strict"], tmp_path / "o1"
    )
    assert "holds a list per doc" in _cli_error(
        capsys, ["buckets", ref, cand, "--metric", "inst_level_strict_acc"], tmp_path / "o2"
    )
    assert "filter 'strict-match' is not in the reference samples /" in _cli_error(
        capsys, ["buckets", ref, cand, "--filter", "strict-match"], tmp_path / "o3"
    )
    assert "--threshold applies to continuous metrics" in _cli_error(
        capsys, ["buckets", ref, cand, "--threshold", "0.5"], tmp_path / "o4"
    )
    assert "different tasks" in _cli_error(capsys, ["buckets", ref, str(gsm8k_pair["cand_dir"])], tmp_path / "o5")
    assert "differ in protocol" in _cli_error(capsys, ["buckets", ref, cand, "--same-protocol"], tmp_path / "o6")
    assert "no such file or folder" in _cli_error(capsys, ["buckets", ref, str(tmp_path / "missing")], tmp_path / "o7")
    # a results file whose samples were not logged
    lone = tmp_path / "lone"
    lone.mkdir()
    res = next(ifeval_pair["cand_dir"].glob("results_*.json"))
    (lone / res.name).write_bytes(res.read_bytes())
    assert "has no samples files" in _cli_error(capsys, ["buckets", ref, str(lone / res.name)], tmp_path / "o8")
    afile = tmp_path / "afile"
    afile.write_text("x")
    rc = main(["buckets", ref, cand, "--output", str(afile), "--quiet"])
    assert rc == 2 and "is a file" in capsys.readouterr().err


def test_protocol_from_the_fingerprint_and_same_protocol_needs_it(ifeval_pair, tmp_path, capsys):
    from lm_eval_sink.protocols import fingerprint_run, task_diff
    from lm_eval_sink.runs import resolve_run

    ref, cand = str(ifeval_pair["ref_dir"]), str(ifeval_pair["cand_dir"])
    out = tmp_path / "p"
    assert _buckets(ref, cand, out, "--bootstrap", "200", "--no-failure-kinds") == 0
    data = json.loads((out / "buckets.json").read_text())
    fa, fb = fingerprint_run(resolve_run(ref)), fingerprint_run(resolve_run(cand))
    assert data["runs"]["reference"]["harness_sha"] == fa.harness_sha(tasks=("ifeval",))
    assert len(data["protocol_differences"]) == len(task_diff(fa, fb, ("ifeval",))) > 0
    protocols = data["runs"]["reference"]["protocol"], data["runs"]["candidate"]["protocol"]
    assert [p["chat_template_applied"] for p in protocols] == [True, False]
    assert data["protocol_differences"]["chat_template_applied"] == {
        "reference": True,
        "candidate": False,
        "affects_scores": True,
    }
    assert data["runs"]["candidate"]["default_max_gen_toks"] == {
        "value": 64,
        "source": "the run's task generation_kwargs",
    }
    capsys.readouterr()
    # a samples file without its results: the protocol is unknown, so --same-protocol cannot hold
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "cand.jsonl").write_bytes(next(ifeval_pair["cand_dir"].glob("samples_*.jsonl")).read_bytes())
    msg = _cli_error(capsys, ["buckets", ref, str(lone / "cand.jsonl"), "--same-protocol"], tmp_path / "o")
    assert "--same-protocol cannot be checked (candidate: no results_<time>.json" in msg


# --- real SmolLM2 runs (session fixtures of the harness issue) ---------------------------------------


def _raw_outcomes(path: Path, metric: str, filt: str) -> dict[int, float]:
    return {row["doc_id"]: float(row[metric]) for row in bl.read_jsonl(path) if row.get("filter", "none") == filt}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("task", "metric", "filt"),
    [("ifeval", "prompt_level_strict_acc", "none"), ("gsm8k_cot_zeroshot", "exact_match", "strict-match")],
)
def test_real_smollm2_runs(
    smollm2_instruct_run, smollm2_community_run, default_model, task, metric, filt, tmp_path, capsys
):
    """Bucket the instruct-protocol run against the community-protocol run of the same model."""
    ref_run, cand_run = smollm2_instruct_run, smollm2_community_run
    out = tmp_path / task
    options = ("--task", task, "--tokenizer", str(default_model), "--bootstrap", "1000")
    rc = _buckets(ref_run.results, cand_run.results, out, *options)
    assert rc == 0, capsys.readouterr().err
    data = json.loads((out / "buckets.json").read_text())
    r = _raw_outcomes(ref_run.samples[task], metric, filt)
    c = _raw_outcomes(cand_run.samples[task], metric, filt)
    assert data["n"] == len(r) == len(c)
    want = {b: 0 for b in BUCKETS}
    for i in r:
        want[("both_pass" if c[i] else "regression") if r[i] else ("recovered" if c[i] else "both_fail")] += 1
    assert data["counts"] == want
    assert data["mcnemar_p"] == pytest.approx(_binom_two_sided(want["regression"], want["recovered"]))
    assert data["delta"] == pytest.approx((sum(c.values()) - sum(r.values())) / len(r))
    assert data["pairing"]["prompt_hash_differs"]["count"] == len(r)  # chat template vs none
    assert "chat_template_applied" in data["protocol_differences"]
    assert any(n.startswith("non-final") for n in data["notes"])
    count = tokenizer_counter(str(default_model))
    cand_lines = {
        row["doc_id"]: row for row in bl.read_jsonl(cand_run.samples[task]) if row.get("filter", "none") == filt
    }
    for row in data["rows"]:
        if row["bucket"] == "regression":
            resp = cand_lines[row["doc_id"]]["resps"][0][0]
            assert row["truncated"] == (count(resp) >= 62)  # max_gen_toks 64, slack 2
            if task == "ifeval":
                assert row["failure_kind"] in FAILURE_KINDS
            else:
                assert row["format_split"] in ("format_failure", "wrong_answer")


def test_hub_schema_docs_pair_with_sparse_docs(ifeval_pair):
    """The hub loader fills absent IFEval kwargs with nulls, a local JSON file does not: same docs."""
    import copy

    cand = copy.deepcopy(ifeval_pair["cand"])
    for line in cand:
        line["doc"]["kwargs"] = [
            {**kw, "num_words": kw.get("num_words"), "relation": kw.get("relation")} for kw in line["doc"]["kwargs"]
        ]
        line["doc_hash"] = bl._h(json.dumps(line["doc"], indent=2, ensure_ascii=False))
    rep = bucket(ifeval_pair["ref"], cand, "ifeval", BucketSettings(n_bootstrap=200, failure_kinds=False))
    assert rep.pairing["docs_equal_after_dropping_nulls"] == 21
    assert rep.counts == {"both_pass": 6, "regression": 10, "recovered": 3, "both_fail": 2}


def test_checker_recheck_is_reproducible(shared_data):
    """lm-eval's letter_frequency check picks a random letter for IFEval key 1122 (letter '#'):
    the re-check seeds it, gives the same answer every time and leaves `random` as it was."""
    import random

    from lm_eval_sink.failure_kinds import check_instructions

    doc = next(d for d in bl.ifeval_docs(shared_data) if d["key"] == 1122)
    response = "this answer has a few letters in it and then some more letters to count here"
    check_instructions(doc, "import lm-eval's checker first", loose=False)  # imports may draw from random
    random.seed(123)
    state = random.getstate()
    results = {tuple(check_instructions(doc, response, loose=False)) for _ in range(20)}
    assert len(results) == 1
    assert random.getstate() == state


@pytest.mark.slow
def test_buckets_run_in_one_folder_is_read_by_report_from_another(
    smollm2_instruct_run, smollm2_community_run, tmp_path, monkeypatch, capsys
):
    """`buckets` run with relative paths inside one folder records absolute ones, so `report` run from a sibling
    folder finds the samples; the page shows every path relative to itself, and buckets.md names each run's folder."""
    import shutil

    work = tmp_path / "work"
    for name, run in (("ref", smollm2_instruct_run), ("cand", smollm2_community_run)):
        shutil.copytree(run.folder, work / name / run.folder.name)
    monkeypatch.chdir(work)
    args = ["--task", "ifeval", "--output", "../b", "--quiet", "--bootstrap", "200", "--no-failure-kinds"]
    assert main(["buckets", "ref", "cand", *args]) == 0, capsys.readouterr().err
    runs = json.loads((tmp_path / "b" / "buckets.json").read_text())["runs"]
    assert all(Path(r[k]).is_absolute() for r in runs.values() for k in ("run", "samples_file", "results_file"))
    md = (tmp_path / "b" / "buckets.md").read_text()
    assert "(run ref)" in md and "(run cand)" in md  # one model under two protocols: the folders tell them apart
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["report", "--buckets", "../b", "-o", "r.html"]) == 0, capsys.readouterr().err
    page = (tmp_path / "elsewhere" / "r.html").read_text()
    assert f"../work/ref/{smollm2_instruct_run.folder.name}/samples_ifeval_" in page
    assert "../b/buckets.json#/" in page and str(tmp_path) not in page


# --- power, noise floor, self-comparison (issue 36) --------------------------------------------------------


def _outcomes(n: int, passes: set[int]) -> list[int]:
    return [int(i in passes) for i in range(n)]


@pytest.fixture(scope="module")
def boolq_trio(shared_data, tmp_path_factory):
    """100 BoolQ docs: the reference passes docs 0-69; the candidate loses 0-15 and gains 70-73 (20 discordant, the
    worked example's psi 0.2); a second run of the reference flips docs 0, 1, 2, 50 (pass -> fail) and 70."""
    root = tmp_path_factory.mktemp("boolq_trio")
    ref = set(range(70))
    runs = {
        "ref": (ref, "ref-model"),
        "cand": ((ref - set(range(16))) | set(range(70, 74)), "cand-model"),
        "repeat": ((ref - {0, 1, 2, 50}) | {70}, "ref-model"),
    }
    return {
        name: bl.write_run(root / name, {"boolq": _boolq_lines(shared_data, _outcomes(100, passes))}, model=model)
        for name, (passes, model) in runs.items()
    }


def test_power_and_noise_floor_in_every_output(boolq_trio, tmp_path, capsys):
    from lm_eval_sink.power import connor_n, connor_power

    out = tmp_path / "b"
    args = ["buckets", str(boolq_trio["ref"]), str(boolq_trio["cand"]), "--repeat", str(boolq_trio["repeat"])]
    assert main([*args, "--output", str(out), "--quiet", "--bootstrap", "200"]) == 0
    stdout = capsys.readouterr().out
    data = json.loads((out / "buckets.json").read_text())
    pw = data["power"]
    assert (pw["n"], pw["discordant_share"], round(100 * pw["mde"], 1)) == (100, 0.2, 12.4)
    assert pw["n_for_effect"] == connor_n(0.2, 0.05) and pw["power_at_effect"] == pytest.approx(
        connor_power(100, 0.2, 0.05)
    )
    assert "share of docs (0-1)" in data["units"] and "points" in data["units"]
    md = (out / "buckets.md").read_text()
    assert "- minimum detectable difference at this n: 12.4 points (power 0.8 there; the exact McNemar" in md
    assert md in stdout and "power to detect a difference of 5 points (default: 5% of the metric's range" in md
    assert f"- paired docs that difference would need for power 0.8: {connor_n(0.2, 0.05)}" in md
    floor = data["noise_floor"]
    assert (floor["flips"], floor["flip_rate"], floor["pass_to_fail"], floor["fail_to_pass"]) == (5, 0.05, 4, 1)
    assert (floor["expected_regressions"], floor["regressions"], floor["explained_by_noise"]) == (4.0, 16, 4)
    assert floor["regressions_on_flipping_docs"] == [0, 1, 2] and floor["identical"] is False
    assert "flip rate 5.0%: 4 pass->fail, 1 fail->pass" in md and "4 of the candidate's 16 regressions" in md
    flips = {r["doc_id"]: r["noise_flip"] for r in data["rows"]}
    assert sorted(i for i, f in flips.items() if f) == [0, 1, 2, 50, 70]
    header, *rows = (out / "prompts.csv").read_text().splitlines()
    assert header.endswith(",noise_flip") and rows[50].endswith(",True") and rows[3].endswith(",False")
    assert data["runs"]["repeat"]["model"] == "ref-model" and data["runs"]["repeat"]["samples_sha256"]


def test_a_run_against_itself_gets_a_note(boolq_trio, shared_data, capsys, tmp_path):
    ref = str(boolq_trio["ref"])
    assert main(["buckets", ref, ref, "--quiet", "--bootstrap", "200"]) == 0
    out = capsys.readouterr().out
    assert "reference and candidate give identical samples (prompt, response and score) for all 100 paired docs" in out
    assert "Power: too few to tell: no doc where the runs disagree" in out
    # a repeat that is the reference itself measures no noise, and says so
    assert main(["buckets", ref, str(boolq_trio["cand"]), "--repeat", ref, "--quiet", "--bootstrap", "200"]) == 0
    out = capsys.readouterr().out
    assert "flip rate 0.0%" in out and "the reference and its repeat give identical samples" in out
    # ... and says why (BoolQ scores fixed choices by log-likelihood) and what would measure noise
    assert (
        "why the repeat is identical: log-likelihood scoring of fixed choices with the same model, settings and "
        "machine is deterministic, so a repeat under the same conditions measures no noise; to measure run-to-run "
        "noise, repeat the reference with another batch size" in out
    )
    assert "another machine or GPU (other kernels), or sampling (do_sample with temperature > 0)" in out
    # a repeat over other docs is named as the repeat, not as the candidate
    short = bl.write_run(
        tmp_path / "short", {"boolq": _boolq_lines(shared_data, _outcomes(90, set(range(70))))}, model="ref-model"
    )
    msg = _cli_error(capsys, ["buckets", ref, str(boolq_trio["cand"]), "--repeat", str(short)], tmp_path / "o3")
    assert "10 doc_ids only in the reference, 0 only in the repeat" in msg and "is only in the reference" in msg
    # a repeat of another model is not a noise floor
    msg = _cli_error(
        capsys, ["buckets", ref, str(boolq_trio["cand"]), "--repeat", str(boolq_trio["cand"])], tmp_path / "o"
    )
    assert "--repeat" in msg and "is a run of cand-model, the reference is a run of ref-model" in msg
    assert "--effect must be a positive" in _cli_error(
        capsys, ["buckets", ref, str(boolq_trio["cand"]), "--effect", "0"], tmp_path / "o2"
    )


def test_instruction_types_below_ten_are_too_few_to_test(ifeval_pair):
    from lm_eval_sink.buckets.render import summary_markdown

    rep = bucket(ifeval_pair["ref"], ifeval_pair["cand"], "ifeval", FAST)
    assert all(t["too_few_to_test"] is (t["n"] < 10) for t in rep.instruction_types) and rep.instruction_types
    md = summary_markdown(rep.to_json())
    assert "| detectable_format:json_format | 1 | 1 | 0 | 100.0 | 0.0 | too few to test | - | - |" in md
    assert "-100.0" not in md
    assert "Power (alpha 0.05 two-sided, power 0.8; the test: exact McNemar" in md  # 21 docs, 13 discordant
    # 21 prompts, no instruction differs: the cluster bootstrap's 0.0 [0.0, 0.0] is withheld, with why
    same = bucket(ifeval_pair["ref"], ifeval_pair["ref"], "ifeval", FAST).instruction_level
    assert same["delta_ci"] is None and same["method"].startswith("withheld: every prompt's share of instructions")
    assert "; Connor (1987) normal approximation for paired proportions, conditional on the observed" in md


# --- small samples said first, truncation over every doc, the power of the test that runs (issues 42, 44) ---------

CUT = "We add and subtract the amounts step by step, and then we keep going with more of the same steps until it is cut"


@pytest.fixture(scope="module")
def gsm8k_four(shared_data, tmp_path_factory):
    """The tour's gsm8k_cot comparison at --limit 4: both runs fail all four problems, and all 8 answers stop at
    max_gen_toks 64 (cut mid-sentence, no final answer)."""
    gen = {"until": ["Q:"], "do_sample": False, "temperature": 0.0, "max_gen_toks": 64}
    root = tmp_path_factory.mktemp("gsm8k_four")
    runs = {}
    for side, suffix, chat in (("ref", "", True), ("cand", " and more", False)):
        lines = [
            s for i, d in enumerate(bl.gsm8k_docs(shared_data)[:4]) for s in bl.gsm8k_samples(i, d, CUT + suffix, gen)
        ]
        runs[side] = bl.write_run(root / side, {"gsm8k_cot_zeroshot": lines}, model="m", limit=4, chat_template=chat)
    return runs


def test_four_docs_say_too_few_to_tell_first_everywhere(gsm8k_four, tmp_path, capsys):
    """4 paired docs: "too few to tell" before every delta (console, buckets.md, the figure's title, the report's
    headline); a 0/1 interval that cannot collapse on identical outcomes (main: a bootstrap's 0.0 [0.0, 0.0]); the
    truncation line although no doc regressed (main: counted over regressions only, so none)."""
    from lm_eval_sink.buckets.render import figure_title

    out = tmp_path / "b"
    args = ["buckets", str(gsm8k_four["ref"]), str(gsm8k_four["cand"]), "--quiet", "--output", str(out)]
    assert main(args) == 0
    console = capsys.readouterr().out
    md = (out / "buckets.md").read_text()
    assert md in console
    first = md.index("**Too few to tell: 4 paired docs (at least 10 are needed).**")
    assert first < md.index("| exact_match |") and "| too few to tell: 0.0 [-49.0, 49.0] | 1 | n/a |" in md
    assert "Intervals: exact_match: Newcombe's hybrid score interval for paired proportions (method 10)" in md
    data = json.loads((out / "buckets.json").read_text())
    assert data["delta_ci"][1] - data["delta_ci"][0] > 0.9 and data["counts"]["both_fail"] == 4
    assert data["too_few_to_tell"] == "too few to tell: 4 paired docs (at least 10 are needed)"
    sides = data["truncation"]["reference"], data["truncation"]["candidate"]
    assert [(c["truncated"], c["responses"]) for c in sides] == [(4, 4), (4, 4)]
    assert "Responses that hit the generation limit: reference 4 of 4, candidate 4 of 4; regressions 0" in md
    assert all(r["truncated"] and r["reference_truncated"] for r in data["rows"])
    assert figure_title(data).startswith("too few to tell: gsm8k_cot_zeroshot: exact_match (strict-match), 4 paired")
    # fewshot_as_multiturn cannot change a 0-shot task's scores ("no" in its table): not among what the delta mixes
    assert data["protocol_differences"]["fewshot_as_multiturn"]["affects_scores"] is False
    assert "protocols differ in chat_template_applied, chat_template_sha: the delta mixes model and protocol" in md
    assert "the protocols also differ in fewshot_as_multiturn, which cannot change this task's scores" in md
    assert main(["report", "--buckets", str(out), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    card = page[page.index('<div class="cards">') :]
    assert card.index(">too few to tell<") < card.index('data-src="b/buckets.json#/delta"') < card.index("McNemar")
    assert "4 paired docs (at least 10 are needed): the delta describes these docs only" in card
    # the report carries every note of buckets.md (buckets.notes), the truncation first
    notes = md.split("Notes:\n\n")[1].strip().splitlines()
    assert notes[0].startswith("- Responses that hit the generation limit: reference 4 of 4, candidate 4 of 4")
    assert all(f"<li>{n[2:]}</li>" in html.unescape(page) for n in notes)


def test_threshold_reports_the_power_of_the_mcnemar_test_it_runs(shared_data):
    """With --threshold buckets runs McNemar on pass/fail: the power is that test's (main: the paired mean's, in
    eqbench units); without, Wilcoxon's, with the default effect 5% of EQ-Bench's declared 0-100 range."""
    from lm_eval_sink.buckets.render import summary_markdown
    from lm_eval_sink.power import connor_power

    ref, cand = _eqbench_pair(shared_data, 24)
    rep = bucket(ref, cand, "eq_bench", BucketSettings(n_bootstrap=500, threshold=90.0))
    pw = rep.power
    assert rep.counts["regression"] and rep.discordant >= 2
    assert pw["test"] == "exact McNemar (binomial on the discordant docs) of pass/fail (score >= 90)"
    assert pw["discordant_share"] == rep.discordant / 24 and pw["sd_difference"] is None
    assert pw["effect_shown"] == 5.0 and pw["effect"] == 0.05
    if pw["power_at_effect"] is not None:
        assert pw["power_at_effect"] == pytest.approx(connor_power(24, pw["discordant_share"], 0.05))
    assert "the test: exact McNemar (binomial on the discordant docs) of pass/fail (score >= 90)" in summary_markdown(
        rep.to_json()
    )
    plain = bucket(ref, cand, "eq_bench", BucketSettings(n_bootstrap=500)).power
    assert plain["test"] == "Wilcoxon signed-rank" and plain["effect"] == 5.0
    assert plain["effect_source"] == "default: 5% of the metric's range, 0 to 100"


def test_each_interval_sits_beside_its_own_test(shared_data):
    """EQ-Bench under --threshold 90: the score's bootstrap interval sits beside Wilcoxon (main: the report's headline
    put it beside McNemar p, the pass rate's test, and buckets.md's score row too); the pass rate's exact interval
    sits beside McNemar, on its own row of the report (main: no pass rate there)."""
    from lm_eval_sink.buckets.render import summary_markdown
    from lm_eval_sink.buckets.stats import EXACT_CI_METHOD
    from lm_eval_sink.report.render import render_html
    from lm_eval_sink.report.view import BucketsInput, Doc, ReportInputs

    ref, cand = _eqbench_pair(shared_data, 24)
    data = bucket(ref, cand, "eq_bench", BucketSettings(n_bootstrap=200, threshold=90.0)).to_json()
    assert data["pass_rate"]["delta_ci_method"] == EXACT_CI_METHOD and data["mcnemar_p"] < 0.05
    score_row = next(line for line in summary_markdown(data).splitlines() if line.startswith("| eqbench |"))
    assert score_row.endswith(f"| n/a | {data['wilcoxon_p']:.4g} |")
    page = render_html(ReportInputs(buckets=(BucketsInput(Doc("b/buckets.json", data, "0"), {}, {}),)))
    card = page[page.index('<div class="cards">') : page.index("</header>")]
    assert "&middot; Wilcoxon p <span" in card and "McNemar" not in card
    row = page[page.index("<td>pass rate (score &ge; 90, points)</td>") :].split("</tr>")[0]
    assert 'data-src="b/buckets.json#/pass_rate/delta_ci/1"' in row and 'data-src="b/buckets.json#/mcnemar_p"' in row


def test_the_0_1_interval_agrees_with_the_exact_test_it_sits_beside(shared_data):
    """100 BoolQ docs, 4 regressions and no recovery: the bootstrap interval of the delta, [-8.0, -1.0] points,
    excluded 0 while the exact McNemar test buckets runs gives p = 0.125 (main: a note said so). The exact conditional
    interval holds 0 (its end nearest 0: +0.8; its far end Newcombe's, -8.3); at 6 regressions (p = 0.031) it
    excludes 0 (-0.5), and the test rejects. No note either way: the two cannot disagree."""
    from lm_eval_sink.buckets.render import summary_markdown
    from lm_eval_sink.buckets.stats import EXACT_CI_METHOD

    ref = _boolq_lines(shared_data, _outcomes(100, set(range(60))))
    four = bucket(ref, _boolq_lines(shared_data, _outcomes(100, set(range(4, 60)))), "boolq", FAST)
    assert four.mcnemar_p == 0.125 and four.delta_ci_method == EXACT_CI_METHOD
    assert [round(100 * x, 1) for x in four.delta_ci] == [-8.3, 0.8]
    assert "| acc | 60.0 | 56.0 | -4.0 [-8.3, 0.8] | 0.125 | n/a |" in summary_markdown(four.to_json())
    six = bucket(ref, _boolq_lines(shared_data, _outcomes(100, set(range(6, 60)))), "boolq", FAST)
    assert six.mcnemar_p < 0.05 and [round(100 * x, 1) for x in six.delta_ci] == [-10.9, -0.5]
    assert not [n for n in four.notes + six.notes if "McNemar" in n or "interval" in n]
