"""The start-up hook never changes a stock run: lm-eval's own objects through every wrap, hook on and off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY_TASK

# lm-eval's console script (`lm_eval.__main__:cli_evaluate`) once per argument list, in one process (one import of
# lm-eval and torch), after printing which of the five wraps are armed.
CLI = """import json, sys
import lm_eval.__main__ as main, lm_eval.evaluator as ev, lm_eval.utils as lu
from lm_eval.tasks._index import TaskIndex
wraps = [TaskIndex.build, ev.simple_evaluate, ev.evaluate, lu.make_table, main.cli_evaluate]
print("ARMED", json.dumps([hasattr(f, "_lm_eval_sink_patched") for f in wraps]), file=sys.stderr)
for args in json.loads(sys.argv[1]):
    print("RUN", flush=True)
    sys.argv = ["lm_eval", *args]
    main.cli_evaluate()
"""


def _outcomes(runs: list[list[str]], out: Path, hook: bool) -> dict:
    """What each run gave (results, configs, counts, samples, the table), the wraps armed and this project's lines."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LM_EVAL_SINK_NO_HOOK": "" if hook else "1"}
    argv = [[*args, "--log_samples", "--output_path", str(out / str(i))] for i, args in enumerate(runs)]
    proc = subprocess.run(
        [sys.executable, "-c", CLI, json.dumps(argv)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = {
        "armed": json.loads(next(line for line in proc.stderr.splitlines() if line.startswith("ARMED"))[6:]),
        "sink_lines": [line for line in proc.stderr.splitlines() if "lm-eval-sink" in line],
    }
    for i, table in enumerate(proc.stdout.split("RUN\n")[1:]):
        results = json.loads(next((out / str(i)).glob("*/results_*.json")).read_text())
        lines = [json.loads(x) for f in sorted((out / str(i)).glob("*/samples_*.jsonl")) for x in f.open()]
        outcome[i] = {
            "results": {k: results[k] for k in ("results", "configs", "n-samples", "higher_is_better")},
            "samples": [(s["doc_id"], s["filtered_resps"], s.get("exact_match")) for s in lines],
            "table": table[table.index("|") :],
        }
    return outcome


@pytest.mark.slow
def test_stock_runs_are_the_same_with_the_hook_on_and_off(handset_llama_dir, tiny_task_dir, tmp_path, capsys):
    """A local task under `--model dummy` (the path lm-eval 0.5 broke: a backend without attention) and under
    `--model hf`: through all five wraps with the hook on, none with it off; same results, samples and table. This
    project's readers take this lm-eval's results and samples files: buckets, protocol diff, attribute."""
    from concurrent.futures import ThreadPoolExecutor

    from lm_eval_sink.cli import main

    task = ["--tasks", TINY_TASK, "--include_path", str(tiny_task_dir)]
    runs = [
        ["--model", "dummy", *task],
        ["--model", "hf", "--model_args", f"pretrained={handset_llama_dir},dtype=float32", "--device", "cpu", *task],
    ]
    with ThreadPoolExecutor(2) as pool:  # hook on and off at the same time
        on, off = pool.map(lambda hook: _outcomes(runs, tmp_path / str(hook), hook), (True, False))
    assert on.pop("armed") == [True] * 5 and off.pop("armed") == [False] * 5
    assert on.pop("sink_lines") == [] and off.pop("sink_lines") == []
    assert len(on[0]["samples"]) == len(on[1]["samples"]) == 4 and on == off
    ref, cand = str(tmp_path / "True" / "1"), str(tmp_path / "False" / "1")
    assert main(["buckets", ref, cand, "--metric", "exact_match", "--output", str(tmp_path / "b"), "--quiet"]) == 0
    assert json.loads((tmp_path / "b" / "buckets.json").read_text())["n"] == 4
    assert main(["protocol", "diff", ref, cand]) == 0 and "no differences" in capsys.readouterr().out
    assert main(["attribute", "--reference", ref, "--candidate", cand, "--output", str(tmp_path / "a")]) == 0
    assert TINY_TASK in (tmp_path / "a" / "attribution.md").read_text()


def test_a_wrapper_that_fails_on_a_stock_call_hands_it_to_lm_eval(tiny_task_dir, monkeypatch):
    """`patching.attempt` in the `simple_evaluate` wrapper: its own part failing unexpectedly (as 0.5's renamed
    index did) on a call with none of this project's tasks gives lm-eval's own result, with one line; the same
    failure on a call that names `sink_strength` propagates."""
    import lm_eval.evaluator as ev
    from lm_eval.tasks import TaskManager

    from lm_eval_sink.errors import SinkWarning
    from lm_eval_sink.harness import discovery, patching

    assert hasattr(ev.simple_evaluate, "_lm_eval_sink_patched")

    def broken(arguments):
        raise AttributeError("'TaskManager' object has no attribute 'task_index'")

    monkeypatch.setattr(discovery, "measure_first_request", broken)
    monkeypatch.setattr(patching, "_SAID", set())
    manager = TaskManager(include_path=str(tiny_task_dir))
    with pytest.warns(SinkWarning, match=r"simple_evaluate met AttributeError: .*lm-eval's own takes the call"):
        out = ev.simple_evaluate(model="dummy", tasks=[TINY_TASK], task_manager=manager, bootstrap_iters=0)
    assert out["results"][TINY_TASK]["exact_match,none"] == 0.0 and out["n-samples"][TINY_TASK]["effective"] == 4
    with pytest.raises(AttributeError, match="task_index"):
        ev.simple_evaluate(model="dummy", tasks=["sink_strength"], task_manager=manager)


def test_a_build_call_the_wrapper_cannot_read_is_lm_evals(monkeypatch):
    """`TaskIndex.build`'s wrapper given roots it cannot read as paths (a later lm-eval's) hands them, as given, to
    lm-eval's own, with one line; an iterator goes there unread."""
    from lm_eval_sink.errors import SinkWarning
    from lm_eval_sink.harness import discovery, patching

    monkeypatch.setattr(patching, "_SAID", set())
    build = discovery._wrap_build(lambda paths, *, resolve_includes=True: ("lm-eval's", paths))
    roots = [{"root": "tasks", "recursive": True}]
    with pytest.warns(SinkWarning, match=r"TaskIndex\.build met TypeError: .*lm-eval's own takes the call"):
        assert build(roots) == ("lm-eval's", roots)
    given = iter(["tasks"])
    assert build(given) == ("lm-eval's", given)


def test_simple_evaluate_declares_what_it_passes_to_lm_eval(monkeypatch):
    """The `simple_evaluate` patch checks the parameters it passes to lm-eval's functions, not only their names:
    a TaskManager without `metadata` is named."""
    from lm_eval.tasks import TaskManager

    from lm_eval_sink.harness import discovery

    assert discovery._lm_eval_calls() is None
    monkeypatch.setattr(TaskManager, "__init__", lambda self, include_path=None: None)
    assert discovery._lm_eval_calls() == "calls TaskManager, which takes (self, include_path), without metadata"


def test_a_weights_file_transformers_never_reads_leaves_a_stock_run_alone(handset_llama_dir, tmp_path):
    """`simple_evaluate`'s check of a local `pretrained` folder reads what transformers loads: a stray file named
    `*.safetensors` beside `model.safetensors` (which transformers loads alone) refused the stock run, exit 2; a
    damaged `model.safetensors` is still one line."""
    import shutil

    from lm_eval_sink.errors import UserError
    from lm_eval_sink.harness.discovery import check_pretrained

    model = shutil.copytree(handset_llama_dir, tmp_path / "model")
    (model / "optimizer.safetensors").write_text("not a tensor file")
    check_pretrained({"model": "hf", "model_args": f"pretrained={model}"})
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:200])
    with pytest.raises(UserError, match=r"model\.safetensors: is cut short"):
        check_pretrained({"model": "hf", "model_args": f"pretrained={model}"})


def test_what_a_patch_reads_is_checked_before_it_arms(monkeypatch):
    """`patching.patch(reads=...)`: a target whose objects lack an attribute the wrapper reads stays as it is, with
    one line naming it; either name of an "a|b" read will do."""
    import types

    from lm_eval_sink.errors import SinkWarning
    from lm_eval_sink.harness import patching

    monkeypatch.setattr(patching, "_SAID", set())

    class Manager:  # 0.5 renamed TaskManager.task_index to _task_index
        _task_index = property(lambda self: {})

    mod = types.ModuleType("lm_eval_evaluator")
    mod.simple_evaluate = lambda model, tasks: "lm-eval's"
    with pytest.warns(SinkWarning, match=r"simple_evaluate reads .*Manager\.task_index, which this lm-eval does not"):
        patching.patch(mod, "simple_evaluate", lambda f: f, reads=((Manager, "task_index"),))
    assert not hasattr(mod.simple_evaluate, "_lm_eval_sink_patched")
    patching.patch(mod, "simple_evaluate", lambda f: lambda *a: "wrapped", reads=((Manager, "task_index|_task_index"),))
    assert mod.simple_evaluate("m", []) == "wrapped"


def test_an_lm_eval_outside_the_tested_versions_gets_one_line_and_no_patch():
    """An lm-eval version not in `patching.TESTED`: the hook arms nothing, with one line saying what stands aside."""
    code = (
        "import os, lm_eval; lm_eval.__version__ = '9.9.9'; del os.environ['LM_EVAL_SINK_NO_HOOK']\n"
        "import lm_eval_sink.hooks as h; h.install()\n"
        "import lm_eval.tasks, lm_eval.utils\n"
        "from lm_eval.tasks._index import TaskIndex\n"
        "print(hasattr(TaskIndex.build, '_lm_eval_sink_patched'), hasattr(lm_eval.utils.make_table, "
        "'_lm_eval_sink_patched'))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LM_EVAL_SINK_NO_HOOK": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "False"]
    lines = [line for line in proc.stderr.splitlines() if "lm-eval-sink" in line]
    assert len(lines) == 1 and "lm-eval 9.9.9 is not a version lm-eval-sink was tested with" in lines[0], lines
    assert "stands aside: the sink_strength tasks without a flag" in lines[0]
