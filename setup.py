"""Puts `lm_eval_sink_hook.pth` at the root of the wheel (see lm_eval_sink/hooks.py) and finds the packages.

Everything else is in pyproject.toml. The .pth text comes from lm_eval_sink.hooks (one source).
"""

import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# pip builds in an isolated environment where this package is not installed yet: import it from
# the source tree (lm_eval_sink/__init__.py, hooks.py and errors.py use only the standard library).
sys.path.insert(0, str(Path(__file__).parent))
import lm_eval_sink.hooks as _hooks

HERE = Path(__file__).parent
# Top-level folders installed under another name; setuptools' find does not see them as lm_eval_sink.*.
PACKAGE_DIR = {"lm_eval_sink.tasks": "tasks", "lm_eval_sink.merge_configs": "merge_configs"}


def packages() -> list[str]:
    """Every folder with an __init__.py under lm_eval_sink/ and the mapped folders: no hand list to forget."""
    found = find_packages(where=str(HERE), include=["lm_eval_sink", "lm_eval_sink.*"])
    for name, folder in PACKAGE_DIR.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(where=str(HERE / folder)))]
    return sorted(found)


class build_py_with_hook(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / _hooks.PTH_NAME
        target.write_text(_hooks.PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / _hooks.PTH_NAME)]


setup(packages=packages(), package_dir=PACKAGE_DIR, cmdclass={"build_py": build_py_with_hook})
