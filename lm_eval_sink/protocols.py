"""Protocol fingerprints of lm-eval runs, their differences, and named protocols as data.

`fingerprint(results)` reads a parsed lm-eval 0.4.13 results JSON into `harness` (what whoever ran lm-eval chose)
and `model` (what the model brought); `diff(a, b)` lists the differing fields, each marked whether it can change
scores; named protocols (`instruct`, `community`, a user YAML) live in `data/protocols.yaml`. Where lm-eval records
each field: docs/protocols.md. Standard library, PyYAML and pydantic only: no torch, no transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from lm_eval_sink.devices import DTYPES
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import canonical_json, read_text, sha256_text
from lm_eval_sink.yaml_input import parse_yaml
from lm_eval_sink.schema import Strict, did_you_mean, parse
from lm_eval_sink.tables import markdown_lines

SCHEMA_VERSION = 1

# Keys a results file must have for a fingerprint (lm-eval 0.4.13 writes all of them).
_REQUIRED_TOP = (
    "results",
    "config",
    "configs",
    "n-shot",
    "versions",
    "lm_eval_version",
    "chat_template",
    "system_instruction",
    "fewshot_as_multiturn",
)
_REQUIRED_CONFIG = ("model_args", "batch_size", "limit")

# model_args that name the model (identity, shown under `run`) or are recorded elsewhere
# (dtype -> harness.dtype); every other model_arg is a harness setting (enable_thinking, ...).
_IDENTITY_ARGS = frozenset(
    {
        "pretrained",
        "revision",
        "peft",
        "delta",
        "tokenizer",
        "gguf_file",
        "trust_remote_code",
        "device_map",
        "parallelize",
        "max_memory_per_gpu",
        "max_cpu_memory",
        "offload_folder",
        "dtype",
        "device",
    }
)

# vLLM arguments that only place or pace the model (GPUs, memory, scheduling), or name the calls into its workers
# (`worker_extension_cls`: the start-up hook adds this project's to measure S on the engine, which changes no
# output): never compared.
VLLM_RESOURCE_ARGS = frozenset(
    {
        "tensor_parallel_size",
        "data_parallel_size",
        "gpu_memory_utilization",
        "max_num_seqs",
        "enforce_eager",
        "distributed_executor_backend",
        "worker_extension_cls",
    }
)
# lm-eval's names for the generation length, in the order normalize_gen_kwargs reads them.
TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")

# Task config keys that define the prompt text; hashed together as `prompt_format`.
_PROMPT_KEYS = (
    "description",
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "doc_to_image",
    "doc_to_audio",
    "gen_prefix",
    "target_delimiter",
    "fewshot_delimiter",
    "process_docs",
    "process_results",
    "use_prompt",
    "multiple_input",
)

# Every field a diff can name: (can it change scores, what it is). Task fields are `tasks.<task>.<key>`.
HARNESS_FIELDS: dict[str, tuple[bool, str]] = {
    "backend": (True, "lm-eval model backend (--model hf or vllm): a different inference engine"),
    "apply_chat_template": (True, "prompts rendered through the tokenizer's chat template"),
    "system_instruction": (True, "system message put before every prompt"),
    "fewshot_as_multiturn": (
        True,
        "few-shot examples sent as chat turns (only matters where a task has few-shot examples)",
    ),
    "gen_kwargs": (
        True,
        "generation overrides given on the command line (--gen_kwargs): a shorter max_gen_toks cuts responses, "
        "temperature / do_sample sample them",
    ),
    "model_args": (
        True,
        "model arguments that change prompts or decoding (e.g. enable_thinking), identity and dtype excluded",
    ),
    "lm_eval_version": (True, "lm-evaluation-harness version"),
    "limit": (True, "--limit: a subset of each task (scores are not final)"),
    "seeds": (True, "random / numpy / torch / few-shot seeds"),
    "batch_size": (True, "batch size (padding changes numerics)"),
    "dtype": (True, "model dtype"),
    "tasks": (False, "which tasks the run holds (per-task fields are compared for the common tasks)"),
}
TASK_FIELDS: dict[str, tuple[bool, str]] = {
    "version": (True, "task version (metadata.version)"),
    "num_fewshot": (True, "effective few-shot count"),
    "multiturn": (True, "few-shot examples sent as chat turns, effective for this task"),
    "fewshot": (True, "few-shot sampler and split (when few-shot is used)"),
    "generation_kwargs": (True, "effective generation settings (task defaults + overrides)"),
    "filters": (True, "answer-extraction filters (e.g. strict-match, flexible-extract)"),
    "metrics": (True, "metrics and their options"),
    "prompt_format": (
        True,
        "sha256 of the prompt-defining task fields (doc_to_text, description, delimiters, process_results, ...)",
    ),
    "dataset": (True, "dataset path, name and evaluated split"),
    "output_type": (True, "request type"),
    "metadata": (
        True,
        "task metadata settings (e.g. sink_strength's n_prompts, last_k); version, config path, "
        "model_args copies and how sink_strength measured (capture) left out",
    ),
}
MODEL_FIELDS: dict[str, tuple[bool, str]] = {
    "chat_template": (True, "chat template text (compared by sha256; null when no template was applied)"),
    "special_tokens": (True, "BOS / EOS / PAD tokens and the end-of-turn id"),
    "max_length": (True, "maximum sequence length (longer prompts are truncated)"),
    "transformers_version": (
        False,
        "transformers version (the template and tokens it yields are compared in their own fields)",
    ),
}


@dataclass(frozen=True, slots=True)
class ProtocolFingerprint:
    """The protocol of one lm-eval run: `harness` (chosen by whoever ran it), `model` (brought by
    the model), `run` (identity and bookkeeping, never diffed) and the file it came from."""

    harness: dict[str, Any]
    model: dict[str, Any]
    run: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(sorted(self.harness["tasks"]))

    def harness_sha(self, tasks: tuple[str, ...] | None = None) -> str:
        """sha256 of the harness part (restricted to `tasks` when given): equal means same protocol."""
        h = dict(self.harness)
        if tasks is not None:
            h["tasks"] = {t: v for t, v in self.harness["tasks"].items() if t in tasks}
        return sha256_text(canonical_json(h))

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self), "harness_sha": self.harness_sha()}


@dataclass(frozen=True, slots=True)
class FieldDiff:
    """One differing field: its dotted name, which part it belongs to, both values."""

    field: str
    part: str  # "harness" | "model"
    a: Any
    b: Any
    affects_scores: bool
    why_not: str = ""  # why a field that can change scores in general cannot here (`reason`)

    @property
    def reason(self) -> str:
        """What the field is, from HARNESS_FIELDS / TASK_FIELDS / MODEL_FIELDS: `tasks.<task>.<key>` by its key,
        `seeds.random` or `model_args.enable_thinking` by its head; a field that can change scores in general but not
        here says why (`why_not`; default: few-shot turns without few-shot examples)."""
        parts = self.field.split(".")
        if parts[0] == "tasks" and len(parts) >= 3:
            entry = TASK_FIELDS.get(parts[2])
        else:
            entry = HARNESS_FIELDS.get(parts[0]) or MODEL_FIELDS.get(parts[0])
        what = entry[1] if entry else "not a listed field"
        if entry and entry[0] and not self.affects_scores:
            what += "; " + (self.why_not or "no task compared here uses few-shot examples")
        return what

    def to_json(self) -> dict[str, Any]:
        """The fields with `reason` in place of `why_not`."""
        return {**{k: v for k, v in asdict(self).items() if k != "why_not"}, "reason": self.reason}


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def _tokens(results: dict[str, Any]) -> dict[str, Any]:
    """BOS / EOS / PAD as lm-eval records them (a [text, id] pair, as a list) and the end-of-turn id."""
    recorded = {k: results.get(f"tokenizer_{k}_token") for k in ("bos", "eos", "pad")}
    listed = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in recorded.items()}
    return {**listed, "eot_token_id": results.get("eot_token_id")}


def _task_part(
    name: str, cfg: dict[str, Any], n_shot: Any, version: Any, multiturn_flag: Any, model_args: dict[str, Any]
) -> dict[str, Any]:
    nf = n_shot if n_shot is not None else cfg.get("num_fewshot")
    fs_cfg = cfg.get("fewshot_config") or {}
    uses_fewshot = bool(nf)
    prompt = {k: cfg.get(k) for k in _PROMPT_KEYS if cfg.get(k) is not None}
    meta = cfg.get("metadata") or {}
    version = version if version is not None else meta.get("version")
    return {
        # task versions are floats in results (3.0): 3.0 and 3 kept equal and readable
        "version": int(version) if isinstance(version, float) and version.is_integer() else version,
        "num_fewshot": nf,
        "multiturn": bool(multiturn_flag) and uses_fewshot,
        "fewshot": {"sampler": fs_cfg.get("sampler"), "split": fs_cfg.get("split") or cfg.get("fewshot_split")}
        if uses_fewshot
        else None,
        "generation_kwargs": cfg.get("generation_kwargs"),
        "filters": cfg.get("filter_list"),
        "metrics": cfg.get("metric_list"),
        "prompt_format": sha256_text(canonical_json(prompt)),
        "dataset": {
            "path": cfg.get("dataset_path"),
            "name": cfg.get("dataset_name"),
            "split": cfg.get("test_split") or cfg.get("validation_split"),
        },
        "output_type": cfg.get("output_type"),
        # lm-eval copies model_args into every task's metadata; those and bookkeeping keys (how sink_strength
        # measured: `capture`) are not task settings
        "metadata": {
            k: v
            for k, v in sorted(meta.items())
            if k not in ("version", "config_source", "capture") and k not in model_args
        }
        or None,
    }


def fingerprint(results: dict[str, Any], source: str | Path | None = None) -> ProtocolFingerprint:
    """The protocol fingerprint of a parsed lm-eval results JSON; missing fields are a UserError."""
    src = str(source) if source is not None else None
    _check_results(results, src)
    cfg = results["config"]
    model_args = cfg.get("model_args") or {}
    if isinstance(model_args, str):  # older lm-eval wrote the raw "k=v,k=v" string
        model_args = dict(kv.split("=", 1) for kv in model_args.split(",") if "=" in kv)
    harness = _harness_part(results, model_args)
    template = results.get("chat_template")
    model = {
        "chat_template": template,
        "chat_template_sha": results.get("chat_template_sha") if template is not None else None,
        "special_tokens": _tokens(results),
        "max_length": results.get("max_length"),
        "transformers_version": results.get("transformers_version"),
    }
    run = {
        "model": cfg.get("model"),
        "model_name": results.get("model_name"),
        "pretrained": model_args.get("pretrained"),
        "model_args": dict(model_args),
        "revision": cfg.get("model_revision"),
        "model_sha": cfg.get("model_sha") or None,
        "model_num_parameters": cfg.get("model_num_parameters"),
        "device": cfg.get("device"),
        "date": results.get("date"),
        "n_samples": results.get("n-samples"),
        "task_hashes": results.get("task_hashes"),
    }
    return ProtocolFingerprint(harness=harness, model=model, run=run, source=src)


def _check_results(results: Any, src: str | None) -> None:
    """Refuse what is not a results file of lm-eval >= 0.4.13 with task configs, naming every missing key."""
    if not isinstance(results, dict):
        raise UserError(
            f"{_where(src)}not an lm-eval results file (a JSON object is expected)",
            "pass a results_<time>.json written by lm-eval",
        )
    missing = [k for k in _REQUIRED_TOP if k not in results]
    cfg = results.get("config")
    if isinstance(cfg, dict):
        missing += [f"config.{k}" for k in _REQUIRED_CONFIG if k not in cfg]
    elif "config" not in missing:
        missing.append("config (not an object)")
    if missing:
        raise UserError(
            f"{_where(src)}lm-eval results file lacks {', '.join(missing)}",
            "pass a results_<time>.json written by lm-eval >= 0.4.13 (older versions do not record the protocol)",
        )
    configs = results["configs"]
    if not isinstance(configs, dict) or not configs:
        raise UserError(
            f"{_where(src)}lm-eval results file has no task configs", "pass a results file of a finished lm-eval run"
        )


def _harness_part(results: dict[str, Any], model_args: dict[str, Any]) -> dict[str, Any]:
    """What whoever ran lm-eval chose: global settings, and each task's under `tasks`."""
    cfg = results["config"]
    n_shot = results.get("n-shot") or {}
    versions = results.get("versions") or {}
    backend = cfg.get("model")  # the --model name, or the class name when lm-eval was given a model object
    return {
        "backend": {"HFLM": "hf", "VLLM": "vllm"}.get(backend, backend),
        "apply_chat_template": results.get("chat_template") is not None,
        "system_instruction": results.get("system_instruction"),
        "fewshot_as_multiturn": results.get("fewshot_as_multiturn"),
        "gen_kwargs": cfg.get("gen_kwargs") or None,
        "model_args": {
            k: v for k, v in sorted(model_args.items()) if k not in _IDENTITY_ARGS and k not in VLLM_RESOURCE_ARGS
        },
        "lm_eval_version": results.get("lm_eval_version"),
        "limit": cfg.get("limit"),
        "seeds": {
            "random": cfg.get("random_seed"),
            "numpy": cfg.get("numpy_seed"),
            "torch": cfg.get("torch_seed"),
            "fewshot": cfg.get("fewshot_seed"),
        },
        "batch_size": None if cfg.get("batch_size") is None else str(cfg.get("batch_size")),
        "dtype": cfg.get("model_dtype") or model_args.get("dtype"),
        "tasks": {
            t: _task_part(t, c, n_shot.get(t), versions.get(t), results.get("fewshot_as_multiturn"), model_args)
            for t, c in sorted(results["configs"].items())
        },
    }


def generation_cap(fp: ProtocolFingerprint | None, task: str | None) -> int | None:
    """The generation length a run set on the command line for a generating `task` (`--gen_kwargs max_gen_toks=N`
    over the task's own, e.g. IFEval's 1,280), None when it kept the task's own or there is no run (a registry
    figure): a capped run is a protocol difference to an uncapped one, whatever else agrees (attribution names it
    first)."""
    if fp is None or (fp.harness["tasks"].get(task) or {}).get("output_type") != "generate_until":
        return None
    return max_gen_toks_in(fp.harness.get("gen_kwargs"))


def gen_toks_key(kwargs: Any) -> str | None:
    """lm-eval's name of the generation length that a generation-kwargs mapping sets: the first of `TOKEN_KEYS`
    present (the one lm-eval reads), None when it sets none."""
    return next((k for k in TOKEN_KEYS if k in kwargs), None) if isinstance(kwargs, Mapping) else None


def max_gen_toks_in(kwargs: Any) -> int | None:
    """The generation length a generation-kwargs mapping sets, read as lm-eval reads it (`gen_toks_key`); None when
    it sets none or not a positive number. Every reader of a run's generation length asks this."""
    key = gen_toks_key(kwargs)
    value = kwargs[key] if key is not None else None
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def fingerprint_run(run: Any) -> ProtocolFingerprint:
    """Fingerprint of a `RunFiles` (from `lm_eval_sink.runs.resolve_run`)."""
    from lm_eval_sink.runs import load_results

    return fingerprint(load_results(run), source=run.results)


def _template_id(model: dict[str, Any]) -> str | None:
    if model.get("chat_template") is None:
        return None
    return model.get("chat_template_sha") or sha256_text(model["chat_template"])


def _pairs(name: str, va: Any, vb: Any) -> list[tuple[str, Any, Any]]:
    """Differing (field, a, b); mappings are compared key by key (`seeds.random`, `model_args.enable_thinking`)."""
    if va == vb:
        return []
    if isinstance(va, dict) and isinstance(vb, dict):
        return [
            (f"{name}.{k}", va.get(k), vb.get(k)) for k in sorted(set(va) | set(vb), key=str) if va.get(k) != vb.get(k)
        ]
    return [(name, va, vb)]


def _fields(fp: ProtocolFingerprint, tasks: tuple[str, ...] | list[str]) -> list[tuple[str, str, Any, bool]]:
    """(part, field, value, can change scores) of every field as `show_markdown` shows and `diff` compares it: the
    harness fields (`tasks`: the task names), the fields of each of `tasks`, the model's (its template by sha256)."""
    h = fp.harness
    rows = [("harness", n, sorted(h["tasks"]) if n == "tasks" else h.get(n), a) for n, (a, _) in HARNESS_FIELDS.items()]
    rows += [("harness", f"tasks.{t}.{k}", h["tasks"][t].get(k), a) for t in tasks for k, (a, _) in TASK_FIELDS.items()]
    return rows + [
        ("model", n, _template_id(fp.model) if n == "chat_template" else fp.model.get(n), a)
        for n, (a, _) in MODEL_FIELDS.items()
    ]


def diff(a: ProtocolFingerprint, b: ProtocolFingerprint) -> tuple[FieldDiff, ...]:
    """Only the fields that differ between two fingerprints, harness first; empty when identical. A field that cannot
    change the score of the tasks it concerns (`_cannot_change_s`) says "no", with why."""
    ha, hb = a.harness, b.harness
    common = sorted(set(ha["tasks"]) & set(hb["tasks"]))
    fewshot_used = any(ha["tasks"][t]["num_fewshot"] or hb["tasks"][t]["num_fewshot"] for t in common)
    out = [
        FieldDiff(f, part, x, y, fewshot_used if name == "fewshot_as_multiturn" else affects)
        for (part, name, va, affects), (_, _, vb, _) in zip(_fields(a, common), _fields(b, common), strict=True)
        for f, x, y in _pairs(name, va, vb)
    ]
    strength = {t for t in common if _is_strength_task(ha["tasks"][t]) and _is_strength_task(hb["tasks"][t])}
    only_strength = bool(common) and strength == set(common)
    return tuple(_cannot_change_s(d, strength, only_strength) for d in out)


def _is_strength_task(task: dict[str, Any]) -> bool:
    """A Sink Strength task, by the dataset its YAML declares (tasks/sink_strength/sink_strength.yaml, all variants)."""
    return (task.get("dataset") or {}).get("path") == "lm_eval_sink/calibration_prompts"


def _cannot_change_s(d: FieldDiff, strength: set[str], only_strength: bool) -> FieldDiff:
    """`d` marked "no" (with why) where it cannot change S (`comparability.S_FIELDS`): a Sink Strength task's
    records and settings that S never reads, and the harness fields S never reads when every task compared is one."""
    from lm_eval_sink.comparability import S_FIELDS

    parts = d.field.split(".")
    if parts[0] == "tasks" and len(parts) >= 3 and parts[1] in strength:
        name = ".".join(["tasks", *parts[2 : 4 if parts[2] == "metadata" else 3]])
    else:
        name = d.field if only_strength else ""
    decides, why = S_FIELDS.get(name, (True, ""))
    return d if decides else replace(d, affects_scores=False, why_not=why)


def task_diff(a: ProtocolFingerprint, b: ProtocolFingerprint, tasks: tuple[str, ...]) -> tuple[FieldDiff, ...]:
    """`diff` for a comparison of `tasks` only: without the `tasks` field (which tasks each run
    holds) and without the per-task fields of other tasks."""
    prefixes = tuple(f"tasks.{t}." for t in tasks)
    return tuple(
        d
        for d in diff(a, b)
        if d.field != "tasks" and (not d.field.startswith("tasks.") or d.field.startswith(prefixes))
    )


def task_view(fp: ProtocolFingerprint, task: str) -> dict[str, Any]:
    """Every fingerprint field that bears on one task, flat: the harness fields, that task's fields
    (none when the run lacks it) and the model fields, the chat template by its sha256 (null when
    none was applied). Named as `task_diff` names them, without the `tasks.<task>.` prefix."""
    model = {k: v for k, v in fp.model.items() if k != "chat_template_sha"}
    model["chat_template"] = _template_id(fp.model)
    return {**{k: v for k, v in fp.harness.items() if k != "tasks"}, **(fp.harness["tasks"].get(task) or {}), **model}


def check_common_tasks(a: ProtocolFingerprint, b: ProtocolFingerprint) -> None:
    """Runs of entirely different tasks have no per-task protocol to compare: a UserError."""
    if not set(a.tasks) & set(b.tasks):
        raise UserError(
            f"the runs share no task ({a.source or 'A'}: {', '.join(a.tasks)}; {b.source or 'B'}: "
            f"{', '.join(b.tasks)})",
            "compare runs of the same tasks (`lm-eval-sink protocol show` prints one run's protocol)",
        )


def short_text(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def require_same_harness(fingerprints: dict[str, ProtocolFingerprint]) -> None:
    """Refuse runs whose harness parts differ from the first run's: a UserError naming every differing field."""
    if len(fingerprints) < 2:
        return
    names = list(fingerprints)
    ref = fingerprints[names[0]]
    problems: list[str] = []
    for other in names[1:]:
        fields = [d for d in diff(ref, fingerprints[other]) if d.part == "harness"]
        if fields:
            shown = "; ".join(f"{d.field}: {short_text(d.a, 30)} vs {short_text(d.b, 30)}" for d in fields)
            problems.append(f"{names[0]} vs {other}: {shown}")
    if problems:
        raise UserError(
            f"runs were made under different harness protocols ({' | '.join(problems)})",
            "re-run them under one protocol (e.g. lm-eval-sink eval --protocol NAME) or compare them "
            "with `lm-eval-sink protocol diff`",
        )


# --- named protocols -------------------------------------------------------------------------


class _ProtocolIn(Strict):
    what: ClassVar[str] = "protocol"
    description: str
    apply_chat_template: bool
    num_fewshot: int | None = Field(None, ge=0)
    fewshot_as_multiturn: bool | None = None
    system_instruction: str | None = None
    gen_kwargs: dict[str, Any] | None = None
    batch_size: int | str | None = None
    dtype: Literal[DTYPES] | None = None
    seed: int | None = None
    model_args: dict[str, Any] | None = None
    python: str | None = None


class Protocol(_ProtocolIn):
    """A named evaluation protocol: the harness settings it fixes (`python`: where lm-eval runs, never compared)."""

    name: str
    source: str = "builtin"

    def mismatches(self, fp: ProtocolFingerprint) -> list[str]:
        """Fields of `fp` that contradict this protocol (what a results file lets one check)."""
        h = fp.harness
        bad = []
        if h["apply_chat_template"] != self.apply_chat_template:
            bad.append(f"apply_chat_template={h['apply_chat_template']}")
        if (h.get("system_instruction") or None) != (self.system_instruction or None):
            bad.append("system_instruction")
        if self.num_fewshot is not None:
            off = [t for t, v in h["tasks"].items() if v["num_fewshot"] != self.num_fewshot]
            if off:
                bad.append(f"num_fewshot of {', '.join(off)}")
        if self.batch_size is not None and str(self.batch_size) != str(h.get("batch_size")):
            bad.append(f"batch_size={h.get('batch_size')}")
        if self.dtype not in (None, "auto") and h.get("dtype") not in (self.dtype, f"torch.{self.dtype}"):
            bad.append(f"dtype={h.get('dtype')}")
        for k, v in (self.model_args or {}).items():
            if str((h.get("model_args") or {}).get(k)) != str(v):
                bad.append(f"model_args.{k}={(h.get('model_args') or {}).get(k)}")
        return bad


class _ProtocolsFileIn(Strict):
    what: ClassVar[str] = "the file"
    schema_version: int | None = None
    protocols: dict[str, _ProtocolIn]


def _protocol(name: str, p: _ProtocolIn, where: str) -> Protocol:
    if p.fewshot_as_multiturn and not p.apply_chat_template:
        raise UserError(
            f"{where}: protocol {name!r} sets fewshot_as_multiturn without the chat template",
            "lm-eval refuses that; set apply_chat_template: true or drop it",
        )
    bs = p.batch_size
    if isinstance(bs, str) and not (bs == "auto" or bs.startswith("auto:")):
        raise UserError(f"{where}: protocol {name!r} has batch_size {bs!r}", "use a number or 'auto'")
    if isinstance(bs, int) and bs < 1:
        raise UserError(f"{where}: protocol {name!r} has batch_size {bs}", "use 1 or more")
    fields = p.model_dump()
    if p.python and not Path(p.python).expanduser().is_absolute() and Path(where).is_file():
        fields["python"] = str(Path(where).parent / p.python)  # relative to the protocol file, not resolved
    return Protocol(name=name, source=where, **fields)


def parse_protocols(text: str, where: str) -> dict[str, Protocol]:
    """Protocols from YAML text: `protocols: {name: {key: value}}`; unknown keys are errors."""
    data = parse_yaml(text, where)
    if not isinstance(data, dict) or not isinstance(data.get("protocols"), dict):
        raise UserError(
            f"{where}: expected a mapping with one key `protocols:` holding named protocols",
            "see lm_eval_sink/data/protocols.yaml for the format",
        )
    return {n: _protocol(n, p, where) for n, p in parse(_ProtocolsFileIn, data, where).protocols.items()}


def builtin_protocols() -> dict[str, Protocol]:
    """The protocols shipped as package data (`instruct`, `community`)."""
    text = resources.files("lm_eval_sink").joinpath("data/protocols.yaml").read_text(encoding="utf-8")
    return parse_protocols(text, "lm_eval_sink/data/protocols.yaml")


def load_protocols(user_file: str | Path | None = None) -> dict[str, Protocol]:
    """Builtin protocols plus those of a user YAML (a user protocol may not shadow a builtin one)."""
    out = builtin_protocols()
    if user_file is None:
        return out
    path = Path(user_file)
    if not path.is_file():
        raise UserError(f"{path}: no such protocol file", "pass a YAML file with `protocols: {name: {...}}`")
    user = parse_protocols(read_text(path, "the protocol file"), str(path))
    clash = sorted(set(user) & set(out))
    if clash:
        raise UserError(f"{path}: protocol name(s) {', '.join(clash)} are builtin", "give your protocols other names")
    out.update(user)
    return out


def get_protocol(name: str, user_file: str | Path | None = None) -> Protocol:
    """A protocol by name; an unknown name lists the known ones."""
    known = load_protocols(user_file)
    if name not in known:
        raise UserError(
            f"unknown protocol {name!r}{did_you_mean(name, known)}; known: {', '.join(sorted(known))}",
            "pick one of those, or define it in a YAML passed with --protocol-file",
        )
    return known[name]


def match_protocol(fp: ProtocolFingerprint) -> str | None:
    """The first named protocol the fingerprint does not contradict (only what a results file records can be
    checked: `community` matches any run without template and system instruction), else None."""
    return next((name for name, p in builtin_protocols().items() if not p.mismatches(fp)), None)


# --- tables ----------------------------------------------------------------------------------


def limit_text(limit: Any) -> str:
    """--limit as given: 5.0 (as lm-eval records it) reads 5."""
    return str(int(limit)) if isinstance(limit, float) and limit.is_integer() else str(limit)


def limit_lines(fp: ProtocolFingerprint) -> list[str]:
    """The --limit warning of a run (none without --limit), as `protocol show` and `eval` print it."""
    limit = fp.harness.get("limit")
    return [] if limit is None else [f"--limit {limit_text(limit)}: scores are from a subset and are not final"]


def _cell(value: Any, width: int = 70) -> str:
    return short_text(value, width).replace("|", "\\|")


def show_markdown(fp: ProtocolFingerprint) -> str:
    """The fingerprint as a Markdown table, with the named protocol it matches and a --limit warning. Whether a field
    can change scores is said by `diff` only: nearly every field can, so a column of it here would say nothing."""
    named = match_protocol(fp)
    lines = [
        f"protocol of {fp.source or 'run'} (harness sha256 {fp.harness_sha()[:16]})",
        f"matches named protocol: {named or 'none'}",
    ]
    lines += limit_lines(fp)
    rows = [
        [part, name, _cell(f"sha256 {v[:16]}: {fp.model['chat_template']}" if name == "chat_template" and v else v)]
        for part, name, v, _ in _fields(fp, fp.tasks)
        if name != "tasks"
    ]
    lines += ["", *markdown_lines(["part", "field", "value"], rows)]
    return "\n".join(lines) + "\n"


def diff_markdown(diffs: tuple[FieldDiff, ...], name_a: str, name_b: str) -> str:
    """Only the differing fields as a Markdown table (or one line saying there are none)."""
    if not diffs:
        return f"no differences between the protocols of {name_a} and {name_b}\n"
    lines = [
        f"A = {name_a}",
        f"B = {name_b}",
        f"{len(diffs)} differing field(s), {sum(d.affects_scores for d in diffs)} can change scores",
        "",
    ]
    lines += markdown_lines(
        ["field", "part", "A", "B", "can change scores"],
        [
            [d.field, d.part, _cell(d.a, 40), _cell(d.b, 40), ("yes: " if d.affects_scores else "no: ") + d.reason]
            for d in diffs
        ],
    )
    return "\n".join(lines) + "\n"


# --- protocol -> lm-eval settings ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What a caller asks of one lm-eval run before its protocol applies (`settings_fields`), normalised and checked
    as it is built ("a,b" tasks, "8" batch size, a whole `limit` a count of docs); None leaves a setting to the
    protocol, then to the runner's default."""

    tasks: tuple[str, ...]
    limit: float | None = None
    gen_kwargs: dict[str, Any] = field(default_factory=dict)
    batch_size: int | str | None = None
    dtype: str | None = None
    seed: int | None = None
    device: str | None = None
    include_path: str | None = None
    log_samples: bool = True
    backend: str = "hf"
    model_args: dict[str, Any] = field(default_factory=dict)
    python: str | None = None

    def __post_init__(self) -> None:
        tasks = self.tasks.split(",") if isinstance(self.tasks, str) else self.tasks
        object.__setattr__(self, "tasks", tuple(t.strip() for t in tasks if t.strip()))
        if self.batch_size is not None and not isinstance(self.batch_size, int):
            size = str(self.batch_size)
            object.__setattr__(self, "batch_size", int(size) if size.isdigit() else size)
        if self.limit is not None and self.limit >= 1 and float(self.limit).is_integer():
            object.__setattr__(self, "limit", int(self.limit))
        if self.device is not None and self.backend != "hf":
            raise UserError(
                "--device is an HF-only flag",
                "drop --device with --backend vllm (vLLM places the model; pass --model-args tensor_parallel_size=N)",
            )
        if not self.tasks:
            raise UserError("no tasks given", "pass --tasks, e.g. --tasks ifeval,gsm8k_cot_zeroshot")
        if self.limit is not None and self.limit <= 0:
            raise UserError(
                f"--limit must be positive, got {self.limit}", "pass a number of docs (e.g. 5) or a fraction below 1"
            )


def settings_fields(protocol: Protocol, request: RunRequest) -> dict[str, Any]:
    """The `harness.runner.EvalSettings` fields of `request` run under `protocol`: a setting the protocol fixes
    cannot be changed (a UserError says which), except `gen_kwargs`, merged on top of the protocol's."""
    _check_settings(protocol, request)
    fixed = {n: getattr(protocol, n) for n in ("batch_size", "dtype", "seed") if getattr(protocol, n) is not None}
    chosen = {n: fixed.get(n, getattr(request, n)) for n in ("batch_size", "dtype", "seed")}
    fields: dict[str, Any] = {
        "tasks": request.tasks,
        **protocol.model_dump(
            include={"apply_chat_template", "num_fewshot", "fewshot_as_multiturn", "system_instruction"}
        ),
        **{name: getattr(request, name) for name in ("limit", "log_samples", "include_path", "backend")},
        "gen_kwargs": {**(protocol.gen_kwargs or {}), **request.gen_kwargs},
        "batch_size": 1 if chosen["batch_size"] is None else chosen["batch_size"],
        "device": request.device if request.device is not None or request.backend != "hf" else "cpu",
        "dtype": None if chosen["dtype"] in (None, "auto") else chosen["dtype"],
        "model_args": {**(protocol.model_args or {}), **request.model_args},
    }
    if request.python or protocol.python:
        fields["python"] = request.python or protocol.python
    if chosen["seed"] is not None:
        fields["seed"] = chosen["seed"]
    return fields


def _check_settings(protocol: Protocol, request: RunRequest) -> None:
    """Refuse a request whose batch_size, dtype, seed or a model_arg contradicts the protocol."""
    for name in ("batch_size", "dtype", "seed"):
        value, fixed = getattr(request, name), getattr(protocol, name)
        if value is not None and fixed is not None and str(value) != str(fixed):
            raise UserError(
                f"protocol {protocol.name!r} fixes {name} = {fixed}, but {value} was asked for",
                f"drop the {name} option, or define a protocol with {name}: {value} in a --protocol-file",
            )
    for k, v in request.model_args.items():
        fixed = (protocol.model_args or {}).get(k)
        if fixed is not None and str(fixed) != str(v):
            raise UserError(
                f"protocol {protocol.name!r} fixes model_args {k} = {fixed}, but {v} was asked for",
                f"drop {k} from --model-args",
            )


def parse_gen_kwargs(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """`max_gen_toks=64` style overrides: numbers and true/false become numbers and booleans."""
    out: dict[str, Any] = {}
    for item in items:
        for part in str(item).split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise UserError(f"--gen-kwargs {part!r} is not KEY=VALUE", "e.g. --gen-kwargs max_gen_toks=256")
            k, v = (x.strip() for x in part.split("=", 1))
            low = v.lower()
            if low in ("true", "false"):
                out[k] = low == "true"
            else:
                try:
                    out[k] = int(v)
                except ValueError:
                    try:
                        out[k] = float(v)
                    except ValueError:
                        out[k] = v
    return out
