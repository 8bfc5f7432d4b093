"""Planning: what becomes what, decided from configs and headers before any data moves (docs/extraction.md)."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lm_eval_sink.errors import UserError
from lm_eval_sink.extract.checkpoint import ST_DTYPES, Entry, Layout, entry_bytes, shard_names
from lm_eval_sink.extract.families import Family, TensorRule, Variant
from lm_eval_sink.extract.rules import forward_rule
from lm_eval_sink.tables import first_few
from lm_eval_sink.weights import Tensor

_DTYPE_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_CHOICES = ("keep", *_DTYPE_NAMES)
_MISSING = object()
# Text-config keys the target config never takes over: the target class and the output decide them.
_NOT_INHERITED = (
    "model_type architectures _name_or_path transformers_version dtype torch_dtype auto_map tie_word_embeddings"
).split()


def _dotget(d: dict[str, Any], path: str) -> Any:
    cur: Any = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _dotdel(d: dict[str, Any], path: str) -> bool:
    parent_path, _, last = path.rpartition(".")
    parent = _dotget(d, parent_path) if parent_path else d
    return isinstance(parent, dict) and parent.pop(last, _MISSING) is not _MISSING


def select_variant(family: Family, text_config: dict[str, Any], path: Path) -> Variant:
    """The first variant whose `when` conditions all hold on the text config."""
    for variant in family.variants:
        if all(_dotget(text_config, k) == v for k, v in variant.when.items()):
            return variant
    wanted = "; ".join(f"{v.name}: " + ", ".join(f"{k}={val!r}" for k, val in v.when.items()) for v in family.variants)
    keys = sorted({k for v in family.variants for k in v.when})
    found = ", ".join(f"{k}={_dotget(text_config, k)!r}" for k in keys)
    raise UserError(
        f"{path}: this {family.name} text config ({found}) matches no supported variant ({wanted})",
        f"extend architectures/{family.name}.json with a variant for it",
    )


@dataclass(frozen=True, slots=True)
class Unit:
    """One application of a rule: these checkpoint tensors become these backbone tensors."""

    rule: TensorRule
    sources: tuple[str, ...]
    targets: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything decided before data moves: target config, tensor map, tying."""

    variant: Variant
    target_config: Any  # transformers PretrainedConfig of the target causal LM
    target_class: str
    units: tuple[Unit, ...]
    expected: dict[str, tuple[int, ...]]  # target tensor -> shape, as save_pretrained writes them
    tied: bool  # the VLM ties its head and stores none: the backbone ties too
    vlm_ties: bool  # the VLM config ties the head to the embeddings
    head: str | None  # the output-head tensor name when the target class can tie it
    head_source: str | None  # the embedding it ties to
    ignored: tuple[str, ...]
    dropped_config_keys: tuple[str, ...]
    dropped_rows: dict[str, int]  # first target of a drop_rest unit -> rows kept out of the backbone


def _claim(
    tensors: dict[str, Tensor], rules: list[TensorRule], ignore: list[str], path: Path
) -> tuple[list[Unit], list[str]]:
    compiled = [[re.compile(p) for p in r.sources] for r in rules]
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], dict[int, str]] = {}
    ignored, leftover = [], []
    for name in sorted(tensors):
        for ri, pats in enumerate(compiled):
            hit = next(((pi, m) for pi, p in enumerate(pats) if (m := p.fullmatch(name))), None)
            if hit is not None:
                pi, m = hit
                slot = groups.setdefault((ri, tuple(sorted(m.groupdict().items()))), {})
                if pi in slot:
                    raise UserError(
                        f"{path}: tensors {slot[pi]} and {name} both match one rule slot", "fix the architecture rules"
                    )
                slot[pi] = name
                break
        else:
            (ignored if any(re.fullmatch(p, name) for p in ignore) else leftover).append(name)
    if leftover:
        raise UserError(
            f"{path}: {len(leftover)} tensor(s) are neither language-model nor ignored vision tensors: "
            + first_few(leftover, 6),
            "the checkpoint layout is not covered by the family's architecture rules; extend its JSON",
        )
    units = []
    for (ri, key), slot in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rule = rules[ri]
        if len(slot) != len(rule.sources):
            have = ", ".join(slot[i] for i in sorted(slot))
            missing = [rule.sources[i] for i in range(len(rule.sources)) if i not in slot]
            raise UserError(
                f"{path}: {have} found without its partner(s) matching {missing}", "the checkpoint is incomplete"
            )
        sources = tuple(slot[i] for i in range(len(rule.sources)))
        values = dict(key)
        if rule.per_index:
            n = tensors[sources[0]].shape[0]
            targets = tuple(t.format(**values, **{rule.per_index: i}) for i in range(n) for t in rule.targets)
        else:
            targets = tuple(t.format(**values) for t in rule.targets)
        units.append(Unit(rule=rule, sources=sources, targets=targets))
    return units, ignored


def _target_config(family: Family, variant: Variant, text: dict[str, Any], path: Path) -> tuple[Any, str, list[str]]:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    d = json.loads(json.dumps(text))  # deep copy
    model_type = variant.target.model_type or d.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{path}: target model type {model_type!r} has no causal-LM class in this transformers",
            f"fix target.model_type in architectures/{family.name}.json",
        )
    dropped = [p for p in variant.target.drop_config if _dotdel(d, p)]
    for old, new in variant.target.rename_config.items():
        if old in d:
            d[new] = d.pop(old)
    d.update(variant.target.set_config)
    for key in _NOT_INHERITED:
        d.pop(key, None)
    # Keys the target class does not declare are kept: modeling code reads some of them with
    # getattr (Qwen3-MoE's head_dim), so only the family's drop_config removes keys.
    try:
        config = AutoConfig.for_model(model_type, tie_word_embeddings=True, **d)  # so the tie map names the head
    except (TypeError, ValueError) as e:
        raise UserError(
            f"{path}: cannot build a {model_type} config from the VLM's text config ({str(e).splitlines()[0]})",
            f"fix target in architectures/{family.name}.json",
        ) from None
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]
    return config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], dropped


def _expected_tensors(config: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Names and shapes `save_pretrained` writes for this config, and the tie map {head: embedding}."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tie_map = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    # on-disk names and layouts (e.g. per-expert MoE tensors) differ from in-memory ones
    state = revert_weight_conversion(model, model.state_dict())
    return {k: tuple(v.shape) for k, v in state.items()}, tie_map


def make_plan(vlm_config: Any, tensors: dict[str, Tensor], family: Family, path: Path) -> Plan:
    """Match the checkpoint's tensors to the target class and decide tying, before any data moves (`vlm_config`: the
    VLM's transformers config; `path` names the VLM in errors)."""
    text_config = getattr(vlm_config, family.text_config, None)
    if text_config is None:
        raise UserError(
            f"{path}: the {family.name} config has no {family.text_config!r}",
            "check that this is a complete VLM config",
        )
    text = text_config.to_dict()
    variant = select_variant(family, text, path)
    config, target_class, dropped = _target_config(family, variant, text, path)
    expected, tie_map = _expected_tensors(config)
    units, ignored = _claim(tensors, variant.rules, family.ignore, path)
    produced = _produced(units, path)
    head, head_source = next(iter(tie_map.items()), (None, None))
    vlm_ties = bool(getattr(vlm_config, "tie_word_embeddings", False))
    tied = _ties_absent_head(head, produced, vlm_ties, path)
    want = {k for k in expected if not (tied and k == head)}  # the names the target class saves
    listed = _listed(("missing", sorted(want - set(produced))), ("unexpected", sorted(set(produced) - want)))
    if listed:
        raise UserError(
            f"{path}: the language tensors do not form a {target_class} ({listed})",
            f"the checkpoint does not match architectures/{family.name}.json; extend its rules",
        )
    dropped_rows = _check_shapes(units, tensors, expected, target_class, path)
    return Plan(
        variant=variant,
        target_config=config,
        target_class=target_class,
        units=tuple(units),
        expected=expected,
        tied=tied,
        vlm_ties=vlm_ties,
        head=head,
        head_source=head_source,
        ignored=tuple(ignored),
        dropped_config_keys=tuple(dropped),
        dropped_rows=dropped_rows,
    )


def _produced(units: list[Unit], path: Path) -> dict[str, str]:
    """Each backbone tensor the units produce -> its first source; one produced twice is an error."""
    produced: dict[str, str] = {}
    for unit in units:
        for t in unit.targets:
            if t in produced:
                raise UserError(
                    f"{path}: backbone tensor {t} is produced from both {produced[t]} and {unit.sources[0]}",
                    "the checkpoint mixes two layouts of the same weights; re-save it",
                )
            produced[t] = unit.sources[0]
    return produced


def _ties_absent_head(head: str | None, produced: dict[str, str], vlm_ties: bool, path: Path) -> bool:
    """True when the VLM ties its head and stores none (the backbone ties too); an absent head the VLM does not tie
    is an error. When the VLM ties its head and stores it too, the data decides later (`tie_pair`)."""
    if head is None or head in produced:
        return False
    if not vlm_ties:
        raise UserError(
            f"{path}: the output head is missing ({head} has no source tensor) and the VLM does not tie it",
            "the checkpoint is incomplete",
        )
    return True


def _listed(*groups: tuple[str, list[str]]) -> str:
    """'missing 2: a, b; unexpected 1: c' of the groups that name any tensor (at most four names each)."""
    return "; ".join(f"{what} {len(names)}: {', '.join(names[:4])}" for what, names in groups if names)


def _check_shapes(
    units: list[Unit],
    tensors: dict[str, Tensor],
    expected: dict[str, tuple[int, ...]],
    target_class: str,
    path: Path,
) -> dict[str, int]:
    """Run each unit's rule on meta tensors and check the shapes it yields; the rows a drop_rest rule keeps out, by
    the unit's first target."""
    dropped_rows: dict[str, int] = {}
    for unit in units:
        metas = [torch.empty(tensors[s].shape, device="meta") for s in unit.sources]
        try:
            outs, rest = forward_rule(unit.rule, metas, [expected[t] for t in unit.targets])
        except ValueError as e:
            raise UserError(
                f"{path}: {', '.join(unit.sources)}: {e}", "the text config and the tensors disagree"
            ) from None
        for t, o in zip(unit.targets, outs, strict=True):
            if tuple(o.shape) != expected[t]:
                raise UserError(
                    f"{path}: {t} would have shape {tuple(o.shape)}, {target_class} expects {expected[t]}",
                    "the text config and the tensors disagree",
                )
        if rest is not None:
            dropped_rows[unit.targets[0]] = int(rest.shape[unit.rule.dim])
    return dropped_rows


def output_dtype(choice: str, tensors: dict[str, Tensor], units: tuple[Unit, ...]) -> torch.dtype:
    """The dtype `choice` names; for "keep", the floating dtype holding most of the language tensors' bytes."""
    if choice in _DTYPE_NAMES:
        return _DTYPE_NAMES[choice]
    weight: dict[torch.dtype, int] = {}
    for unit in units:
        for s in unit.sources:
            d = ST_DTYPES[tensors[s].dtype]
            if d.is_floating_point:
                weight[d] = weight.get(d, 0) + math.prod(tensors[s].shape) * d.itemsize
    return max(weight, key=weight.get) if weight else torch.float32


def production_order(plan: Plan, tensors: dict[str, Tensor]) -> list[Unit]:
    """Units in source-shard order, so each source shard is read once."""
    return sorted(plan.units, key=lambda u: (min(tensors[s].file for s in u.sources), u.sources))


def tie_pair(plan: Plan) -> tuple[str, str] | None:
    """(stored head, stored embedding) whose equality decides tying, when the VLM ties its head but stores it too."""
    if plan.tied or not plan.vlm_ties or plan.head is None:
        return None
    head_unit = next(u for u in plan.units if plan.head in u.targets)
    embed_unit = next(u for u in plan.units if plan.head_source in u.targets)
    if (
        head_unit.rule.per_index is None
        and len(head_unit.sources) == len(head_unit.targets) == 1
        and len(embed_unit.sources) == 1
        and not embed_unit.rule.drop_rest
    ):
        return head_unit.sources[0], embed_unit.sources[0]
    return None


def extract_layout(
    plan: Plan, tensors: dict[str, Tensor], cast: torch.dtype | None, skip: set[str], max_shard_bytes: int
) -> Layout:
    """The backbone's shards: targets in production order (floating ones cast to `cast`), cut at `max_shard_bytes`."""
    entries: list[Entry] = []
    for unit in production_order(plan, tensors):
        src_dtype = functools.reduce(torch.promote_types, [ST_DTYPES[tensors[s].dtype] for s in unit.sources])
        d = cast if (cast is not None and src_dtype.is_floating_point) else src_dtype
        entries.extend((t, d, plan.expected[t]) for t in unit.targets if t not in skip)
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + entry_bytes(e) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += entry_bytes(e)
    return tuple(zip(shard_names(len(shards)), (tuple(s) for s in shards), strict=True))


def mirror_layout(tensors: dict[str, Tensor]) -> Layout:
    """The VLM's own shards: each file's tensors, sorted by name, in their stored dtype."""
    files = sorted({t.file for t in tensors.values()})
    return tuple(
        (f, tuple((n, ST_DTYPES[t.dtype], t.shape) for n, t in sorted(tensors.items()) if t.file == f)) for f in files
    )


def check_backbone(
    plan: Plan, config: dict[str, Any], tensors: dict[str, Tensor], backbone: Path, vlm: Path
) -> dict[str, str]:
    """Check a backbone (its config.json contents and tensors) against the plan; return aliases {needed: stored}."""
    want_type = plan.target_config.model_type
    if config.get("model_type") != want_type:
        raise UserError(
            f"{backbone}: backbone model type {config.get('model_type')!r} does not match the VLM's "
            f"language model ({want_type!r})",
            f"pass a {plan.target_class} backbone extracted from (or merged with) this VLM",
        )
    needed = [t for u in plan.units for t in u.targets]
    alias: dict[str, str] = {}
    missing = []
    for t in needed:
        if t in tensors:
            continue
        if t == plan.head and config.get("tie_word_embeddings") and plan.head_source in tensors:
            alias[t] = plan.head_source  # the backbone ties its head: the VLM's stored head is the embedding
        else:
            missing.append(t)
    extra = sorted(set(tensors) - set(needed))
    if plan.tied and extra == [plan.head]:
        extra = []  # checked against the embedding when written
    listed = _listed(("missing", missing), ("not in the VLM", extra))
    if listed:
        raise UserError(
            f"{backbone}: backbone tensors do not match the VLM's language model ({listed})",
            f"pass a backbone with the architecture of {vlm}'s language model",
        )
    for t in needed:
        have = tensors[alias.get(t, t)].shape
        if have != plan.expected[t]:
            raise UserError(
                f"{backbone}: {t} has shape {list(have)}, the VLM's language model has {list(plan.expected[t])}",
                "pass a backbone of the same size (layers, hidden size, vocabulary) as the VLM's language model",
            )
    return alias
