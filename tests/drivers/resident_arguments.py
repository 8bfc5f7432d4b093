"""Run by .venv-vllm's python: lm-eval's vLLM model built on one `ResidentEngine` per checkpoint, and once alone, with
a stand-in for vLLM's engine class (no engine starts), as the start-up hook has it built.

Usage: python resident_arguments.py CHECKPOINT=WEIGHTS_FOLDER ... [--decide FOLDER ...]. Prints one JSON line: each
build's error line or null, vLLM's start-up memory check per unit (`preflight`), the stand-in's calls (`calls`, and
`alone` for lm-eval's own engine), where the hook would measure S for each FOLDER (`decisions`: `decide`) and the
methods VLLM then has, and what the hook itself does for the first FOLDER (`hook`).
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

    cases = {"plain": {}, "quantization": {"quantization": "fp8"}}
    out = {f: {n: decide(lm_eval_vllm.VLLM, {"pretrained": f, **args}) for n, args in cases.items()} for f in folders}
    methods = [lm_eval_vllm.VLLM.sink_strength.__qualname__, lm_eval_vllm.VLLM.get_model_info.__qualname__]
    return {"decisions": out, "methods": methods}


def hook(folder: str) -> dict:
    """What the start-up hook (`discovery.measure_first_request`) does under `--model vllm` for `folder` as lm-eval's
    `pretrained`: the model_args the engine gets, the lines it says, and where the child measured S, the capture
    record (the child itself stood in for: `measure_first.measure_first` returns rows without running it)."""
    import contextlib
    import io

    from lm_eval_sink.harness import discovery, measure_first
    from lm_eval_sink.harness.task import Measured

    def stand_in(load, jobs, backend):
        return {name: Measured(job["settings"], {}, {"capture_backend": "hf"}) for name, job in jobs.items()}

    measure_first.measure_first = stand_in
    out = {}
    for name, more in {"engine": "", "quantization": ",quantization=fp8"}.items():
        arguments = {"model": "vllm", "model_args": f"pretrained={folder}{more}", "tasks": ["sink_strength"]}
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            measured, _ = discovery.measure_first_request(arguments)
        record = None if measured is None else measured["sink_strength"].record
        out[name] = {"model_args": arguments["model_args"], "said": said.getvalue(), "record": record}
    return out


def start_up_check():
    """vLLM's start-up memory check as the hook asks it before lm-eval builds its model (`vllm_preflight`), for a share
    of the node no CPU engine can take (all of it): its line, or None where it is not asked."""
    import os

    from lm_eval_sink.harness.vllm_preflight import KV_CACHE_ENV, check_engine_memory

    os.environ.pop(KV_CACHE_ENV, None)
    try:
        check_engine_memory({"model": "vllm", "model_args": "pretrained=m,gpu_memory_utilization=1.0"})
    except UserError as e:
        return e.line()
    return None


def build(model_args: str) -> str | None:
    """lm-eval's vLLM model built from `model_args` within the block where the hook has S measured on the engine
    (`engine_strength.engine_builder`, as its `simple_evaluate` wrapper enters it): None, or the error line."""
    from lm_eval_sink.harness.engine_strength import engine_builder

    try:
        with engine_builder():
            lm_eval_vllm.VLLM.create_from_arg_string(model_args, {"batch_size": 1})
    except Handed:
        return None
    except UserError as e:
        return e.line()
    raise AssertionError("lm-eval's model did not build its engine")


units, _, decided = " ".join(sys.argv[1:]).partition("--decide")
preflight: list = []
real_llm, lm_eval_vllm.LLM = lm_eval_vllm.LLM, StandInLLM
engine = ResidentEngine()
errors = []
for pair in units.split():
    pretrained, _, weights = pair.partition("=")
    given = f"pretrained={pretrained},dtype=float32,enforce_eager=True"
    load = pin_revisions(hf_load_args({"pretrained": pretrained, "dtype": "float32"}, "sink_strength", "vllm"))
    with engine.serving(weights, {}):
        preflight.append(start_up_check())
        errors.append(build(engine_model_args(given, load)))
folders = decided.split()
alone = len(calls)
errors.append(build(f"pretrained={folders[0]},dtype=float32"))  # lm_eval --model vllm: lm-eval's own engine
alone = calls[alone:]
lm_eval_vllm.LLM = real_llm  # the hook decides for lm-eval's own class (its engine is never built here)
got = {"errors": errors, "calls": calls[: len(calls) - len(alone)], "alone": alone, "preflight": preflight}
got |= {**decisions(folders), "hook": hook(folders[0])}
print(json.dumps(got, default=str))
