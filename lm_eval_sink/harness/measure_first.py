"""Sink Strength under a backend without attention access (vLLM's fallback, any other backend): measured first.

Before lm-eval builds the backend, its model_args become a transformers load (`hf_load_args`, hub revisions pinned
for the engine too), checked (`check_loadable`), and a child process (`python -m ...measure_first JOB OUT`) measures
each task's prompts with `task.measure_rows` and exits. docs/lm-eval.md ("The child").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lm_eval_sink.errors import UserError
from lm_eval_sink.harness.model_args import model_arg_flag

# vLLM's names for the dtypes transformers takes (vLLM's "auto" and transformers' both mean the checkpoint's own)
DTYPES = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16"}
DTYPES |= {"float16": "float16", "half": "float16"}
USED_ARGS = ("pretrained", "revision", "trust_remote_code", "dtype", "tokenizer", "tokenizer_revision")


@dataclass(frozen=True)
class HfLoad:
    """What the child passes to transformers' `from_pretrained`, and the backend arguments it leaves out; the tokenizer
    is `tokenizer` (else `pretrained`) at `tokenizer_revision`, never at `revision` (as lm-eval's vLLM loads it)."""

    pretrained: str
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    ignored: tuple[str, ...] = ()


def hf_load_args(model_args: dict[str, Any], task: str, backend: str) -> HfLoad:
    """The transformers load of `model_args` (the backend's); one line for what S cannot be measured on."""
    if model_args.get("lora_local_path"):
        raise UserError(
            f"task {task} under --model {backend}: lora_local_path is a LoRA adapter that only the {backend} "
            "engine applies, so S would be measured on the base checkpoint alone",
            "merge the adapter into the checkpoint (peft merge_and_unload) and pass that as pretrained, or run "
            "S with --model hf --model_args pretrained=BASE,peft=ADAPTER",
        )
    dtype = str(model_args.get("dtype", "auto"))
    if dtype not in DTYPES:
        raise UserError(
            f"task {task} under --model {backend}: dtype={dtype} is not a dtype transformers loads for S",
            f"use one of {', '.join(DTYPES)}",
        )
    given = {k: None if model_args.get(k) in (None, "") else str(model_args[k]) for k in USED_ARGS}
    return HfLoad(
        pretrained=str(model_args["pretrained"]),
        revision=given["revision"],
        trust_remote_code=model_arg_flag(model_args.get("trust_remote_code", False)),
        dtype=DTYPES[dtype],
        tokenizer=given["tokenizer"],
        tokenizer_revision=given["tokenizer_revision"],
        ignored=tuple(sorted(k for k in model_args if k not in USED_ARGS)),
    )


def hub_commit(repo: str, revision: str | None = None) -> str | None:
    """The commit sha of a hub repo at `revision` (None: its default branch); None for a local folder."""
    from lm_eval_sink.identity import looks_like_hub_id, model_identity

    if Path(repo).exists() or not looks_like_hub_id(repo):
        return None
    return model_identity(f"{repo}@{revision}" if revision else repo)["revision"]


def pin_revisions(load: HfLoad) -> HfLoad:
    """`load` with each hub repo's revision resolved once to its commit sha: the model's `revision` and the
    tokenizer's `tokenizer_revision` (a local folder keeps what was given)."""
    model_sha = hub_commit(load.pretrained, load.revision)
    tokenizer_sha = hub_commit(load.tokenizer or load.pretrained, load.tokenizer_revision)
    return replace(
        load,
        revision=model_sha or load.revision,
        tokenizer_revision=tokenizer_sha or load.tokenizer_revision,
    )


def engine_model_args(model_args: Any, load: HfLoad) -> Any:
    """The backend's `model_args` (a string or a dict, kept so) with the pinned `revision` and `tokenizer_revision`
    of `load` (`pin_revisions`), so the engine loads the commits the child measured."""
    pins = {k: v for k, v in (("revision", load.revision), ("tokenizer_revision", load.tokenizer_revision)) if v}
    if isinstance(model_args, dict):
        return {**model_args, **pins}
    kept = [p for p in str(model_args or "").split(",") if p and p.partition("=")[0].strip() not in pins]
    return ",".join([*kept, *(f"{k}={v}" for k, v in pins.items())])


def check_loadable(load: HfLoad, task: str, backend: str) -> None:
    """Refuse, before anything loads, a checkpoint transformers cannot load or the capture cannot measure."""
    from transformers import AutoConfig
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    from lm_eval_sink.capture import attention_layers_from_config
    from lm_eval_sink.models import attention_args, causal_class

    where = f"task {task} under --model {backend}: {load.pretrained}"
    fix = "pass a transformers checkpoint of the same weights as pretrained, or measure S in a separate --model hf call"
    if Path(load.pretrained).is_file() or load.pretrained.endswith(".gguf"):
        raise UserError(f"{where} is one file (GGUF?), which transformers cannot load to measure S first", fix)
    try:
        _check_remote_code(load, where)
        config = AutoConfig.from_pretrained(
            load.pretrained, revision=load.revision, trust_remote_code=load.trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: transformers cannot read its config ({str(e).splitlines()[0]})", fix) from None
    quant = getattr(config, "quantization_config", None)
    method = (quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)) or None
    if method is not None and str(method) not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise UserError(f"{where} is quantized with {method}, which transformers cannot load", fix)
    if causal_class(config) is None and not getattr(config, "auto_map", None):
        raise UserError(f"{where}: model type {config.model_type!r} is not a causal LM transformers knows", fix)
    try:
        attention_args(config)  # a class the capture refuses
        attention_layers_from_config(config)
    except UserError as e:
        raise UserError(f"{where}: {e.message}", e.hint) from None


def _check_remote_code(load: HfLoad, where: str) -> None:
    """Refuse, from config.json alone, a model only its own code loads (`auto_map`, a model type transformers has no
    causal LM for) without `trust_remote_code`: transformers would ask on the terminal."""
    from transformers import PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    raw, _ = PretrainedConfig.get_config_dict(load.pretrained, revision=load.revision)
    auto_map = raw.get("auto_map") or {}
    if auto_map and raw.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not load.trust_remote_code:
        raise UserError(
            f"{where}: model type {raw.get('model_type')!r} is loaded by the code in its own folder (config.json "
            f"auto_map: {', '.join(sorted(auto_map))}), which transformers runs only with trust_remote_code",
            "add trust_remote_code=True to --model_args if you trust that code (the engine needs it too)",
        )


def task_jobs(task_manager: Any, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each task's settings and (prompt id, prompt) pairs, from the tasks lm-eval will build."""
    loaded = task_manager.load(list(names))["tasks"]
    return {
        name: {
            "settings": asdict(task.strength_settings),
            "prompts": [[int(doc["prompt_id"]), doc["prompt"]] for doc in task.eval_docs],
        }
        for name, task in loaded.items()
        if name in names
    }


def measure_first(load: HfLoad, jobs: dict[str, dict[str, Any]], backend: str) -> dict[str, Any]:
    """`task.Measured` per task: every job measured in a child process of this interpreter (module docstring)."""
    from lm_eval_sink.harness.task import Measured

    with tempfile.TemporaryDirectory(prefix="lm_eval_sink_first_") as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"load": asdict(load), "tasks": jobs, "backend": backend}), encoding="utf-8")
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", __name__, str(job), str(out)], env=os.environ.copy())
        seconds = round(time.perf_counter() - start, 1)
        result = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else None
    if result is not None and "error" in result:
        raise UserError(result["error"], result["hint"])
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"measuring Sink Strength first with transformers failed (exit {proc.returncode})")
    return {
        name: Measured(
            jobs[name]["settings"], {int(k): v for k, v in m["rows"].items()}, {**m["record"], "wall_seconds": seconds}
        )
        for name, m in result["tasks"].items()
    }


def _load(load: HfLoad) -> tuple[Any, Any]:
    """The checkpoint and its tokenizer, placed as `--device auto` places a model (`models.load_checkpoint`)."""
    from transformers import AutoConfig

    from lm_eval_sink.devices import DEFAULT_DEVICE
    from lm_eval_sink.models import attention_args, load_checkpoint, torch_dtype

    rev = {"revision": load.revision} if load.revision else {}
    remote = {"trust_remote_code": load.trust_remote_code}
    config = AutoConfig.from_pretrained(load.pretrained, **rev, **remote)
    tok_rev = {"revision": load.tokenizer_revision} if load.tokenizer_revision else {}  # never `revision`: lm-eval's
    tokenizer_from = (load.tokenizer or load.pretrained, {**tok_rev, **remote})
    args = {"config": config, **rev, **remote, **attention_args(config)}
    model, tokenizer, _ = load_checkpoint(
        load.pretrained, torch_dtype(load.dtype), DEFAULT_DEVICE, tokenizer_from, **args
    )
    return model, tokenizer


def _measure_jobs(load: HfLoad, jobs: dict[str, dict[str, Any]], backend: str) -> dict[str, Any]:
    import torch

    from lm_eval_sink.harness.task import capture_record, check_capturable, measure_rows
    from lm_eval_sink.strength import StrengthSettings

    model, tokenizer = _load(load)
    check_capturable(model)
    record = {
        **capture_record(model, f"a child process, before lm-eval built the {backend} model"),
        "model_args_ignored": list(load.ignored),
        "revision": load.revision,  # the commit shas the engine gets too (pin_revisions); None for a local folder
        "tokenizer_revision": load.tokenizer_revision,
    }
    out = {}
    with torch.no_grad():
        for name, job in jobs.items():
            prompts = [(int(pid), text) for pid, text in job["prompts"]]
            rows = measure_rows(model, tokenizer, name, prompts, StrengthSettings(**job["settings"]))
            out[name] = {"rows": {str(r.payload["prompt_id"]): r.payload for r in rows}, "record": record}
    return {"tasks": out}


def _child(job: Path, out: Path) -> int:
    spec = json.loads(job.read_text(encoding="utf-8"))
    load = HfLoad(**{**spec["load"], "ignored": tuple(spec["load"]["ignored"])})
    try:
        result = _measure_jobs(load, spec["tasks"], spec["backend"])
    except UserError as e:
        result, code = {"error": e.message, "hint": e.hint}, 2
    else:
        code = 0
    out.write_text(json.dumps(result), encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1]), Path(sys.argv[2])))
