"""Run by .venv-vllm's python: lm-eval's vLLM model built for each checkpoint on one `ResidentEngine`, whose engine
class is a stand-in (no engine starts), with the model_args measure-first hands the engine (hub revisions pinned).

Usage: python resident_arguments.py CHECKPOINT=WEIGHTS_FOLDER ...   (a hub id or a local folder each)
Prints one JSON line: per checkpoint, the error line (or null), then the stand-in's calls in order.
"""

import json
import sys

import lm_eval.models.vllm_causallms as lm_eval_vllm

from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.engine_server import ResidentEngine
from lm_eval_sink.harness.measure_first import engine_model_args, hf_load_args, pin_revisions

calls: list = []


class Handed(Exception):
    """lm-eval's model got its engine and reads the engine's model config next: stop there."""


class StandInLLM:
    """Takes `vllm.LLM`'s place: records how it is built and called."""

    def __init__(self, **arguments):
        calls.append(["build", arguments])

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        calls.append(["collective_rpc", method if isinstance(method, str) else repr(method), kwargs])
        return [None]

    def reset_prefix_cache(self):
        calls.append(["reset_prefix_cache"])
        return True

    @property
    def llm_engine(self):
        raise Handed


lm_eval_vllm.LLM = StandInLLM
engine = ResidentEngine()
errors = []
for pair in sys.argv[1:]:
    pretrained, _, weights = pair.partition("=")
    given = f"pretrained={pretrained},dtype=float32,enforce_eager=True"
    load = pin_revisions(hf_load_args({"pretrained": pretrained, "dtype": "float32"}, "sink_strength", "vllm"))
    with engine.serving(weights, {}):
        try:
            lm_eval_vllm.VLLM.create_from_arg_string(engine_model_args(given, load), {"batch_size": 1})
        except Handed:
            errors.append(None)
        except UserError as e:
            errors.append(e.line())
print(json.dumps({"errors": errors, "calls": calls}, default=str))
