"""Comparable S, or a flag where it is shown: settings, K across depths, and a mixed ranking flagged in every output
(strength's ranking, screen, the report, a sweep's table)."""

from __future__ import annotations

import csv
import io
import json
import shutil

import pytest

import sinkmodels as sm
from helpers import make_tokenizer
from lm_eval_sink.cli import main
from lm_eval_sink.comparability import Setting, compare
from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import StrengthSettings, k_for, parse_last_k

NO_TEMPLATE = (
    "chat template asked (settings.use_chat_template: true), not applied (protocol.chat_template_applied: false)"
)


def _setting(n_layers: int, asked=10, **changes) -> Setting:
    fields = dict(
        prompt_set="ab" * 32,
        prompt_source="builtin",
        n_prompts=15,
        chat_template_asked=True,
        chat_template_applied=True,
        system_prompt=None,
        rows="all",
        statistic="median",
        last_k_asked=asked,
        last_k=k_for(asked, n_layers),
        attention_layers=n_layers,
        dtype="bfloat16",
    )
    return Setting(**{**fields, **changes})


def test_k_is_a_fixed_count_with_its_share_shown_or_a_share_on_request():
    # a 16-layer and a 40-layer model at the paper's K = 10: one setting by the paper's definition, the shares named
    count = compare(["small", "large"], [_setting(16), _setting(40)])
    assert count.comparable and count.labels == ("A", "A")
    assert [s.k_cell() for s in count.settings] == ["10/16 (62%)", "10/40 (25%)"]
    assert "62% of small's 16, 25% of large's 40" in count.k_note()
    assert any("--last-k N% takes one share" in line for line in count.lines())
    # --last-k 33%: one share of each depth (5 of 16, 13 of 40), no note
    assert parse_last_k("33%") == "33%" and parse_last_k("all") is None and parse_last_k("10") == 10
    share = compare(["small", "large"], [_setting(16, "33%"), _setting(40, "33%")])
    assert [s.last_k for s in share.settings] == [5, 13] and share.comparable and share.k_note() is None
    assert StrengthSettings(last_k="33%").layers_for(range(40)) == tuple(range(27, 40))
    # a count deeper than a model is clipped: fewer layers than asked, another setting, said in words
    clipped = compare(["deep", "shallow"], [_setting(30), _setting(6)])
    assert clipped.labels == ("A", "B") and "K = 10 asked, 6 applied" in " ".join(clipped.lines())
    for bad in ("0%", "150%", "x%", "0", "ten"):
        with pytest.raises(UserError):
            parse_last_k(bad)
    with pytest.raises(UserError, match="must be a number or 'all', got '33%'"):
        parse_last_k("33%", shares=False)  # margin's table layers: a count or all


def test_every_applied_field_splits_and_is_named():
    base = _setting(30)
    for field, other in (
        ("prompt_set", "cd" * 32),
        ("chat_template_applied", False),
        ("system_prompt", "Be brief."),
        ("rows", "content"),
        ("statistic", "mean"),
        ("dtype", "float32"),
    ):
        c = compare(["a", "b", "c"], [base, base, _setting(30, **{field: other})])
        assert c.labels == ("A", "A", "B") and not c.comparable and c.ranks([1.0, 2.0, 3.0]) == [2, 1, 1]
        assert len(c.differences("B")) == 1, (field, c.differences("B"))
    # what was asked is not what decides: asking no template and getting none is the same setting as getting none
    plain = _setting(30, chat_template_applied=False)
    assert compare(["x", "y"], [plain, _setting(30, chat_template_asked=False, chat_template_applied=False)]).comparable


def test_a_line_that_shows_one_s_says_its_dtype():
    """`lm_eval --model vllm` without `dtype=` runs a float32 checkpoint in bfloat16, which moved S from 1.7321 to
    1.7179 on SmolLM2 (review of issue 47: the record said bfloat16, the console's `S = ` line did not): the line
    says the dtype the setting (`setting_of_results`) recorded, or that none was."""
    from lm_eval_sink.harness.discovery import strength_lines

    metrics = {"sink_strength,none": 1.7179, "pos0_argmax_fraction,none": 0.99, "attention_layers,none": [*range(30)]}
    meta = {"capture": {"capture_backend": "vllm", "dtype": "bfloat16"}, "last_k": 10}
    results = {"results": {"sink_strength": metrics}, "configs": {"sink_strength": {"metadata": meta}}}
    (line,) = strength_lines(results)
    assert line.startswith("sink_strength: S = 1.7179 in bfloat16 over the last 10 of 30 attention layers (33%)")
    del meta["capture"]
    assert strength_lines(results)[0].startswith("sink_strength: S = 1.7179 in a dtype not recorded over the last")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """`strength` on three hand-set models: two with a chat template (3 and 4 layers), one whose tokenizer has none."""
    root = tmp_path_factory.mktemp("mixed")
    tok = make_tokenizer()
    for name, fam, layers in (("chat3", "llama", 3), ("chat4", "olmo2", 4), ("plain", "llama", 3)):
        sm.build(fam, n_layers=layers, bos_id=tok.bos_token_id).save_pretrained(root / name)
        if name == "plain":
            tok.chat_template = None
        tok.save_pretrained(root / name)
    out = root / "strength"
    args = ["strength", *(root / n for n in ("chat3", "plain", "chat4")), "--last-k", "2", "--output", out, "--quiet"]
    return root, out, args


def test_a_mixed_ranking_is_flagged_in_every_output(mixed, capsys):
    _, out, args = mixed
    capsys.readouterr()
    assert main([str(a) for a in args]) == 0
    printed = capsys.readouterr().out
    # the console: the warning, both settings, what was asked and what was applied, K across depths
    assert "warning: S measured in 2 different settings" in printed
    assert f"note: plain: {NO_TEMPLATE}" in printed
    assert (
        "setting B (plain)" in printed
        and "differs from A in chat template applied: no (plain text) (A: yes)" in printed
    )
    assert "67% of chat3's 3, 67% of plain's 3, 50% of chat4's 4" in printed
    # Markdown and CSV: the setting column, ranks within each setting
    md = (out / "ranking.md").read_text()
    assert "highest first within each setting" in md and f"- note: plain: {NO_TEMPLATE}" in md
    rows = list(csv.DictReader(io.StringIO((out / "ranking.csv").read_text())))
    assert [(r["model"], r["setting"], r["rank"]) for r in rows][-1] == ("plain", "B", "1")
    assert {r["setting"] for r in rows[:2]} == {"A"} and sorted(r["rank"] for r in rows[:2]) == ["1", "2"]
    assert {r["model"]: r["k_share"] for r in rows} == {"chat3": "0.667", "chat4": "0.500", "plain": "0.667"}
    assert rows[-1]["chat_template_applied"] == "no (plain text)"
    # JSON: not comparable, the settings and each model's letter
    data = json.loads((out / "ranking.json").read_text())
    assert data["comparable"] is False and data["models"][-1] == {
        "rank": 1,
        "model": "plain",
        "sink_strength": pytest.approx(data["models"][-1]["sink_strength"]),
        "setting": "B",
    }
    assert data["comparison"]["settings"]["B"]["chat_template_applied"] is False
    assert data["comparison"]["settings"]["B"]["chat_template_asked"] is True
    assert (out / "ranking.png").stat().st_size > 0


def test_screen_ranks_within_settings_and_the_report_flags_them(mixed, tmp_path, capsys):
    root, out, args = mixed
    if not (out / "ranking.json").is_file():
        assert main([str(a) for a in args]) == 0
    scr = tmp_path / "screen"
    shutil.copytree(out, scr / "strength")  # the same inputs: reused, nothing measured again
    capsys.readouterr()
    models = [str(root / n) for n in ("chat3", "plain", "chat4")]
    assert main(["screen", *models, "--last-k", "2", "--output", str(scr), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert printed.count(": reused ") == 3 and printed.count("warning: S measured in 2 different settings") == 1
    assert f"note: plain: {NO_TEMPLATE}" in printed and "| B | 1 | plain |" in printed
    assert "no predicted deltas" in printed  # no fit asked: the ranking alone
    data = json.loads((scr / "screen.json").read_text())
    assert [(m["slug"], m["setting"], m["rank"]) for m in data["models"]][-1] == ("plain", "B", 1)
    assert data["comparison"]["comparable"] is False and data["predictions_from"] is None
    head = (scr / "screen.csv").read_text().splitlines()[0]
    assert head.startswith("setting,rank,model,sink_strength") and "k_share" in head
    assert "| B | 1 | plain |" in (scr / "screen.md").read_text()
    # the report: each S with its setting, and the flag at the top
    page = tmp_path / "report.html"
    strength_files = [str(out / f"{n}.strength.json") for n in ("chat3", "plain")]
    assert main(["report", "--strength", *strength_files, "-o", str(page)]) == 0
    html = page.read_text()
    assert "setting B: not comparable" in html and NO_TEMPLATE in html
    assert "warning: S measured in 2 different settings" in html


def _linear_plan():
    """The plan of a linear sweep between a reference and a candidate (no units run)."""
    from pathlib import Path

    from lm_eval_sink.merging.sweep import SweepSpec, plan_units

    spec = SweepSpec("sweep.yaml", Path("out"), {"reference": "r", "candidate": "c"}, ("linear",))
    identities = {r: {"fingerprint": f"sha256:{r}"} for r in ("reference", "candidate")}
    return plan_units(spec, identities, {"eval": {}, "strength": {}})


def test_a_sweep_table_marks_s_of_another_setting(tmp_path):
    from lm_eval_sink.merging.sweep import build_table, table_text
    from lm_eval_sink.report.view import Doc, ReportInputs, build_view

    plan = _linear_plan()
    names = [ck.name for ck in plan.checkpoints]
    settings = {n: _setting(30, chat_template_applied=n != "candidate") for n in names}
    strengths = {n: 1.0 + i for i, n in enumerate(names)}
    table = build_table(plan, {}, {}, {}, strengths, settings)
    assert table["strength_comparability"]["comparable"] is False
    assert {r["checkpoint"]: r["s_setting"] for r in table["rows"]}["candidate"] == "B"
    md, csv_text = table_text(table)
    assert "S, warning: S measured in 2 different settings" in md and "2.0000 (B)" in md and "(B)" in csv_text
    view = build_view(ReportInputs(sweep=Doc("table.json", table, "0" * 64)))
    assert [r["s_setting"] for r in view["sweep"]["rows"]] == [table["rows"][i]["s_setting"] for i in range(len(names))]
    same = build_table(plan, {}, {}, {}, strengths, {n: _setting(30) for n in names})
    assert same["strength_comparability"]["comparable"] and "(A)" not in table_text(same)[0]


def _sink_results(s: float, applied: bool) -> dict:
    """An lm-eval results JSON's Sink Strength task as this project's task writes it: S, the metrics beside it and
    the metadata that say its setting (the chat template applied or not: plain text for a base model)."""
    meta = {"n_prompts": 15, "last_k": 10, "statistic": "median", "rows": "all", "chat_template": True}
    return {
        "results": {
            "sink_strength": {
                "alias": "sink_strength",
                "sink_strength,none": s,
                "pos0_argmax_fraction,none": 0.9,
                "chat_template_applied,none": applied,
                "attention_layers,none": list(range(16)),
            }
        },
        "configs": {
            "sink_strength": {"metadata": {**meta, "prompt_set_sha256": "ab" * 32, "capture": {"dtype": "bfloat16"}}}
        },
        "n-samples": {"sink_strength": {"effective": 15}},
    }


def test_a_sweep_table_marks_the_eval_units_s_of_another_setting(tmp_path):
    """The eval units' `sink_strength` columns go through the check the strength units go through: a base model
    measured on plain text and instruct checkpoints under their chat template get their setting's letter beside
    each S and its delta in table.md and table.csv, the settings in words above the table, on the console and in the
    report; one setting gets no mark."""
    from lm_eval_sink.merging.sweep import build_table, comparability_lines, table_text
    from lm_eval_sink.report.view import Doc, ReportInputs, build_view

    plan = _linear_plan()
    results = {"reference": _sink_results(2.0, True), "candidate": _sink_results(0.5, False)}
    table = build_table(plan, {}, results, {}, {})
    comparison = table["task_strength_comparability"]["sink_strength"]
    assert comparison["comparable"] is False
    marks = {r["checkpoint"]: r["metric_settings"] for r in table["rows"]}
    assert marks["candidate"] == {
        "sink_strength/sink_strength,none": "B",
        "sink_strength/pos0_argmax_fraction,none": "B",
    }
    md, csv_text = table_text(table)
    assert "sink_strength (S of the eval units), warning: S measured in 2 different settings" in md
    assert "chat template applied: no (plain text) (A: yes)" in md
    assert "| 0.5000 (B) | -1.5000 (B) |" in md and "-1.5000 (B)" in csv_text and "2.0000 (A)" in csv_text
    console = comparability_lines(table)
    assert console[0].startswith("sink_strength: warning: S measured in 2 different settings")
    view = build_view(ReportInputs(sweep=Doc("table.json", table, "0" * 64)))
    assert any(c[2] == "B" for c in view["sweep"]["rows"][1]["cells"])
    assert any("sink_strength (the eval units' S): warning" in n for n in view["sweep"]["strength_notes"])
    same = build_table(plan, {}, {"reference": _sink_results(2.0, True), "candidate": _sink_results(0.5, True)}, {}, {})
    assert same["task_strength_comparability"]["sink_strength"]["comparable"] and not comparability_lines(same)
    assert "(A)" not in table_text(same)[0] and all(r["metric_settings"] == {} for r in same["rows"])


def test_last_k_as_a_share_through_the_command(mixed, tmp_path, capsys):
    root, _, _ = mixed
    out = tmp_path / "share"
    models = [str(root / "chat3"), str(root / "chat4")]
    assert main(["strength", *models, "--last-k", "50%", "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    got = {n: json.loads((out / f"{n}.strength.json").read_text()) for n in ("chat3", "chat4")}
    assert [got[n]["last_k"] for n in ("chat3", "chat4")] == [2, 2]  # half of 3 rounded half up, half of 4
    assert got["chat4"]["layers"] == [2, 3] and got["chat4"]["provenance"]["settings"]["last_k"] == "50%"
    assert "setting A (all 2 models: one setting, comparable)" in printed and "K: last 50% of the attention" in printed
    assert "K is a fixed count" not in printed  # equal shares: no note on depths
