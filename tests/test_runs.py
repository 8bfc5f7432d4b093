"""The shared run resolver, the atomic-write helpers, the output-folder mechanism and the table helper (standard library
only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import atomic_write_json, canonical_json
from lm_eval_sink.outputs import COMPLETE, manifest, read_complete, staged_dir, write_complete
from lm_eval_sink.runs import load_results, read_samples, resolve_run
from lm_eval_sink.tables import csv_text, markdown_table

T1, T2 = "2026-12-01T10-00-00.000001", "2026-12-02T10-00-00.000002"


def _run_folder(root, model="org__model", stamps=(T1, T2), tasks=("ifeval",)):
    folder = root / model
    folder.mkdir(parents=True)
    for ts in stamps:
        (folder / f"results_{ts}.json").write_text(json.dumps({"results": {}, "config": {"ts": ts}}))
        for t in tasks:
            (folder / f"samples_{t}_{ts}.jsonl").write_text(json.dumps({"doc_id": 0, "ts": ts}) + "\n")
    return folder


def test_folder_resolves_to_newest_results_and_its_samples(tmp_path):
    folder = _run_folder(tmp_path, tasks=("ifeval", "gsm8k_cot_zeroshot"))
    for arg in (folder, tmp_path):  # the model folder, or an output folder holding one model
        run = resolve_run(arg)
        assert run.timestamp == T2 and run.results.name == f"results_{T2}.json"
        assert set(run.samples) == {"ifeval", "gsm8k_cot_zeroshot"}
        assert all(T2 in p.name for p in run.samples.values())
    assert load_results(resolve_run(folder))["config"]["ts"] == T2


def test_results_and_samples_files_resolve_to_their_own_time(tmp_path):
    folder = _run_folder(tmp_path)
    run = resolve_run(folder / f"results_{T1}.json")
    assert run.timestamp == T1 and run.samples["ifeval"].name == f"samples_ifeval_{T1}.jsonl"
    run = resolve_run(folder / f"samples_ifeval_{T1}.jsonl")
    assert run.results.name == f"results_{T1}.json"
    assert read_samples(run.samples_for(None)[1])[0]["ts"] == T1


def test_several_models_is_an_error_listing_them(tmp_path):
    _run_folder(tmp_path, "org__a")
    _run_folder(tmp_path, "org__b")
    with pytest.raises(UserError, match=r"several models.*org__a, org__b"):
        resolve_run(tmp_path)


def test_bad_runs_are_user_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    not_results = tmp_path / "results_2026-12-01T10-00-00.json"
    not_results.write_text('{"a": 1}')
    bad, empty = tmp_path / f"samples_ifeval_{T1}.jsonl", tmp_path / f"samples_gsm8k_{T1}.jsonl"
    bad.write_text('{"doc_id": 0}\n{oops\n')
    empty.write_text("\n")
    no_samples = _run_folder(tmp_path / "runs", tasks=())
    for call, pattern in [
        (lambda: resolve_run(tmp_path / "nope"), "no such file or folder"),
        (lambda: resolve_run(tmp_path / "empty"), "no lm-eval results"),
        (lambda: load_results(resolve_run(not_results)), "not an lm-eval results file"),
        (lambda: read_samples(bad), r":2: not valid JSON"),
        (lambda: read_samples(empty), "empty samples file"),
        (lambda: resolve_run(no_samples).samples_for("ifeval"), "no samples files"),
    ]:
        with pytest.raises(UserError, match=pattern):
            call()


def test_canonical_json_is_byte_identical_and_refuses_nan(tmp_path):
    a = atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [1.5, None]}).read_bytes()
    b = atomic_write_json(tmp_path / "b.json", {"a": [1.5, None], "b": 1}).read_bytes()
    assert a == b
    with pytest.raises(ValueError, match="not JSON compliant"):
        canonical_json({"x": float("nan")})


def test_staged_dir_leaves_nothing_that_looks_complete_on_failure(tmp_path):
    out = tmp_path / "out"

    def interrupted_build() -> None:
        with staged_dir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted_build()
    assert not out.exists() and not list(tmp_path.iterdir())  # refusal and --force: test_outputs.py


def test_complete_marker_is_written_inside_the_staged_folder_and_read_by_key(tmp_path):
    out = tmp_path / "unit"
    with staged_dir(out) as tmp:
        (tmp / "w.bin").write_bytes(b"12345")
        write_complete(tmp, {"key": "k1", "weight_files": manifest(tmp, ["w.bin"])})
        assert read_complete(out) is None  # not at `out` until the rename
    assert read_complete(out) == {"key": "k1", "weight_files": {"w.bin": 5}}
    assert read_complete(out, "k1")["key"] == "k1"
    assert read_complete(out, "k2") is None  # made from other inputs: not reused
    (out / COMPLETE).write_text("{not json")
    assert read_complete(out) is None and read_complete(tmp_path / "missing") is None
    with pytest.raises(UserError, match="is a file, not a folder"), staged_dir(out / COMPLETE, force=True):
        pass


def test_table_helper_markdown_and_csv():
    assert markdown_table(["a", "b"], [[1, "x"], ["2", 0.5]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2 | 0.5 |\n"
    assert csv_text(["a", "b"], [["x, y", 'q"'], [1, ""]]) == 'a,b\n"x, y","q"""\n1,\n'


def test_light_modules_import_no_torch():
    """Modules that work on saved logs or numbers, and the CLI, load no torch, transformers or matplotlib."""
    light = "errors io runs calibration strength cli buckets protocols attribution predict margin".split()
    imports = ", ".join(f"lm_eval_sink.{m}" for m in light)
    heavy = ("torch", "transformers", "click", "matplotlib")
    code = f"import sys, {imports}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['click']"  # cli imports click; nothing imports torch, transformers or matplotlib
