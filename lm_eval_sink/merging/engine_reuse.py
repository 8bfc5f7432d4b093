"""Which checkpoints of a vLLM sweep share one resident engine, and which engine takes which: decisions, no I/O.

An engine fixes what it read of its first checkpoint (`engine_fields`); a checkpoint that differs in any of it gets
an engine of its own (docs/scale.md, "One engine per sweep").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval_sink.io import canonical_json, sha256_text
from lm_eval_sink.tables import first_few

Fields = dict[str, Any]  # one checkpoint's engine-fixed settings, flat: {"config.json vocab_size": 49152, ...}

# Keys that name where a file came from or which library wrote it: they fix nothing in an engine.
SOURCE_KEYS = frozenset({"_name_or_path", "_model_name_or_path", "transformers_version", "_commit_hash"})
# tokenizer_config.json keys that are how it was loaded, not what it is.
LOADER_KEYS = frozenset({"name_or_path", "is_local", "local_files_only"})
DTYPE_KEYS = ("dtype", "torch_dtype")
WEIGHTS = "weights: tensor names and shapes"


def engine_fields(facts: Mapping[str, Any], dtype: str | None) -> Fields:
    """The settings an engine started from this checkpoint would fix, from `facts` (`engine_client.checkpoint_facts`);
    a `dtype` the eval settings fix (not None / "auto") replaces the config's."""
    fixed = dtype not in (None, "auto")
    out: Fields = {"dtype": dtype} if fixed else {}
    for key, value in (facts.get("config") or {}).items():
        if key in SOURCE_KEYS or (fixed and key in DTYPE_KEYS):
            continue
        out[f"config.json {'dtype' if key in DTYPE_KEYS else key}"] = value
    for key, value in (facts.get("generation_config") or {}).items():
        if key not in SOURCE_KEYS:
            out[f"generation_config.json {key}"] = value
    for key, value in (facts.get("tokenizer_config") or {}).items():
        if key not in SOURCE_KEYS | LOADER_KEYS:
            out[f"tokenizer_config.json {key}"] = value
    out |= {f"tokenizer file {name}": sha for name, sha in (facts.get("files") or {}).items()}
    out[WEIGHTS] = sha256_text(canonical_json(facts.get("tensors") or {}))
    return out


def differences(engine: Fields, checkpoint: Fields) -> list[str]:
    """The fields in which a checkpoint differs from an engine's (present in one only, or with other values)."""
    return sorted(k for k in set(engine) | set(checkpoint) if engine.get(k, ...) != checkpoint.get(k, ...))


def engine_starts(order: Sequence[str], fields: Mapping[str, Fields | None]) -> list[tuple[str, str | None]]:
    """For checkpoints in run order, each with the reason it starts an engine (`new_engine_reason`; None: it takes the
    engine before it, or its fields are not known yet: a merge not made, decided when it runs)."""
    out: list[tuple[str, str | None]] = []
    held: tuple[str, Fields] | None = None
    for name in order:
        mine = fields.get(name)
        why = None if mine is None else new_engine_reason(held, None, name, mine)
        out.append((name, why))
        if why is not None:
            held = (name, mine)
    return out


def new_engine_reason(
    held: tuple[str, Fields] | None, failed: str | None, checkpoint: str, fields: Fields
) -> str | None:
    """Why an eval unit of `checkpoint` (its `fields`) needs a new engine, or None where the running one takes its
    weights. `held`: (the checkpoint the running engine holds, its fields), None when no engine runs; `failed`:
    the unit that failed on that engine (its weights may be half written), which rules it out whatever it holds."""
    if failed is not None:
        return f"the previous unit ({failed}) failed"
    if held is None:
        return "the first checkpoint"
    diff = differences(held[1], fields)
    return f"{checkpoint} differs from {held[0]} in {first_few(diff, 4)}" if diff else None


def assign(
    actors: Sequence[tuple[str, Fields | None, bool]], waiting: Sequence[tuple[str, Fields]]
) -> list[tuple[str, str]]:
    """Which idle actor takes which waiting eval unit, as (actor, unit) pairs, from `actors` (id, the fields its
    engine holds or None, idle) and `waiting` (unit id, its fields; plan order): first a unit its engine holds, else one
    no other actor's engine could hold, else the first left (a rebuild costs less than an idle slot)."""
    left = list(waiting)
    idle = [(a, held) for a, held, free in actors if free]
    pairs: list[tuple[str, str]] = []
    unmatched = []
    for actor, held in idle:
        match = next((u for u in left if held is not None and u[1] == held), None)
        if match is None:
            unmatched.append(actor)
            continue
        pairs.append((actor, match[0]))
        left.remove(match)
    for actor in unmatched:
        if not left:
            break
        others = [held for a, held, _ in actors if a != actor and held is not None]
        unit = next((u for u in left if u[1] not in others), left[0])
        pairs.append((actor, unit[0]))
        left.remove(unit)
    return pairs


# --- accelerator memory beside a resident engine ----------------------------------------------------------------

_GIB = 2**30


@dataclass(frozen=True, slots=True)
class Need:
    """What loads a model on the accelerators while the resident engine holds its share: `weight_bytes` placed over
    `devices` (every visible GPU for `--device auto`)."""

    what: str  # e.g. "the strength: units (reference's weights in float32)"
    weight_bytes: int
    devices: tuple[str, ...]
    instead: str = ""  # what the fix adds about S from the engine, which would need no second copy


def _gib(n: float) -> str:
    return f"{n / _GIB:.1f} GiB"


def room_refusal(
    total: Mapping[str, int], engine: Sequence[str], utilization: float, needs: Sequence[Need]
) -> tuple[str, str] | None:
    """The first need that does not fit beside the engine, as (message, fix), or None: the engine takes `utilization`
    of each of its devices' total memory, a need has the rest of its devices; the fix names the largest utilization
    that leaves the room, where one does."""
    held = {d: utilization * total[d] for d in engine if d in total}
    for need in needs:
        devices = [d for d in need.devices if d in total]
        room = sum(total[d] - held.get(d, 0) for d in devices)
        if room >= need.weight_bytes:
            continue
        shared = sum(total[d] for d in devices if d in held)
        most = (sum(total[d] for d in devices) - need.weight_bytes) * 100 // shared / 100 if shared else 0
        message = (
            f"the resident vLLM engine takes {utilization:g} of {', '.join(engine)} "
            f"({_gib(sum(held.values()))} of {_gib(sum(total[d] for d in held))}), which leaves {_gib(room)} of "
            f"{', '.join(devices)} for {need.what}: {_gib(need.weight_bytes)}"
        )
        lower = f"set eval.model_args.gpu_memory_utilization to {most:.2f} or lower, or " if most > 0 else ""
        fix = lower + "pass --fresh-engine (an engine per checkpoint, started after S is measured)" + need.instead
        return message, fix
    return None
