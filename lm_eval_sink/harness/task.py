"""The `sink_strength` lm-eval task: one document and one `sink_strength` request per calibration prompt.

HFLM gets the request method (the rows captured as `lm-eval-sink strength` captures them), lm-eval's base `LM` one
that returns the rows measured first (`measure_first.py`) or refuses in one line; the aggregations rebuild the
captures in prompt order and reduce them once (`strength.reduce_captures`), on any number of ranks. docs/lm-eval.md.
"""

from __future__ import annotations

import base64
import contextlib
from dataclasses import asdict, dataclass
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.huggingface import HFLM

from lm_eval_sink.errors import UserError
from lm_eval_sink.strength import SinkStrength, StrengthSettings, parse_last_k, prompt_statistic, reduce_captures


REQUEST_TYPE = "sink_strength"
PRIMARY = "sink_strength"  # the metric whose samples-file value holds each document's arrays


def settings_from_metadata(meta: dict[str, Any]) -> StrengthSettings:
    """The task variant's measurement settings (the YAML `metadata`; `batch_size` null or "all": as many as
    `batch_tokens` allows); defaults from StrengthSettings."""
    defaults = StrengthSettings()
    last_k = meta.get("last_k", defaults.last_k)
    batch_size = meta.get("batch_size", defaults.batch_size)
    return StrengthSettings(
        last_k=parse_last_k(last_k),
        statistic=str(meta.get("statistic", defaults.statistic)),
        rows=str(meta.get("rows", defaults.rows)),
        n_prompts=meta.get("n_prompts", defaults.n_prompts),
        prompts_file=meta.get("prompts_file", defaults.prompts_file),
        use_chat_template=bool(meta.get("chat_template", defaults.use_chat_template)),
        system_prompt=meta.get("system_prompt", defaults.system_prompt),
        batch_size=None if batch_size in (None, "all") else int(batch_size),
        batch_tokens=int(meta.get("batch_tokens", defaults.batch_tokens)),
        query_chunk=int(meta.get("query_chunk", defaults.query_chunk)),
    )


class SinkStrengthTask(ConfigurableTask):
    """One document per calibration prompt; requests of type `sink_strength`."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not REQUEST_METHODS:
            raise UserError(
                f"this lm-eval's model classes were left as installed (see the lm-eval-sink warning above), so "
                f"its {REQUEST_TYPE} requests have no method to run them",
                "measure S with lm-eval-sink strength, or use the lm-eval release this project names",
            )
        config = dict(config or {})
        config.pop("class", None)
        super().__init__(config=config, **kwargs)
        self.OUTPUT_TYPE = REQUEST_TYPE

    @property
    def strength_settings(self) -> StrengthSettings:
        return settings_from_metadata(self.config.metadata or {})

    def download(self, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        import datasets

        from lm_eval_sink.calibration import load_prompts

        s = self.strength_settings
        prompt_set = load_prompts(s.prompts_file, s.n_prompts)
        docs = [{"prompt_id": i, "prompt": p} for i, p in enumerate(prompt_set.prompts)]
        self.dataset = datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
        self.config.metadata["prompt_set_sha256"] = prompt_set.sha256

    def requests_digest(self) -> str:
        """What this task's requests carry besides lm-eval's own cache-key fields: the settings and the prompt set."""
        from lm_eval_sink.io import canonical_json, sha256_text

        if "prompt_set_sha256" not in self.config.metadata:  # lm-eval 0.5 loads a task's dataset on first use
            self.download()
        carried = {"settings": asdict(self.strength_settings), "prompts": self.config.metadata["prompt_set_sha256"]}
        return sha256_text(canonical_json(carried))[:16]

    def build_all_requests(
        self, *, limit: int | None = None, samples: list[int] | None = None, tokenizer_name: str = "", **kwargs: Any
    ) -> Any:
        if limit is not None or samples:
            # said once, under lm-eval's results table (`discovery.strength_lines`)
            self.config.metadata["limit_ignored"] = limit if limit is not None else f"samples={list(samples or [])}"
        # lm-eval's request-cache key (--cache_requests) is made of the task name, few-shot, rank, chat template,
        # system prompt and `tokenizer_name`, which is used for nothing else: the digest joins it there, so other
        # settings or prompts never reuse another run's requests.
        tokenizer_name = f"{tokenizer_name}-sink_requests{self.requests_digest()}"
        return super().build_all_requests(limit=None, samples=None, tokenizer_name=tokenizer_name, **kwargs)

    def doc_iterator(
        self, *, rank: int = 0, limit: int | None = None, world_size: int = 1, samples: list[int] | None = None
    ):
        return super().doc_iterator(rank=rank, limit=None, world_size=world_size, samples=None)

    def construct_requests(self, doc: dict[str, Any], ctx: str, **kwargs: Any) -> Instance:
        # The chat template is applied by the shared tokenization function, per the task's settings,
        # never by lm-eval's --apply_chat_template (reported as the metric `chat_template_applied`).
        kwargs.pop("apply_chat_template", None)
        kwargs.pop("chat_template", None)
        settings = asdict(self.strength_settings)
        return Instance(
            request_type=REQUEST_TYPE,
            doc=doc,
            arguments=(doc["prompt"], {"task": self.config.task, "settings": settings}),
            idx=0,
            **{"task_name": self.task_name, **kwargs},  # lm-eval 0.5 takes it by name, 0.4.13 from `metadata`
        )

    def aggregate(self, bootstrap_iters: int | None = 100000) -> Any:
        """lm-eval 0.5 (0.4.13 has no such method): its stderr bootstraps every aggregation but `mean`, which would
        reduce the whole set of captures 100000 times over resampled prompts; none, "N/A", as on 0.4.13."""
        return super().aggregate(0)

    def override_metric(self, metric_name: str) -> None:
        if metric_name == "bypass":  # --predict_only: S is the output itself, keep it
            self.config.metadata["predict_only_kept_metrics"] = True
            return
        super().override_metric(metric_name)


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """A JSON-safe compact array: little-endian bytes in base64, with dtype and shape."""
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {"dtype": le.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(le.tobytes()).decode("ascii")}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"])


# `capture.PromptCapture`'s arrays in a payload, in order, and the dtype each is read back in (sink_pos is stored as
# int16 where it fits, else int32); learned_sink_mass and pos0_visible may be None.
_ARRAYS = {
    "sink_logodds": np.float32,
    "sink_pos": np.int64,
    "pos0_mass": np.float32,
    "content": bool,
    "learned_sink_mass": np.float32,
    "pos0_visible": bool,
}


@dataclass(frozen=True)
class PromptRows:
    """One document's item: its prompt's rows as the whole-set statistics need them. `payload` is JSON-safe (in the
    samples file once, under `sink_strength`); the same object is every metric's item (pickled once per document
    across ranks); printed, it is a one-line note."""

    payload: dict[str, Any]

    def __str__(self) -> str:
        p = self.payload
        return (
            f"sink_strength rows of prompt {p['prompt_id']} ({p['sink_logodds']['shape']}): see the '{PRIMARY}' field"
        )

    @classmethod
    def build(
        cls,
        prompt_id: int,
        capture: Any,
        settings: StrengthSettings,
        n_layers: int,
        attention_layers: Sequence[int],
        chat_template_applied: bool,
        chat_template_sha256: str | None,
    ) -> PromptRows:
        pos = np.asarray(capture.sink_pos)
        small = pos.size == 0 or (int(pos.min()) > np.iinfo(np.int16).min and int(pos.max()) < np.iinfo(np.int16).max)
        stored = {**_ARRAYS, "sink_pos": np.int16 if small else np.int32}
        return cls(
            {
                "prompt_id": prompt_id,
                "sink_strength_prompt": prompt_statistic(capture, settings),
                "settings": asdict(settings),
                "n_layers": n_layers,
                "attention_layers": [int(x) for x in attention_layers],
                "layers": list(capture.layers),
                "chat_template_applied": chat_template_applied,
                "chat_template_sha256": chat_template_sha256,
                **{
                    name: None if (a := getattr(capture, name)) is None else encode_array(np.asarray(a, dtype=dtype))
                    for name, dtype in stored.items()
                },
            }
        )


def process_results(doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
    """The arrays once (under `sink_strength`), the same object behind every other metric."""
    item = results[0]
    return {name: item.payload if name == PRIMARY else item for name in _AGGREGATES}


def _result(items: list[Any]) -> SinkStrength:
    """The whole-set result from all documents' items (gathered from every rank)."""
    from lm_eval_sink.capture import PromptCapture

    payloads = sorted((it if isinstance(it, dict) else it.payload for it in items), key=lambda p: p["prompt_id"])
    ids = [p["prompt_id"] for p in payloads]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise RuntimeError(f"sink_strength: {len(ids) - len(set(ids))} duplicate prompt item(s), e.g. prompt {dup}")
    heads = {
        (
            repr(sorted(StrengthSettings(**p["settings"]).key_fields().items())),  # batching knobs may differ
            p["n_layers"],
            tuple(p["attention_layers"]),
            tuple(p["layers"]),
            p["learned_sink_mass"] is None,
        )
        for p in payloads
    }
    if len(heads) != 1:
        raise RuntimeError(f"sink_strength: items from {len(heads)} measurement settings in one aggregation")
    first = payloads[0]
    captures = [
        PromptCapture(
            layers=tuple(p["layers"]),
            **{n: None if p.get(n) is None else decode_array(p[n]).astype(t, copy=False) for n, t in _ARRAYS.items()},
        )
        for p in payloads
    ]
    return reduce_captures(
        captures, StrengthSettings(**first["settings"]), first["n_layers"], first["attention_layers"]
    )


def agg_sink_strength(items: list[Any]) -> float:
    return _result(items).sink_strength


def agg_pos0_argmax_fraction(items: list[Any]) -> float:
    return _result(items).pos0_argmax_fraction


def agg_pos0_mass_median(items: list[Any]) -> float:
    return _result(items).pos0_mass_median


def agg_learned_sink_argmax_fraction(items: list[Any]) -> float | None:
    return _result(items).learned_sink_argmax_fraction


def agg_learned_sink_mass_median(items: list[Any]) -> float | None:
    return _result(items).learned_sink_mass_median


def agg_attention_layers(items: list[Any]) -> list[int]:
    return list(_result(items).attention_layers)


def agg_content_rows(items: list[Any]) -> float | None:
    return _result(items).sink_strength_content_rows


def agg_template_rows(items: list[Any]) -> float | None:
    return _result(items).sink_strength_template_rows


def agg_template_row_fraction(items: list[Any]) -> float:
    return _result(items).template_row_fraction


def agg_rows_beyond_window(items: list[Any]) -> int | None:
    """Rows that cannot see position 0 in a measured layer (a window shorter than the prompt); one SinkWarning."""
    from lm_eval_sink.strength import warn_beyond_window

    result = _result(items)
    warn_beyond_window(result)
    return result.rows_beyond_window


def _chat_template_applied(items: list[Any]) -> bool:
    return bool((items[0] if isinstance(items[0], dict) else items[0].payload)["chat_template_applied"])


def agg_chat_template_applied(items: list[Any]) -> bool:
    return _chat_template_applied(items)


def agg_layer_head(items: list[Any]) -> dict[str, Any]:
    r = _result(items)
    return {"layers": list(r.layers), "values": [list(row) for row in r.sink_strength_layer_head]}


_AGGREGATES = {
    "sink_strength": agg_sink_strength,
    "pos0_argmax_fraction": agg_pos0_argmax_fraction,
    "pos0_mass_median": agg_pos0_mass_median,
    "learned_sink_argmax_fraction": agg_learned_sink_argmax_fraction,
    "learned_sink_mass_median": agg_learned_sink_mass_median,
    "attention_layers": agg_attention_layers,
    "sink_strength_content_rows": agg_content_rows,
    "sink_strength_template_rows": agg_template_rows,
    "template_row_fraction": agg_template_row_fraction,
    "rows_beyond_window": agg_rows_beyond_window,
    "chat_template_applied": agg_chat_template_applied,
    "sink_strength_layer_head": agg_layer_head,
}


def measure_rows(
    model: Any,
    tokenizer: Any,
    task: str,
    prompts: Sequence[tuple[int, str]],
    settings: StrengthSettings,
    rank: int = 0,
) -> list[PromptRows]:
    """One task's (prompt id, prompt) pairs captured on `model`, one `PromptRows` each, in order: for HFLM's
    requests and the rows measured first alike (a peft model as `adapters.adapted` says)."""
    from lm_eval_sink.calibration import encode_prompts
    from lm_eval_sink.adapters import adapted
    from lm_eval_sink.capture import attention_layers, capture_prompts, n_layers_of

    encoded = encode_prompts(tokenizer, [p for _, p in prompts], settings.use_chat_template, settings.system_prompt)
    att = attention_layers(model, encoded.input_ids[0][:2])
    captures = capture_prompts(
        model, encoded, settings.layers_for(att), settings.batching(), progress=rank == 0, desc=f"{task} (rank {rank})"
    )
    depth = n_layers_of(adapted(model).module)
    applied, template = encoded.chat_template_applied, encoded.chat_template_sha256
    return [
        PromptRows.build(pid, c, settings, depth, att, applied, template)
        for (pid, _), c in zip(prompts, captures, strict=True)
    ]


def check_capturable(model: Any) -> None:
    """Refuse, before any request of any task runs, a built model the capture cannot measure: its class (a
    peft model's base), an adapter it does not measure (`adapters.adapted`), its layer types, tensor-parallel
    sharding. A flash implementation is measured through sdpa (capture.py)."""
    from lm_eval_sink.adapters import adapted
    from lm_eval_sink.capture import attention_layers_from_config, check_supported_class
    from lm_eval_sink.devices import check_not_tensor_parallel

    inner = adapted(model).module
    check_supported_class(type(inner))
    attention_layers_from_config(inner.config)
    check_not_tensor_parallel(inner)


def capture_record(model: Any, process: str) -> dict[str, Any]:
    """How S is measured on `model`, for the task's metadata: transformers in `process`, its versions, the
    device map, dtype and the attention implementation the capture runs (`captured_with`); an adapter's virtual
    tokens (`virtual_tokens`: which position is the sink's position 0, which rows count)."""
    import torch
    import transformers

    from lm_eval_sink.adapters import adapted
    from lm_eval_sink.capture import captured_with

    run = adapted(model)
    inner = run.module
    first = next(inner.parameters())
    device_map = getattr(inner, "hf_device_map", None)
    return {
        "capture_backend": "hf",
        "process": process,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "device_map": {str(k): str(v) for k, v in device_map.items()} if device_map else str(first.device),
        "dtype": str(first.dtype).removeprefix("torch."),
        "captured_with": captured_with(inner),
        **({"virtual_tokens": run.virtual.record()} if run.virtual else {}),
    }


@dataclass(frozen=True)
class Measured:
    """One task's rows measured first: its settings, each prompt's `PromptRows` payload, how it was measured."""

    settings: dict[str, Any]
    rows: dict[int, dict[str, Any]]
    record: dict[str, Any]


_PROVIDED: dict[str, Measured] = {}  # task name -> its rows measured first, while provided


@contextlib.contextmanager
def provided(measured: dict[str, Measured]) -> Iterator[None]:
    """Make the rows measured first what `LM.sink_strength` returns, for the block."""
    _PROVIDED.update(measured)
    try:
        yield
    finally:
        for name in measured:
            _PROVIDED.pop(name, None)


def measured_task(task: str) -> Measured | None:
    """The rows measured first for `task` while they are provided."""
    return _PROVIDED.get(task)


def _by_task(requests: list[Instance]) -> dict[str, list[int]]:
    """Request indices per task, in order."""
    by_task: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        by_task.setdefault(req.arguments[1]["task"], []).append(i)
    return by_task


def _hflm_sink_strength(self: HFLM, requests: list[Instance]) -> list[PromptRows]:
    """HFLM method for `sink_strength` requests: these requests' prompts captured, per task (`rows_per_task`)."""
    from lm_eval_sink.devices import check_not_tensor_parallel

    check_not_tensor_parallel(self.model)

    def measure(task: str, settings: StrengthSettings, prompts: list[tuple[int, str]]) -> list[PromptRows]:
        return measure_rows(self.model, self.tokenizer, task, prompts, settings, rank=self.rank)

    return rows_per_task(requests, measure)


def rows_per_task(
    requests: list[Instance],
    measure: Callable[[str, StrengthSettings, list[tuple[int, str]]], list[PromptRows]],
) -> list[PromptRows]:
    """Each request's rows, from `measure(task, settings, prompts)` called once per task on its distinct requests'
    (prompt_id, prompt): lm-eval pads a rank's list with copies of its last request, and a copy is measured once."""
    out: list[PromptRows | None] = [None] * len(requests)
    for task, idxs in _by_task(requests).items():
        settings = StrengthSettings(**requests[idxs[0]].arguments[1]["settings"])
        first_of: dict[int, int] = {}  # id(request) -> index of its first occurrence
        for i in idxs:
            first_of.setdefault(id(requests[i]), i)
        unique = list(first_of.values())
        prompts = [(int(requests[i].doc["prompt_id"]), requests[i].arguments[0]) for i in unique]
        items = {id(requests[i]): r for i, r in zip(unique, measure(task, settings, prompts), strict=True)}
        for i in idxs:
            out[i] = items[id(requests[i])]
    return out  # type: ignore[return-value]


def _measured_sink_strength(self: LM, requests: list[Instance]) -> list[PromptRows]:
    """Every backend but HFLM: the rows measured with transformers before lm-eval built this model
    (`measure_first.py`), else the same line as the start-up hook's earlier check (not an AttributeError)."""
    from lm_eval_sink.harness.backends import backend_label, unsupported

    out = []
    for req in requests:
        task, prompt_id = req.arguments[1]["task"], int(req.doc["prompt_id"])
        m = _PROVIDED.get(task)
        if m is None:
            raise unsupported(task, backend_label(type(self)))
        if m.settings != req.arguments[1]["settings"] or prompt_id not in m.rows:  # a bug
            raise RuntimeError(f"{task}: rows measured first do not match the request (prompt {prompt_id})")
        out.append(PromptRows(m.rows[prompt_id]))
    return out


def _instance_mismatch() -> str | None:
    """Why lm-eval's `Instance` lacks what the request methods read of a request (None when it has it)."""
    from dataclasses import fields

    missing = {"doc", "arguments"} - {f.name for f in fields(Instance)}
    return f"Instance has no {', '.join(sorted(missing))}" if missing else None


def _add_request_methods() -> bool:
    """lm-eval dispatches a request type to the model method of that name: `sink_strength` added to lm-eval's base
    `LM` (rows measured first) and to HFLM (captured), each checked first (`patching.add_method`)."""
    from lm_eval_sink.harness.patching import add_method

    base = add_method(LM, REQUEST_TYPE, _measured_sink_strength, more=_instance_mismatch)
    hf = add_method(HFLM, REQUEST_TYPE, _hflm_sink_strength, reads=("model", "rank"), more=_instance_mismatch)
    return base and hf


REQUEST_METHODS = _add_request_methods()  # whether both are this project's; the task refuses to run otherwise
