"""lm-eval with two patch targets of another signature (a release that renamed their parameters), then the
start-up hook: both must stay as they are, with one warning line for the process.

Run with LM_EVAL_SINK_NO_HOOK=1 (so lm-eval is imported unpatched first); prints one JSON line:
{"build_kept", "table_kept", "calls": the folders TaskManager() indexed, "tasks": its task names}.
"""

import json
import os

import lm_eval.tasks
import lm_eval.utils
from lm_eval.tasks._index import TaskIndex

calls = []


def build(roots, *, recursive=True):  # `paths` renamed, `resolve_includes` gone: quick, indexes nothing
    calls.append([str(r) for r in roots])
    return {}


def make_table(results, column="results", sort_results=False):
    return "table\n"


TaskIndex.build = staticmethod(build)
lm_eval.utils.make_table = make_table
del os.environ["LM_EVAL_SINK_NO_HOOK"]

from lm_eval_sink import hooks  # noqa: E402

hooks.install()  # the modules already imported are handled now, as the start-up hook would on import
manager = lm_eval.tasks.TaskManager()
print(
    json.dumps(
        {
            "build_kept": TaskIndex.build is build,
            "table_kept": lm_eval.utils.make_table is make_table,
            "calls": calls,
            "tasks": manager.all_tasks,
        }
    )
)
