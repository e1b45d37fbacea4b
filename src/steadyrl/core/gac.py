"""GAC, gradient alignment control (arXiv 2603.01501) [reconstructed]: project out stale-aligned gradient directions.

The paper's signature: under asynchrony, consecutive flattened policy gradients stay aligned (high
c = cos(g_t, g_{t−1})); synchronous training is near-orthogonal. Only the abstract and summaries were available, so
the rule below is our reading, with every uncertain piece a named option:

With u = g_prev / ‖g_prev‖ and c = cos(g, g_prev):

=======================  ==========================================================================
c ≤ τ_proj               g unchanged
τ_proj < c ≤ τ_skip      g ← g − α·max(0, ⟨g, u⟩)·u       (partial projection, α ∈ [0, 1])
c > τ_skip               ``skip_action="skip"``: g ← 0 (skip the step);
                         ``"project"``: g ← g − max(0, ⟨g, u⟩)·u (full projection)
=======================  ==========================================================================

Reconstructed defaults (module constants; sweep them): τ_proj = :data:`GAC_TAU_PROJ` = 0.3 — well above the
near-zero cosine of synchronous training, so on-policy steps pass untouched; τ_skip = :data:`GAC_TAU_SKIP` = 0.9 — a
step that nearly repeats the previous direction; α = 1. Options the caller decides: which g_prev (the raw previous
gradient or the one actually applied), and global (one flattened vector: pass the concatenation) or per-parameter
(call once per parameter tensor, flattened). Always log ``cos``.

No host sync: branches are ``torch.where`` on 0-d tensors. A missing or zero-norm ``prev_grad`` (first step) or a zero
``grad`` gives cos = 0 and leaves the gradient unchanged.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from steadyrl.core.weights import check_choice

SkipAction = Literal["skip", "project"]
SKIP_ACTIONS: tuple[str, ...] = get_args(SkipAction)

#: Cosine above which the aligned component is projected out [reconstructed default].
GAC_TAU_PROJ: float = 0.3
#: Cosine above which the step is skipped (or fully projected) [reconstructed default].
GAC_TAU_SKIP: float = 0.9
#: Fraction of the aligned component removed in the projection band.
GAC_ALPHA: float = 1.0


class GACResult(NamedTuple):
    """Result of :func:`gac_project`: the gradient to apply, the cosine, and which branch was taken (0-d bools)."""

    grad: Float[Tensor, " P"]
    cos: Float[Tensor, ""]
    projected: Bool[Tensor, ""]
    skipped: Bool[Tensor, ""]


class _Unit(NamedTuple):
    vec: Float[Tensor, " P"]
    nonzero: Bool[Tensor, ""]


def _scaled_unit(x: Float[Tensor, " P"]) -> _Unit:
    """x/‖x‖ and ‖x‖ > 0, computed after dividing by max|x| so ‖x‖² cannot overflow; the unit vector is 0 for x = 0."""
    scale = x.abs().amax()
    nonzero = scale > 0
    y = x / torch.where(nonzero, scale, torch.ones_like(scale))
    norm = torch.linalg.vector_norm(y)
    return _Unit(vec=y / torch.where(nonzero, norm, torch.ones_like(norm)), nonzero=nonzero)


def grad_cosine(*, a: Float[Tensor, " P"], b: Float[Tensor, " P"]) -> Float[Tensor, ""]:
    """cos(a, b) = ⟨a, b⟩ / (‖a‖‖b‖), 0 when either vector is zero; overflow-safe (vectors are rescaled first).

    ======  =====  ================================
    ``a``   [P]    flattened gradient (detached here)
    ``b``   [P]    flattened gradient (detached here)
    ======  =====  ================================
    """
    ua = _scaled_unit(a.detach()).vec
    ub = _scaled_unit(b.detach()).vec
    return (ua * ub).sum().clamp(min=-1.0, max=1.0)


def gac_project(
    *,
    grad: Float[Tensor, " P"],
    prev_grad: Float[Tensor, " P"] | None,
    tau_proj: float = GAC_TAU_PROJ,
    tau_skip: float = GAC_TAU_SKIP,
    alpha: float = GAC_ALPHA,
    skip_action: SkipAction | str = "skip",
) -> GACResult:
    """Gradient alignment control step (arXiv 2603.01501) [reconstructed]; the rule is in the module docstring.

    ===============  =====  ========================================================
    ``grad``         [P]    g_t, the flattened current gradient (detached here)
    ``prev_grad``    [P]    g_prev, or None at the first step (then g is unchanged)
    out ``grad``     [P]    the gradient to apply
    out ``cos``      []     c = cos(g_t, g_prev) (0 without a usable g_prev)
    ===============  =====  ========================================================
    """
    check_choice("skip_action", skip_action, SKIP_ACTIONS)
    if tau_proj > tau_skip:
        raise ValueError(f"tau_proj ({tau_proj}) must not exceed tau_skip ({tau_skip})")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    g = grad.detach()
    false = torch.zeros((), dtype=torch.bool, device=g.device)
    if prev_grad is None:
        return GACResult(grad=g, cos=torch.zeros((), dtype=g.dtype, device=g.device), projected=false, skipped=false)
    unit = _scaled_unit(prev_grad.detach())
    u = unit.vec  # u = g_prev / ‖g_prev‖
    c = grad_cosine(a=g, b=prev_grad)
    usable = unit.nonzero & (g.abs().amax() > 0)
    aligned = (g * u).sum().clamp(min=0.0) * u  # max(0, ⟨g, u⟩)·u
    band = usable & (c > tau_proj) & (c <= tau_skip)
    over = usable & (c > tau_skip)
    g_band = g - alpha * aligned  # g − α·max(0, ⟨g, u⟩)·u
    g_over = torch.zeros_like(g) if skip_action == "skip" else g - aligned
    out = torch.where(over, g_over, torch.where(band, g_band, g))
    skipped = over & (skip_action == "skip")
    projected = band | (over & (skip_action == "project"))
    return GACResult(grad=out, cos=c, projected=projected, skipped=skipped)
