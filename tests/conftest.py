"""Shared test fixtures: the embedded default model, ../shared data, tiny tokenizers and models, real lm-eval runs of
SmolLM2 made ONCE per session and reused. Plain helpers and constants live in helpers.py (import them from there).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from helpers import (
    FIXTURE_BATCH,
    FIXTURE_GEN_KWARGS,
    FIXTURE_LIMIT,
    SHARED,
    TINY_SWEEP_UNITS,
    TINY_TASK,
    VLLM_ENV,
    VLLM_PY,
    isolated_ray_auth,
    make_tiny_lm,
    make_tokenizer,
    smollm2_sweep_file,
    vllm_missing_reason,
    write_tiny_sweep,
)
from lm_eval_sink.merging.engines import LOOPBACK_ENV

# The property tests' fixed, derandomized examples; HYPOTHESIS_PROFILE=thorough searches wider (docs/development.md).
hypothesis_settings.register_profile(
    "ci", max_examples=40, derandomize=True, deadline=None, database=None, print_blob=True
)
hypothesis_settings.register_profile("thorough", max_examples=2000, deadline=None, database=None, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every Ray the tests start or reach stays on 127.0.0.1 and sends no usage statistics. Ray reads
# these when it is imported, so they are set before any test module imports it.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault(LOOPBACK_ENV, "0")
# Ray's auth state is the test session's own: every cluster the tests start and every driver they run
# use token auth with a token made here, never a ~/.ray/auth_token left by an earlier Ray on the machine
# (a cluster that picked that one up refused the tests' drivers). Ray reads the mode when imported.
_RAY_AUTH = Path(tempfile.mkdtemp(prefix="lm-eval-sink-ray-auth-"))
atexit.register(shutil.rmtree, _RAY_AUTH, True)
os.environ.update(isolated_ray_auth(_RAY_AUTH))
os.environ.pop("RAY_AUTH_TOKEN", None)  # it would win over RAY_AUTH_TOKEN_PATH

# The files that take minutes, longest first: xdist's workers take whole files in this order (docs/development.md,
# 'Longest files first').
LONGEST_FIRST = (
    "test_backends.py",
    "test_ray.py",
    "test_sweep.py",
    "test_sweep_memory.py",
    "test_harness.py",
    "test_experiments.py",
    "test_attribution.py",
    "test_protocols.py",
    "test_wheel.py",
    "test_data_parallel.py",
)


# Every cache a test run can fill starts empty, as on a new user's machine: one temporary root per run, made by the
# controller before the xdist workers start (docs/development.md, 'Empty caches').
FRESH_CACHES = {
    "LM_EVAL_SINK_CACHE": "lm_eval_sink",
    "HF_HOME": "huggingface",
    "XDG_CACHE_HOME": "xdg",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "VLLM_CACHE_ROOT": "vllm",
}


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller set the caches
        return
    root = Path(tempfile.mkdtemp(prefix="lm-eval-sink-test-caches-"))
    config._fresh_caches = root
    os.environ.update({name: str(root / sub) for name, sub in FRESH_CACHES.items()})


def pytest_unconfigure(config: pytest.Config) -> None:
    root = getattr(config, "_fresh_caches", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


# The files whose tests start lm-eval (a process, simple_evaluate or a TaskManager): each of their tests first gets
# `lm_eval_task_index`, so lm-eval's index is built once per run, not by two workers' first processes at once.
STARTS_LM_EVAL = (
    "test_adapters.py",
    "test_architectures.py",
    "test_attribution.py",
    "test_backends.py",
    "test_data_parallel.py",
    "test_experiments.py",
    "test_extract.py",
    "test_harness.py",
    "test_inmemory.py",
    "test_loading.py",
    "test_measure_first.py",
    "test_protocols.py",
    "test_ray.py",
    "test_report.py",
    "test_sweep.py",
    "test_sweep_memory.py",
    "test_wheel.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONGEST_FIRST's files first, in that order; every other file and every file's own tests keep theirs; the
    tests of STARTS_LM_EVAL's files get the task index first."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if item.path.name in STARTS_LM_EVAL and "lm_eval_task_index" not in item.fixturenames:
            item.fixturenames.insert(0, "lm_eval_task_index")


def _made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `make(folder)` once per test run, in the temp folder the xdist workers share (the
    first that needs it makes it under a file lock, the others wait)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or skip with the reason."""
    d = SHARED / "data"
    if not (d / "ifeval" / "input_data.jsonl").is_file():
        pytest.skip(f"benchmark data not found at {d} (set LM_EVAL_SINK_SHARED to the shared folder)")
    return d


@pytest.fixture(scope="session")
def default_model(tmp_path_factory) -> Path:
    """The converted SmolLM2-135M-Instruct folder: converted once per run into the run's empty project cache (by the
    first worker that needs it, while the other waits), as a new user's first command does."""
    from lm_eval_sink.models import default_model_dir

    _made_once(tmp_path_factory, "default_model", lambda _: default_model_dir())
    return default_model_dir(create=False)


@pytest.fixture(scope="session")
def lm_eval_task_index(tmp_path_factory) -> None:
    """lm-eval's index of its own tasks, built once per run into the run's empty project cache (harness/task_index.py),
    so the run's lm-eval processes read it instead of each building it; used by the modules that start lm-eval."""

    def make(_: Path) -> None:
        from lm_eval.tasks import TaskManager

        TaskManager()

    _made_once(tmp_path_factory, "lm_eval_task_index", make)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


# Real lm-eval runs of the embedded default model, made ONCE per test session and shared by the
# harness, buckets and protocols tests. Small and non-final: --limit 5, max_gen_toks 64.
def _fixture_run(tmp_path_factory, shared_data, default_model, name: str, settings):
    from lm_eval_sink.harness.runner import run_lm_eval
    from lm_eval_sink.runs import resolve_run

    env = {"LM_EVAL_SINK_DATA": str(shared_data), "HF_HUB_OFFLINE": "1"}
    return resolve_run(
        _made_once(tmp_path_factory, name, lambda out: run_lm_eval(str(default_model), settings, out, env))
    )


def _protocol_settings(protocol: str, tasks: tuple[str, ...]):
    from lm_eval_sink.harness.runner import EvalSettings
    from lm_eval_sink.protocols import RunRequest, get_protocol, settings_fields

    request = RunRequest(tasks, limit=FIXTURE_LIMIT, gen_kwargs=FIXTURE_GEN_KWARGS, batch_size=FIXTURE_BATCH)
    return EvalSettings(**settings_fields(get_protocol(protocol), request))


@pytest.fixture(scope="session")
def smollm2_instruct_run(tmp_path_factory, shared_data, default_model, lm_eval_task_index):
    """sink_strength + ifeval + gsm8k_cot_zeroshot under the `instruct` protocol (chat template, 0-shot, batch 8)."""
    settings = _protocol_settings("instruct", ("sink_strength", "ifeval", "gsm8k_cot_zeroshot"))
    return _fixture_run(tmp_path_factory, shared_data, default_model, "instruct", settings)


@pytest.fixture(scope="session")
def smollm2_community_run(tmp_path_factory, shared_data, default_model, lm_eval_task_index):
    """ifeval + gsm8k_cot_zeroshot under the named `community` protocol (no chat template, task-default few-shot)."""
    settings = _protocol_settings("community", ("ifeval", "gsm8k_cot_zeroshot"))
    return _fixture_run(tmp_path_factory, shared_data, default_model, "community", settings)


@pytest.fixture(scope="session")
def tiny_task_dir(tmp_path_factory) -> Path:
    """A folder for --include_path with one tiny local generate_until task (`tiny_gen`, 4 docs)."""
    import json

    d = tmp_path_factory.mktemp("tiny_task")
    docs = [{"question": f"Name {w} colors.", "answer": w} for w in ("two", "three", "four", "five")]
    (d / "tiny_gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "tiny_gen.yaml").write_text(
        f"task: {TINY_TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'tiny_gen.jsonl'}\n"
        'output_type: generate_until\ntest_split: test\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 4\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: "
        "true\nmetadata:\n  version: 1.0\n"
    )
    return d


@pytest.fixture(scope="session")
def handset_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The hand-set Llama of sinkmodels.py (3 layers) saved with the tiny tokenizer."""
    import sinkmodels as sm

    d = tmp_path_factory.mktemp("handset_llama")
    sm.build("llama", n_layers=3, bos_id=tiny_tokenizer.bos_token_id).save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return d


TRIO = (("base", None), ("reference", 1), ("candidate", 2))


@pytest.fixture(scope="session")
def tiny_trio(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama models: base, reference = base + tau_r, candidate = base + tau_c; made once per run and read only,
    so the sweeps of every worker name the same model folders (the shared sweep's table records them)."""

    def make(root: Path) -> None:
        for role, seed in TRIO:
            make_tiny_lm(root / role, "llama", seed)

    root = _made_once(tmp_path_factory, "tiny_trio", make)
    return {role: root / role for role, _ in TRIO}


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, tiny_trio, lm_eval_task_index) -> Path:
    """An uninterrupted tiny sweep (`write_tiny_sweep`): reference, candidate and one DARE merge, evaluated and
    measured once per session; the sweep and Ray tests read it or work on copies of it."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    def make(folder: Path) -> None:
        report = run_sweep(load_sweep(write_tiny_sweep(folder, tiny_trio)), progress=False)
        assert not report.failures, report.failures
        assert report.ran == list(TINY_SWEEP_UNITS)

    return _made_once(tmp_path_factory, "sweep_a", make) / "sweep.yaml"


# --- real vLLM: the SmolLM2 sweep they compare with (docs/scale.md) -------------------------------------------------


@pytest.fixture(scope="module")
def vllm_env(shared_data):
    """The environment of the real-vLLM tests (in-process engine, one thread, offline data), for a module."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**VLLM_ENV, "LM_EVAL_SINK_DATA": str(shared_data), "HF_HUB_OFFLINE": "1"}.items():
            mp.setenv(k, v)
        yield


def _perturbed(default_model: Path, out: Path) -> None:
    """A copy of SmolLM2 whose MLP down projections of layers 10-29 carry seeded noise (std 0.02): fluent, but its
    greedy responses differ from the reference's."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(default_model, out, ignore=shutil.ignore_patterns("COMPLETE.json"))
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for layer in range(10, 30):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        noise = torch.randn(weights[name].shape, generator=generator, dtype=weights[name].dtype)
        weights[name] = weights[name] + 0.02 * noise
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="session")
def smollm2_candidate(tmp_path_factory, default_model) -> Path:
    """The SmolLM2 sweeps' candidate (`_perturbed`), made once per run."""
    return _made_once(tmp_path_factory, "smollm2_candidate", lambda d: _perturbed(default_model, d / "m")) / "m"


@pytest.fixture(scope="session")
def smollm2_sweep(tmp_path_factory, shared_data, default_model, smollm2_candidate) -> Path:
    """The SmolLM2 sweep file (reference, the perturbed candidate, the near-reference merge; IFEval on SWEEP_LIMIT
    local prompts and sink_strength; strength: units), run once per run with its eval units under HF in `.venv-vllm`
    (the transformers that measures S first under vLLM is that venv's): the reference the real-vLLM tests compare
    with, the one-call vLLM run of its reference (test_backends) and the resident engine's sweep on a copy of its
    folder (test_vllm_engine)."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    if not VLLM_PY.is_file():
        pytest.skip(vllm_missing_reason())

    def make(root: Path) -> None:
        env = {**VLLM_ENV, "LM_EVAL_SINK_DATA": str(shared_data), "HF_HUB_OFFLINE": "1"}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            strength = {"n_prompts": 5, "last_k": 2, "dtype": "float32"}
            path = smollm2_sweep_file(root / "hf", default_model, smollm2_candidate, {}, strength)
            report = run_sweep(load_sweep(path), progress=False)
            assert not report.failures, report.failures

    return _made_once(tmp_path_factory, "smollm2_sweep", make) / "hf" / "sweep.yaml"


@pytest.fixture
def user_error(capsys):
    """Run the CLI on bad input: one `error: ...` line, exit 2, and none of `unwritten` exists. Returns the line."""
    from lm_eval_sink.cli import main

    def run(argv: list[str], *unwritten: Path) -> str:
        capsys.readouterr()
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
        for path in unwritten:
            assert not Path(path).exists(), path
        return err[0]

    return run


@pytest.fixture(autouse=True)
def _quiet_ends_with_its_command():
    """A test's in-process `--quiet` sets the environment the processes it starts inherit (cli.QUIET_ENV) and
    transformers' bar and verbosity; the next test starts without them (its children print progress bars)."""
    import sys

    from lm_eval_sink.cli import QUIET_ENV

    saved = {name: os.environ.get(name) for name in QUIET_ENV}
    logging = sys.modules["transformers"].utils.logging if "transformers" in sys.modules else None
    bar, verbosity = (logging.is_progress_bar_enabled(), logging.get_verbosity()) if logging else (None, None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if logging:
        (logging.enable_progress_bar if bar else logging.disable_progress_bar)()
        logging.set_verbosity(verbosity)
