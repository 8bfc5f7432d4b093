"""Head-selective sink protection during training: choose sink heads, then keep their sink logit.

Rule K projects k_proj's update off the sink token's input direction x^, Rule Q projects q_proj's update off the
rotary planes holding the sink key, and `freeze` fixes the position-0 path below the lowest protected layer; the
rules and what they hold under QK-norm and LoRA are in docs/training.md ("The rules"). The math functions are pure
numpy; the model functions only read and write parameters.
"""

from __future__ import annotations

import math
import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import TypeAdapter, ValidationError
from transformers import TrainerCallback

from lm_eval_sink.adapters import adapted
from lm_eval_sink.calibration import encoded_prompts
from lm_eval_sink.capture import attention_layers, capture_prompts, text_config_of
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import read_json
from lm_eval_sink.margin import captured_rows
from lm_eval_sink.strength import StrengthSettings
from lm_eval_sink.training.callback import unwrap_model

SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------- pure math


def select_head(
    median_logodds: float, pos0_fraction: float, threshold: float, min_pos0_fraction: float
) -> tuple[bool, str]:
    """Whether a head is protected, and why (its sink must be strong and at position 0)."""
    if pos0_fraction < min_pos0_fraction:
        return False, f"sink at position 0 in {pos0_fraction:.2f} of rows < {min_pos0_fraction}"
    if not median_logodds > threshold:
        return False, f"median log-odds {median_logodds:.3f} <= threshold {threshold}"
    return True, f"median log-odds {median_logodds:.3f} > {threshold}, position 0 in {pos0_fraction:.2f} of rows"


def sink_basis(k_s: np.ndarray, rotary_dim: int, tau: float) -> tuple[np.ndarray, float]:
    """(U [d, r] orthonormal, excluded energy share) for one KV head's sink key (rotate-half RoPE): its rotary planes,
    largest first, until they hold (1 - tau) of |k_s|^2, the unrotated dims one block along k_s's part there."""
    k = np.asarray(k_s, dtype=np.float64)
    d = k.shape[0]
    half = rotary_dim // 2
    blocks: list[tuple[float, np.ndarray]] = []
    for i in range(half):
        e = np.zeros((d, 2))
        e[i, 0] = e[i + half, 1] = 1.0
        blocks.append((float(k[i] ** 2 + k[i + half] ** 2), e))
    rest = np.zeros(d)
    rest[rotary_dim:] = k[rotary_dim:]
    if np.linalg.norm(rest) > 0:
        blocks.append((float(rest @ rest), (rest / np.linalg.norm(rest))[:, None]))
    total = float(k @ k)
    if total == 0.0:
        return np.zeros((d, 0)), 0.0
    kept, energy = [], 0.0
    for e, basis in sorted(blocks, key=lambda b: -b[0]):
        if energy >= (1.0 - tau) * total or e == 0.0:
            break
        kept.append(basis)
        energy += e
    return np.concatenate(kept, axis=1), max(0.0, 1.0 - energy / total)


# ---------------------------------------------------------------------------- plan


@dataclass(frozen=True, slots=True)
class HeadChoice:
    layer: int
    head: int
    kv_head: int
    sink_pos: int  # most frequent argmax key
    pos0_fraction: float
    median_logodds: float
    selected: bool
    reason: str


@dataclass(frozen=True, slots=True)
class LayerPlan:
    layer: int
    heads: tuple[int, ...]  # protected query heads (Rule Q)
    kv_heads: tuple[int, ...]  # protected KV heads (Rule K)
    x_hat: tuple[float, ...]
    k_sink: dict[int, tuple[float, ...]]  # KV head -> k_s
    u_rank: dict[int, int]  # KV head -> rank of U
    excluded_energy: dict[int, float]  # KV head -> share of |k_s|^2 outside U

    @property
    def max_u_rank(self) -> int:
        return max(self.u_rank.values(), default=0)


@dataclass(frozen=True, slots=True)
class ProtectionPlan:
    """Which heads to protect, and the sink geometry the rules need (from the start weights)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: str
    sink_token_id: int
    threshold: float
    min_pos0_fraction: float
    tau: float
    heads: tuple[HeadChoice, ...]
    layers: tuple[LayerPlan, ...]  # protected layers only, ascending
    start_sha256: str  # of the protected layers' start q_proj / k_proj weights
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def lowest_layer(self) -> int | None:
        return self.layers[0].layer if self.layers else None

    def to_json(self) -> dict[str, Any]:
        d = _PLAN.dump_python(self, mode="json")  # KV-head keys as strings, tuples as lists
        for lp, layer in zip(d["layers"], self.layers, strict=True):
            lp["max_u_rank"] = layer.max_u_rank
        return {**d, "schema_version": SCHEMA_VERSION}

    def basis(self, layer: LayerPlan, kv_head: int) -> np.ndarray:
        return sink_basis(np.asarray(layer.k_sink[kv_head]), self.rotary_dim, self.tau)[0]


_PLAN = TypeAdapter(ProtectionPlan)


def read_plan(path: str | Path) -> ProtectionPlan:
    data = read_json(Path(path))
    try:
        plan = _PLAN.validate_python(data)  # int KV-head keys and tuples again; schema_version, max_u_rank left out
    except ValidationError:
        plan = None
    if plan is None or data.get("schema_version") != SCHEMA_VERSION:
        raise UserError(
            f"{path}: not a protection plan (schema_version {SCHEMA_VERSION})",
            "write one with `lm-eval-sink protect-plan MODEL -o plan.json`",
        )
    return plan


# ---------------------------------------------------------------------------- model access


def _decoder(model: Any) -> Any:
    base = unwrap_model(model)
    inner = getattr(base, "model", base)
    if not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise UserError(
            f"{type(base).__name__}: no decoder layers at .model.layers",
            "use a decoder-only causal LM (Llama, Qwen2/3, OLMo2, Gemma, ...)",
        )
    return inner


def _is_lora(module: Any) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def _linear(module: Any) -> Any:
    return module.base_layer if _is_lora(module) else module


def _lora_parts(module: Any) -> list[tuple[Any, Any]]:
    """(A weight [r, in], B weight [out, r]) of each active adapter (the rules project A or B: its scaling is moot)."""
    names = module.active_adapters if hasattr(module, "active_adapters") else list(module.lora_A)
    return [(module.lora_A[n].weight, module.lora_B[n].weight) for n in names if n in module.lora_A]


def _shape(model: Any) -> tuple[int, int, int, int]:
    cfg = text_config_of(unwrap_model(model).config)
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    return int(cfg.num_hidden_layers), n_heads, n_kv, head_dim


def check_unsharded(model: Any, args: Any = None) -> None:
    """Refuse sharded weights (FSDP, DeepSpeed ZeRO-3): the rules need each full matrix."""
    ds = getattr(args, "hf_deepspeed_config", None)  # args None: the parameters alone tell
    sharded = bool(getattr(args, "fsdp", None)) or bool(ds is not None and getattr(ds, "is_zero3", lambda: False)())
    sharded = sharded or any(
        hasattr(p, "ds_id")
        or type(p).__name__ in ("DTensor", "FlatParameter")
        or type(getattr(p, "data", None)).__name__ == "DTensor"
        for p in model.parameters()
    )
    if sharded or any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise UserError(
            "SinkProtection needs unsharded weights, but FSDP / ZeRO-3 shard them",
            "train with DDP or DeepSpeed ZeRO-1/2, or on one device",
        )


def check_no_learned_sinks(model: Any) -> None:
    """Refuse learned sinks (gpt-oss `sinks`): the sink is a per-head logit there, not position 0's key."""
    if any(getattr(getattr(layer, "self_attn", None), "sinks", None) is not None for layer in _decoder(model).layers):
        raise UserError(
            f"{type(unwrap_model(model)).__name__} has learned attention sinks (a per-head sink logit), "
            "but SinkProtection holds the key of position 0, which is not the sink there",
            "protect a model whose sink is its first token (Llama, Qwen, OLMo, Gemma, ...)",
        )


def protectable_attention(model: Any, layer: int) -> Any:
    """Layer `layer`'s attention, refused in one line unless it is what the rules read: `self_attn` with q_proj and
    k_proj, its query/key norms (if any) named q_norm/k_norm (LFM2's q_layernorm would be left out of the rules)."""
    attn = getattr(_decoder(model).layers[layer], "self_attn", None)
    children = [] if attn is None else [name for name, _ in attn.named_children()]
    others = [name for name in children if "norm" in name and name not in ("q_norm", "k_norm")]
    if attn is None or not (hasattr(attn, "q_proj") and hasattr(attn, "k_proj")) or others:
        raise UserError(
            f"layer {layer}'s attention ({type(attn).__name__}) is not one SinkProtection reads: it needs q_proj and "
            f"k_proj with query/key norms named q_norm/k_norm{', not ' + ', '.join(others) if others else ''}",
            "protect a Llama, Qwen2/3, OLMo2 or Gemma layout",
        )
    return attn


def check_no_virtual_tokens(virtual: Any, what: str) -> None:
    """Refuse a prompt-learning adapter (`adapters.VirtualTokens`, None: none): position 0 is a virtual token there,
    not the real first token whose key a plan holds."""
    if virtual is not None:
        raise UserError(
            f"{what}: a {virtual.method} adapter puts {virtual.n} virtual tokens before every prompt, so position 0 "
            "is a virtual token, not the real sink token whose key a protection plan holds",
            "make the plan on its base model (lm-eval-sink protect-plan BASE): prompt learning trains no weight "
            "the plan would protect",
        )


def sink_geometry(model: Any, sink_token_id: int, layers: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer: (x_s [hidden], k_s [kv, d]) of the sink token at position 0."""
    _, _, n_kv, d = _shape(model)
    got = _attention_inputs(model, layers, [[sink_token_id]], position_ids=[[0]])
    return {
        l: (x.reshape(-1).double().cpu().numpy(), k.reshape(n_kv, d).double().cpu().numpy())
        for l, (x, k) in got.items()
    }


def _attention_inputs(model: Any, layers: list[int], input_ids: Any, position_ids: Any = None) -> dict[int, tuple]:
    """Per layer, from one forward of `input_ids` [1, L]: (the input of q_proj and k_proj, the key after k_norm where
    present)."""
    dec = _decoder(model)
    got: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for l in layers:
        attn = dec.layers[l].self_attn
        hooks.append(attn.k_proj.register_forward_pre_hook(lambda m, a, l=l: got.__setitem__((l, "x"), a[0].detach())))
        key_mod = attn.k_norm if getattr(attn, "k_norm", None) is not None else attn.k_proj
        hooks.append(key_mod.register_forward_hook(lambda m, a, out, l=l: got.__setitem__((l, "k"), out.detach())))
    try:
        dev = dec.embed_tokens.weight.device  # where token ids go in (under a device map, not the first parameter's)
        positions = None if position_ids is None else torch.as_tensor(position_ids, dtype=torch.long, device=dev)
        with torch.no_grad():
            unwrap_model(model)(
                input_ids=torch.as_tensor(input_ids, device=dev), position_ids=positions, use_cache=False
            )
    finally:
        for h in hooks:
            h.remove()
    return {l: (got[(l, "x")], got[(l, "k")]) for l in layers}


def _start_sha(model: Any, layers: list[int]) -> str:
    dec = _decoder(model)
    h = hashlib.sha256()
    for l in layers:
        attn = dec.layers[l].self_attn
        for mod in (attn.q_proj, attn.k_proj):
            h.update(_linear(mod).weight.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class ProtectSettings:
    """Which heads to protect: median sink log-odds above `threshold` with the sink at position 0 in at least
    `min_pos0_fraction` of rows, and `tau`, the share of |k_s|^2 Rule Q may leave unprotected (0: exact). Checked
    where built, before any model is loaded."""

    threshold: float = 0.0
    min_pos0_fraction: float = 0.8
    tau: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.threshold):
            raise UserError(f"--threshold must be a finite log-odds, got {self.threshold}", "use e.g. 0")
        if not 0.0 <= self.tau < 1.0:
            raise UserError(
                f"--tau must lie in [0, 1), got {self.tau}", "use 0 to keep the sink logit exactly, or e.g. 0.05"
            )
        if not 0.0 <= self.min_pos0_fraction <= 1.0:
            raise UserError(f"--min-pos0-fraction must lie in [0, 1], got {self.min_pos0_fraction}", "use e.g. 0.8")


def select_sink_heads(
    model: Any,
    tokenizer: Any,
    settings: StrengthSettings = StrengthSettings(),
    protect: ProtectSettings = ProtectSettings(),
    progress: bool = True,
) -> ProtectionPlan:
    """Capture the calibration prompts on the start model and choose the heads to protect (`select_head` over the
    rows `settings.rows` says)."""
    check_no_virtual_tokens(adapted(model).virtual, type(model).__name__)
    check_no_learned_sinks(model)
    n_layers, n_heads, n_kv, d = _shape(model)
    prompt_set, encoded = encoded_prompts(tokenizer, settings)
    first = {ids[0] for ids in encoded.input_ids}  # the sink whose key the rules hold
    if len(first) != 1:
        raise UserError(
            f"the calibration prompts start with {len(first)} different tokens {sorted(first)[:5]}",
            "use prompts whose first token (the sink) is the same, e.g. through the chat template",
        )
    sink_token = first.pop()
    layers = settings.layers_for(attention_layers(unwrap_model(model), encoded.input_ids[0][:2]))  # as S chooses
    attentions = [protectable_attention(model, layer) for layer in layers]  # each one the rules read
    q_norm = getattr(getattr(attentions[0], "q_norm", None), "weight", None)  # over head_dim, or all heads' dims
    kind = "none" if q_norm is None else "per_head" if q_norm.numel() == d else "layerwise"
    captures = capture_prompts(
        unwrap_model(model), encoded, layers, settings.batching(), progress=progress, desc="protect-plan capture"
    )
    heads = _choose_heads(captures, layers, n_heads // n_kv, settings.rows, protect)
    chosen: dict[int, list[int]] = {}
    for c in heads:
        if c.selected:
            chosen.setdefault(c.layer, []).append(c.head)
    inv_freq = getattr(getattr(_decoder(model), "rotary_emb", None), "inv_freq", None)
    rot = d if inv_freq is None else 2 * int(inv_freq.numel())  # the rotary dimensions (partial RoPE: fewer than d)
    return ProtectionPlan(
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=d,
        rotary_dim=rot,
        qk_norm=kind,
        sink_token_id=int(sink_token),
        **{name: float(value) for name, value in asdict(protect).items()},  # threshold, min_pos0_fraction, tau
        heads=heads,
        layers=_layer_plans(model, sink_token, chosen, n_heads // n_kv, n_kv, kind, rot, protect.tau),
        start_sha256=_start_sha(model, sorted(chosen)),
        provenance={
            "settings": asdict(settings),
            "prompt_set": {"source": prompt_set.source, "sha256": prompt_set.sha256},
        },
    )


def _choose_heads(
    captures: list[Any], layers: list[int], group: int, rows: str, protect: ProtectSettings
) -> tuple[HeadChoice, ...]:
    """Every captured head's choice, in (layer, head) order, from its rows' sink log-odds and argmax keys."""
    logodds, pos = (captured_rows(captures, quantity, rows) for quantity in ("sink_logodds", "sink_pos"))
    heads = []
    for li, l in enumerate(layers):
        for h in range(logodds.shape[1]):
            p = pos[li, h]
            frac, med = float((p == 0).mean()), float(np.median(logodds[li, h]))
            ok, why = select_head(med, frac, protect.threshold, protect.min_pos0_fraction)
            heads.append(
                HeadChoice(
                    layer=l,
                    head=h,
                    kv_head=h // group,
                    sink_pos=int(np.bincount(p).argmax()),
                    pos0_fraction=frac,
                    median_logodds=med,
                    selected=ok,
                    reason=why,
                )
            )
    return tuple(heads)


def _layer_plans(
    model: Any,
    sink_token: int,
    chosen: dict[int, list[int]],
    group: int,
    n_kv: int,
    kind: str,
    rot: int,
    tau: float,
) -> tuple[LayerPlan, ...]:
    """Per layer with a chosen head, ascending: the sink token's x^ and, per protected KV head, k_s and its basis U
    (all KV heads under a layerwise QK-norm)."""
    geometry = sink_geometry(model, sink_token, sorted(chosen))
    plans = []
    for l in sorted(chosen):
        x_s, k_s = geometry[l]
        norm = float(np.linalg.norm(x_s))
        if norm == 0.0:
            raise UserError(
                f"layer {l}: the sink token's input to k_proj is zero",
                "protect other layers (--last-k) or check the model",
            )
        kv = sorted({h // group for h in chosen[l]}) if kind != "layerwise" else list(range(n_kv))
        bases = {g: sink_basis(k_s[g], rot, tau) for g in kv}
        plans.append(
            LayerPlan(
                layer=l,
                heads=tuple(chosen[l]),
                kv_heads=tuple(kv),
                x_hat=tuple(float(v) for v in x_s / norm),
                k_sink={g: tuple(float(v) for v in k_s[g]) for g in kv},
                u_rank={g: int(bases[g][0].shape[1]) for g in kv},
                excluded_energy={g: float(bases[g][1]) for g in kv},
            )
        )
    return tuple(plans)


# ---------------------------------------------------------------------------- protection


class SinkProtection(TrainerCallback):
    """Apply a plan during training: `freeze(model)` once, `project_(model)` after each optimizer step; as a Trainer
    callback it freezes in `on_init_end` and projects in `on_step_end` (docs/training.md, "DDP"). The start weights,
    taken at the first call, must be the ones the plan was made from."""

    def __init__(self, plan: ProtectionPlan, freeze: bool = True, project: bool = True) -> None:
        self.plan = plan
        self.do_freeze = freeze
        self.do_project = project
        self._start: dict[str, Any] | None = None
        self._frozen = False

    @classmethod
    def from_plan(cls, path: str | Path, freeze: bool = True, project: bool = True) -> SinkProtection:
        return cls(read_plan(path), freeze=freeze, project=project)

    def _bind(self, model: Any) -> dict[str, Any]:
        """The start weights, each protected layer's x^ and each KV head's U (float64), taken at the first call and
        moved once when their layer has moved since (a Trainer places the model after `freeze`), never per step."""
        if self._start is None:
            self._start = self._take_start(model)
        dec = _decoder(model)
        where = {str(lp.layer): _linear(dec.layers[lp.layer].self_attn.q_proj).weight.device for lp in self.plan.layers}
        where["embed_row"] = dec.embed_tokens.weight.device
        for key, tensor in self._start.items():
            device = where[key.split(".")[0]]
            if tensor.device != device:
                self._start[key] = tensor.to(device)
        return self._start

    def _check_model(self, model: Any) -> None:
        """Refuse a sharded model, learned sinks, another shape or other start weights than the plan's."""
        check_unsharded(unwrap_model(model))
        check_no_learned_sinks(model)
        plan, (n_layers, n_heads, n_kv, d) = self.plan, _shape(model)
        if (n_layers, n_heads, n_kv, d) != (plan.n_layers, plan.n_heads, plan.n_kv_heads, plan.head_dim):
            raise UserError(
                f"the plan is for {plan.n_layers} layers x {plan.n_heads} heads ({plan.n_kv_heads} KV, dim "
                f"{plan.head_dim}), the model has {n_layers} x {n_heads} ({n_kv}, {d})",
                "make the plan from this model with `lm-eval-sink protect-plan`",
            )
        if _start_sha(model, [lp.layer for lp in self.plan.layers]) != self.plan.start_sha256:
            raise UserError(
                "the model's q_proj / k_proj weights are not the ones the plan was made from",
                "bind the protection before training starts, to the model the plan was made from",
            )

    def _take_start(self, model: Any) -> dict[str, Any]:
        """Copies of the weights the rules hold or project against, and x^ and U built once (`_bind` places them)."""
        self._check_model(model)
        dec = _decoder(model)
        start: dict[str, Any] = {"embed_row": dec.embed_tokens.weight[self.plan.sink_token_id].detach().clone()}
        for lp in self.plan.layers:
            attn = dec.layers[lp.layer].self_attn
            for name in ("q_proj", "k_proj"):
                lin = _linear(getattr(attn, name))
                start[f"{lp.layer}.{name}.weight"] = lin.weight.detach().clone()
                if lin.bias is not None:
                    start[f"{lp.layer}.{name}.bias"] = lin.bias.detach().clone()
            for name in ("q_norm", "k_norm"):
                norm = getattr(attn, name, None)
                if getattr(norm, "weight", None) is not None:
                    start[f"{lp.layer}.{name}.weight"] = norm.weight.detach().clone()
            dev = _linear(attn.q_proj).weight.device  # made where the layer is, whatever device is the default
            start[f"{lp.layer}.x_hat"] = torch.tensor(lp.x_hat, dtype=torch.float64, device=dev)
            for g in lp.kv_heads:
                start[f"{lp.layer}.basis.{g}"] = torch.tensor(self.plan.basis(lp, g), dtype=torch.float64, device=dev)
        return start

    def _to_freeze(self, model: Any) -> list[tuple[str, Any]]:
        """(name, parameter) of the position-0 path below the lowest protected layer, and its input norm."""
        low = self.plan.lowest_layer
        if low is None:
            return []
        dec = _decoder(model)
        out = [
            (f"layers.{l}.{name}", p)
            for l in range(low)
            for name, p in dec.layers[l].named_parameters()
            if not name.startswith(("self_attn.q_proj", "self_attn.k_proj"))
        ]
        norm = getattr(dec.layers[low], "input_layernorm", None)
        if norm is not None:
            out += [(f"layers.{low}.input_layernorm.{name}", p) for name, p in norm.named_parameters()]
        return out

    def freeze(self, model: Any) -> list[str]:
        """Fix the position-0 path up to the lowest protected layer; returns the frozen parameter names."""
        self._bind(model)
        params = self._to_freeze(model)
        for _, p in params:
            p.requires_grad_(False)
        self._frozen = self.plan.lowest_layer is not None  # the sink token's embedding row is reset after steps
        return [name for name, _ in params]

    def project_(self, model: Any) -> None:
        """Apply Rule K and Rule Q to the cumulative updates; hold biases, QK-norm scales and the sink row."""
        start = self._bind(model)
        dec = _decoder(model)
        d = self.plan.head_dim
        self._reset_sink_row(model)
        with torch.no_grad():
            for lp in self.plan.layers:
                attn = dec.layers[lp.layer].self_attn
                self._rule_k(attn.k_proj, start, lp, d)
                self._rule_q(attn.q_proj, start, lp, d)
                for name in ("q_norm", "k_norm"):
                    key = f"{lp.layer}.{name}.weight"
                    if key in start:
                        getattr(attn, name).weight.copy_(start[key])

    def _rule_k(self, module: Any, start: dict[str, Any], lp: LayerPlan, d: int) -> None:
        x_hat = start[f"{lp.layer}.x_hat"]
        if _is_lora(module):
            for a, _ in _lora_parts(module):
                a64 = a.double()
                a.copy_((a64 - torch.outer(a64 @ x_hat, x_hat)).to(a.dtype))
            return
        w, w0 = module.weight, start[f"{lp.layer}.k_proj.weight"]
        for g in lp.kv_heads:
            rows = slice(g * d, (g + 1) * d)
            delta = (w[rows] - w0[rows]).double()
            w[rows] = (w0[rows].double() + delta - torch.outer(delta @ x_hat, x_hat)).to(w.dtype)
            if module.bias is not None:
                module.bias[rows] = start[f"{lp.layer}.k_proj.bias"][rows]

    def _rule_q(self, module: Any, start: dict[str, Any], lp: LayerPlan, d: int) -> None:
        group = self.plan.n_heads // self.plan.n_kv_heads
        lora = _is_lora(module)
        lin = _linear(module)
        for h in lp.heads:
            u = start[f"{lp.layer}.basis.{h // group}"]
            if u.shape[1] == 0:
                continue
            rows = slice(h * d, (h + 1) * d)
            if lora:
                for _, b in _lora_parts(module):
                    b64 = b[rows].double()
                    b[rows] = (b64 - u @ (u.T @ b64)).to(b.dtype)
                continue
            w0 = start[f"{lp.layer}.q_proj.weight"]
            delta = (lin.weight[rows] - w0[rows]).double()
            lin.weight[rows] = (w0[rows].double() + delta - u @ (u.T @ delta)).to(lin.weight.dtype)
            if lin.bias is not None:
                b0 = start[f"{lp.layer}.q_proj.bias"]
                db = (lin.bias[rows] - b0[rows]).double()
                lin.bias[rows] = (b0[rows].double() + db - u @ (u.T @ db)).to(lin.bias.dtype)

    def report(self, model: Any, input_ids: Any) -> dict[str, Any]:
        """Per protected layer: max |dk_s| over its KV heads and `q_norm_ratio`, the (min, max) over positions >= 1 and
        protected heads of |u_i0| / |u_i| (per-head QK-norm) or |Q0(x_i)| / |Q(x_i)| (layerwise; None: no QK-norm)."""
        start = self._bind(model)
        dec = _decoder(model)
        layers = [lp.layer for lp in self.plan.layers]
        geometry = sink_geometry(model, self.plan.sink_token_id, layers)
        inputs = {l: x for l, (x, _) in _attention_inputs(model, layers, input_ids).items()}
        d, out = self.plan.head_dim, {}
        for lp in self.plan.layers:
            k_now = geometry[lp.layer][1]
            dk = max(float(np.linalg.norm(k_now[g] - np.asarray(lp.k_sink[g]))) for g in lp.kv_heads)
            ratio = None
            if self.plan.qk_norm != "none":
                x = inputs[lp.layer][0, 1:].double()
                lin = _linear(dec.layers[lp.layer].self_attn.q_proj)
                q_now = dec.layers[lp.layer].self_attn.q_proj(inputs[lp.layer][0, 1:]).double()
                w0 = start[f"{lp.layer}.q_proj.weight"].double()
                q0 = x @ w0.T + (start[f"{lp.layer}.q_proj.bias"].double() if lin.bias is not None else 0.0)
                if self.plan.qk_norm == "per_head":  # each protected head's query apart: [position, head, d]
                    q0, q_now = (q.reshape(q.shape[0], -1, d)[:, list(lp.heads)] for q in (q0, q_now))
                r = q0.norm(dim=-1) / q_now.norm(dim=-1)
                ratio = (float(r.min()), float(r.max()))
            out[lp.layer] = {"dk_sink": dk, "q_norm_ratio": ratio}
        return out

    def on_init_end(self, args, state, control, model=None, **kwargs):
        """Freeze when the Trainer is built: before it makes the optimizer and before DDP wraps the model."""
        if self.do_freeze and model is not None:
            check_unsharded(unwrap_model(model), args)
            self.freeze(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        check_unsharded(unwrap_model(model), args)
        self._bind(model)
        if not self.do_freeze:
            return
        if getattr(args, "world_size", 1) > 1 and any(p.requires_grad for _, p in self._to_freeze(model)):
            raise UserError(
                "SinkProtection would freeze parameters after DDP wrapped the model (it was added after the "
                "Trainer was built)",
                "pass it in Trainer(callbacks=[...]) or call protection.freeze(model) before building the Trainer",
            )
        self.freeze(model)

    def _reset_sink_row(self, model: Any) -> None:
        """After a step with the position-0 path frozen: the sink token's embedding row back to its start value."""
        if self._frozen:
            with torch.no_grad():
                _decoder(model).embed_tokens.weight[self.plan.sink_token_id].copy_(self._bind(model)["embed_row"])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.do_project:
            self.project_(model)
        else:
            self._reset_sink_row(model)
