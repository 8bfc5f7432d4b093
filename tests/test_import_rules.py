"""The package's layering rules: no import cycle, statistics modules load no torch, core modules do no file I/O."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

from helpers import REPO

PACKAGE = REPO / "lm_eval_sink"
BUCKETS = tuple(f"buckets.{p.stem}" for p in sorted((PACKAGE / "buckets").glob("[!_]*.py")))  # the buckets package
# Core modules take and return data; reading inputs and writing outputs is their commands/<subcommand>.py's.
CORE = (
    *BUCKETS,
    "recovery",
    "power",
    "attribution",
    "margin",
    "predict",
    "tables",
    "pairing",
    "report.view",
    "report.render",
    "training.protection",
    "strength",
    "screen",
    "merging.sweep",
    "merging.scheduler",
    "comparability",
    "merging.engine_reuse",
    "options",
)
TORCH_CORE = ("report.render", "training.protection", "strength", "merging.engine_reuse")  # cores that may load torch
# Pure statistics, data and schema modules (every other core among them): importing them must not load torch or
# transformers.
TORCH_FREE = (
    *(m for m in CORE if m not in TORCH_CORE),
    "schema",
    "errors",
    "devices",
    "io",
    "failure_kinds",
    "benchmarks",
    "vendors",
    "protocols",
    "runs",
    "calibration",
    "merging.configs",
    "weights",
    "harness.engine_decision",  # decides before any engine or model is loaded
    "harness.engine_capture",
)
# Calls that read or write files: builtins and pathlib methods, and the project's readers and writers.
FILE_IO_CALLS = frozenset(
    {
        "open",
        "read_text",
        "write_text",
        "read_bytes",
        "write_bytes",
        "savez",
        "savez_compressed",
        "savefig",
        "atomic_write_bytes",
        "atomic_write_text",
        "atomic_write_json",
        "staged_dir",
        "check_output_dir",
        "check_new_outputs",
        "write_complete",
        "read_complete",
        "read_json",
        "sha256_file",
        "read_samples",
        "resolve_run",
        "load_results",
    }
)
# (module, function) allowed to read a file: the Trainer callback's public `SinkProtection.from_plan(path)` reads its
# plan;
# the QK-norm classifier reads its table from the package's own data (importlib.resources), never a user's file.
FILE_IO_ALLOWED = frozenset({("training.protection", "read_plan"), ("screen", "qk_norm_table")})


def _file_io_calls(module: str) -> list[str]:
    """`function: call` for each file-I/O call in `module` outside FILE_IO_ALLOWED."""
    path = PACKAGE.joinpath(*module.split(".")).with_suffix(".py")
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = (
                child.name
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and where == "<module>"
                else where
            )
            if isinstance(child, ast.Call):
                f = child.func
                called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if called in FILE_IO_CALLS and (module, name) not in FILE_IO_ALLOWED:
                    found.append(f"{name}: {called}")
            visit(child, name)

    visit(ast.parse(path.read_text(encoding="utf-8")), "<module>")
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> project modules it imports anywhere (top level or inside a function)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path a -> ... -> a, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_cycle_between_project_modules():
    graph = _import_graph()
    assert "lm_eval_sink.errors" in graph["lm_eval_sink.schema"]  # the graph is read
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the check itself finds a cycle


def test_statistics_modules_import_no_torch():
    code = (
        "import importlib, json, sys\n"
        f"out = {{}}\nfor m in {list(TORCH_FREE)!r}:\n"
        "    importlib.import_module('lm_eval_sink.' + m)\n"
        "    out[m] = sorted(k for k in ('torch', 'transformers') if k in sys.modules)\n"
        "print(json.dumps(out))"
    )
    env = {**os.environ, "LM_EVAL_SINK_NO_HOOK": "1"}
    out = json.loads(
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    )
    assert out == {m: [] for m in TORCH_FREE}


def test_core_modules_and_the_cli_do_no_file_io():
    assert {m: _file_io_calls(m) for m in (*CORE, "cli")} == {m: [] for m in (*CORE, "cli")}
    found = {m: _file_io_calls(f"commands.{m}") for m in ("buckets", "report", "strength", "screen")}
    assert "write_outputs: staged_dir" in found["buckets"] and "run_report: atomic_write_text" in found["report"]
    assert "_save: atomic_write_json" in found["strength"] and "reused_strength: read_json" in found["screen"]


def test_core_modules_import_no_command():
    graph = _import_graph()
    uses = {m: sorted(d for d in graph[f"lm_eval_sink.{m}"] if d.startswith("lm_eval_sink.commands")) for m in CORE}
    assert uses == {m: [] for m in CORE}
    assert "lm_eval_sink.buckets.compare" in graph["lm_eval_sink.commands.buckets"]  # the commands' imports are read


MAX_FUNCTION_LINES = 60  # docs/development.md: from the `def` line to the last line, decorators excluded
# docs/development.md: what travels together through several calls is one options object; cli.py's click commands
# take their options as parameters and are left out.
MAX_PARAMETERS = 8


def _functions():
    """(path, function node) of every function in the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_every_function_fits_on_one_screen_and_outside_the_cli_takes_at_most_eight_parameters():
    found = []
    for path, node in _functions():
        where, a = f"{path.relative_to(REPO)}:{node.lineno} {node.name}", node.args
        n_lines = node.end_lineno - node.lineno + 1
        names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None]
        n_parameters = len([x for x in names if x not in ("self", "cls")])
        if n_lines > MAX_FUNCTION_LINES:
            found.append(f"{where} ({n_lines} lines)")
        if n_parameters > MAX_PARAMETERS and path != PACKAGE / "cli.py":
            found.append(f"{where} ({n_parameters} parameters)")
    assert not found, found


# Every attribute assignment and setattr on an object other than self (`_foreign_assignments`), as (module, target),
# with the words of docs/footguns.md that list it: a change to another library's object, or an object of this
# project's own (None). One that is not here fails the test below, so a new one is listed before it is merged.
ASSIGNMENTS = {
    ("capture", "attention.__name__"): None,  # the attention function this module defines
    ("capture", "collector.first_real"): None,  # capture's own collector
    ("capture", "collector.records"): None,
    ("capture", "collector.query_chunk"): None,
    ("capture", "collector.fixed_keys"): None,
    ("capture", "config._attn_implementation_internal"): "each config's `_attn_implementation_internal`",
    ("commands.sweep", "report.table_files"): None,  # the sweep's own report
    ("commands.sweep", "report.times"): None,
    ("commands.sweep", "report.verdicts"): None,
    ("merging.sweep", "StrengthIn.what"): None,  # the sweep schema's own class
    ("extract.pipeline", "config.tie_word_embeddings"): "fields of the configs of the folders it writes",
    ("extract.pipeline", "config.dtype"): "fields of the configs of the folders it writes",
    ("extract.plan", "config.architectures"): "fields of the configs of the folders it writes",
    ("failure_kinds", "DetectorFactory.seed"): "langdetect's `DetectorFactory.seed`",
    ("harness.engine_capture", "impl.forward"): "`impl.forward`, an instance attribute shadowing vLLM's method",
    ("harness.engine_strength", "module.LLM"): "`lm_eval.models.vllm_causallms.LLM`",
    ("harness.engine_strength", "builder._lm_eval_sink_builder"): None,  # marks the builder it made
    ("harness.inprocess", "tracker.general_config_tracker.model_source"): "the model name on the `EvaluationTracker`",
    ("harness.patching", "setattr wrapper"): None,  # marks the wrapper it made
    ("harness.patching", "setattr method"): None,  # marks this project's method
    ("harness.patching", "setattr owner"): "One mechanism makes every lm-eval change",
    ("hooks", "spec.loader"): "installs one lazy post-import hook",
}


def _foreign_assignments() -> set[tuple[str, str]]:
    """(module, target) of each `X.attr = ...` (also augmented and annotated) whose X is not self or cls, and each
    `setattr(X, ...)`, in the package."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets = [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else targets
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in (t for t in flat if isinstance(t, ast.Attribute)):
                base = t
                while isinstance(base, ast.Attribute):
                    base = base.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                    found.add((module, ast.unparse(t)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                found.add((module, f"setattr {ast.unparse(node.args[0])}"))
    return found


def test_every_change_to_another_librarys_object_is_listed_in_footguns():
    """footguns.md says its lists are all of them; the vLLM attention layers' `impl.forward` that the engine capture
    wraps was in neither. Each assignment is known here, and each to another library's object is in the doc."""
    doc = " ".join((REPO / "docs" / "footguns.md").read_text(encoding="utf-8").split())  # words, not line breaks
    found = _foreign_assignments()
    assert not sorted(found - set(ASSIGNMENTS)), "list each in docs/footguns.md and in ASSIGNMENTS"
    assert not sorted(set(ASSIGNMENTS) - found), "gone from the source: drop them here (and in footguns.md)"
    assert not [k for k, words in ASSIGNMENTS.items() if words is not None and words not in doc]
