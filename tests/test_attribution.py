"""Gap attribution on constructed runs with known strict / lenient outcomes, the vendor registry, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from constructed_runs import TS, write_run

from lm_eval_sink.attribution import INTERVALS, AttributeOptions, lineage, per_prompt_split, plot_rows, to_markdown
from lm_eval_sink.benchmarks import benchmark_of, load_benchmarks
from lm_eval_sink.cli import main
from lm_eval_sink.commands.attribute import run_attribution
from lm_eval_sink.errors import UserError
from lm_eval_sink.vendors import STATED_KEYS

# IFEval: reference passes 4/5 strict, 5/5 loose; candidate 2/5 strict, 4/5 loose.
# doc 1: strict regression forgiven by the loose check (access); doc 2: lost under both (capacity).
REF_IF = ([1, 1, 1, 1, 0], [1, 1, 1, 1, 1])
CAND_IF = ([1, 0, 0, 1, 0], [1, 1, 0, 1, 1])
# GSM8K: reference 3/4 strict, 4/4 flexible; candidate 1/4 strict, 3/4 flexible.
REF_GSM = ([1, 1, 1, 0], [1, 1, 1, 1])
CAND_GSM = ([0, 1, 0, 0], [1, 1, 0, 1])


def _pair(tmp_path: Path, name: str = "p", samples: bool = True, **kw) -> tuple[Path, Path]:
    ref = write_run(
        tmp_path / name / "ref", {"ifeval": REF_IF, "gsm8k_cot": REF_GSM}, model="/models/llm", samples=samples, **kw
    )
    cand = write_run(
        tmp_path / name / "cand",
        {"ifeval": CAND_IF, "gsm8k_cot": CAND_GSM},
        model="/models/vlm-backbone",
        samples=samples,
        **kw,
    )
    return ref, cand


def _bench(att, name):
    return next(b for b in att.benchmarks if b["benchmark"] == name)


def test_per_prompt_split_is_exact(tmp_path):
    ref, cand = _pair(tmp_path)
    att = run_attribution([str(ref)], [str(cand)])
    ife = _bench(att, "IFEval")
    assert ife["construct"] == "format"
    [row] = ife["comparisons"]
    assert row["kind"] == "same_protocol" and row["protocol"] == "instruct" and row["split_from"] == "samples"
    assert row["gap"] == -40.0 and row["capacity"] == -20.0 and row["access"] == -20.0
    pp = row["per_prompt"]
    assert (pp["n"], pp["strict_regressions"], pp["regressions_access"], pp["regressions_capacity"]) == (5, 2, 1, 1)
    assert pp["access_doc_ids"] == [1] and pp["capacity_doc_ids"] == [2]
    assert pp["strict_recoveries"] == 0 and pp["prompt_hash_differs"] == 0 and pp["matches_results"] is True
    assert pp["reference"] == {"strict": 80.0, "lenient": 100.0}
    assert pp["candidate"] == {"strict": 40.0, "lenient": 80.0}
    gsm = _bench(att, "GSM8K")
    [row] = gsm["comparisons"]
    assert gsm["construct"] == "procedure"
    assert (row["gap"], row["access"], row["capacity"]) == (-50.0, -25.0, -25.0)
    assert (row["per_prompt"]["regressions_access"], row["per_prompt"]["regressions_capacity"]) == (1, 1)
    assert row["non_final"] is True  # --limit 5 runs


def test_parts_that_exceed_the_gap_or_take_the_other_sign_are_explained(tmp_path):
    # reference 40 strict / 100 loose, candidate 20 / 20: gap -20 = capacity -80 + access +60
    ref = write_run(tmp_path / "r", {"ifeval": ([1, 1, 0, 0, 0], [1, 1, 1, 1, 1])}, model="/models/llm")
    cand = write_run(tmp_path / "c", {"ifeval": ([1, 0, 0, 0, 0], [1, 0, 0, 0, 0])}, model="/models/vlm")
    att = run_attribution([str(ref)], [str(cand)])
    [row] = _bench(att, "IFEval")["comparisons"]
    assert (row["gap"], row["access"], row["capacity"]) == (-20.0, 60.0, -80.0)
    sentence = (
        "access +60.00 and capacity -80.00 add up to the gap -20.00 although they take opposite signs and access and "
        "capacity exceed the gap in size: capacity is the gap under lenient answer extraction "
        "(prompt_level_loose_acc,none), -80.00, and access = gap - capacity is what strict extraction adds to it, "
        "+60.00; neither part is bounded by the gap"
    )
    assert row["explanation"] == sentence and f"- instruct: {sentence}\n" in to_markdown(att)
    # parts within the gap and of its sign need no sentence (the exact split above: -40 = -20 + -20)
    ref, cand = _pair(tmp_path)
    [row] = _bench(run_attribution([str(ref)], [str(cand)]), "IFEval")["comparisons"]
    assert row["explanation"] is None


def test_aggregate_split_without_samples(tmp_path):
    ref, cand = _pair(tmp_path, samples=False)
    att = run_attribution([str(ref)], [str(cand)])
    [row] = _bench(att, "IFEval")["comparisons"]
    assert row["split_from"] == "aggregate" and row["per_prompt"] is None
    assert (row["gap"], row["access"], row["capacity"]) == (-40.0, -20.0, -20.0)


def test_two_protocols_gap_per_protocol_and_sign_flip(tmp_path):
    ri, ci = _pair(tmp_path, "instruct")
    # community-style runs where the candidate is AHEAD on IFEval: +20 strict
    rc = write_run(
        tmp_path / "community" / "ref",
        {"ifeval": ([1, 0, 0, 0, 0], [1, 0, 0, 0, 0])},
        model="/models/llm",
        chat=False,
        batch_size=1,
    )
    cc = write_run(
        tmp_path / "community" / "cand",
        {"ifeval": ([1, 1, 0, 0, 0], [1, 1, 0, 0, 0])},
        model="/models/vlm-backbone",
        chat=False,
        batch_size=1,
    )
    att = run_attribution([str(ri), str(rc)], [str(ci), str(cc)])
    ife = _bench(att, "IFEval")
    kinds = sorted((r["kind"], r["protocol"]) for r in ife["comparisons"])
    assert kinds == [("same_protocol", "community"), ("same_protocol", "instruct")]
    pe = ife["protocol_effect"]
    assert pe["gaps"] == {"instruct": [-40.0], "community": [20.0]}
    assert pe["baseline"] == "instruct" and pe["effects"] == {"community": 60.0}
    assert pe["sign_flip"] is True and pe["spread"] == 60.0
    community = next(r for r in ife["comparisons"] if r["protocol"] == "community")
    assert community["protocol_part"] == 60.0
    # cross-protocol pairs of different models are not compared at all (each has a same-protocol partner)
    assert ife["not_compared"] == [] and ife["unpaired"] == []
    # the plot draws community as the instruct gap's parts plus the protocol effect
    bar = next(b for b in plot_rows(att) if b["label"] == "IFEval\ncommunity")
    assert bar["parts"] == {"access": -20.0, "capacity": -20.0, "protocol": 60.0, "unsplit": 0.0, "unexplained": 0.0}
    md = to_markdown(att)
    assert "sign FLIPS" in md and "effect vs instruct: community +60.00" in md
    # baseline chosen by the user
    att2 = run_attribution([str(ri), str(rc)], [str(ci), str(cc)], AttributeOptions(baseline_protocol="community"))
    assert _bench(att2, "IFEval")["protocol_effect"]["effects"] == {"instruct": -60.0}


def test_same_weights_under_two_protocols_is_a_protocol_artefact(tmp_path):
    a = write_run(
        tmp_path / "a",
        {"ifeval": ([1, 1, 1, 1, 0], [1, 1, 1, 1, 1])},
        model="/models/qwen3",
        model_args={"enable_thinking": False},
    )
    b = write_run(tmp_path / "b", {"ifeval": ([1, 0, 0, 0, 0], [1, 1, 0, 0, 0])}, model="/models/qwen3")
    att = run_attribution([str(a)], [str(b)])
    [row] = _bench(att, "IFEval")["comparisons"]
    assert row["kind"] == "protocol_artefact" and row["gap"] == -60.0 and row["protocol_part"] == -60.0
    assert row["access"] is None and row["capacity"] is None
    assert [d["field"] for d in row["differing_fields"]] == ["model_args.enable_thinking"]
    assert att.lineage[0]["status"] == "same_model" and att.lineage[0]["flagged"] is False
    assert plot_rows(att)[0]["parts"]["protocol"] == -60.0


def test_same_weights_differing_only_in_limit_are_unexplained_not_protocol(tmp_path):
    a = write_run(tmp_path / "a", {"ifeval": REF_IF}, model="/models/qwen3", limit=None)
    b = write_run(tmp_path / "b", {"ifeval": CAND_IF}, model="/models/qwen3", limit=4.0)
    att = run_attribution([str(a)], [str(b)])
    [row] = _bench(att, "IFEval")["comparisons"]
    assert [d["field"] for d in row["differing_fields"]] == ["limit"]
    assert row["kind"] == "unexplained" and row["protocol_part"] is None and row["unexplained"] == row["gap"] == -40.0
    # the reference scored 5 of the task's 100 documents with no --limit recorded (lm-eval's --samples): not "all"
    assert (
        "reference a subset (5 of 100 documents; no --limit recorded; not final), candidate a --limit 4 subset (5 of "
        "100 documents; not final)" in row["explanation"]
    )
    assert plot_rows(att)[0]["parts"]["protocol"] == 0.0
    md = to_markdown(att)  # the note names the documents, never "only fields that cannot change scores"
    assert "same model: no protocol field differs; the documents differ (--limit) |" in md
    assert "cannot change scores" not in md.split("| unexplained |")[1]
    assert "- subset, not final: reference qwen3 IFEval 5 of 100 documents (no --limit recorded); candidate" in md
    # the HTML report: the same split (an unexplained column) and the same caveat, above the table
    out, page = tmp_path / "att", tmp_path / "r.html"
    assert main(["attribute", "--reference", str(a), "--candidate", str(b), "--output", str(out)]) == 0
    assert main(["report", "--attribution", str(out), "-o", str(page)]) == 0
    html = page.read_text()
    section = html[html.index('<section id="attribution">') :]
    assert section.index("Subset, not final: reference qwen3 IFEval 5 of 100") < section.index("<th>unexplained</th>")
    assert "<th>gap</th><th>protocol part</th><th>unexplained</th>" in section
    part = 'comparisons/0/gap">-40.00</span> [-72.64, +16.26]</td><td><span class="na">n/a</span></td>'
    part += '<td><span class="num" data-src='
    assert part + '"att/attribution.json#/benchmarks/0/comparisons/0/unexplained"' in section
    other = write_run(tmp_path / "c", {"ifeval": CAND_IF}, model="/models/other", limit=4.0)
    assert "- not compared (different models on different document subsets (--limit)): " in to_markdown(
        run_attribution([str(a)], [str(other)])
    )


def test_a_capped_run_against_an_uncapped_one_names_the_cap_first_and_too_few_to_tell(tmp_path):
    """The issue-49 case: the same model, generation capped at 48 tokens against IFEval's own 1,280, 5 documents:
    a protocol difference named first, and buckets' small-sample rule before the gap and its interval."""
    a = write_run(tmp_path / "a", {"ifeval": REF_IF}, model="/models/qwen", max_gen_toks=None)
    b = write_run(tmp_path / "b", {"ifeval": CAND_IF}, model="/models/qwen", max_gen_toks=48)
    att = run_attribution([str(a)], [str(b)])
    [row] = _bench(att, "IFEval")["comparisons"]
    assert row["kind"] == "protocol_artefact" and row["protocol_part"] == row["gap"] == -40.0
    cap = {"field": "generation cap (max_gen_toks)", "reference": "the task's own"}
    assert row["differing_fields"][0] == {**cap, "candidate": "48 tokens (--gen_kwargs)", "affects_scores": True}
    assert row["too_few_to_tell"] and row["gap_interval"] == pytest.approx([-72.64, 16.26], abs=0.005)
    md = to_markdown(att)
    assert "| too few to tell: -40.00 [-72.64, +16.26] |" in md and f"- intervals: {INTERVALS}\n" in md
    assert "95% interval for two unpaired shares" in INTERVALS  # Newcombe's, as statsmodels' "newcomb" gives it
    assert "same model: generation cap (max_gen_toks): the task's own vs 48 tokens (--gen_kwargs); gen_kwargs" in md
    out, page = tmp_path / "att", tmp_path / "r.html"  # the HTML report names the cap and says too few to tell
    assert main(["attribute", "--reference", str(a), "--candidate", str(b), "--output", str(out)]) == 0
    assert main(["report", "--attribution", str(out), "-o", str(page)]) == 0
    section = page.read_text().split('<section id="attribution">')[1]
    assert ">too few to tell: <span" in section and "[-72.64, +16.26]" in section
    assert '<p class="muted">Intervals: each gap&#39;s [low, high] is a 95% interval for two unpaired shares' in section
    assert '<td class="mono">generation cap (max_gen_toks), gen_kwargs' in section


def test_different_models_under_different_protocols_are_not_compared(tmp_path):
    ref = write_run(tmp_path / "r", {"ifeval": REF_IF}, model="/models/llm", chat=True)
    cand = write_run(tmp_path / "c", {"ifeval": CAND_IF}, model="/models/vlm", chat=False)
    att = run_attribution([str(ref)], [str(cand)])
    ife = _bench(att, "IFEval")
    assert ife["comparisons"] == []
    [nc] = ife["not_compared"]
    assert nc["kind"] == "confounded" and nc["gap"] is None
    assert {d["field"] for d in nc["differing_fields"]} >= {"apply_chat_template", "chat_template"}
    assert "not compared (different models under different protocols)" in to_markdown(att)


def test_sample_pairing_refuses_different_documents_and_reports_prompts(tmp_path):
    ref = write_run(tmp_path / "r", {"ifeval": REF_IF}, model="/models/llm")
    cand = write_run(tmp_path / "c", {"ifeval": CAND_IF}, model="/models/vlm", prompt_tag="<think>")
    att = run_attribution([str(ref)], [str(cand)])
    assert _bench(att, "IFEval")["comparisons"][0]["per_prompt"]["prompt_hash_differs"] == 5
    rows_r = json.loads("[" + ",".join((tmp_path / "r" / f"samples_ifeval_{TS}.jsonl").read_text().splitlines()) + "]")
    rows_c = [dict(r) for r in rows_r]
    rows_c[3]["doc_hash"] = "0" * 64
    with pytest.raises(UserError, match="doc_id 3 has different doc_hash"):
        per_prompt_split(rows_r, rows_c, "prompt_level_strict_acc,none", "prompt_level_loose_acc,none")
    with pytest.raises(
        UserError, match=r"1 doc_ids only in the reference, 0 only in the candidate \(.*: 5 docs, .*: 4;"
    ):
        per_prompt_split(rows_r, rows_r[:4], "prompt_level_strict_acc,none", None)
    part = per_prompt_split(rows_r, rows_r[:4], "prompt_level_strict_acc,none", None, allow_partial=True)
    assert part["n"] == 4 and part["dropped"] == {"reference_only": 1, "candidate_only": 0} and part["gap"] == 0.0
    with pytest.raises(UserError, match="appears twice"):
        per_prompt_split(rows_r + rows_r[:1], rows_r, "prompt_level_strict_acc,none", None)
    with pytest.raises(UserError, match="no samples under filter 'strict-match'"):
        per_prompt_split(rows_r, rows_r, "exact_match,strict-match", None)


def _model_dir(path: Path, base_model: str | None = None, text_config: str | None = None) -> Path:
    path.mkdir(parents=True)
    cfg = {"model_type": "llama"}
    if text_config:
        cfg["text_config"] = {"_name_or_path": text_config}
    (path / "config.json").write_text(json.dumps(cfg))
    if base_model:
        (path / "README.md").write_text(f"---\nbase_model:\n- {base_model}\nlicense: apache-2.0\n---\n# card\n")
    return path


def test_lineage_from_model_card_config_registry_and_declaration(tmp_path):
    ref_dir = _model_dir(tmp_path / "Qwen2.5-7B-Instruct")
    cand_dir = _model_dir(tmp_path / "my-vlm-backbone", base_model="Qwen/Qwen2.5-7B-Instruct")
    other = _model_dir(tmp_path / "other-backbone", text_config="Qwen/Qwen2.5-7B")
    ref = write_run(tmp_path / "r", {"ifeval": REF_IF}, model=str(ref_dir))
    cand = write_run(tmp_path / "c", {"ifeval": CAND_IF}, model=str(cand_dir))
    cand2 = write_run(tmp_path / "c2", {"ifeval": CAND_IF}, model=str(other))
    [li] = run_attribution([str(ref)], [str(cand)]).lineage
    assert li["status"] == "parent" and li["flagged"] is False
    assert li["evidence"] == [{"parent": "Qwen/Qwen2.5-7B-Instruct", "source": "model card base_model"}]
    [li] = run_attribution([str(ref)], [str(cand2)]).lineage
    assert li["status"] == "not_parent" and li["flagged"] is True
    assert "config.json text_config._name_or_path names Qwen/Qwen2.5-7B" in li["how"]
    [li] = run_attribution([str(ref)], [str(cand2)], AttributeOptions(declared_lineage="parent")).lineage
    assert li["status"] == "mismatched" and li["flagged"] is True
    # no evidence anywhere: unknown unless declared
    plain = {"key": "/a", "names": ["/a"], "parents": []}
    assert lineage(plain, {"key": "/b", "names": ["/b"], "parents": []})["status"] == "unknown"
    assert lineage(plain, {"key": "/b", "names": ["/b"], "parents": []}, "parent") == {
        "status": "parent",
        "flagged": False,
        "how": "declared by the user",
        "evidence": [],
        "declared": "parent",
    }


def test_mixture_is_shown_as_declared_never_inferred(tmp_path):
    ref, cand = _pair(tmp_path)
    att = run_attribution([str(ref)], [str(cand)], AttributeOptions(mixture={"text_share": "0.1"}))
    assert att.mixture["declared"] == {"text_share": "0.1"}
    assert run_attribution([str(ref)], [str(cand)]).mixture["declared"] is None


def test_benchmarks_are_data():
    b = load_benchmarks()
    assert benchmark_of("gsm8k_cot_zeroshot", b).name == "GSM8K"
    assert benchmark_of("mmlu_pro_math", b).name == "MMLU-Pro"  # the longest matching pattern wins over mmlu_*
    assert benchmark_of("mmlu_anatomy", b).name == "MMLU"
    assert (
        benchmark_of("ifeval", b).construct == "format" and benchmark_of("sink_strength", b).construct == "diagnostic"
    )
    assert benchmark_of("hellaswag", b) is None


# --- registry ----------------------------------------------------------------------------------


def test_readme_example_protocol_artefact_qwen3():
    att = run_attribution(
        ["vendor:qwen3-8b/ifeval/nothink-template"],
        ["vendor:qwen3-8b/ifeval/default-template"],
        AttributeOptions(vendor=True),
    )
    ife = _bench(att, "IFEval")
    [row] = ife["comparisons"]
    assert row["kind"] == "protocol_artefact" and row["gap"] == -48.43 and row["protocol_part"] == -48.43
    assert row["differing_fields"] == [
        {"field": "enable_thinking", "reference": False, "candidate": True, "affects_scores": True}
    ]
    assert att.lineage[0]["status"] == "same_model"
    vend = {v["measured"]["protocol"]: v for v in ife["vendor"]}
    assert (
        vend["qwen3-nothink-template"]["measured_minus_vendor"] == 0.18
        and vend["qwen3-nothink-template"]["protocol_differences"] == []
    )
    assert vend["qwen3-default-template"]["protocol_differences"] == [
        {"field": "enable_thinking", "vendor": False, "measured": True}
    ]


def test_readme_example_gap_changes_with_protocol_qwen25_vl():
    att = run_attribution(
        ["vendor:Qwen2.5-7B-Instruct"], ["vendor:Qwen2.5-VL-7B"], AttributeOptions(baseline_protocol="instruct")
    )
    pe = _bench(att, "IFEval")["protocol_effect"]
    assert pe["gaps"]["instruct"] == [-9.43] and pe["gaps"]["community"] == [-20.52]
    assert pe["effects"]["community"] == -11.09 and pe["sign_flip"] is False
    assert _bench(att, "GSM8K")["protocol_effect"]["effects"] == {"community": -21.38}
    assert _bench(att, "MMLU")["construct"] == "knowledge"
    assert att.lineage[0]["status"] == "unknown" and att.lineage[0]["flagged"] is True


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_attribute_writes_json_markdown_png_with_provenance(tmp_path, capsys):
    ref, cand = _pair(tmp_path)
    out = tmp_path / "att"
    args = ["attribute", "--reference", str(ref), "--candidate", str(cand), "--mixture", "text_share=0.1"]
    assert main([*args, "--output", str(out)]) == 0
    stdout = capsys.readouterr().out
    # 5 documents: buckets' small-sample rule before the gap, which has its interval
    gap = "too few to tell: -40.00 [-72.64, +16.26]"
    assert f"| instruct | same_protocol | llm 80.00 | vlm-backbone 40.00 | {gap} | -20.00 | -20.00 |" in stdout
    doc = json.loads((out / "attribution.json").read_text())
    assert doc["schema_version"] == 1 and doc["mixture"]["declared"] == {"text_share": "0.1"}
    assert [i["sha256"] for i in doc["provenance"]["inputs"]] == [i["sha256"] for i in doc["inputs"]]
    assert len(doc["provenance"]["inputs"][0]["sha256"]) == 64
    assert (out / "attribution.md").read_text().startswith("# Gap attribution")
    assert (out / "attribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # rerun: same result, byte for byte apart from the provenance block
    out2 = tmp_path / "att2"
    assert main([*args, "--output", str(out2)]) == 0
    doc2 = json.loads((out2 / "attribution.json").read_text())
    assert doc2["provenance"]["result_sha256"] == doc["provenance"]["result_sha256"]
    assert (out2 / "attribution.md").read_bytes() == (out / "attribution.md").read_bytes()
    # refuses to overwrite
    assert main(["attribute", "--reference", str(ref), "--candidate", str(cand), "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_samples_beside_a_results_file_are_in_the_attribute_key(tmp_path):
    """`attribute` given a results JSON (not its folder) keyed that file alone, so its samples, edited in place (same
    size and mtime), kept the key: now each file beside it is keyed by content, and put back the same key."""
    import os

    from lm_eval_sink.commands.attribute import AttributeWork
    from lm_eval_sink.keys import key_of

    ref, cand = _pair(tmp_path)
    work = AttributeWork((str(ref),), (str(cand),), AttributeOptions(), None)
    key = key_of(work).key
    for samples in sorted(ref.parent.glob("samples_*.jsonl")):
        data, st = samples.read_bytes(), samples.stat()
        for content in (bytes([data[0] ^ 1]) + data[1:], data):
            samples.write_bytes(content)
            os.utime(samples, ns=(st.st_atime_ns, st.st_mtime_ns))
            assert (key_of(work).key == key) == (content == data), samples.name


def test_cli_many_values_after_one_flag(tmp_path, capsys):
    ri, ci = _pair(tmp_path, "instruct")
    rc, cc = _pair(tmp_path, "community", chat=False, batch_size=1)
    assert main(["attribute", "--reference", str(ri), str(rc), "--candidate", str(ci), str(cc)]) == 0
    out = capsys.readouterr().out
    assert "| instruct | same_protocol |" in out and "| community | same_protocol |" in out


def _bad(tmp_path: Path, case: str) -> list[str]:
    ref, cand = _pair(tmp_path)
    if case == "different_tasks":
        other = write_run(tmp_path / "o", {"gsm8k_cot": REF_GSM}, model="/models/x")
        only_if = write_run(tmp_path / "i", {"ifeval": REF_IF}, model="/models/y")
        return ["--reference", str(only_if), "--candidate", str(other)]
    if case == "not_lm_eval":
        p = tmp_path / "x" / f"results_{TS}.json"
        p.parent.mkdir()
        p.write_text(json.dumps({"accuracy": 0.5}))
        return ["--reference", str(ref), "--candidate", str(p)]
    if case == "missing_metric":
        res = json.loads(cand.read_text())
        del res["results"]["ifeval"]["prompt_level_loose_acc,none"]
        cand.write_text(json.dumps(res))
        return ["--reference", str(ref), "--candidate", str(cand)]
    if case == "missing_field":
        res = json.loads(cand.read_text())
        del res["configs"]
        cand.write_text(json.dumps(res))
        return ["--reference", str(ref), "--candidate", str(cand)]
    if case == "bad_mixture":
        return ["--reference", str(ref), "--candidate", str(cand), "--mixture", "textshare"]
    if case == "unknown_vendor_entry":
        return ["--reference", "vendor:Qwen9", "--candidate", str(cand)]
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case", ["different_tasks", "not_lm_eval", "missing_metric", "missing_field", "bad_mixture", "unknown_vendor_entry"]
)
def test_cli_attribute_bad_inputs(tmp_path, capsys, case):
    args = _bad(tmp_path, case)
    out = tmp_path / "out"
    assert main(["attribute", *args, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert not out.exists() and not list(tmp_path.glob("out.partial-*"))
    expected = {
        "different_tasks": "share no benchmark",
        "not_lm_eval": "not an lm-eval results file",
        "missing_metric": "no 'prompt_level_loose_acc,none'",
        "missing_field": "lacks configs",
        "bad_mixture": "not KEY=VALUE",
        "unknown_vendor_entry": "not in the vendor registry",
    }[case]
    assert expected in err[0]


# --- real lm-eval runs ---------------------------------------------------------------------------


@pytest.mark.slow
def test_real_runs_same_weights_two_protocols_and_per_prompt_self_pairing(smollm2_instruct_run, smollm2_community_run):
    from lm_eval_sink.runs import load_results

    ri, rc = load_results(smollm2_instruct_run)["results"], load_results(smollm2_community_run)["results"]
    att = run_attribution([str(smollm2_instruct_run.results)], [str(smollm2_community_run.results)])
    assert att.lineage[0]["status"] == "same_model"
    assert sorted(b["benchmark"] for b in att.benchmarks) == ["GSM8K", "IFEval"]  # sink_strength is a diagnostic
    ife = _bench(att, "IFEval")
    [row] = ife["comparisons"]
    assert row["kind"] == "protocol_artefact"
    want = round(100 * (rc["ifeval"]["prompt_level_strict_acc,none"] - ri["ifeval"]["prompt_level_strict_acc,none"]), 6)
    assert row["gap"] == want and row["protocol_part"] == want
    assert {d["field"] for d in row["differing_fields"]} == {
        "apply_chat_template",
        "fewshot_as_multiturn",
        "chat_template",
    }
    # a run against itself: same protocol, real samples paired per prompt, nothing lost
    self_att = run_attribution([str(smollm2_instruct_run.results)], [str(smollm2_instruct_run.folder)])
    for name, key in (("IFEval", "prompt_level_strict_acc,none"), ("GSM8K", "exact_match,strict-match")):
        [row] = _bench(self_att, name)["comparisons"]
        pp = row["per_prompt"]
        assert row["kind"] == "same_protocol" and row["split_from"] == "samples"
        assert (
            row["gap"],
            row["access"],
            row["capacity"],
            pp["n"],
            pp["strict_regressions"],
            pp["prompt_hash_differs"],
        ) == (0.0, 0.0, 0.0, 5, 0, 0)
        assert pp["matches_results"] is True
        task = "ifeval" if name == "IFEval" else "gsm8k_cot_zeroshot"
        assert pp["reference"]["strict"] == round(100 * ri[task][key], 6)


@pytest.mark.slow
def test_real_capped_run_beside_its_own_vendor_figure_names_the_cap_and_is_drawn_so(
    tmp_path, capsys, smollm2_instruct_run
):
    """A --limit 5 run of SmolLM2 capped at 64 tokens beside a vendor figure of SmolLM2 whose protocol states nothing
    else that differs: the cap is the protocol difference (issue 49: named first, the whole gap its part), the subset
    named, in the table and the figure."""
    from lm_eval_sink.attribution import plot_title
    from lm_eval_sink.runs import load_results

    reg, out, name = tmp_path / "mine.yaml", tmp_path / "att", "SmolLM2-135M-Instruct"
    add = ["vendor", "add", "--model", name, "--benchmark", "IFEval", "--value", "56.7", "--source", "card"]
    add += ["--source-title", "SmolLM2 card", "--protocol", "card", "--described", "chat", "--registry", str(reg)]
    assert main([*add, "--stated", "apply_chat_template=true"]) == 0
    run = ["--candidate", str(smollm2_instruct_run.folder), "--as", name, "--vendor", "--registry", str(reg)]
    assert main(["attribute", "--reference", f"vendor:{name}", *run, "--output", str(out)]) == 0
    stdout = capsys.readouterr().out
    att = run_attribution(
        [f"vendor:{name}"], run[1:2], AttributeOptions(vendor=True, registry_file=reg, as_names=[name])
    )
    [row] = _bench(att, "IFEval")["comparisons"]
    assert json.loads((out / "attribution.json").read_text())["benchmarks"][0]["comparisons"][0] == row
    measured = round(100 * load_results(smollm2_instruct_run)["results"]["ifeval"]["prompt_level_strict_acc,none"], 6)
    gap = round(measured - 56.7, 6)
    assert row["kind"] == "protocol_artefact" and row["gap"] == row["protocol_part"] == gap
    assert row["differing_fields"][0]["field"] == "generation cap (max_gen_toks)" and "left unexplained" not in stdout
    assert f"- subset, not final: candidate {name} IFEval 5 of 541 documents (--limit 5)" in stdout
    # the figure: the same split as the table, the subset in its title
    [bar] = plot_rows(att)
    assert bar["parts"]["protocol"] == gap and not bar["parts"].get("unexplained")
    title = " ".join(plot_title(att).split())
    assert f"split into its parts subset, not final: candidate {name} IFEval 5 of 541 documents (--limit 5)" in title


def test_vendor_figures_and_reported_gaps_beside_measured_runs(tmp_path):
    ref = write_run(tmp_path / "r", {"ifeval": REF_IF}, model="/models/Qwen2.5-7B-Instruct")
    cand = write_run(tmp_path / "c", {"ifeval": CAND_IF}, model="/models/Qwen2.5-VL-7B-Instruct")
    as_names = ["/models/Qwen2.5-7B-Instruct=Qwen2.5-7B-Instruct", "/models/Qwen2.5-VL-7B-Instruct=Qwen2.5-VL-7B"]
    plain = run_attribution([str(ref)], [str(cand)], AttributeOptions(as_names=as_names))
    # no registry figures without --vendor
    assert [r["kind"] for r in _bench(plain, "IFEval")["comparisons"]] == ["same_protocol"]
    # a local folder is never matched by its name: without --as, none of the registry's figures
    unmatched = run_attribution([str(ref)], [str(cand)], AttributeOptions(vendor=True))
    assert _bench(unmatched, "IFEval")["vendor"] == []
    assert unmatched.registry["vendor_missing"] == ["Qwen2.5-7B-Instruct", "Qwen2.5-VL-7B-Instruct"]
    att = run_attribution([str(ref)], [str(cand)], AttributeOptions(vendor=True, as_names=as_names))
    assert [m["by"] for m in att.registry["matches"]] == ["matched by --as"] * 2
    assert att.registry["vendor_missing"] == ["Qwen2.5-VL-7B"]  # the registry has no vendor figure of the VLM
    ife = _bench(att, "IFEval")
    kinds = [(r["kind"], r["protocol"], r["gap"]) for r in ife["comparisons"]]
    assert kinds[0] == ("same_protocol", "instruct", -40.0)
    assert ("reported_gap", "instruct", -9.43) in kinds and ("reported_gap", "community", -20.52) in kinds
    # measured and reported under the same named protocol
    assert ife["protocol_effect"]["gaps"]["instruct"] == [-40.0, -9.43]
    [v] = ife["vendor"]
    assert v["vendor"]["id"] == "qwen2.5-7b-instruct/ifeval/vendor"
    assert v["measured"]["value"] == 80.0 and v["measured_minus_vendor"] == 8.8
    # the run capped generation at 64 tokens; the vendor states nothing about its protocol (the task's own length)
    cap = {"field": "generation cap (max_gen_toks)", "vendor": "the task's own", "measured": 64}
    assert v["protocol_differences"] == [cap] and v["vendor_unstated"] == list(STATED_KEYS)
    assert v["too_few_to_tell"] and v["gap_interval"] is not None  # 5 measured documents
