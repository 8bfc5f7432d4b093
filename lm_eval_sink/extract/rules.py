"""Tensor rules applied to data, forward (VLM tensors -> backbone tensors) and inverse, so inject(extract(x)) == x
exactly; both work on meta tensors too, which is how whole plans are checked before any data is read.
"""

from __future__ import annotations

import torch

from lm_eval_sink.extract.families import TensorRule


def _combined(shapes: list[tuple[int, ...]], dim: int) -> tuple[int, ...]:
    first = list(shapes[0])
    for s in shapes[1:]:
        if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first, strict=True)) if i != dim):
            raise ValueError(f"shapes {shapes} cannot be concatenated along dim {dim}")
    first[dim] = sum(s[dim] for s in shapes)
    return tuple(first)


def _fits(shape: tuple[int, ...], want: tuple[int, ...], dim: int, allow_more: bool) -> bool:
    if len(shape) != len(want):
        return False
    return all(a == b or (allow_more and i == dim and a > b) for i, (a, b) in enumerate(zip(shape, want, strict=True)))


def forward_rule(
    rule: TensorRule, sources: list[torch.Tensor], target_shapes: list[tuple[int, ...]]
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Apply a rule to source tensors: returns the target tensors and the dropped rest (or None)."""
    x = sources[0] if len(sources) == 1 else torch.cat(sources, dim=rule.dim)
    k = len(rule.targets)
    if rule.per_index:
        n = x.shape[0]
        if len(target_shapes) != n * k:
            raise ValueError(f"{n} slices x {k} targets != {len(target_shapes)} planned targets")
        piece = _combined(target_shapes[:k], rule.dim)
        want = (n, *piece)
        dim = rule.dim + 1  # split dim inside the stacked tensor
    else:
        want = _combined(target_shapes, rule.dim)
        dim = rule.dim
    if rule.transpose and not _fits(tuple(x.shape), want, dim, rule.drop_rest):
        swapped = x.transpose(*rule.transpose)
        if _fits(tuple(swapped.shape), want, dim, rule.drop_rest):
            x = swapped
    if not _fits(tuple(x.shape), want, dim, rule.drop_rest):
        raise ValueError(f"source shape {tuple(x.shape)} does not give the target shape {want}")
    rest = None
    if x.shape[dim] > want[dim]:
        rest = x.narrow(dim, want[dim], x.shape[dim] - want[dim])
        x = x.narrow(dim, 0, want[dim])
    pieces = list(x.unbind(0)) if rule.per_index else [x]
    sizes = [s[rule.dim] for s in target_shapes[:k]]
    out: list[torch.Tensor] = []
    for p in pieces:
        out.extend(p.split(sizes, dim=rule.dim) if k > 1 else [p])
    return out, rest


def inverse_rule(
    rule: TensorRule, targets: list[torch.Tensor], source_shapes: list[tuple[int, ...]], rest: torch.Tensor | None
) -> list[torch.Tensor]:
    """The inverse of `forward_rule`: rebuild the source tensors from the targets (and the rest)."""
    k = len(rule.targets)
    if rule.per_index:
        pieces = [
            torch.cat(targets[i : i + k], dim=rule.dim) if k > 1 else targets[i] for i in range(0, len(targets), k)
        ]
        x = torch.stack(pieces, dim=0)
        dim = rule.dim + 1
    else:
        x = torch.cat(targets, dim=rule.dim) if k > 1 else targets[0]
        dim = rule.dim
    if rest is not None:
        x = torch.cat([x, rest.to(x.dtype)], dim=dim)
    want = _combined(source_shapes, rule.dim)
    if rule.transpose and tuple(x.shape) != want and tuple(x.transpose(*rule.transpose).shape) == want:
        x = x.transpose(*rule.transpose)
    if tuple(x.shape) != want:
        raise ValueError(f"backbone tensors give shape {tuple(x.shape)}, the VLM stores {want}")
    if len(source_shapes) == 1:
        return [x]
    return list(x.split([s[rule.dim] for s in source_shapes], dim=rule.dim))
