"""The registered harness extension: real `lm_eval` runs in subprocesses."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import sinkmodels as sm
from helpers import CHILD_ENV, FIXTURE_LIMIT, REPO, TINY_TASK
from lm_eval_sink.calibration import builtin_prompts, encode_prompts
from lm_eval_sink.harness import tasks_dir
from lm_eval_sink.harness.discovery import index_of
from lm_eval_sink.runs import load_results, read_samples

LM_EVAL = [str(Path(sys.executable).with_name("lm_eval"))]  # the real console script of this environment
DRIVER = Path(__file__).parent / "drivers" / "lm_eval_counting.py"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **CHILD_ENV, **extra}


def _closed_form_s(tiny_tokenizer, last_k=10, n_prompts=None):
    """(S, per layer and head) of the hand-set Llama on the first `n_prompts` built-in prompts (None: all)."""
    lengths = [len(x) for x in encode_prompts(tiny_tokenizer, builtin_prompts()[:n_prompts]).input_ids]
    return sm.expected_strength("llama", 3, lengths, last_k=last_k)


def _only_results(out: Path) -> dict:
    files = list(out.glob("*/results_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


# ---- the shared SmolLM2 run: the mission's command, with no extra flag ----


@pytest.mark.slow
def test_mission_command_one_results_file(smollm2_instruct_run, default_model):
    from lm_eval_sink.strength import StrengthSettings, measure_model

    res = load_results(smollm2_instruct_run)
    assert {"sink_strength", "ifeval", "gsm8k_cot_zeroshot"} <= set(res["results"])
    s = res["results"]["sink_strength"]
    api = measure_model(str(default_model), StrengthSettings(), dtype="float32", progress=False)
    assert s["sink_strength,none"] == pytest.approx(api.sink_strength, abs=1e-5)
    assert s["pos0_argmax_fraction,none"] == pytest.approx(api.pos0_argmax_fraction, abs=1e-6)
    assert s["pos0_mass_median,none"] == pytest.approx(api.pos0_mass_median, abs=1e-6)
    matrix = s["sink_strength_layer_head,none"]
    assert matrix["layers"] == list(range(20, 30)) and np.allclose(
        matrix["values"], api.sink_strength_layer_head, atol=1e-5
    )
    assert s["chat_template_applied,none"] is True
    meta = res["configs"]["sink_strength"]["metadata"]
    assert meta["limit_ignored"] == FIXTURE_LIMIT and res["n-samples"]["sink_strength"]["effective"] == 15
    assert res["n-samples"]["ifeval"]["effective"] == FIXTURE_LIMIT
    for metric in ("prompt_level_strict_acc,none", "prompt_level_loose_acc,none"):
        assert 0.0 <= res["results"]["ifeval"][metric] <= 1.0
    rows = read_samples(smollm2_instruct_run.samples["sink_strength"])
    assert len(rows) == 15
    per_prompt = [r["sink_strength"]["sink_strength_prompt"] for r in sorted(rows, key=lambda r: r["doc_id"])]
    assert np.allclose(per_prompt, api.per_prompt, atol=1e-5)


@pytest.mark.slow
def test_limit_is_said_once_in_the_console(smollm2_instruct_run):
    """The shared run's own console log (lm_eval --tasks sink_strength,... --limit 5 at lm-eval's default verbosity):
    one line says that the calibration set was used whole, and S is shown with K's share of the layers."""
    folder = smollm2_instruct_run.folder
    logs = sorted(next(p for p in (folder, *folder.parents) if (p / "logs").is_dir()).joinpath("logs").glob("*.log"))
    console = logs[-1].read_text(encoding="utf-8")
    line = f"sink_strength: --limit {FIXTURE_LIMIT} not applied: S uses the whole calibration set (15 prompts)"
    assert console.count(line) == 1, console[-3000:]
    assert "sink_strength: S = " in console and "over the last 10 of 30 attention layers (33%)" in console


@pytest.mark.slow
def test_offline_stock_tasks_record_the_local_dataset(smollm2_instruct_run, shared_data):
    res = load_results(smollm2_instruct_run)
    cfg = res["configs"]["ifeval"]
    assert cfg["dataset_path"] == "json"
    data = shared_data.resolve()  # the recorded path is the real one (a symlinked shared folder resolved)
    assert cfg["dataset_kwargs"]["data_files"]["train"] == str(data / "ifeval" / "input_data.jsonl")
    assert res["configs"]["gsm8k_cot_zeroshot"]["dataset_kwargs"]["data_files"]["test"] == str(
        data / "gsm8k" / "test.jsonl"
    )


# ---- tiny models: one call loads the model once; flags users pass ----


def test_one_call_loads_model_once_with_common_flags(handset_llama_dir, tiny_task_dir, tiny_tokenizer, tmp_path):
    out, count = tmp_path / "out", tmp_path / "count"
    cmd = [
        sys.executable,
        str(DRIVER),
        str(count),
        "--model",
        "hf",
        "--model_args",
        f"pretrained={handset_llama_dir}",
        "--tasks",
        f"sink_strength,{TINY_TASK}",
        "--include_path",
        str(tiny_task_dir),
        "--limit",
        "2",
        "--batch_size",
        "4",
        "--seed",
        "1",
        "--device",
        "cpu",
        "--apply_chat_template",
        "--predict_only",
        "--use_cache",
        str(tmp_path / "cache"),
        "--log_samples",
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert count.read_text() == "1"
    res = _only_results(out)
    assert {"sink_strength", TINY_TASK} <= set(res["results"])
    want, per = _closed_form_s(tiny_tokenizer)
    got = res["results"]["sink_strength"]
    assert got["sink_strength,none"] == pytest.approx(want, abs=1e-5)
    np.testing.assert_allclose(got["sink_strength_layer_head,none"]["values"], per, atol=1e-5)
    assert res["configs"]["sink_strength"]["metadata"]["limit_ignored"] == 2
    assert res["configs"]["sink_strength"]["metadata"]["predict_only_kept_metrics"] is True
    assert len(list(out.glob("*/samples_sink_strength_*.jsonl"))) == 1


def test_explicit_include_path_without_hook_and_bf16(handset_llama_dir, tiny_tokenizer, tmp_path):
    """The explicit --include_path form with the hook off, on a bf16 model (capture stays float32)."""
    out = tmp_path / "out"
    cmd = [
        *LM_EVAL,
        "--model",
        "hf",
        "--model_args",
        f"pretrained={handset_llama_dir},dtype=bfloat16",
        "--tasks",
        "sink_strength_n5",
        "--include_path",
        str(tasks_dir()),
        "--device",
        "cpu",
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(cmd, env=_env(LM_EVAL_SINK_NO_HOOK="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _only_results(out)["results"]["sink_strength_n5"]
    want, _ = _closed_form_s(tiny_tokenizer, n_prompts=5)
    assert got["chat_template_applied,none"] is True
    assert math.isfinite(got["sink_strength,none"]) and got["sink_strength,none"] == pytest.approx(
        want, abs=0.05
    )  # bf16 weights


def test_task_config_can_turn_the_template_off(handset_llama_dir, tiny_tokenizer):
    """metadata chat_template: false (here through lm-eval's --metadata) tokenizes the prompts as plain text."""
    import lm_eval

    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={handset_llama_dir}",
        tasks=["sink_strength_n5"],
        device="cpu",
        metadata={"chat_template": False},
    )
    got = res["results"]["sink_strength_n5"]
    assert got["chat_template_applied,none"] is False
    # Plain text has no BOS here, so every key is the zero vector: each row is uniform, log-odds = -log(q).
    enc = encode_prompts(tiny_tokenizer, builtin_prompts()[:5], use_chat_template=False)
    assert not enc.chat_template_applied and all(tiny_tokenizer.bos_token_id not in ids for ids in enc.input_ids)
    want = float(np.median([-math.log(q) for ids in enc.input_ids for q in range(1, len(ids))]))
    assert got["sink_strength,none"] == pytest.approx(want, abs=1e-5)


def test_cached_requests_follow_the_settings(handset_llama_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """--cache_requests with other --metadata gives that metadata's S, not the cached run's (the key holds a digest
    of the settings and the prompt set); the same settings again reuse the cached requests."""
    import lm_eval
    from lm_eval.caching import cache

    monkeypatch.setattr(cache, "PATH", str(tmp_path / "requests"))  # what LM_HARNESS_CACHE_PATH sets at import
    got = {}
    for last_k in (1, 10, 1):
        res = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={handset_llama_dir}",
            tasks=["sink_strength_n5"],
            device="cpu",
            cache_requests=True,
            metadata={"last_k": last_k},
        )
        got[last_k] = res["results"]["sink_strength_n5"]["sink_strength,none"]
        assert got[last_k] == pytest.approx(_closed_form_s(tiny_tokenizer, last_k, 5)[0], abs=1e-5)
    assert got[1] != pytest.approx(got[10], abs=1e-3)
    assert len(list((tmp_path / "requests").iterdir())) == 2  # one cache file per settings, reused the third time


def test_lm_eval_ls_lists_sink_strength_with_no_flag():
    proc = subprocess.run([*LM_EVAL, "ls", "tasks"], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "sink_strength " in proc.stdout.replace("|", " ")


def test_a_model_the_capture_refuses_stops_before_any_request_of_any_task(tiny_tokenizer, tmp_path):
    """`--tasks ifeval,sink_strength` on a built model the capture refuses (Bloom: its attention bypasses
    transformers' interface): one line, exit 2, before lm-eval runs any request (IFEval's generation included)."""
    from transformers import BloomConfig, BloomForCausalLM

    model = tmp_path / "bloom"
    config = BloomConfig(vocab_size=len(tiny_tokenizer), hidden_size=16, n_layer=2, n_head=2)
    BloomForCausalLM(config).save_pretrained(model)
    tiny_tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    cmd = [*LM_EVAL, "--model", "hf", "--model_args", f"pretrained={model}", "--tasks", "ifeval,sink_strength"]
    cmd += ["--limit", "1", "--device", "cpu", "--output_path", str(out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: BloomForCausalLM does not route attention through transformers' AttentionInterface")
    assert "Initializing hf model" in proc.stderr  # the check is of the built model
    assert "Running generate_until requests" not in proc.stderr and "Running sink_strength" not in proc.stderr
    assert not out.exists()


# ---- offline data override: configs equal to stock except dataset keys; hub schema ----

DATASET_KEYS = {"dataset_path", "dataset_name", "dataset_kwargs", "custom_dataset"}
# google/IFEval's declared `kwargs` features, in the hub's order (dataset card, dataset_info).
HUB_IFEVAL_KWARGS = [
    "num_highlights",
    "relation",
    "num_words",
    "num_placeholders",
    "prompt_to_repeat",
    "num_bullets",
    "section_spliter",
    "num_sections",
    "capital_relation",
    "capital_frequency",
    "keywords",
    "num_paragraphs",
    "language",
    "let_relation",
    "letter",
    "let_frequency",
    "end_phrase",
    "forbidden_words",
    "keyword",
    "frequency",
    "num_sentences",
    "postscript_marker",
    "first_word",
    "nth_paragraph",
]


@pytest.fixture(scope="module")
def offline_manager(shared_data, tmp_path_factory):
    """One hooked TaskManager with LM_EVAL_SINK_DATA set (building the index costs seconds), built after files
    that would run code if lm-eval imported them were planted beside the generated YAMLs (this process's folder):
    a module where lm-eval looks first for the loader's `!function`, and a tampered `ifeval.yaml` naming a planted
    module. The marker (yielded with the manager) must never appear."""
    from lm_eval.tasks import TaskManager

    from lm_eval_sink.harness.offline import data_root, generated_dir

    marker = tmp_path_factory.mktemp("planted") / "planted-code-ran"
    code = f"open({str(marker)!r}, 'w').close()\ndef load_local(**_):\n    raise RuntimeError('planted')\n"
    old = os.environ.get("LM_EVAL_SINK_DATA")
    os.environ["LM_EVAL_SINK_DATA"] = str(shared_data)
    folder = generated_dir(data_root())
    planted = [folder / "lm_eval_sink" / "harness" / "offline.py", folder / "evil.py"]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    tampered = folder / "ifeval.yaml"
    tampered.write_text("task: ifeval\ncustom_dataset: !function evil.load_local\n")
    try:
        yield TaskManager(), marker
    finally:
        for path in planted:
            path.unlink()
        if old is None:
            os.environ.pop("LM_EVAL_SINK_DATA")
        else:
            os.environ["LM_EVAL_SINK_DATA"] = old


@pytest.mark.parametrize("task", ["ifeval", "gsm8k_cot_zeroshot", "gsm8k_cot", "gsm8k_cot_llama", "eq_bench"])
def test_overridden_stock_task_config_equals_stock_except_dataset(task, offline_manager):
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = index_of(offline_manager[0])[task]
    stock_path = Path(load_yaml(entry.yaml_path, resolve_func=False, recursive=False)["include"][0])
    generated = load_yaml(entry.yaml_path, resolve_func=False)
    stock = load_yaml(stock_path, resolve_func=False)
    assert "lm_eval/tasks" in str(stock_path)
    diff = {k for k in set(stock) | set(generated) if stock.get(k) != generated.get(k)}
    assert diff <= DATASET_KEYS, diff
    assert generated["dataset_path"] == "json"


def test_local_ifeval_docs_have_the_hub_schema(offline_manager):
    """Read through the generated YAMLs with planted code beside them: the documents are right, and nothing
    planted ran (the loader is lm_eval_sink's own)."""
    from lm_eval_sink.harness.offline import load_local

    manager, marker = offline_manager
    task = manager.load(["ifeval"])["tasks"]["ifeval"]
    assert task.config.custom_dataset is load_local
    docs = list(task.eval_docs)
    assert len(docs) == 541
    assert list(docs[0]) == ["key", "prompt", "instruction_id_list", "kwargs"]
    for doc in (docs[0], docs[100], docs[540]):
        for kw in doc["kwargs"]:
            assert list(kw) == HUB_IFEVAL_KWARGS  # every key present, None where unused, the hub's order
    assert docs[0]["kwargs"][0]["num_highlights"] is None and docs[0]["kwargs"][1]["num_highlights"] == 3
    gsm = manager.load(["gsm8k_cot_zeroshot"])["tasks"]["gsm8k_cot_zeroshot"]
    assert len(list(gsm.eval_docs)) == 1319 and list(next(iter(gsm.eval_docs))) == ["question", "answer"]
    assert not marker.exists()


def test_without_data_env_the_generated_override_is_not_used(offline_manager, monkeypatch):
    from lm_eval_sink.harness.offline import data_root

    monkeypatch.delenv("LM_EVAL_SINK_DATA", raising=False)
    assert data_root() is None  # TaskManager then leaves every stock entry as lm-eval built it
    assert "lm-eval-sink-tasks-" in str(index_of(offline_manager[0])["ifeval"].yaml_path)


def _as_another_user(action) -> bool:
    """Whether `action()` succeeds as uid/gid 65534 (`nobody`, a forked child): where the tests run as root."""
    if (pid := os.fork()) == 0:  # the child exits without running pytest's teardown
        try:
            os.setgid(65534)
            os.setuid(65534)
            action()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def test_a_yaml_nobody_else_can_swap_after_the_build(offline_manager, shared_data, tmp_path, monkeypatch):
    """lm-eval reads a task's YAML again at every load, and a sweep keeps one TaskManager: a generated YAML swapped
    after the build to name `!function planted_mod.x` imported planted_mod.py from the cache folder that held it.
    A cache others can write is refused before anything is written; the generated YAMLs are in no cache but in a
    folder of this process alone (0700, removed at its exit), where another user can plant nothing (tried as
    `nobody` where the tests run as root), so a later load runs nothing planted."""
    from lm_eval.tasks import TaskManager

    from lm_eval_sink.errors import UserError

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("LM_EVAL_SINK_CACHE", str(shared))
    monkeypatch.setenv("LM_EVAL_SINK_DATA", str(shared_data))
    with pytest.raises(UserError, match=rf"the project cache {shared} is writable by others \(mode 777\)"):
        TaskManager()
    assert list(shared.iterdir()) == []

    from lm_eval_sink.cache import private_problem

    manager, marker = offline_manager
    path = Path(index_of(manager)["ifeval"].yaml_path)
    folder = path.parent.parent  # <process folder>/<data folder key>/ifeval.yaml
    assert folder.name.startswith("lm-eval-sink-tasks-") and folder.stat().st_mode & 0o777 == 0o700
    assert private_problem(folder) is None and not path.is_relative_to(Path(os.environ["LM_EVAL_SINK_CACHE"]))

    def swap() -> None:
        (path.parent / "planted_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef x(**_):\n    pass\n")
        path.write_text("task: ifeval\ncustom_dataset: !function planted_mod.x\n")

    if os.geteuid() == 0:
        assert not _as_another_user(swap)
    assert len(list(manager.load(["ifeval"])["tasks"]["ifeval"].eval_docs)) == 541 and not marker.exists()

    code = "from pathlib import Path; from lm_eval_sink.harness.offline import generated_dir as g; print(g(Path('/d')))"
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).parent.name.startswith("lm-eval-sink-tasks-")
    assert not Path(out.stdout.strip()).parent.exists()  # removed at exit


# ---- the hook itself ----


def test_hook_costs_nothing_until_lm_eval_is_imported():
    code = (
        "import sys, json; print(json.dumps(['lm_eval_sink.hooks' in sys.modules, "
        "'lm_eval_sink.harness' in sys.modules, 'lm_eval' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [True, False, False]
    out = subprocess.run(
        [sys.executable, "-c", code], env=_env(LM_EVAL_SINK_NO_HOOK="1"), capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out) == [False, False, False]


def test_hook_fails_soft_with_one_warning(monkeypatch):
    from lm_eval_sink import hooks

    monkeypatch.setitem(hooks.POST_IMPORT, "json", "lm_eval_sink.harness.discovery:no_such_patch")
    with pytest.warns(UserWarning, match="could not register with json"):
        hooks._run_callback("json")


def test_setup_py_runs_where_the_package_is_not_installed(tmp_path):
    """pip builds a fresh clone in an isolated environment (only setuptools): setup.py must not need an installed
    lm_eval_sink."""
    import sysconfig

    code = (
        "import runpy, sys; sys.path.append(sys.argv[1]); "
        "import importlib.util as u; assert u.find_spec('lm_eval_sink') is None, 'not isolated'; "
        "sys.argv = ['setup.py', '-q', 'build_py', '--build-lib', sys.argv[2]]; "
        "runpy.run_path('setup.py', run_name='__main__')"
    )
    # -I -S: neither the working directory nor the site-packages .pth files (this environment's editable install) are on
    # the path.
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, sysconfig.get_paths()["purelib"], str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from lm_eval_sink.hooks import PTH_LINE, PTH_NAME

    assert (tmp_path / PTH_NAME).read_text() == PTH_LINE


def test_the_entry_point_and_the_hook_reach_every_task_variant(offline_manager):
    """The declared `lm_eval.tasks` entry point resolves, as lm-eval's proposed plugin contract does, to the folder of
    this project's task YAMLs, and the hooked TaskManager indexes every variant there."""
    import importlib.util
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["lm_eval.tasks"]
    assert declared == {"lm_eval_sink": "lm_eval_sink.tasks"}
    module = declared["lm_eval_sink"].partition(":")[0]  # the proposed contract ignores ':attr'
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations
    assert Path(next(iter(spec.submodule_search_locations))) == tasks_dir()
    assert {
        "sink_strength",
        "sink_strength_n5",
        "sink_strength_all_layers",
        "sink_strength_content",
        "sink_strength_suite",
    } <= set(offline_manager[0].all_tasks)


def test_include_defaults_false_lists_only_the_given_folder():
    """lm-eval's contract, and lm-eval's own warnings naming the caller (no frame of this project between a
    TaskManager and its caller: `verbosity`'s DeprecationWarning would otherwise point into the hook, and Python's
    default filters show it only when it names `__main__`)."""
    import warnings

    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    assert getattr(TaskIndex.build, "_lm_eval_sink_patched", False)  # the start-up hook is active here
    folder = Path(__file__).parent / "data" / "merging_task"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        only = TaskManager(verbosity="INFO", include_defaults=False, include_path=str(folder))
    assert set(only.all_tasks) == {"lm_eval_sink_tiny_choice"}  # neither lm-eval's tasks nor this project's
    assert [(w.category, w.filename) for w in caught if "verbosity" in str(w.message)] == [
        (DeprecationWarning, __file__)
    ]
    assert (
        "sink_strength" in TaskManager(include_defaults=False, include_path=[str(folder), str(tasks_dir())]).all_tasks
    )


def test_a_changed_patch_target_is_left_as_installed_with_one_line_each():
    """A release whose TaskIndex.build and make_table take other parameters and whose LM has a `sink_strength` of
    its own: all stay lm-eval's (this project's folder not indexed, LM's and HFLM's request method not replaced),
    one warning line per target names it, lm-eval's version and what to do, and the task refuses to run in one line."""
    from importlib.metadata import version

    import lm_eval

    from lm_eval_sink.harness.patching import EXPLICIT_WAY

    driver = Path(__file__).parent / "drivers" / "changed_targets.py"
    proc = subprocess.run(
        [sys.executable, str(driver)], env=_env(LM_EVAL_SINK_NO_HOOK="1"), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    own = str(Path(lm_eval.__file__).parent / "tasks")
    out = json.loads(proc.stdout)
    assert out.pop("task_refused").startswith("this lm-eval's model classes were left as installed")
    assert out == {"build_kept": True, "table_kept": True, "calls": [[own]], "tasks": [], "request_kept": True}
    lines = [line for line in proc.stderr.splitlines() if "lm-eval-sink" in line]
    v = re.escape(version("lm_eval"))
    assert len(lines) == 4, proc.stderr
    assert re.search(
        rf"lm-eval {v}'s lm_eval\.tasks\._index\.TaskIndex\.build takes \(roots, recursive\), not", lines[0]
    )
    assert re.search(
        rf"lm-eval {v}'s lm_eval\.utils\.make_table takes \(results, column, sort_results\), not", lines[1]
    )
    assert lines[0].endswith(EXPLICIT_WAY) and lines[1].endswith(EXPLICIT_WAY)
    for line, owner in zip(lines[2:], ("api.model.LM", "models.huggingface.HFLM"), strict=True):
        assert f"lm_eval.{owner}.sink_strength is lm-eval's own" in line and line.endswith("lm-eval-sink strength)")


def test_a_request_method_is_added_only_where_what_it_reads_is(monkeypatch):
    """`patching.add_method`, the check of `LM.sink_strength` and `HFLM.sink_strength`: a class without an attribute
    the method reads keeps no such method, with one line; one that has it gets it, once, and its subclass with it;
    a subclass's own method of that name stays."""
    from lm_eval_sink.errors import SinkWarning
    from lm_eval_sink.harness import patching

    monkeypatch.setattr(patching, "_SAID", set())

    def method(self, requests):
        return requests

    class Changed:  # a release whose model class lost `rank`
        model = None

    with pytest.warns(SinkWarning, match=r"Changed.sink_strength reads .*Changed.rank, which .* installed .* refuses"):
        assert not patching.add_method(Changed, "sink_strength", method, reads=("model", "rank"))
    assert not hasattr(Changed, "sink_strength")

    class Base:
        model = rank = None

    class Own(Base):
        def sink_strength(self, requests):
            return None

    assert patching.add_method(Base, "sink_strength", method, reads=("model", "rank"))
    assert patching.add_method(Base, "sink_strength", method) and Base.sink_strength is method
    with pytest.warns(SinkWarning, match=r"Own.sink_strength is lm-eval's own"):  # a line of its own: another target
        assert not patching.add_method(Own, "sink_strength", method) and Own.sink_strength is not method


def test_the_resident_engine_takes_the_place_of_an_llm_only_lm_eval_builds_by_that_name():
    """`patching.engine_target_problem`, the check before the resident engine swaps `vllm_causallms.LLM`: a release
    whose vLLM model builds its engine through another name would get a new engine per checkpoint without a word."""
    import types

    from lm_eval_sink.harness.patching import engine_target_problem

    def module(source: str) -> types.ModuleType:
        mod = types.ModuleType("vllm_causallms")
        exec(source, mod.__dict__)
        return mod

    builds = module("LLM = dict\nclass VLLM:\n    def __init__(self):\n        self.model = LLM()\n")
    assert engine_target_problem(builds, ("model",)) is None
    assert engine_target_problem(builds, ("model", "lora_request")) == "VLLM.__init__ sets no lora_request"
    other = module("import types as vllm\nLLM = dict\nclass VLLM:\n    def __init__(self):\n        vllm.LLM()\n")
    assert engine_target_problem(other) == "builds its engine in VLLM.__init__ through no module global LLM"
    assert engine_target_problem(module("class VLLM:\n    pass\n")) == "has no LLM"


def test_start_up_file_failure_is_one_warning():
    from lm_eval_sink.hooks import PTH_LINE

    code = f"import sys; sys.modules['lm_eval_sink.hooks'] = None\n{PTH_LINE}"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_env(LM_EVAL_SINK_NO_HOOK=""), capture_output=True, text=True, check=True
    )
    assert proc.stderr.count("lm-eval-sink: start-up hook failed") == 1


def test_groups_tags_inline_configs_and_yaml_paths_reach_their_tasks(tmp_path):
    """`discovery.task_leaves`, the one walk of lm-eval's groups and tags (the vLLM refusal and plan-time checks):
    a group of a tag and an inline task, a YAML path, an inline group; the inline keys over the indexed config."""
    from lm_eval.tasks import TaskManager

    from lm_eval_sink.harness.discovery import own_leaves, task_leaves

    folder = tmp_path / "suite"
    folder.mkdir()
    for name, tag in (("gen_a", "gens"), ("gen_b", "gens"), ("other", None)):
        tags = f"tag: {tag}\n" if tag else ""
        (folder / f"{name}.yaml").write_text(f"task: {name}\n{tags}output_type: generate_until\ndataset_path: x\n")
    (folder / "suite.yaml").write_text(
        "group: suite\ntask:\n  - gens\n  - task: sink_strength\n    num_fewshot: 3\nmetadata:\n  version: 1.0\n"
    )
    index = index_of(TaskManager(include_defaults=False, include_path=[str(folder), str(tasks_dir())]))
    leaves = task_leaves(["suite"], index)
    assert sorted(leaves) == ["gen_a", "gen_b", "sink_strength"]
    assert leaves["sink_strength"]["num_fewshot"] == 3 and leaves["gen_a"]["output_type"] == "generate_until"
    inline = {"group": "g", "task": ["gen_b"]}
    assert sorted(task_leaves([str(folder / "other.yaml"), inline], index)) == ["gen_b", "other"]
    assert own_leaves(task_leaves(["suite", "other"], index)) == ["sink_strength"]
    assert own_leaves(task_leaves(["gens"], index)) == []
    # A YAML path is read whole: a group file's members, a task file's class (a copy of sink_strength, renamed).
    mine = tmp_path / "mine.yaml"
    mine.write_text(f"include: {tasks_dir() / 'sink_strength' / 'sink_strength.yaml'}\ntask: my_sink\n")
    assert own_leaves(task_leaves([str(folder / "suite.yaml"), str(mine)], index)) == ["my_sink", "sink_strength"]
