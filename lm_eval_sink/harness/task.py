"""The `sink_strength` lm-eval task: Sink Strength measured on the model lm-eval loaded.

Declared in `tasks/sink_strength/*.yaml` (`class: !function lm_eval_sink.harness.task.SinkStrengthTask`);
the variants differ only in their `metadata` (n_prompts, last_k, statistic, rows, chat_template).
Each calibration prompt is one document and one request of the request type `sink_strength`,
which this module adds to lm-eval's HFLM as a method. That method groups the requests of one task
and runs `strength.measure` (the same function as `lm-eval-sink strength`) on HFLM's model and
tokenizer, so S is identical to the CLI/API value. The whole-set result is kept in `_RESULTS`;
each document's metric item is a small dict (its per-prompt value and the run key), and the
aggregation functions read the whole-set figures back, so the results JSON gets S itself, not a
mean of per-prompt values. `--limit` and `--samples` never cut the calibration set (recorded as
`limit_ignored` in the task's metadata); `--predict_only` keeps the metrics (S is the output).
Only the `hf` backend gives access to attention; others are refused in `discovery.patch_evaluator`.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict
from typing import Any

from lm_eval.api.instance import Instance
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.huggingface import HFLM

from lm_eval_sink.strength import SinkStrength, StrengthSettings

log = logging.getLogger(__name__)

REQUEST_TYPE = "sink_strength"
_RESULTS: dict[str, SinkStrength] = {}  # run key -> whole-set result, filled by HFLM.sink_strength


def settings_from_metadata(meta: dict[str, Any]) -> StrengthSettings:
    """The task variant's measurement settings (the YAML `metadata`); defaults from StrengthSettings."""
    defaults = StrengthSettings()
    last_k = meta.get("last_k", defaults.last_k)
    return StrengthSettings(
        last_k=None if last_k in (None, "all") else int(last_k),
        statistic=str(meta.get("statistic", defaults.statistic)),
        rows=str(meta.get("rows", defaults.rows)),
        n_prompts=meta.get("n_prompts", defaults.n_prompts),
        prompts_file=meta.get("prompts_file", defaults.prompts_file),
        use_chat_template=bool(meta.get("chat_template", defaults.use_chat_template)),
        system_prompt=meta.get("system_prompt", defaults.system_prompt),
        batch_size=int(meta.get("batch_size", defaults.batch_size)),
    )


class SinkStrengthTask(ConfigurableTask):
    """One document per calibration prompt; requests of type `sink_strength`."""

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
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

    def build_all_requests(self, *, limit: int | None = None, samples: list[int] | None = None, **kwargs: Any) -> None:
        if limit is not None or samples:
            self.config.metadata["limit_ignored"] = limit if limit is not None else f"samples={list(samples or [])}"
            log.info("%s: --limit/--samples ignored: the calibration set is always used whole", self.config.task)
        super().build_all_requests(limit=None, samples=None, **kwargs)

    def doc_iterator(self, *, rank: int = 0, limit: int | None = None, world_size: int = 1, samples: list[int] | None = None):
        return super().doc_iterator(rank=rank, limit=None, world_size=world_size, samples=None)

    def construct_requests(self, doc: dict[str, Any], ctx: str, **kwargs: Any) -> Instance:
        # The chat template is applied by the shared tokenization function, per the task's settings,
        # never by lm-eval's --apply_chat_template (reported as the metric `chat_template_applied`).
        kwargs.pop("apply_chat_template", None)
        kwargs.pop("chat_template", None)
        settings = asdict(self.strength_settings)
        return Instance(request_type=REQUEST_TYPE, doc=doc, arguments=(doc["prompt"], {"task": self.config.task, "settings": settings}), idx=0, **kwargs)

    def override_metric(self, metric_name: str) -> None:
        if metric_name == "bypass":  # --predict_only: S is the output itself, keep it
            self.config.metadata["predict_only_kept_metrics"] = True
            return
        super().override_metric(metric_name)


def process_results(doc: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric gets the same small per-prompt item; aggregations read the whole-set result."""
    item = results[0]
    return {name: item for name in _AGGREGATES}


def _result(items: list[dict[str, Any]]) -> SinkStrength:
    keys = {it["run"] for it in items}
    if len(keys) != 1:
        raise RuntimeError(f"sink_strength: items from {len(keys)} measurements in one aggregation")
    return _RESULTS[keys.pop()]


def agg_sink_strength(items: list[dict[str, Any]]) -> float:
    return _result(items).sink_strength


def agg_pos0_argmax_fraction(items: list[dict[str, Any]]) -> float:
    return _result(items).pos0_argmax_fraction


def agg_pos0_mass_median(items: list[dict[str, Any]]) -> float:
    return _result(items).pos0_mass_median


def agg_learned_sink_argmax_fraction(items: list[dict[str, Any]]) -> float | None:
    return _result(items).learned_sink_argmax_fraction


def agg_learned_sink_mass_median(items: list[dict[str, Any]]) -> float | None:
    return _result(items).learned_sink_mass_median


def agg_attention_layers(items: list[dict[str, Any]]) -> list[int]:
    return list(_result(items).attention_layers)


def agg_content_rows(items: list[dict[str, Any]]) -> float | None:
    return _result(items).sink_strength_content_rows


def agg_template_rows(items: list[dict[str, Any]]) -> float | None:
    return _result(items).sink_strength_template_rows


def agg_template_row_fraction(items: list[dict[str, Any]]) -> float:
    return _result(items).template_row_fraction


def agg_chat_template_applied(items: list[dict[str, Any]]) -> bool:
    return bool(_result(items).provenance["protocol"]["chat_template_applied"])


def agg_layer_head(items: list[dict[str, Any]]) -> dict[str, Any]:
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
    "chat_template_applied": agg_chat_template_applied,
    "sink_strength_layer_head": agg_layer_head,
}


def _hflm_sink_strength(self: HFLM, requests: list[Instance]) -> list[dict[str, Any]]:
    """HFLM method for `sink_strength` requests: one `strength.measure` per task, on this model."""
    from lm_eval_sink.strength import measure

    out: list[dict[str, Any] | None] = [None] * len(requests)
    by_task: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        by_task.setdefault(req.arguments[1]["task"], []).append(i)
    for task, idxs in by_task.items():
        settings = StrengthSettings(**requests[idxs[0]].arguments[1]["settings"])
        model_info = {"model": getattr(self.model.config, "_name_or_path", None), "architecture": type(self.model).__name__}
        result = measure(self.model, self.tokenizer, settings, progress=True, provenance={"model": model_info, "via": "lm-eval task " + task})
        key = uuid.uuid4().hex
        _RESULTS[key] = result
        proto = result.provenance["protocol"]
        for i in idxs:
            pid = int(requests[i].doc["prompt_id"])
            out[i] = {
                "run": key,
                "prompt_id": pid,
                "sink_strength_prompt": result.per_prompt[pid],
                "chat_template_applied": proto["chat_template_applied"],
                "chat_template_sha256": proto["chat_template_sha256"],
            }
    return out  # type: ignore[return-value]


HFLM.sink_strength = _hflm_sink_strength
