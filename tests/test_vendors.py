"""The vendor registry: every figure verified in its source or said to be unverified; `vendor add` for the user's own
model, then `attribute --vendor` on a local folder matched only by --as or its hub id."""

from __future__ import annotations

import json

import pytest
import yaml
from constructed_runs import write_run

from lm_eval_sink.attribution import AttributeOptions, to_markdown, unverified_figures
from lm_eval_sink.cli import main
from lm_eval_sink.commands.attribute import run_attribution
from lm_eval_sink.errors import UserError
from lm_eval_sink.vendors import STATED_KEYS, load_registry

SCORE = "{id: x, model: Qwen3-8B, benchmark: IFEval, metric: m, value: 1, source: qwen3-report, protocol: instruct"
GAP = (
    "{id: g, reference: Qwen3-8B, candidate: Qwen3-VL-8B, benchmark: IFEval, metric: m, value: -1, "
    "source: qwen3-report, protocol: instruct"
)
ONE = "unverified must be given when the figure has no `verified: {date, source, quote}`"
VERIFIED = "verified: {date: 2026-12-05, source: 'T1', quote: '1'}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (f"scores:\n  - {SCORE}}}\n", [f"scores[0].unverified: {ONE}"]),  # neither
        (f"scores:\n  - {SCORE}, {VERIFIED}, unverified: why}}\n", [f"scores[0].unverified: {ONE}"]),  # both
        (f"gaps:\n  - {GAP}, unverified: '  '}}\n", [f"gaps[0].unverified: {ONE}"]),
        (f"scores:\n  - {SCORE}, verified: {{date: 2026-12-05, source: T1}}}}\n", ["scores[0].verified", "quote"]),
        (f"scores:\n  - {SCORE}, verified: {{date: yesterday, source: T, quote: q}}}}\n", ["scores[0].verified.date"]),
        (
            f"scores:\n  - {SCORE}, unverified: why, verfied: {{}}}}\n",
            ["unknown key 'verfied' (did you mean 'verified'?)"],
        ),
        (f"scores:\n  - {SCORE}, unverified: u, vlaue: 2}}\n", ["unknown key 'vlaue' (did you mean 'value'?)"]),
        ("protocols:\n  p: {described: d, stated: {num_shots: 5}}\n", ["key 'num_shots'", "'num_fewshot'?"]),
        (f"scores:\n  - {SCORE.replace('qwen3-report', 'nowhere')}, unverified: u}}\n", ["'nowhere' is not defined"]),
        (f"scores:\n  - {SCORE.replace(', protocol: instruct', '')}, unverified: u}}\n", ["score lacks 'protocol'"]),
        (f"scores:\n  - {SCORE.replace('IFEval', 'IFEVAL')}, unverified: u}}\n", ["unknown benchmark 'IFEVAL'"]),
        (
            f"scores:\n  - {SCORE.replace('id: x', 'id: qwen3-8b/ifeval/vendor-nothink')}, unverified: u}}\n",
            ["used twice"],
        ),
    ],
)
def test_user_registry_is_validated_strictly(tmp_path, extra, message):
    f = tmp_path / "reg.yaml"
    f.write_text(extra)
    with pytest.raises(UserError) as e:
        load_registry(f)
    assert all(part in e.value.message for part in message) and "\n" not in e.value.message, e.value.message


def test_bundled_registry_every_figure_verified_with_its_quote_or_unverified_with_a_reason():
    reg = load_registry()
    assert len(reg.scores) >= 9 and len(reg.gaps) >= 11
    for e in [*reg.scores, *reg.gaps]:
        assert e.source.title and e.source.kind in ("vendor", "independent", "paper")
        assert e.protocol.described and set(e.protocol.stated) <= set(STATED_KEYS)
        v = e.verified
        assert (v is not None and v.date and v.source and v.quote and not e.unverified) or (
            v is None and e.unverified
        ), e.id
    verified = {e.id: e.verified for e in [*reg.scores, *reg.gaps] if e.verified is not None}
    assert set(verified) == {
        "qwen2.5-7b-instruct/ifeval/vendor",
        "qwen2.5-7b-instruct/gsm8k/vendor",
        "qwen3-8b/ifeval/vendor-nothink",
    }
    # the quote is the source's own text, and it holds the registry's value
    values = {s.id: s.value for s in reg.scores}
    for sid, v in verified.items():
        assert f"{values[sid]:g}" in v.quote and v.date == "2026-12-05", sid
    assert verified["qwen3-8b/ifeval/vendor-nothink"].quote == "IFEval strict prompt 75.0 80.2 71.2 81.0 81.2 83.0"
    assert "Table 18" in verified["qwen3-8b/ifeval/vendor-nothink"].source
    assert values["qwen3-8b/ifeval/nothink-template"] == 83.18 and values["qwen3-8b/ifeval/default-template"] == 34.75
    gaps = {(g.candidate, g.benchmark, g.protocol.id): g.value for g in reg.gaps}
    assert gaps[("Qwen2.5-VL-7B", "IFEval", "instruct")] == -9.43
    assert gaps[("Qwen2.5-VL-7B", "IFEval", "community")] == -20.52
    assert gaps[("Qwen2.5-VL-7B", "IFEval", "sink-paper-headline")] == -9.6  # same pair, another source, kept apart
    assert reg.identify("/data/models/Qwen2.5-VL-7B-Instruct") == "Qwen2.5-VL-7B"


def test_vendor_show_prints_the_verification(capsys):
    assert main(["vendor", "list"]) == 0
    out = capsys.readouterr().out
    assert "| Qwen3-8B | Qwen/Qwen3-8B | llm | 3 | 2 | 1/5 |" in out and "| vlm | 0 | 6 | 0/6 |" in out
    assert "| Qwen2.5-VL-7B | Qwen/Qwen2.5-VL-7B-Instruct | vlm | 0 | 6 |" in out
    assert main(["vendor", "show", "Qwen/Qwen3-8B"]) == 0  # by its hub id
    out = capsys.readouterr().out
    assert "qwen3-8b/ifeval/default-template | IFEval | prompt-level strict accuracy | 34.75 | independent-audit" in out
    assert "| qwen3-8b/ifeval/vendor-nothink | IFEval | prompt-level strict accuracy | 83 | qwen3-report" in out
    assert "(enable_thinking=False) | verified 2026-12-05 |" in out
    assert "| sink-paper-headline (lm_eval_version=0.4.12) | UNVERIFIED |" in out
    assert "- qwen3-8b/ifeval/vendor-nothink: verified 2026-12-05 at Qwen3 Technical Report" in out
    assert "- qwen3-8b/ifeval/default-template: UNVERIFIED: the notes' table" in out
    assert main(["vendor", "show", "Qwen3-8B", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    vend = next(s for s in doc["scores"] if s["id"] == "qwen3-8b/ifeval/vendor-nothink")
    assert vend["verified"]["quote"].endswith("83.0") and vend["unverified"] is None and vend["source"]["title"]
    assert main(["vendor", "show", "qwen3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'Qwen3-8B'" in err[0]


def test_attribute_shows_which_registry_figures_are_unverified(tmp_path, capsys):
    att = run_attribution(
        ["vendor:qwen3-8b/ifeval/nothink-template"],
        ["vendor:qwen3-8b/ifeval/default-template"],
        AttributeOptions(vendor=True),
    )
    assert unverified_figures(att) == ["qwen3-8b/ifeval/default-template", "qwen3-8b/ifeval/nothink-template"]
    assert att.to_json()["unverified_registry_figures"] == unverified_figures(att)
    md = to_markdown(att)
    assert "## Registry figures not verified in their source" in md
    assert "- qwen3-8b/ifeval/nothink-template\n" in md and "- qwen3-8b/ifeval/vendor-nothink\n" not in md
    assert "| qwen3-report (verified 2026-12-05) |" in md  # the vendor figure, in the vendor table
    assert "reference figure qwen3-8b/ifeval/nothink-template: UNVERIFIED" in md  # the measured ones, in the note
    # lineage of a model to itself: same model, never flagged
    assert "- lineage Qwen3-8B -> Qwen3-8B: same model (reference and candidate are the same model)" in md
    att = run_attribution(["vendor:Qwen2.5-7B-Instruct"], ["vendor:Qwen2.5-VL-7B"], AttributeOptions(vendor=True))
    md = to_markdown(att)
    assert "independent-audit (independent, UNVERIFIED)" in md and "sink-paper (paper, UNVERIFIED)" in md
    assert "qwen2.5-7b-instruct/ifeval/vendor" not in unverified_figures(att)
    # the report's attribution section says it too; attribution.json names its unit once
    args = ["--reference", "vendor:Qwen2.5-7B-Instruct", "--candidate", "vendor:Qwen2.5-VL-7B"]
    assert main(["attribute", *args, "--output", str(tmp_path / "att")]) == 0
    assert json.loads((tmp_path / "att" / "attribution.json").read_text())["units"].startswith("scores, gaps and")
    assert main(["report", "--attribution", str(tmp_path / "att"), "-o", str(tmp_path / "r.html")]) == 0
    assert "<td>reported_gap (registry figure UNVERIFIED)</td>" in (tmp_path / "r.html").read_text()
    capsys.readouterr()


# --- vendor add, then attribute --vendor on the user's own model --------------------------------------------


def _my_runs(tmp_path, limit=5):
    """A local base model folder and a local VLM backbone, each run under the instruct protocol (--limit 5)."""
    base, vlm = tmp_path / "my-base-llm", tmp_path / "my-vlm-backbone"
    for d in (base, vlm):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ref = write_run(tmp_path / "r", {"ifeval": ([1, 1, 1, 1, 0], [1, 1, 1, 1, 1])}, model=str(base), limit=limit)
    cand = write_run(tmp_path / "c", {"ifeval": ([1, 0, 0, 1, 0], [1, 1, 0, 1, 1])}, model=str(vlm), limit=limit)
    return base, ref, cand


def _add(reg, *extra) -> list[str]:
    return [
        "vendor",
        "add",
        "--model",
        "My-Base-LLM",
        "--hub-id",
        "me/my-base-llm",
        "--benchmark",
        "IFEval",
        "--value",
        "75",
        "--source",
        "my-card",
        "--source-title",
        "My Base LLM model card, table Evaluation",
        "--protocol",
        "my-card-protocol",
        "--described",
        "zero-shot, chat template",
        "--stated",
        "apply_chat_template=true",
        "--stated",
        "num_fewshot=0",
        "--registry",
        str(reg),
        *extra,
    ]


def test_vendor_add_then_attribute_vendor_on_a_local_model(tmp_path, capsys):
    base, ref, cand = _my_runs(tmp_path)
    reg = tmp_path / "mine.yaml"
    # before: no figure for either model, said in one line
    md = to_markdown(run_attribution([str(ref)], [str(cand)], AttributeOptions(vendor=True, registry_file=None)))
    [line] = [x for x in md.splitlines() if x.startswith("- vendor figures:")]
    assert line.startswith("- vendor figures: none in the registry for my-base-llm, my-vlm-backbone (")
    assert (
        main(_add(reg, "--verified-at", "https://x/card, table Evaluation, row IFEval", "--quote", "IFEval 75.0")) == 0
    )
    out = capsys.readouterr().out
    assert "added my-base-llm/ifeval/my-card: My-Base-LLM IFEval 75 (source my-card, protocol my-card-protocol" in out
    data = yaml.safe_load(reg.read_text())
    assert data["models"] == {"My-Base-LLM": {"kind": "llm", "hub_id": "me/my-base-llm"}}
    assert data["scores"][0]["metric"] == "prompt_level_strict_acc" and data["scores"][0]["verified"]["quote"]
    # the folder's name is not a match: without --as, still no figure
    att = run_attribution([str(ref)], [str(cand)], AttributeOptions(vendor=True, registry_file=reg))
    assert att.registry["matches"] == [] and att.benchmarks[0]["vendor"] == []
    # --as FOLDER=NAME: matched, said so; the vendor row carries the --limit caveat and the verification
    att = run_attribution(
        [str(ref)], [str(cand)], AttributeOptions(vendor=True, registry_file=reg, as_names=[f"{base}=My-Base-LLM"])
    )
    assert att.registry["matches"] == [
        {"model": str(base.resolve()), "registry_model": "My-Base-LLM", "by": "matched by --as"}
    ]
    assert att.registry["vendor_missing"] == ["my-vlm-backbone"]
    [v] = att.benchmarks[0]["vendor"]
    cap = {"field": "generation cap (max_gen_toks)", "vendor": "the task's own", "measured": 64}  # the run's
    assert v["measured_minus_vendor"] == 5.0 and v["protocol_differences"] == [cap]  # 80 measured vs 75
    md = to_markdown(att)
    assert f"- registry: {base.resolve()} is the registry's My-Base-LLM (matched by --as)" in md
    assert "| My-Base-LLM | 75.00 | my-card (verified " in md and "| 80.00 (--limit 5 run: not final) |" in md
    assert "| too few to tell: +5.00 [-37.45, +21.38] (subset) | generation cap (max_gen_toks): vendor the task" in md
    # a bare --as with two local models is ambiguous; an --as that names no run's folder is refused
    with pytest.raises(UserError, match="ambiguous"):
        run_attribution([str(ref)], [str(cand)], AttributeOptions(registry_file=reg, as_names=["My-Base-LLM"]))
    with pytest.raises(UserError, match="matches no run's local model folder"):
        run_attribution(
            [str(ref)], [str(cand)], AttributeOptions(registry_file=reg, as_names=["/elsewhere=My-Base-LLM"])
        )


def test_a_run_of_a_hub_id_is_matched_by_it_and_a_model_against_its_own_figure_is_the_same_model(tmp_path, capsys):
    reg = tmp_path / "mine.yaml"
    assert main(_add(reg)) == 0  # no quote: unverified, said so
    assert "UNVERIFIED) to " in capsys.readouterr().out
    outcomes = {"ifeval": ([1, 1, 1, 0, 0], [1, 1, 1, 1, 0])}  # with the task's own generation length
    run = write_run(tmp_path / "h", outcomes, model="me/my-base-llm", limit=None, max_gen_toks=None)
    att = run_attribution(["vendor:My-Base-LLM"], [str(run)], AttributeOptions(vendor=True, registry_file=reg))
    assert att.registry["matches"][0]["by"] == "matched by its hub id me/my-base-llm"
    [li] = att.lineage
    assert li["status"] == "same_model" and li["flagged"] is False
    # the figure and the run: one model, no protocol field that can change scores differs: no protocol artefact
    [row] = att.benchmarks[0]["comparisons"]
    assert row["kind"] == "unexplained" and row["gap"] == row["unexplained"] == -15.0 and row["protocol_part"] is None
    md = to_markdown(att)
    assert "FLAGGED" not in md and "not compared" not in md
    assert "same model: no recorded field that can change scores differs, but one side does not state" in md
    assert "documents compared: reference the registry figure my-base-llm/ifeval/my-card (its documents not " in md


def test_vendor_add_writes_the_project_cache_by_default_and_refuses_bad_figures(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(tmp_path / "cache"))
    args = [a for a in _add(tmp_path / "x") if a not in ("--registry", str(tmp_path / "x"))]
    assert main(args) == 0
    default = tmp_path / "cache" / "vendors.yaml"
    assert str(default) in capsys.readouterr().out and "My-Base-LLM" in load_registry().models
    before = default.read_bytes()
    for bad, expected in (
        ([], "already has an entry 'my-base-llm/ifeval/my-card'"),
        (["--id", "new", "--benchmark", "IFEVAL"], "unknown benchmark 'IFEVAL'"),
        (["--id", "new", "--protocol", "p2", "--stated", "num_shots=0"], "did you mean 'num_fewshot'"),
        (["--id", "new", "--described", "few-shot"], "protocol 'my-card-protocol' is already defined"),
        (["--id", "new", "--quote", "75"], "--verified-at and --quote go together"),
        (["--id", "new", "--hub-id", "Qwen/Qwen3-8B"], "hub id Qwen/Qwen3-8B is the registry's model 'Qwen3-8B'"),
        (["--id", "new", "--verified-at", "x", "--quote", "75"], f"would go into the project cache's {default}"),
    ):
        assert main([*args, *bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (bad, err)
        assert default.read_bytes() == before  # nothing written
    # A `verified:` written into the cache's file by hand (or by anyone who could write the cache) counts as
    # unverified, with what it claimed; the same file named with --registry is the user's to vouch for.
    data = yaml.safe_load(before)
    data["scores"][0]["verified"] = {"date": "2026-12-05", "source": "card", "quote": "IFEval 75"}
    del data["scores"][0]["unverified"]
    default.write_text(yaml.safe_dump(data))
    [figure] = load_registry().scores_of("My-Base-LLM")
    assert figure.verified is None and figure.unverified.startswith(
        f"marked verified 2026-12-05 at card ('IFEval 75') in the project cache's {default}, which never decides"
    )
    assert load_registry(default).scores_of("My-Base-LLM")[0].verified
    import lm_eval_sink

    bundled = tmp_path.parent / "x"  # a path inside the installed package is refused
    assert main([*args, "--registry", str(type(bundled)(lm_eval_sink.__file__).parent / "data" / "vendors.yaml")]) == 2
    assert "inside the installed package" in capsys.readouterr().err


def test_stated_protocols_compare_exactly_and_leniently_only_against_a_run():
    """Two sources' statements compare exactly; a run's values as lm-eval records them (batch size as text, dtype
    with its `torch.` prefix) agree with a source stating 8 and bfloat16."""
    from lm_eval_sink.vendors import stated_differences

    source, run = {"batch_size": 8, "dtype": "bfloat16"}, {"batch_size": "8", "dtype": "torch.bfloat16"}
    assert [d["field"] for d in stated_differences(source, run)[0]] == ["batch_size", "dtype"]
    assert stated_differences(source, run, "b") == stated_differences(run, source, "a") == ([], [])
    assert [d["field"] for d in stated_differences(run, source, "b")[0]] == ["dtype"]  # a run's dtype has no prefix
