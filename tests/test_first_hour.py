"""What a new user meets in the first hour (issue 49): lines that name the real cause and its fix, and a `--quiet`
that silences the libraries too. Each is one `error:` line, exit 2, before any work."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

import pytest
from helpers import REPO, TINY_SWEEP_TASK, TINY_SWEEP_TASKS, VLLM_PY, vllm_missing_reason, write_tiny_sweep

from lm_eval_sink.harness.vllm_preflight import KV_CACHE_ENV

EXTS = ("md", "csv", "json", "png")


def test_lm_eval_limit_0_is_one_line_before_the_model_loads(monkeypatch, capsys):
    import lm_eval.__main__ as main_mod  # patched by the start-up hook

    monkeypatch.setattr(sys, "argv", ["lm_eval", "--model", "hf", "--tasks", "sink_strength,ifeval", "--limit", "0"])
    with pytest.raises(SystemExit) as stop:
        main_mod.cli_evaluate()
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --limit 0: no document") and "--limit 5" in err[0]
    from lm_eval_sink.harness.discovery import check_cli_limit

    check_cli_limit(["--model", "hf", "--tasks", "ifeval", "--limit", "0"])  # a stock run: lm-eval's own behaviour


def test_a_hand_written_strength_json_says_what_is_missing(handset_llama_dir, tmp_path, user_error):
    made = tmp_path / "m.strength.json"
    prov = {"inputs_key": "0" * 64, "model": {"model": str(handset_llama_dir), "fingerprint": "x"}}
    made.write_text(json.dumps({"sink_strength": 1.0, "provenance": prov}))
    line = user_error(["screen", made, "--output", tmp_path / "out"], tmp_path / "out")
    assert "its model identity has no fingerprint_rule, files (written by hand, cut short, or by a" in line


def test_screen_on_an_lm_eval_results_file_names_the_model_it_ran(tmp_path, user_error):
    results = tmp_path / "results_2026-01-01T00-00-00.json"
    config = {"model": "hf", "model_args": "pretrained=/models/qwen,dtype=float32"}
    results.write_text(json.dumps({"results": {"sink_strength": {"sink_strength,none": 1.7}}, "config": config}))
    line = user_error(["screen", results, "--output", tmp_path / "out"], tmp_path / "out")
    assert "is an lm-eval results file, not a model folder" in line and "(/models/qwen)" in line


def test_quiet_silences_the_libraries_bars_and_warnings_and_keeps_errors(tmp_path, user_error):
    """In this process and in those it starts: a tqdm bar of a library that draws its own (transformers' GGUF loader,
    converting `default` on first use, did under --quiet) is not drawn there."""
    import subprocess

    from transformers.utils import logging

    bar = [sys.executable, "-c", "from tqdm.auto import tqdm; list(tqdm(range(2), desc='a library bar'))"]
    line = user_error(["strength", tmp_path / "nothing", "--quiet", "--output", tmp_path / "out"])
    assert "no such model folder" in line
    assert not logging.is_progress_bar_enabled() and logging.get_verbosity() == logging.ERROR
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    assert subprocess.run(bar, capture_output=True, text=True, check=True).stderr == ""


@pytest.mark.skipif(not VLLM_PY.is_file(), reason=vllm_missing_reason())
def test_a_vllm_sweep_whose_engine_cannot_start_is_refused_before_any_merge(tiny_trio, tmp_path, monkeypatch, capsys):
    """The plan asks `lm_eval --model vllm`'s own start-up check, in the sweep's lm-eval interpreter: vLLM's CPU
    worker can never reserve all of the memory (gpu_memory_utilization 1.0, no KV cache size given)."""
    from lm_eval_sink.cli import main

    monkeypatch.setenv(KV_CACHE_ENV, "")
    evals = {"tasks": [TINY_SWEEP_TASK], "include_path": str(TINY_SWEEP_TASKS), "backend": "vllm"}
    evals |= {"python": str(VLLM_PY), "model_args": {"gpu_memory_utilization": 1.0, "enforce_eager": True}}
    sweep = write_tiny_sweep(tmp_path / "s", tiny_trio, eval=evals)
    assert main(["sweep", str(sweep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval: --model vllm: vLLM's CPU engine would not start" in err[0], err
    assert f"(fix: set {KV_CACHE_ENV}=N" in err[0] and not (tmp_path / "s" / "out").exists()


# --- the README's quick starts, run as written -----------------------------------------------------------------------


def readme_commands() -> dict[str, list[list[str]]]:
    """Each README quick start's commands as its fenced bash blocks hold them (continuation lines joined, comments
    dropped, split as the shell splits them), so the README and this test cannot drift."""
    text = (REPO / "README.md").read_text()
    out = {}
    for section in re.split(r"^## ", text, flags=re.M):
        if section.startswith("Quick start"):
            blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
            lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
            out[section.split(":")[0]] = [shlex.split(line, comments=True) for line in lines if line.strip()]
    return out


def _substituted(argv: list[str], models: dict[str, str]) -> list[str]:
    """A README command with its model placeholders replaced by tiny models (the paths the README leaves to you)."""
    out = []
    for arg in argv:
        for name, path in models.items():
            arg = arg.replace(name, path) if name.isupper() or name.startswith("$(") else (path if arg == name else arg)
        out.append(arg)
    return out


def _run(argv: list[str], monkeypatch) -> None:
    """One README command in this process: `lm_eval` through its console entry (this project's hook in place),
    `lm-eval-sink` through its own."""
    from lm_eval_sink.cli import main

    if argv[0] == "lm_eval":
        import lm_eval.__main__ as lm_eval_main

        monkeypatch.setattr(sys, "argv", argv)
        lm_eval_main.cli_evaluate()
    else:
        assert argv[0] == "lm-eval-sink" and main(argv[1:]) == 0, argv


def test_each_readme_quick_start_runs_as_written_and_prints_what_it_says(
    tiny_trio, lm_eval_task_index, tmp_path, monkeypatch, capsys
):
    """Every command of the README's quick starts, with tiny models for the model names; what each says it writes and
    prints is there. The vLLM call is skipped (its engine's start-up is a minute here): test_backends.py runs
    `lm_eval --model vllm` with the sweep's settings, not the README's line as written."""
    base, ref, cand = (str(tiny_trio[r]) for r in ("base", "reference", "candidate"))
    models = {"$(lm-eval-sink models default)": base, "default": base, "./llm_a": ref, "./llm_b": cand}
    models |= {"REFERENCE": ref, "CANDIDATE": cand}
    monkeypatch.chdir(tmp_path)
    printed = {}
    for name, commands in readme_commands().items():
        capsys.readouterr()
        for argv in commands:
            if argv[0].startswith("VLLM_CPU_KVCACHE_SPACE="):
                continue
            _run(_substituted(argv, models), monkeypatch)
        printed[name] = capsys.readouterr().out
    assert set(printed) == {"Quick start 1", "Quick start 2", "Quick start 3"}
    [results] = (tmp_path / "out").glob("*/results_*.json")  # S and IFEval in the same results file
    assert {"sink_strength", "ifeval"} <= set(json.loads(results.read_text())["results"])
    assert "|sink_strength|" in printed["Quick start 1"] and "|ifeval" in printed["Quick start 1"]
    for folder, names in (("strength_out", ("base",)), ("ranking_out", ("reference", "candidate"))):
        for name in names:  # one line per model; per model its strength.json (top-level sink_strength) and heatmap
            assert f"{name}: S = " in printed["Quick start 2"]
            assert "sink_strength" in json.loads((tmp_path / folder / f"{name}.strength.json").read_text())
            assert (tmp_path / folder / f"{name}.heatmap.png").is_file()
    assert {p.name for p in (tmp_path / "ranking_out").glob("ranking.*")} == {f"ranking.{e}" for e in EXTS}
    assert "too few to tell: " in printed["Quick start 3"] and (tmp_path / "buckets_ifeval" / "buckets.md").is_file()


# --- readable sweep outputs ---------------------------------------------------------------------------------------

IFE, S_TASK, CONST = "ifeval/prompt_level_strict_acc,none", "sink_strength/sink_strength,none", "ifeval/inst_x,none"


def _sweep_table() -> dict:
    """A sweep's table.json at `limit: 3`: IFEval (a headline and a constant column) and the sink_strength task."""
    values = {"reference": (1 / 3, 1.73), "candidate": (2 / 3, 1.20), "linear": (1 / 3, 1.50)}
    rows = []
    for name, (ife, s) in values.items():
        metrics = {IFE: ife, CONST: 0.5, "ifeval/prompt_level_loose_acc,none": ife, S_TASK: s}
        ref = {IFE: 1 / 3, CONST: 0.5, "ifeval/prompt_level_loose_acc,none": 1 / 3, S_TASK: 1.73}
        rows.append(
            {"checkpoint": name, "role": name, "method": None, "status": "ok", "metrics": metrics}
            | {"delta_vs_reference": {c: v - ref[c] for c, v in metrics.items()}, "metric_settings": {}}
            | {"sink_strength": None, "sink_strength_delta_vs_reference": None, "s_setting": None}
        )
    return {
        "lineage": "chain",
        "columns": [IFE, CONST, "ifeval/prompt_level_loose_acc,none", S_TASK],
        "rows": rows,
        "final": False,
        "final_note": "evaluated with limit=3: not final scores",
        "protocol": {"eval": {"limit": 3}},
    }


def test_table_md_shows_headlines_and_too_few_to_tell_and_the_figure_one_unit_per_axis():
    from lm_eval_sink.merging.sweep import table_text
    from lm_eval_sink.report.view import sweep_series

    table = _sweep_table()
    md, csv = table_text(table)
    head = next(line for line in md.splitlines() if line.startswith("| checkpoint"))
    assert head == (
        "| checkpoint | method | IFEval | IFEval delta | Sink-Strength, sink_strength | Sink-Strength, sink_strength "
        "delta | S | S delta | status |"
    )  # each task's headline (IFEval's strict prompt level), not its loose or instruction-level columns
    assert "**Too few to tell: 3 docs in its smallest task (at least 10 are needed).**" in md
    fraction = {**table, "protocol": {"eval": {"limit": 0.01}}, "docs_per_task": {"ifeval": 5, "sink_strength": 15}}
    assert "**Too few to tell: 5 docs in its smallest task" in table_text(fraction)[0]  # a fractional --limit too
    assert "Too few" not in table_text({**fraction, "docs_per_task": {"ifeval": 541}})[0]
    assert "| candidate | candidate | 66.7 | +33.3 | 1.2000 | -0.5300 |" in md  # IFEval in points, S in its own unit
    assert csv.splitlines()[0].count("delta") == 5 and "inst_x" in csv.splitlines()[0]  # every column, S included
    series = sweep_series(table)
    assert list(series["drawn"]) == ["IFEval"]  # points only: S is in its own panel
    assert series["unit"] == "points" and series["s"] == [1.73, 1.20, 1.50]  # the task's S in the S panel
    for row in table["rows"]:
        row["metrics"][IFE] = 0.0
    series = sweep_series(table)  # a headline that never changes: not drawn, said once in the title
    assert series["drawn"] == {} and series["note"].endswith("; unchanged in every checkpoint: IFEval")
    md = table_text(table)[0]  # ... and not tabled in table.md, said once above it with its value
    head = next(line for line in md.splitlines() if line.startswith("| checkpoint"))
    assert head.startswith("| checkpoint | method | Sink-Strength, sink_strength |") and "IFEval" not in head
    assert "Unchanged in every checkpoint, so left out below: IFEval 0.0.\n" in md


def test_the_console_ends_with_each_checkpoints_time_and_the_engines_build_and_swaps():
    from types import SimpleNamespace as Fields

    from lm_eval_sink.commands.sweep import times_line

    units = [Fields(id=f"{k}:{c}", kind=k, checkpoint=c) for c in ("reference", "linear") for k in ("merge", "eval")]
    markers = {"eval:reference": {"timings": {"engine_build": 19.6, "swap": 0.4}}, "eval:linear": {"timings": {}}}
    markers["eval:linear"]["timings"]["swap"] = 0.7
    seconds = {"eval:reference": 27.4, "merge:linear": 3.0, "eval:linear": 7.8}
    line = times_line(Fields(units=units), markers, seconds)
    assert line == "times of this run: reference 27.4 s, linear 10.8 s; engine build 19.6 s; weight swap 0.4-0.7 s"
    assert times_line(Fields(units=units), {}, {}) is None
