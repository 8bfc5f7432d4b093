"""lm-eval with two patch targets of another signature (a release that renamed their parameters) and a model base
class that has a `sink_strength` of its own (a release that defines it), then the start-up hook and this project's
task module: all must stay as they are, with one warning line for the process, and the task refuses to run.

Run with LM_EVAL_SINK_NO_HOOK=1 (so lm-eval is imported unpatched first); prints one JSON line:
{"build_kept", "table_kept", "calls": the folders TaskManager() indexed, "tasks": its task names, "request_kept":
LM's and HFLM's `sink_strength` are lm-eval's, "task_refused": the task's error line}.
"""

import json
import os

import lm_eval.tasks
import lm_eval.utils
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks._index import TaskIndex

calls = []


def build(roots, *, recursive=True):  # `paths` renamed, `resolve_includes` gone: quick, indexes nothing
    calls.append([str(r) for r in roots])
    return {}


def make_table(results, column="results", sort_results=False):
    return "table\n"


def sink_strength(self, requests):  # lm-eval's own method of that name
    return []


TaskIndex.build = staticmethod(build)
lm_eval.utils.make_table = make_table
LM.sink_strength = sink_strength
del os.environ["LM_EVAL_SINK_NO_HOOK"]

from lm_eval_sink import hooks  # noqa: E402

hooks.install()  # the modules already imported are handled now, as the start-up hook would on import
manager = lm_eval.tasks.TaskManager()
from lm_eval_sink.errors import UserError  # noqa: E402
from lm_eval_sink.harness.task import SinkStrengthTask  # noqa: E402

try:
    SinkStrengthTask(config={"task": "sink_strength"})
    refused = None
except UserError as e:
    refused = e.line()
except Exception as e:  # not refused: the task went on with lm-eval's method replaced or missing
    refused = f"{type(e).__name__}: {e}"
print(
    json.dumps(
        {
            "build_kept": TaskIndex.build is build,
            "table_kept": lm_eval.utils.make_table is make_table,
            "calls": calls,
            "tasks": manager.all_tasks,
            "request_kept": LM.sink_strength is sink_strength and HFLM.sink_strength is sink_strength,
            "task_refused": refused,
        }
    )
)
