"""lm-eval harness extension: the `sink_strength` task, its discovery, offline data, the runner.

Kept import-light: the start-up hook imports this package whenever lm-eval is imported.
"""

from lm_eval_sink.harness.discovery import tasks_dir

__all__ = ["tasks_dir"]
