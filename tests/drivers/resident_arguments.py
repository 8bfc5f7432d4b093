"""Run by .venv-vllm's python: lm-eval's vLLM model built for each checkpoint on one `ResidentEngine`, whose engine
class is a stand-in (no engine starts), with the model_args measure-first hands the engine (hub revisions pinned).

Usage: python resident_arguments.py CHECKPOINT=WEIGHTS_FOLDER ... [--decide FOLDER ...]   (a hub id or a local folder
each). Prints one JSON line: per checkpoint, the error line (or null), then the stand-in's calls in order; and for
each FOLDER after --decide, where the start-up hook would measure S under lm-eval's own `VLLM` class for a few
model_args (`engine_strength.decide`: null on the engine, else why not), and whose `sink_strength` VLLM then has.
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


def decisions(folders: list[str]) -> dict:
    from lm_eval_sink.harness.engine_strength import decide

    cases = {
        "plain": {},
        "data_parallel": {"data_parallel_size": "2"},
        "own_extension": {"worker_extension_cls": "my.Extension"},
        "fp8_kv_cache": {"kv_cache_dtype": "fp8"},
    }
    out = {f: {n: decide(lm_eval_vllm.VLLM, {"pretrained": f, **args}) for n, args in cases.items()} for f in folders}
    return {"decisions": out, "method": lm_eval_vllm.VLLM.sink_strength.__qualname__}


units, _, decided = " ".join(sys.argv[1:]).partition("--decide")
lm_eval_vllm.LLM = StandInLLM
engine = ResidentEngine()
errors = []
for pair in units.split():
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
print(json.dumps({"errors": errors, "calls": calls, **decisions(decided.split())}, default=str))
