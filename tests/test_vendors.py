"""The vendor registry's checks: every source, score and gap says whether it was compared with its original."""

from __future__ import annotations

import json

import pytest

from lm_eval_sink.attribution import to_markdown, unchecked_figures
from lm_eval_sink.cli import main
from lm_eval_sink.commands.attribute import run_attribution
from lm_eval_sink.errors import UserError
from lm_eval_sink.vendors import load_registry

SCORE = "{id: x, model: Qwen3-8B, benchmark: IFEval, metric: m, value: 1, source: qwen3-report, protocol: instruct"
NEEDS = "checked_at must say where the figure was seen"
GAP = (
    "{id: g, reference: Qwen3-8B, candidate: Qwen3-VL-8B, benchmark: IFEval, metric: m, value: -1, "
    "source: qwen3-report, protocol: instruct"
)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (f"scores:\n  - {SCORE}, checked: true}}\n", [f"scores[0].checked_at: {NEEDS}", "got None"]),
        (f"scores:\n  - {SCORE}, checked: true, checked_at: '  '}}\n", [f"scores[0].checked_at: {NEEDS}", "got '  '"]),
        (f"gaps:\n  - {GAP}, checked: true}}\n", [f"gaps[0].checked_at: {NEEDS}"]),
        ("sources:\n  s: {title: t, kind: vendor, checked: true}\n", [f"sources.s.checked_at: {NEEDS}"]),
        (f"scores:\n  - {SCORE}, checked_at: Table 1}}\n", ["be left out when checked is false", "got 'Table 1'"]),
        (f"scores:\n  - {SCORE}, checked: 'true'}}\n", ["scores[0].checked: expected true or false, got 'true'"]),
        (f"scores:\n  - {SCORE}, chekced_at: T}}\n", ["unknown key 'chekced_at' (did you mean 'checked_at'?)"]),
    ],
)
def test_check_fields_validate_strictly(tmp_path, extra, message):
    f = tmp_path / "reg.yaml"
    f.write_text(extra)
    with pytest.raises(UserError) as e:
        load_registry(f)
    assert all(part in e.value.message for part in message) and "\n" not in e.value.message


def test_user_entry_checked_with_its_place_loads(tmp_path):
    f = tmp_path / "reg.yaml"
    f.write_text(f"gaps:\n  - {GAP}, checked: true, checked_at: 'https://x, Table 2, cell \"-1.0\"'}}\n")
    [g] = [g for g in load_registry(f).gaps if g.id == "g"]
    assert g.checked and g.check.at == 'https://x, Table 2, cell "-1.0"'
    assert g.to_json()["checked_at"] == g.check.at and g.to_json()["checked"] is True


def test_bundled_registry_every_entry_checked_with_place_or_unchecked_with_reason():
    reg = load_registry()
    for e in [*reg.sources.values(), *reg.scores, *reg.gaps]:
        assert (e.check.checked and e.check.at) or (not e.check.checked and e.check.note), e
    checked = {e.id: e.check.at for e in [*reg.scores, *reg.gaps] if e.checked}
    assert set(checked) == {
        "qwen2.5-7b-instruct/ifeval/vendor",
        "qwen2.5-7b-instruct/gsm8k/vendor",
        "qwen3-8b/ifeval/vendor-nothink",
    }
    # the exact cell text is recorded, and it is the registry's value
    assert '"71.2"' in checked["qwen2.5-7b-instruct/ifeval/vendor"]
    assert '"**91.6**"' in checked["qwen2.5-7b-instruct/gsm8k/vendor"]
    assert (
        '"83.0"' in checked["qwen3-8b/ifeval/vendor-nothink"]
        and "Table 18" in checked["qwen3-8b/ifeval/vendor-nothink"]
    )
    assert not reg.sources["sink-paper"].checked and not reg.sources["independent-audit"].checked


def test_vendor_show_prints_the_checks(capsys):
    assert main(["vendor", "list"]) == 0
    out = capsys.readouterr().out
    assert "| Qwen3-8B | Qwen/Qwen3-8B | llm | 3 | 2 | 1/5 |" in out and "| vlm | 0 | 6 | 0/6 |" in out
    assert main(["vendor", "show", "Qwen3-8B"]) == 0
    out = capsys.readouterr().out
    assert "| qwen3-8b/ifeval/vendor-nothink | IFEval | prompt-level strict accuracy | 83 | qwen3-report" in out
    assert "(enable_thinking=False) | yes |" in out  # the checked column
    assert "| sink-paper-headline (lm_eval_version=0.4.12) | NO |" in out
    assert "- qwen3-8b/ifeval/vendor-nothink: checked at Qwen3_Technical_Report.pdf p. 18, Table 18" in out
    assert "- qwen3-8b/ifeval/default-template: NOT checked against the original: the notes' table" in out
    assert "- sink-paper: " in out and "NOT checked against the original: the paper's text" in out
    assert main(["vendor", "show", "Qwen3-8B", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    vend = next(s for s in doc["scores"] if s["id"] == "qwen3-8b/ifeval/vendor-nothink")
    assert vend["checked"] is True and "Table 18" in vend["checked_at"]
    assert vend["source"]["checked"] is True and "QwenLM/Qwen3" in vend["source"]["checked_at"]


def test_attribute_marks_unchecked_registry_figures():
    # measured (registry) figures from the unchecked audit, beside the checked vendor figure
    att = run_attribution(
        ["vendor:qwen3-8b/ifeval/nothink-template"], ["vendor:qwen3-8b/ifeval/default-template"], vendor=True
    )
    assert unchecked_figures(att) == ["qwen3-8b/ifeval/default-template", "qwen3-8b/ifeval/nothink-template"]
    assert att.to_json()["unchecked_registry_figures"] == unchecked_figures(att)
    md = to_markdown(att)
    assert "## Registry figures not checked against their original source" in md
    assert "- qwen3-8b/ifeval/nothink-template\n" in md and "- qwen3-8b/ifeval/vendor-nothink\n" not in md
    assert "| qwen3-report |" in md and "qwen3-report (UNCHECKED)" not in md  # the checked vendor figure
    # reported gaps of the pair: all unchecked, marked in their row and listed
    att = run_attribution(["vendor:Qwen2.5-7B-Instruct"], ["vendor:Qwen2.5-VL-7B"], vendor=True)
    md = to_markdown(att)
    assert "independent-audit (independent, UNCHECKED)" in md and "sink-paper (paper, UNCHECKED)" in md
    assert "qwen2.5-vl-7b/ifeval/sink-paper" in unchecked_figures(att)
    assert "qwen2.5-7b-instruct/ifeval/vendor" not in unchecked_figures(att)


def test_attribute_says_nothing_when_every_figure_is_checked(tmp_path):
    f = tmp_path / "reg.yaml"
    f.write_text(
        "models:\n  llm-x: {kind: llm}\n  vlm-x: {kind: vlm}\n"
        "scores:\n"
        "  - {id: a, model: llm-x, benchmark: IFEval, metric: m, value: 80, source: qwen3-report, "
        "protocol: instruct, checked: true, checked_at: 'T1 \"80\"'}\n"
        "  - {id: b, model: vlm-x, benchmark: IFEval, metric: m, value: 70, source: qwen3-report, "
        "protocol: instruct, checked: true, checked_at: 'T1 \"70\"'}\n"
    )
    att = run_attribution(["vendor:a"], ["vendor:b"], registry_file=f)
    assert [r["gap"] for r in att.benchmarks[0]["comparisons"]] == [-10.0]
    assert unchecked_figures(att) == [] and "not checked" not in to_markdown(att)
