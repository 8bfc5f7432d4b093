"""Protocol fingerprints, diffs, named protocols and the protocol CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from constructed_runs import TS, results_dict, write_run

from lm_eval_sink.cli import main
from lm_eval_sink.errors import UserError
from lm_eval_sink.protocols import (
    HARNESS_FIELDS,
    MODEL_FIELDS,
    TASK_FIELDS,
    FieldDiff,
    ProtocolFingerprint,
    builtin_protocols,
    diff,
    fingerprint,
    get_protocol,
    load_protocols,
    match_protocol,
    require_same_harness,
    task_diff,
    task_view,
)

SCORES = {"ifeval": {"prompt_level_strict_acc,none": 0.4}, "gsm8k_cot": {"exact_match,strict-match": 0.2}}


def test_fingerprint_reads_every_field_from_its_place():
    res = results_dict(
        SCORES,
        chat=True,
        num_fewshot={"gsm8k_cot": 8},
        system_instruction="Be brief.",
        model_args={"enable_thinking": False, "dtype": "bfloat16"},
    )
    fp = fingerprint(res, source="r.json")
    h, m = fp.harness, fp.model
    assert h["apply_chat_template"] is True
    assert h["system_instruction"] == "Be brief."
    assert h["fewshot_as_multiturn"] is True
    assert h["gen_kwargs"] == {"max_gen_toks": 64}
    assert h["model_args"] == {"enable_thinking": False}  # pretrained (identity) and dtype (own field) left out
    assert h["lm_eval_version"] == "0.4.13"
    assert h["limit"] == 5.0
    assert h["seeds"] == {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}
    assert h["batch_size"] == "8"
    assert h["dtype"] == "torch.bfloat16"
    assert sorted(h["tasks"]) == ["gsm8k_cot", "ifeval"]
    g = h["tasks"]["gsm8k_cot"]
    assert g["version"] == 3 and g["num_fewshot"] == 8 and g["multiturn"] is True
    assert g["fewshot"] == {"sampler": "first_n", "split": "train"}
    assert [f["name"] for f in g["filters"]] == ["strict-match", "flexible-extract"]
    assert g["generation_kwargs"]["max_gen_toks"] == 64
    assert g["dataset"] == {"path": "openai/gsm8k", "name": "main", "split": "test"}
    i = h["tasks"]["ifeval"]
    assert i["num_fewshot"] == 0 and i["multiturn"] is False and i["fewshot"] is None and i["filters"] is None
    assert m["chat_template"].startswith("{% for m in messages")
    assert m["chat_template_sha"] == res["chat_template_sha"]
    assert m["special_tokens"] == {
        "bos": ["<|im_start|>", "1"],
        "eos": ["<|im_end|>", "2"],
        "pad": ["<|im_end|>", "2"],
        "eot_token_id": 2,
    }
    assert m["max_length"] == 8192 and m["transformers_version"] == "5.24.0"
    assert fp.run["pretrained"] == "/models/ref" and fp.source == "r.json"
    doc = json.loads(json.dumps(fp.to_json()))  # the JSON keeps every part, with the harness sha
    assert ProtocolFingerprint(doc["harness"], doc["model"], doc["run"], doc["source"]) == fp
    assert doc["harness_sha"] == fp.harness_sha()


def test_task_diff_and_task_view_keep_one_task():
    a = fingerprint(results_dict(SCORES, chat=True))
    b = fingerprint(results_dict({"ifeval": SCORES["ifeval"]}, chat=True, num_fewshot={"ifeval": 3}))
    want = {"tasks.ifeval.num_fewshot", "tasks.ifeval.multiturn", "tasks.ifeval.fewshot"}
    assert {d.field for d in diff(a, b)} == {"tasks", *want}
    assert {d.field for d in task_diff(a, b, ("ifeval",))} == want
    # b lacks gsm8k_cot: nothing of it to compare, and which tasks a run holds is no protocol field
    assert task_diff(a, b, ("gsm8k_cot",)) == ()
    view = task_view(a, "gsm8k_cot")
    assert view["apply_chat_template"] is True and view["num_fewshot"] == 0 and view["version"] == 3
    assert view["chat_template"] == a.model["chat_template_sha"] and "chat_template_sha" not in view
    assert {d.field.removeprefix("tasks.ifeval.").split(".")[0] for d in task_diff(a, b, ("ifeval",))} <= set(
        task_view(b, "ifeval")
    )


def test_diff_of_a_run_with_itself_is_empty_and_field_by_field_otherwise():
    a = fingerprint(results_dict(SCORES, chat=True))
    assert diff(a, a) == ()
    b = fingerprint(
        results_dict(
            SCORES, chat=False, num_fewshot={"gsm8k_cot": 8}, batch_size=1, model_args={"enable_thinking": False}
        )
    )
    got = {d.field: d for d in diff(a, b)}
    assert set(got) == {
        "apply_chat_template",
        "fewshot_as_multiturn",
        "model_args.enable_thinking",
        "batch_size",
        "tasks.gsm8k_cot.num_fewshot",
        "tasks.gsm8k_cot.fewshot",
        "chat_template",
    }
    assert got["apply_chat_template"] == FieldDiff("apply_chat_template", "harness", True, False, True)
    assert got["batch_size"].a == "8" and got["batch_size"].b == "1"
    assert got["tasks.gsm8k_cot.num_fewshot"].a == 0 and got["tasks.gsm8k_cot.num_fewshot"].b == 8
    assert got["model_args.enable_thinking"].a is None and got["model_args.enable_thinking"].b is False
    assert got["chat_template"].part == "model" and got["chat_template"].b is None
    # multiturn matters here because one side uses few-shot examples
    assert got["fewshot_as_multiturn"].affects_scores is True
    # harness rows come before model rows
    parts = [d.part for d in diff(a, b)]
    assert parts == sorted(parts)
    # the multiturn flag alone cannot change zero-shot scores, nor the transformers version
    res = results_dict(SCORES, chat=True)
    res["fewshot_as_multiturn"] = False
    res["transformers_version"] = "5.0.0"
    got = {d.field: d for d in diff(a, fingerprint(res))}
    assert set(got) == {"fewshot_as_multiturn", "transformers_version"}
    assert got["fewshot_as_multiturn"].affects_scores is False
    assert got["transformers_version"].affects_scores is False


def test_require_same_harness_names_every_field_and_the_runs_and_ignores_the_model_part():
    a = fingerprint(results_dict(SCORES))
    other_model = fingerprint(results_dict(SCORES, model="/m/b", template="{{ other }}"))
    assert [d.field for d in diff(a, other_model)] == ["chat_template"]
    require_same_harness({"a": a, "b": other_model})  # no error: only the model part differs
    assert a.harness_sha() == other_model.harness_sha()
    b = fingerprint(results_dict(SCORES, limit=10.0))
    c = fingerprint(results_dict(SCORES, batch_size=4, system_instruction="Hi"))
    with pytest.raises(UserError) as e:
        require_same_harness({"run_a": a, "run_b": b, "run_c": c})
    msg = e.value.message
    assert "run_a vs run_c:" in msg and "batch_size" in msg and "system_instruction" in msg
    assert "run_a vs run_b: limit: 5.0 vs 10.0 |" in msg  # run_b names only its own field


def test_missing_fields_and_non_lm_eval_json_are_user_errors():
    res = results_dict(SCORES)
    del res["chat_template"], res["config"]["limit"]
    with pytest.raises(UserError, match=r"r\.json: lm-eval results file lacks chat_template, config\.limit"):
        fingerprint(res, source="r.json")
    with pytest.raises(UserError, match="not an lm-eval results file"):
        fingerprint([1, 2])


def test_named_protocols_are_data_and_user_yaml_is_validated(tmp_path):
    builtin = builtin_protocols()
    assert set(builtin) == {"instruct", "community"}
    ins, com = builtin["instruct"], builtin["community"]
    assert (ins.apply_chat_template, ins.num_fewshot, ins.batch_size) == (True, 0, 8)
    assert (com.apply_chat_template, com.num_fewshot) == (False, None)
    good = tmp_path / "p.yaml"
    good.write_text(
        "protocols:\n  short:\n    description: instruct with short generations\n    apply_chat_template: true\n"
        "    num_fewshot: 0\n    gen_kwargs: {max_gen_toks: 256}\n    batch_size: 4\n",
        encoding="utf-8",
    )
    assert get_protocol("short", good).gen_kwargs == {"max_gen_toks": 256}
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "protocols:\n  x:\n    description: d\n    apply_chat_template: true\n    num_fewshots: 0\n", encoding="utf-8"
    )
    with pytest.raises(UserError, match=r"unknown key 'num_fewshots' \(did you mean 'num_fewshot'\?\)"):
        load_protocols(bad)
    bad.write_text("protocols:\n  x:\n    description: d\n    apply_chat_template: yes please\n", encoding="utf-8")
    with pytest.raises(UserError, match="apply_chat_template"):
        load_protocols(bad)
    bad.write_text("protocols:\n  instruct:\n    description: d\n    apply_chat_template: false\n", encoding="utf-8")
    with pytest.raises(UserError, match="builtin"):
        load_protocols(bad)
    bad.write_text("protocols: [\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"bad\.yaml:\d+: not valid YAML"):
        load_protocols(bad)
    with pytest.raises(UserError, match=r"unknown protocol 'instrcut' \(did you mean 'instruct'\?\)"):
        get_protocol("instrcut")


def test_match_protocol_labels_runs():
    assert match_protocol(fingerprint(results_dict(SCORES, chat=True, batch_size=8))) == "instruct"
    assert match_protocol(fingerprint(results_dict(SCORES, chat=True, batch_size=1))) is None
    assert (
        match_protocol(fingerprint(results_dict(SCORES, chat=False, num_fewshot={"gsm8k_cot": 8}, batch_size=1)))
        == "community"
    )
    assert match_protocol(fingerprint(results_dict(SCORES, chat=False, system_instruction="x"))) is None


def test_field_tables_cover_every_fingerprint_key():
    fp = fingerprint(results_dict(SCORES))
    assert set(fp.harness) == set(HARNESS_FIELDS)
    assert set(fp.harness["tasks"]["ifeval"]) == set(TASK_FIELDS)
    assert set(fp.model) - {"chat_template_sha"} == set(MODEL_FIELDS)


def test_protocols_module_imports_no_torch():
    code = (
        "import sys, lm_eval_sink.protocols, lm_eval_sink.attribution, lm_eval_sink.vendors; "
        "print(sorted(m for m in ('torch', 'transformers', 'lm_eval', 'matplotlib') if m in "
        "sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- CLI --------------------------------------------------------------------------------------


def _two_runs(tmp_path: Path) -> tuple[Path, Path]:
    a = write_run(tmp_path / "a", {"ifeval": ([1, 0], [1, 1])}, chat=True)
    b = write_run(tmp_path / "b", {"ifeval": ([1, 0], [1, 1])}, chat=False)
    return a, b


def test_cli_show_and_diff(tmp_path, capsys):
    a, b = _two_runs(tmp_path)
    assert main(["protocol", "show", str(a)]) == 0
    out = capsys.readouterr().out
    assert "apply_chat_template" in out and "tasks.ifeval.num_fewshot" in out
    assert "matches named protocol: instruct" in out
    # nearly every field can change scores: `show` has no column for it, `diff` says why per field
    assert "| part | field | value |\n" in out and "can change scores" not in out
    assert main(["protocol", "diff", str(a), str(a)]) == 0
    assert "no differences" in capsys.readouterr().out
    assert main(["protocol", "diff", str(a.parent), str(b.parent)]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| field")]
    assert [r.split("|")[1].strip() for r in rows] == ["apply_chat_template", "fewshot_as_multiturn", "chat_template"]
    assert rows[0].endswith("| yes: prompts rendered through the tokenizer's chat template |")
    assert rows[1].endswith(  # zero-shot ifeval: sending few-shot examples as turns changes nothing here
        "| no: few-shot examples sent as chat turns (only matters where a task has few-shot examples); no task "
        "compared here uses few-shot examples |"
    )
    assert rows[2].endswith("| yes: chat template text (compared by sha256; null when no template was applied) |")
    out_json = tmp_path / "d.json"
    assert main(["protocol", "diff", str(a), str(b), "-o", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    assert data["differences"][0]["reason"] == "prompts rendered through the tokenizer's chat template"
    assert data["provenance"]["inputs"][0]["sha256"]
    assert next(d["field"] for d in data["differences"]) == "apply_chat_template"
    assert main(["protocol", "diff", str(a), str(b), "-o", str(out_json)]) == 2
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "not_lm_eval", "no_file", "different_tasks"])
def test_cli_bad_inputs_one_line_exit_2(tmp_path, capsys, case):
    a, _ = _two_runs(tmp_path)
    bad = tmp_path / "bad" / f"results_{TS}.json"
    bad.parent.mkdir()
    if case == "missing":
        res = json.loads(a.read_text())
        del res["n-shot"]
        bad.write_text(json.dumps(res))
    elif case == "not_lm_eval":
        bad.write_text(json.dumps({"results": {}, "hello": 1}))
    elif case == "different_tasks":
        bad = write_run(tmp_path / "g", {"gsm8k_cot": ([1], [1])})
    else:
        bad = tmp_path / "nothing.json"
    out = tmp_path / "out.json"
    assert main(["protocol", "diff", str(a), str(bad), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0]
    assert not out.exists()
    assert {
        "missing": "lacks n-shot",
        "not_lm_eval": "not an lm-eval results file",
        "no_file": "no such file",
        "different_tasks": "share no task",
    }[case] in err[0]


def test_named_protocols_map_to_eval_settings():
    from lm_eval_sink.protocols import RunRequest, parse_gen_kwargs, settings_fields

    ins = settings_fields(
        get_protocol("instruct"),
        RunRequest(("ifeval",), limit=5, gen_kwargs=parse_gen_kwargs(["max_gen_toks=64,do_sample=false"])),
    )
    assert ins == {
        "tasks": ("ifeval",),
        "apply_chat_template": True,
        "num_fewshot": 0,
        "fewshot_as_multiturn": None,
        "system_instruction": None,
        "gen_kwargs": {"max_gen_toks": 64, "do_sample": False},
        "limit": 5,
        "batch_size": 8,
        "device": "cpu",
        "dtype": None,
        "log_samples": True,
        "include_path": None,
        "model_args": {},
        "backend": "hf",
    }
    com = settings_fields(
        get_protocol("community"), RunRequest(("ifeval", "gsm8k_cot"), batch_size=2, dtype="float32", seed=3)
    )
    assert (com["apply_chat_template"], com["num_fewshot"], com["fewshot_as_multiturn"]) == (False, None, None)
    assert (com["batch_size"], com["dtype"], com["seed"], com["gen_kwargs"]) == (2, "float32", 3, {})
    # the fields build the runner's settings object as they are
    from lm_eval_sink.harness.runner import EvalSettings

    cmd = EvalSettings(**ins).command("/m", Path("/o"))
    assert (
        cmd[cmd.index("--batch_size") + 1] == "8"
        and "--apply_chat_template" in cmd
        and cmd[cmd.index("--num_fewshot") + 1] == "0"
    )
    assert "--fewshot_as_multiturn" not in EvalSettings(**com).command("/m", Path("/o"))
    with pytest.raises(UserError, match="protocol 'instruct' fixes batch_size = 8, but 4 was asked for"):
        settings_fields(get_protocol("instruct"), RunRequest(("ifeval",), batch_size=4))
    assert settings_fields(get_protocol("instruct"), RunRequest(("ifeval",), batch_size=8))["batch_size"] == 8
    with pytest.raises(UserError, match="no tasks"):
        settings_fields(get_protocol("instruct"), RunRequest(()))
    with pytest.raises(UserError, match="not KEY=VALUE"):
        parse_gen_kwargs(["max_gen_toks"])


def test_cli_eval_unknown_protocol_is_one_line(tmp_path, capsys):
    assert (
        main(["eval", "default", "--protocol", "instrukt", "--tasks", "ifeval", "--output", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean 'instruct'" in err[0]
    assert not (tmp_path / "o").exists()


def test_cli_eval_output_that_is_a_file_is_one_line(tmp_path, user_error):
    out = tmp_path / "o"
    out.write_text("not a folder")
    line = user_error(
        ["eval", "default", "--protocol", "instruct", "--tasks", "ifeval", "--output", out], tmp_path / "o" / "logs"
    )
    assert "is a file, not a folder" in line and out.read_text() == "not a folder"


# --- real lm-eval runs (session fixtures: SmolLM2, --limit 5, max_gen_toks 64, local data) --------


@pytest.mark.slow
def test_real_instruct_run_fingerprint_field_by_field(smollm2_instruct_run, default_model):
    import transformers

    from lm_eval_sink.io import sha256_text
    from lm_eval_sink.protocols import fingerprint_run

    fp = fingerprint_run(smollm2_instruct_run)
    h, m = fp.harness, fp.model
    assert h["apply_chat_template"] is True
    assert h["system_instruction"] is None
    assert h["fewshot_as_multiturn"] is True  # lm-eval's default with a chat template
    assert h["gen_kwargs"] == {"max_gen_toks": 64}
    assert h["model_args"] == {}
    assert h["lm_eval_version"] == "0.4.13"
    assert h["limit"] == 5
    assert h["seeds"]["random"] == 0 and set(h["seeds"]) == {"random", "numpy", "torch", "fewshot"}
    assert h["batch_size"] == "8"
    assert h["dtype"] == "torch.float32"
    assert sorted(h["tasks"]) == ["gsm8k_cot_zeroshot", "ifeval", "sink_strength"]
    ife, gsm = h["tasks"]["ifeval"], h["tasks"]["gsm8k_cot_zeroshot"]
    assert (ife["version"], ife["num_fewshot"], ife["multiturn"], ife["fewshot"], ife["filters"]) == (
        4,
        0,
        False,
        None,
        None,
    )
    assert ife["generation_kwargs"]["max_gen_toks"] == 64 and ife["generation_kwargs"]["do_sample"] is False
    assert [x["metric"] for x in ife["metrics"]] == [
        "prompt_level_strict_acc",
        "inst_level_strict_acc",
        "prompt_level_loose_acc",
        "inst_level_loose_acc",
    ]
    assert ife["dataset"]["split"] == "train" and ife["output_type"] == "generate_until"
    assert (gsm["version"], gsm["num_fewshot"]) == (3, 0)
    assert [x["name"] for x in gsm["filters"]] == ["strict-match", "flexible-extract"]
    # the model part: the template lm-eval applied is the model folder's own
    cfg = json.loads((Path(default_model) / "tokenizer_config.json").read_text())
    own = cfg.get("chat_template")
    if own is None and (Path(default_model) / "chat_template.jinja").is_file():
        own = (Path(default_model) / "chat_template.jinja").read_text()
    assert m["chat_template"] == own and m["chat_template_sha"] == sha256_text(own)
    assert m["special_tokens"]["eos"][0] == "<|im_end|>" and m["special_tokens"]["bos"][0] == "<|im_start|>"
    assert m["max_length"] == 8192 and m["transformers_version"] == transformers.__version__
    assert fp.run["pretrained"] == str(default_model)


@pytest.mark.slow
def test_real_runs_under_two_protocols_diff_field_by_field(smollm2_instruct_run, smollm2_community_run):
    from lm_eval_sink.protocols import fingerprint_run

    a, b = fingerprint_run(smollm2_instruct_run), fingerprint_run(smollm2_community_run)
    assert diff(a, a) == () and diff(b, b) == ()
    got = {d.field: d for d in diff(a, b)}
    assert set(got) == {"apply_chat_template", "fewshot_as_multiturn", "tasks", "chat_template"}
    assert (got["apply_chat_template"].a, got["apply_chat_template"].b, got["apply_chat_template"].affects_scores) == (
        True,
        False,
        True,
    )
    assert (
        got["fewshot_as_multiturn"].a,
        got["fewshot_as_multiturn"].b,
        got["fewshot_as_multiturn"].affects_scores,
    ) == (True, None, False)
    assert got["tasks"].a == ["gsm8k_cot_zeroshot", "ifeval", "sink_strength"] and got["tasks"].b == [
        "gsm8k_cot_zeroshot",
        "ifeval",
    ]
    assert (
        got["chat_template"].part == "model"
        and got["chat_template"].a == a.model["chat_template_sha"]
        and got["chat_template"].b is None
    )
    assert b.model["chat_template"] is None and b.harness["fewshot_as_multiturn"] is None
    assert match_protocol(b) == "community" and match_protocol(a) == "instruct"  # the fixtures run the named protocols
    with pytest.raises(UserError, match="instruct vs community: apply_chat_template: true vs false"):
        require_same_harness({"instruct": a, "community": b})


@pytest.mark.slow
def test_real_runs_cli_show_and_diff(smollm2_instruct_run, smollm2_community_run, capsys):
    assert main(["protocol", "diff", str(smollm2_instruct_run.folder), str(smollm2_instruct_run.results)]) == 0
    assert "no differences" in capsys.readouterr().out
    assert (
        main(["protocol", "diff", str(smollm2_instruct_run.results), str(smollm2_community_run.results), "--json"]) == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert [d["field"] for d in doc["differences"]] == [
        "apply_chat_template",
        "fewshot_as_multiturn",
        "tasks",
        "chat_template",
    ]
    assert main(["protocol", "show", str(smollm2_community_run.results)]) == 0
    out = capsys.readouterr().out
    assert "matches named protocol: community" in out and "--limit 5: scores are from a subset and are not final" in out


@pytest.mark.slow
def test_real_run_at_another_limit_records_that_cannot_change_a_score_say_no(tmp_path, smollm2_instruct_run, capsys):
    """The fixture run (--limit 5) beside a copy as --limit 4 and other S batching would record it: `limit` can
    change the IFEval and GSM8K scores, the Sink Strength task's records and batching cannot change S; with only the
    Sink Strength task compared, neither can `limit`."""
    import copy

    from lm_eval_sink.runs import load_results

    res = load_results(smollm2_instruct_run)
    other = copy.deepcopy(res)
    other["config"]["limit"] = 4.0
    other["configs"]["sink_strength"]["metadata"].update(limit_ignored=4, batch_tokens=4096)
    path = tmp_path / f"results_{TS}.json"
    path.write_text(json.dumps(other))
    assert main(["protocol", "diff", str(smollm2_instruct_run.results), str(path), "--json"]) == 0
    got = {d["field"]: d for d in json.loads(capsys.readouterr().out)["differences"]}
    assert sorted(got) == [
        "limit",
        "tasks.sink_strength.metadata.batch_tokens",
        "tasks.sink_strength.metadata.limit_ignored",
    ]
    assert got["limit"]["affects_scores"] is True
    ignored = got["tasks.sink_strength.metadata.limit_ignored"]
    assert (ignored["a"], ignored["b"], ignored["affects_scores"]) == (5, 4, False)
    assert "did not apply (S uses every prompt)" in ignored["reason"]
    assert got["tasks.sink_strength.metadata.batch_tokens"]["affects_scores"] is False
    assert main(["protocol", "diff", str(smollm2_instruct_run.results), str(path)]) == 0
    assert "| tasks.sink_strength.metadata.limit_ignored | harness | 5 | 4 | no: " in capsys.readouterr().out
    # only the Sink Strength task compared: --limit cannot change S either
    a_res = copy.deepcopy(res)
    for doc in (a_res, other):
        for key in ("results", "configs", "n-shot", "versions"):
            doc[key] = {t: v for t, v in doc[key].items() if t == "sink_strength"}
    only = diff(fingerprint(a_res), fingerprint(other))
    assert {d.field: d.affects_scores for d in only} == {
        "limit": False,
        "tasks.sink_strength.metadata.batch_tokens": False,
        "tasks.sink_strength.metadata.limit_ignored": False,
    }
    assert "never cut a Sink Strength task's calibration prompts" in only[0].reason


@pytest.mark.slow
def test_real_eval_under_named_protocol(tmp_path, shared_data, default_model, capsys, monkeypatch):
    from lm_eval_sink.protocols import fingerprint_run
    from lm_eval_sink.runs import resolve_run

    monkeypatch.setenv("LM_EVAL_SINK_DATA", str(shared_data))
    out = tmp_path / "run"
    args = ["eval", str(default_model), "--protocol", "instruct", "--tasks", "gsm8k_cot_zeroshot", "--output", str(out)]
    assert main([*args, "--limit", "1", "--gen-kwargs", "max_gen_toks=8"]) == 0
    text = capsys.readouterr().out
    assert "protocol instruct: recorded settings match" in text and "--limit 1: scores are from a subset" in text
    fp = fingerprint_run(resolve_run(out))
    assert match_protocol(fp) == "instruct"
    assert (
        fp.harness["batch_size"],
        fp.harness["apply_chat_template"],
        fp.harness["tasks"]["gsm8k_cot_zeroshot"]["num_fewshot"],
    ) == ("8", True, 0)
    assert fp.harness["gen_kwargs"] == {"max_gen_toks": 8}
    # a second eval into the same folder needs --force
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err


def test_task_metadata_settings_are_compared_but_model_args_copies_are_not():
    a_res = results_dict(SCORES, model_args={"dtype": "bfloat16"})
    b_res = results_dict(SCORES, model_args={"dtype": "bfloat16"})
    for res, n in ((a_res, 15), (b_res, 5)):
        res["configs"]["ifeval"]["metadata"].update(
            {
                "n_prompts": n,
                "pretrained": res["config"]["model_args"]["pretrained"],
                "dtype": "bfloat16",
                "config_source": f"/somewhere/{n}.yaml",
            }
        )
    a, b = fingerprint(a_res), fingerprint(b_res)
    assert a.harness["tasks"]["ifeval"]["metadata"] == {"n_prompts": 15}
    assert [(d.field, d.a, d.b) for d in diff(a, b)] == [("tasks.ifeval.metadata.n_prompts", 15, 5)]
