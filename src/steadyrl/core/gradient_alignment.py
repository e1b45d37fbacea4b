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

A gradient is one vector, given either flat (``[P]``) or as its parts (a sequence of tensors, e.g. one per parameter,
whose concatenation is the vector): the parts form never builds the flat copy. Every rule above reduces to
g ← a·g − k·(g_prev/max|g_prev|) with 0-d coefficients (:func:`gac_coefficients`), which :func:`gac_project_`
applies to the parts in place (the optimizer-step hook :class:`steadyrl.control.gac.GradientAlignmentController`
uses it) and :func:`gac_project` to a copy. Products and sums run in float32 at least (float64 stays float64), one
part at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from steadyrl.core.importance_weights import check_choice

SkipAction = Literal["skip", "project"]
SKIP_ACTIONS: tuple[str, ...] = get_args(SkipAction)

#: Cosine above which the aligned component is projected out [reconstructed default].
GAC_TAU_PROJ: float = 0.3
#: Cosine above which the step is skipped (or fully projected) [reconstructed default].
GAC_TAU_SKIP: float = 0.9
#: Fraction of the aligned component removed in the projection band.
GAC_ALPHA: float = 1.0


#: A gradient vector: flat ``[P]``, or its parts (their concatenation is the vector).
GradParts = Tensor | Sequence[Tensor]


class GACResult(NamedTuple):
    """Result of :func:`gac_project`: the gradient to apply, the cosine, and which branch was taken (0-d bools)."""

    grad: Float[Tensor, " P"]
    cos: Float[Tensor, ""]
    projected: Bool[Tensor, ""]
    skipped: Bool[Tensor, ""]


class GACCoefficients(NamedTuple):
    """The rule of the module docstring as g ← ``keep``·g − ``k_prev``·(g_prev/``prev_scale``) (0-d tensors), and
    what it decided. ``prev_scale`` = max |g_prev| (1 for a zero g_prev): g_prev is rescaled before it is multiplied,
    so no coefficient overflows whatever the two gradients' magnitudes."""

    keep: Float[Tensor, ""]
    k_prev: Float[Tensor, ""]
    prev_scale: Float[Tensor, ""]
    cos: Float[Tensor, ""]
    projected: Bool[Tensor, ""]
    skipped: Bool[Tensor, ""]


def _parts(x: GradParts) -> list[Tensor]:
    return [x] if isinstance(x, Tensor) else list(x)


def _compute_dtype(parts: Sequence[Tensor]) -> torch.dtype:
    dtype = torch.float32
    for p in parts:
        dtype = torch.promote_types(dtype, p.dtype)
    return dtype


def _max_abs(parts: Sequence[Tensor], dtype: torch.dtype) -> Float[Tensor, ""]:
    """max |x| over all parts (0 for an empty vector)."""
    peaks = [p.detach().abs().amax().to(dtype) for p in parts if p.numel()]
    return torch.stack(peaks).amax() if peaks else torch.zeros((), dtype=dtype)


def _scaled_dot(a: Sequence[Tensor], sa: Tensor, b: Sequence[Tensor], sb: Tensor, dtype: torch.dtype) -> Tensor:
    """⟨a/sa, b/sb⟩ summed part by part (parts upcast to ``dtype`` one at a time)."""
    total = torch.zeros((), dtype=dtype, device=sa.device)
    for x, y in zip(a, b, strict=True):
        total = total + ((x.detach().to(dtype) / sa) * (y.detach().to(dtype) / sb)).sum()
    return total


class _Stats(NamedTuple):
    dot: Tensor  # ⟨a/sa, b/sb⟩
    na: Tensor  # ‖a/sa‖
    nb: Tensor  # ‖b/sb‖
    sb: Tensor  # max|b| (1 where b = 0)
    nonzero_a: Tensor
    nonzero_b: Tensor


def _stats(a: Sequence[Tensor], b: Sequence[Tensor]) -> _Stats:
    """Dot product and norms of a and b after dividing each by its max |x| (so ‖x‖² cannot overflow)."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        raise ValueError("the two gradients have different shapes (parts of different parameters?)")
    dtype = _compute_dtype([*a, *b])
    sa, sb = _max_abs(a, dtype), _max_abs(b, dtype)
    if a:
        sa, sb = sa.to(a[0].device), sb.to(a[0].device)
    nonzero_a, nonzero_b = sa > 0, sb > 0
    sa = torch.where(nonzero_a, sa, torch.ones_like(sa))
    sb = torch.where(nonzero_b, sb, torch.ones_like(sb))
    dot = _scaled_dot(a, sa, b, sb, dtype)
    na = _scaled_dot(a, sa, a, sa, dtype).sqrt()
    nb = _scaled_dot(b, sb, b, sb, dtype).sqrt()
    return _Stats(dot, na, nb, sb, nonzero_a, nonzero_b)


def _cosine(st: _Stats) -> Tensor:
    usable = st.nonzero_a & st.nonzero_b
    denom = torch.where(usable, st.na * st.nb, torch.ones_like(st.na))
    return torch.where(usable, st.dot / denom, torch.zeros_like(st.dot)).clamp(min=-1.0, max=1.0)


def grad_cosine(*, a: GradParts, b: GradParts) -> Float[Tensor, ""]:
    """cos(a, b) = ⟨a, b⟩ / (‖a‖‖b‖), 0 when either vector is zero; overflow-safe (vectors are rescaled first).

    ======  ========================  ===========================================================
    ``a``   [P] or parts              gradient, flat or as its parts (detached here)
    ``b``   [P] or parts              the other gradient, in the same form and part shapes
    ======  ========================  ===========================================================
    """
    return _cosine(_stats(_parts(a), _parts(b)))


def _check_options(tau_proj: float, tau_skip: float, alpha: float, skip_action: str) -> None:
    check_choice("skip_action", skip_action, SKIP_ACTIONS)
    if tau_proj > tau_skip:
        raise ValueError(f"tau_proj ({tau_proj}) must not exceed tau_skip ({tau_skip})")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")


def gac_coefficients(
    *,
    grad: GradParts,
    prev_grad: GradParts | None,
    tau_proj: float = GAC_TAU_PROJ,
    tau_skip: float = GAC_TAU_SKIP,
    alpha: float = GAC_ALPHA,
    skip_action: SkipAction | str = "skip",
) -> GACCoefficients:
    """The GAC step as g ← keep·g − k_prev·(g_prev/prev_scale) (module docstring), without touching ``grad``.

    With u = g_prev/‖g_prev‖ = (g_prev/s)/‖g_prev/s‖ (s = max |g_prev|): the projection g − β·max(0, ⟨g, u⟩)·u is
    keep = 1, k_prev = β·max(0, ⟨g, u⟩)/‖g_prev/s‖ (β = α in the band, 1 for a full projection); a skip is keep = 0,
    k_prev = 0; no change is keep = 1, k_prev = 0.
    """
    _check_options(tau_proj, tau_skip, alpha, skip_action)
    g = _parts(grad)
    device = g[0].device if g else torch.device("cpu")
    dtype = _compute_dtype(g)
    one = torch.ones((), dtype=dtype, device=device)
    false = torch.zeros((), dtype=torch.bool, device=device)
    if prev_grad is None:
        return GACCoefficients(one, torch.zeros_like(one), one, torch.zeros_like(one), false, false)
    st = _stats(g, _parts(prev_grad))
    c = _cosine(st)
    usable = st.nonzero_a & st.nonzero_b
    # ⟨g, u⟩ = ⟨g/sa, g_prev/sb⟩·sa/‖g_prev/sb‖, so max(0, ⟨g, u⟩)/‖g_prev/sb‖ = max(0, dot)·sa/‖g_prev/sb‖²
    nb = torch.where(usable, st.nb, torch.ones_like(st.nb))
    sa = _max_abs(g, dtype).to(device)
    along = st.dot.clamp(min=0.0) * sa / (nb * nb)
    band = usable & (c > tau_proj) & (c <= tau_skip)
    over = usable & (c > tau_skip)
    skipped = over & (skip_action == "skip")
    projected = band | (over & (skip_action == "project"))
    beta = torch.where(band, alpha * one, one)
    k_prev = torch.where(projected, beta * along, torch.zeros_like(along))
    keep = torch.where(skipped, torch.zeros_like(one), one)
    return GACCoefficients(keep, k_prev, st.sb, c, projected, skipped)


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
    out ``grad``     [P]    the gradient to apply (a new tensor)
    out ``cos``      []     c = cos(g_t, g_prev) (0 without a usable g_prev)
    ===============  =====  ========================================================
    """
    co = gac_coefficients(
        grad=grad, prev_grad=prev_grad, tau_proj=tau_proj, tau_skip=tau_skip, alpha=alpha, skip_action=skip_action
    )
    g = grad.detach()
    if prev_grad is None:
        return GACResult(grad=g, cos=co.cos.to(g.dtype), projected=co.projected, skipped=co.skipped)
    dtype = _compute_dtype([g, prev_grad])
    out = co.keep * g.to(dtype) - co.k_prev * (prev_grad.detach().to(dtype) / co.prev_scale)
    return GACResult(grad=out.to(g.dtype), cos=co.cos.to(g.dtype), projected=co.projected, skipped=co.skipped)


def gac_project_(
    grad: Sequence[Tensor],
    prev_grad: Sequence[Tensor] | None,
    *,
    tau_proj: float = GAC_TAU_PROJ,
    tau_skip: float = GAC_TAU_SKIP,
    alpha: float = GAC_ALPHA,
    skip_action: SkipAction | str = "skip",
) -> GACCoefficients:
    """:func:`gac_project` on a gradient given as parts (e.g. each parameter's ``.grad``), edited in place.

    No flat copy and no host sync: each part becomes keep·g_p − k_prev·g_prev,p. Returns the coefficients (with the
    cosine and the decisions).
    """
    co = gac_coefficients(
        grad=grad, prev_grad=prev_grad, tau_proj=tau_proj, tau_skip=tau_skip, alpha=alpha, skip_action=skip_action
    )
    if prev_grad is None:
        return co
    for g, p in zip(grad, prev_grad, strict=True):
        dtype = torch.promote_types(g.dtype, co.k_prev.dtype)
        update = co.keep * g.to(dtype) - co.k_prev * (p.detach().to(dtype) / co.prev_scale)
        g.copy_(update)  # one part's transient at a time, written back in the gradient's dtype
    return co
