"""Verification by round-trip logits on a fixed probe (docs/extraction.md, 'Verification')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# fp32 comparisons of the same weights through the same operations come out at 0 or ~1e-6.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-5),
    "bfloat16": (2e-2, 1e-2),
    "float16": (2e-3, 1e-3),
}
PROBE_TEXT = (
    "The capital of France is Paris. Write a list of three colors as a JSON list, then explain "
    "in two sentences why the sky is blue, using only letters and words."
)


@dataclass(frozen=True, slots=True)
class Verification:
    """Round-trip logits of the VLM's text path vs the standalone backbone on the fixed probe."""

    passed: bool
    max_abs_diff: float | None
    tolerance: float | None
    dtype: str
    probe_tokens: int
    reason: str | None


def multimodal_token_ids(vlm_config: Any) -> set[int]:
    """The VLM config's image/video/vision token ids (`*_token_id`, `*_token_index`), kept out of the probe."""
    text_ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {
        value
        for key, value in vlm_config.to_dict().items()
        if isinstance(value, int) and not isinstance(value, bool) and key.endswith(("_token_id", "_token_index"))
        if key not in text_ids
    }


def probe_ids(tokens: list[int], vocab_size: int, banned: set[int]) -> list[int]:
    """The probe: PROBE_TEXT's token ids minus multimodal ones, at most 64, padded to 16 with fixed ids."""
    ids = [i for i in tokens if 0 <= i < vocab_size and i not in banned][:64]
    step = 0
    while len(ids) < 16:
        candidate = (7919 * step + 11) % vocab_size
        step += 1
        if candidate not in banned:
            ids.append(candidate)
    return ids


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    """float32 logits of one unpadded sequence (the ids made on the device of the model's embeddings)."""
    model.eval()
    with torch.no_grad():
        x = torch.tensor([ids], device=model.get_input_embeddings().weight.device)
        return model(input_ids=x, attention_mask=torch.ones_like(x)).logits.float()


def compare(
    ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, probe_tokens: int, loading_info: dict[str, Any]
) -> Verification:
    """The verdict on the VLM's logits `ref` vs the backbone's `got` (and how the backbone loaded)."""
    name = str(dtype).removeprefix("torch.")
    atol, rtol = TOLERANCES.get(name, TOLERANCES["bfloat16"])

    def failed(reason: str) -> Verification:
        return Verification(False, None, None, name, probe_tokens, reason)

    problems = [
        f"{k}: {sorted(v)[:4]}"
        for k, v in loading_info.items()
        if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
    ]
    if problems:
        return failed("backbone loads with " + "; ".join(problems))
    if ref.shape != got.shape:
        return failed(f"logit shapes differ: VLM {tuple(ref.shape)}, backbone {tuple(got.shape)}")
    if not (torch.isfinite(ref).all() and torch.isfinite(got).all()):
        return failed("non-finite logits (NaN or inf)")
    diff = float((ref - got).abs().max())
    tol = atol + rtol * float(ref.abs().max())
    reason = None if diff <= tol else f"max |logit difference| {diff:.3g} exceeds the {name} tolerance {tol:.3g}"
    return Verification(diff <= tol, diff, tol, name, probe_tokens, reason)
