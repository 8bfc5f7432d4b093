"""TSV and STAR: their tensor math, and their registration as mergekit merge methods.

Both merge T task vectors tau_i = model_i - base, parameter by parameter, in float32 whatever the
storage dtype (SVD on CPU is deterministic, so a merge is reproducible bit for bit):

- TSV (Task Singular Vectors, Gargiulo et al., CVPR 2025, arXiv 2412.00081): for a 2-D parameter,
  SVD each tau_i = U_i S_i V_i^T and keep its top k = floor(min(rows, cols) / T) components
  (at least one); stack U = [U_1 .. U_T], S = diag(S_1 .. S_T), V = [V_1 .. V_T]; replace U and V
  by their polar factors (the nearest matrices with orthonormal columns: P Q^T from the SVD
  P Sigma Q^T); merged delta = polar(U) S polar(V)^T. Other parameters: mean of the task vectors.
  merged = base + alpha * merged delta. Components with a numerically zero singular value (below
  max(S) * max(rows, cols) * float32 eps) are dropped before stacking: they add nothing to the
  sum but their arbitrary directions would tilt the orthogonalisation. With one task the merge
  is the task vector itself (up to float32 rounding): TSV(alpha = 1) returns the model.
- STAR (Spectral Truncation And Rescale, Lee et al., NAACL 2025, arXiv 2502.10339): for each task
  and 2-D parameter, SVD, keep the smallest rank r whose singular values reach the fraction eta of
  their sum, multiply the kept values by sum(all) / sum(kept) so the nuclear norm is unchanged,
  reconstruct; average over tasks; merged = base + that mean. Other parameters: mean of tasks.

`register()` makes `tsv` and `star` available to mergekit by name (its `merge_method` API and
registry). It is idempotent and cheap; the package's import hook calls it when mergekit's
registry module is imported, so plain `mergekit-yaml` runs configs that use them. mergekit is
imported only inside `register()`.
"""

from collections.abc import Sequence

import torch

METHOD_NAMES = ("tsv", "star")
TSV_URL = "https://arxiv.org/abs/2412.00081"
STAR_URL = "https://arxiv.org/abs/2502.10339"


def _svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD in float32: U [rows, r], S [r] (descending), Vh [r, cols]."""
    return torch.linalg.svd(matrix.to(torch.float32), full_matrices=False)


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """The orthonormal polar factor P Q^T of `matrix` = P Sigma Q^T (same shape)."""
    p, _, qh = _svd(matrix)
    return p @ qh


def _numerical_rank(s: torch.Tensor, shape: Sequence[int]) -> int:
    if s.numel() == 0 or float(s[0]) == 0.0:
        return 0
    tol = float(s[0]) * max(shape) * torch.finfo(torch.float32).eps
    return int((s > tol).sum())


def tsv_delta(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """TSV merge of task vectors of one parameter (float32, the parameter's shape)."""
    if not deltas:
        raise ValueError("TSV needs at least one task vector")
    first = deltas[0]
    if first.ndim != 2:
        return torch.stack([d.to(torch.float32) for d in deltas]).mean(dim=0)
    rows, cols = first.shape
    k = max(1, min(rows, cols) // len(deltas))
    us, ss, vs = [], [], []
    for delta in deltas:
        u, s, vh = _svd(delta)
        r = min(k, _numerical_rank(s, first.shape))
        us.append(u[:, :r])
        ss.append(s[:r])
        vs.append(vh[:r].T)
    s_all = torch.cat(ss)
    if s_all.numel() == 0:
        return torch.zeros(first.shape, dtype=torch.float32, device=first.device)
    u_orth = polar_factor(torch.cat(us, dim=1))
    v_orth = polar_factor(torch.cat(vs, dim=1))
    return (u_orth * s_all) @ v_orth.T


def star_truncate(delta: torch.Tensor, eta: float) -> torch.Tensor:
    """STAR on one 2-D task vector: truncate to the rank reaching `eta` of the nuclear norm, rescale."""
    u, s, vh = _svd(delta)
    s64 = s.to(torch.float64)
    total = float(s64.sum())
    if total == 0.0:
        return torch.zeros(delta.shape, dtype=torch.float32, device=delta.device)
    cumulative = torch.cumsum(s64, dim=0)
    r = min(int(torch.searchsorted(cumulative, eta * total)) + 1, s.numel())  # a scalar: no tensor off the device
    kept = (s64[:r] * (total / float(cumulative[r - 1]))).to(torch.float32)
    return (u[:, :r] * kept) @ vh[:r]


def star_delta(deltas: Sequence[torch.Tensor], eta: float) -> torch.Tensor:
    """STAR merge of task vectors of one parameter: mean of the truncated-and-rescaled vectors."""
    if not deltas:
        raise ValueError("STAR needs at least one task vector")
    if not 0.0 < eta <= 1.0:
        raise ValueError(f"STAR eta must be in (0, 1], got {eta}")
    parts = [star_truncate(d, eta) if d.ndim == 2 else d.to(torch.float32) for d in deltas]
    return torch.stack(parts).mean(dim=0)


def _task_vectors(group) -> tuple[torch.Tensor, list[torch.Tensor]]:
    base = group.base.tensor
    base32 = base.to(torch.float32)
    return base, [entry.tensor.to(torch.float32) - base32 for entry in group.non_base]


def register() -> None:
    """Register `tsv` and `star` with mergekit's method registry (no-op if already there)."""
    from typing import Annotated

    from pydantic import Field

    from mergekit.merge_methods import registry
    from mergekit.merge_methods.base import BasePolicy, InputContract, TensorGroup
    from mergekit.merge_methods.easy_define import merge_method

    present = {m.spec.name for m in registry.registered_methods()}
    if all(name in present for name in METHOD_NAMES):
        return
    contract = InputContract(base=BasePolicy.REQUIRED, min_non_base=1)

    def tsv(group: TensorGroup, alpha: Annotated[float, Field(allow_inf_nan=False)] = 1.0) -> torch.Tensor:
        base, deltas = _task_vectors(group)
        if not deltas:
            return base
        return (base.to(torch.float32) + alpha * tsv_delta(deltas)).to(base.dtype)

    def star(group: TensorGroup, eta: Annotated[float, Field(gt=0.0, le=1.0)] = 0.4) -> torch.Tensor:
        base, deltas = _task_vectors(group)
        if not deltas:
            return base
        return (base.to(torch.float32) + star_delta(deltas, eta)).to(base.dtype)

    methods = {
        "tsv": merge_method(
            tsv, name="tsv", pretty_name="Task Singular Vectors (TSV-Merge)", reference_url=TSV_URL, contract=contract
        ),
        "star": merge_method(
            star,
            name="star",
            pretty_name="Spectral Truncation And Rescale (STAR)",
            reference_url=STAR_URL,
            contract=contract,
        ),
    }
    for name, method in methods.items():
        if name not in present:
            registry.register(method)
