"""Only here to put `lm_eval_sink_hook.pth` at the root of the wheel (see lm_eval_sink/hooks.py).

Everything else is in pyproject.toml. The .pth text comes from lm_eval_sink.hooks (one source).
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_spec = importlib.util.spec_from_file_location("_hooks", Path(__file__).parent / "lm_eval_sink" / "hooks.py")
_hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hooks)


class build_py_with_hook(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / _hooks.PTH_NAME
        target.write_text(_hooks.PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / _hooks.PTH_NAME)]


setup(cmdclass={"build_py": build_py_with_hook})
