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


def test_strength_limit_names_n_prompts(user_error):
    assert "this command takes --n-prompts" in user_error(["strength", "default", "--limit", "0"])


def test_a_hand_written_strength_json_says_what_is_missing(handset_llama_dir, tmp_path, user_error):
    made = tmp_path / "m.strength.json"
    prov = {"inputs_key": "0" * 64, "model": {"model": str(handset_llama_dir), "fingerprint": "x"}}
    made.write_text(json.dumps({"sink_strength": 1.0, "provenance": prov}))
    line = user_error(["screen", made, "--output", tmp_path / "out"], tmp_path / "out")
    assert "has no fingerprint_rule, files (written by hand, or cut short)" in line and "older" not in line


def test_screen_on_an_lm_eval_results_file_names_the_model_it_ran(tmp_path, user_error):
    results = tmp_path / "results_2026-01-01T00-00-00.json"
    config = {"model": "hf", "model_args": "pretrained=/models/qwen,dtype=float32"}
    results.write_text(json.dumps({"results": {"sink_strength": {"sink_strength,none": 1.7}}, "config": config}))
    line = user_error(["screen", results, "--output", tmp_path / "out"], tmp_path / "out")
    assert "is an lm-eval results file, not a model folder" in line and "(/models/qwen)" in line


def test_a_folder_holding_only_a_gguf_names_the_file(tmp_path, user_error):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.Q4.gguf").write_bytes(b"GGUF")
    line = user_error(["strength", tmp_path / "m", "--output", tmp_path / "out"], tmp_path / "out")
    assert line.endswith(f"(fix: pass the GGUF file itself: {tmp_path / 'm' / 'model.Q4.gguf'})")


def test_quiet_silences_the_libraries_bars_and_warnings_and_keeps_errors(tmp_path, user_error, monkeypatch):
    from transformers.utils import logging

    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    before = logging.get_verbosity()
    try:
        line = user_error(["strength", tmp_path / "nothing", "--quiet", "--output", tmp_path / "out"])
        assert "no such model folder" in line
        assert not logging.is_progress_bar_enabled() and logging.get_verbosity() == logging.ERROR
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    finally:
        logging.enable_progress_bar()
        logging.set_verbosity(before)


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
    """Every command of the README's quick starts, with tiny models for the model names (the vLLM call is
    test_backends.py's: its engine's start-up is a minute here); what each says it writes and prints is there."""
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
    assert (tmp_path / "strength_out" / "base.strength.json").is_file()
    assert (tmp_path / "strength_out" / "base.heatmap.png").is_file()
    assert {p.name for p in (tmp_path / "ranking_out").glob("ranking.*")} == {f"ranking.{e}" for e in EXTS}
    assert "base: S = " in printed["Quick start 2"] and "reference: S = " in printed["Quick start 2"]
    assert "too few to tell: " in printed["Quick start 3"] and (tmp_path / "buckets_ifeval" / "buckets.md").is_file()
