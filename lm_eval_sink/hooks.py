"""One lazy post-import hook that registers this project with lm-eval and mergekit (neither has plugin discovery),
installed at start-up by `lm_eval_sink_hook.pth` (docs/footguns.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import sysconfig
import warnings
from pathlib import Path

from lm_eval_sink.errors import SinkWarning

DISABLE_ENV = "LM_EVAL_SINK_NO_HOOK"
PTH_NAME = "lm_eval_sink_hook.pth"
PTH_LINE = (
    'import os; exec("try:\\n import lm_eval_sink.hooks as h; h.install()\\nexcept Exception as e:\\n import warnings; '
    "warnings.warn('lm-eval-sink: start-up hook failed (%r); set LM_EVAL_SINK_NO_HOOK=1 to silence' % (e,))\") "
    'if not os.environ.get("LM_EVAL_SINK_NO_HOOK") else None\n'
)

# watched module -> "module:function" called once after it has been imported.
POST_IMPORT: dict[str, str] = {
    "lm_eval.tasks.manager": "lm_eval_sink.harness.discovery:patch_task_index",
    "lm_eval.evaluator": "lm_eval_sink.harness.discovery:patch_evaluator",
    "lm_eval.__main__": "lm_eval_sink.harness.discovery:patch_cli",
    "lm_eval.utils": "lm_eval_sink.harness.discovery:patch_table",
    "mergekit.merge_methods.registry": "lm_eval_sink.merging.methods:register",
}


def _run_callback(module_name: str) -> None:
    mod_name, _, func_name = POST_IMPORT[module_name].partition(":")
    try:
        from lm_eval_sink.harness.patching import stands_aside  # an untested lm-eval: no patch, one line

        if module_name.startswith("lm_eval.") and stands_aside():
            return
        getattr(importlib.import_module(mod_name), func_name)()
    except Exception as e:  # fail soft: the host library keeps working without us
        warnings.warn(
            f"lm-eval-sink: could not register with {module_name} ({type(e).__name__}: {e}); set "
            f"{DISABLE_ENV}=1 to silence",
            SinkWarning,
            stacklevel=2,
        )


class _Loader(importlib.abc.Loader):
    """Wraps the real loader and runs the callback after the module body has executed."""

    def __init__(self, real: importlib.abc.Loader, name: str) -> None:
        self.real = real
        self.name = name

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        self.real.exec_module(module)
        _run_callback(self.name)

    def __getattr__(self, item):  # get_resource_reader, get_source, ... of the real loader
        return getattr(self.real, item)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending = set(POST_IMPORT)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        spec = importlib.util.find_spec(fullname)  # the other finders' (this one no longer watches `fullname`)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


def install() -> None:
    """Watch the modules of POST_IMPORT (idempotent; already-imported ones are handled now)."""
    if os.environ.get(DISABLE_ENV) or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    finder = _Finder()
    for name in POST_IMPORT:  # in a fixed order
        if name in sys.modules:
            finder.pending.discard(name)
            _run_callback(name)
    sys.meta_path.insert(0, finder)


def write_pth() -> Path:
    """Install the start-up file into this interpreter's purelib (site-packages; for editable installs)."""
    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    if not path.exists() or path.read_text() != PTH_LINE:
        path.write_text(PTH_LINE)
    return path


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        print(write_pth())
    else:
        sys.exit("usage: python -m lm_eval_sink.hooks install")
