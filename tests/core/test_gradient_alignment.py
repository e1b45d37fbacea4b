"""GAC projection rule (arXiv 2603.01501, reconstructed) against a float64 reference written from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.gradient_alignment import GAC_TAU_PROJ, GAC_TAU_SKIP, gac_project, grad_cosine


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _ref_gac(g, p, tau_proj, tau_skip, alpha, skip_action):
    """(grad, cos, projected, skipped) from the rule, with plain Python floats."""
    ng, npv = math.sqrt(_dot(g, g)), math.sqrt(_dot(p, p))
    if ng == 0 or npv == 0:
        return list(g), 0.0, False, False
    u = [x / npv for x in p]
    c = _dot(g, p) / (ng * npv)
    a = max(0.0, _dot(g, u))
    if c <= tau_proj:
        return list(g), c, False, False
    if c <= tau_skip:
        return [gi - alpha * a * ui for gi, ui in zip(g, u, strict=True)], c, True, False
    if skip_action == "skip":
        return [0.0] * len(g), c, False, True
    return [gi - a * ui for gi, ui in zip(g, u, strict=True)], c, True, False


def _pair(seed: int, P: int, target_cos: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float64 vectors whose cosine is target_cos."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(P, generator=gen, dtype=torch.float64)
    q = torch.randn(P, generator=gen, dtype=torch.float64)
    q = q - (q @ p) / (p @ p) * p  # orthogonal to p
    g = target_cos * p / p.norm() + math.sqrt(1 - target_cos**2) * q / q.norm()
    return 3.0 * g, p


@pytest.mark.parametrize("target", [-0.8, 0.0, 0.2, 0.5, 0.85, 0.95, 0.999])
@pytest.mark.parametrize("skip_action", ["skip", "project"])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_gac_matches_reference(target: float, skip_action: str, alpha: float) -> None:
    g, p = _pair(seed=int(target * 1000) % 97, P=50, target_cos=target)
    out = gac_project(grad=g, prev_grad=p, tau_proj=0.3, tau_skip=0.9, alpha=alpha, skip_action=skip_action)
    ref_g, ref_c, ref_proj, ref_skip = _ref_gac(g.tolist(), p.tolist(), 0.3, 0.9, alpha, skip_action)
    assert abs(float(out.cos) - ref_c) < 1e-12
    assert abs(ref_c - target) < 1e-12
    assert torch.allclose(out.grad, torch.tensor(ref_g, dtype=torch.float64), atol=1e-12, rtol=0)
    assert bool(out.projected) == ref_proj and bool(out.skipped) == ref_skip


def test_orthogonal_gradient_unchanged() -> None:
    g = torch.tensor([1.0, 0.0, 0.0, 2.0])
    p = torch.tensor([0.0, 3.0, -1.0, 0.0])
    out = gac_project(grad=g, prev_grad=p, tau_proj=-0.5, tau_skip=0.9)  # even when orthogonal is in the band
    assert torch.equal(out.grad, g)
    assert float(out.cos) == 0.0


def test_projection_removes_aligned_component() -> None:
    g, p = _pair(seed=1, P=30, target_cos=0.6)
    out = gac_project(grad=g, prev_grad=p)  # defaults: 0.6 lies in (τ_proj, τ_skip]
    assert GAC_TAU_PROJ < 0.6 <= GAC_TAU_SKIP
    assert bool(out.projected) and not bool(out.skipped)
    assert abs(float(out.grad @ p)) < 1e-10  # α = 1: nothing left along g_prev
    assert abs(float(grad_cosine(a=out.grad, b=p))) < 1e-10


def test_skip_zeroes_the_gradient() -> None:
    g, p = _pair(seed=2, P=20, target_cos=0.97)
    out = gac_project(grad=g, prev_grad=p)
    assert bool(out.skipped) and not bool(out.projected)
    assert torch.equal(out.grad, torch.zeros_like(g))


def test_missing_or_zero_previous_gradient() -> None:
    g = torch.randn(10)
    for prev in (None, torch.zeros(10)):
        out = gac_project(grad=g, prev_grad=prev, tau_proj=-1.0, tau_skip=-1.0)
        assert torch.equal(out.grad, g)
        assert float(out.cos) == 0.0 and not bool(out.projected) and not bool(out.skipped)
    zero = gac_project(grad=torch.zeros(10), prev_grad=g, tau_proj=-1.0, tau_skip=-1.0)
    assert torch.equal(zero.grad, torch.zeros(10)) and not bool(zero.skipped)


def test_grad_cosine_reference_and_overflow_safety() -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(40, generator=gen, dtype=torch.float64)
    b = torch.randn(40, generator=gen, dtype=torch.float64)
    ref = _dot(a.tolist(), b.tolist()) / math.sqrt(_dot(a.tolist(), a.tolist()) * _dot(b.tolist(), b.tolist()))
    assert abs(float(grad_cosine(a=a, b=b)) - ref) < 1e-12
    big = grad_cosine(a=(a * 1e30).float(), b=(b * 1e-30).float())  # ‖a‖² overflows float32 without rescaling
    assert torch.isfinite(big) and abs(float(big) - ref) < 1e-5


@given(seed=st.integers(0, 2**16), P=st.integers(2, 64), scale=st.sampled_from([1e-20, 1.0, 1e20]))
def test_gac_never_increases_alignment_and_is_finite(seed: int, P: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(P, generator=gen)
    g = scale * (torch.randn(P, generator=gen) + 2.0 * p)
    out = gac_project(grad=g, prev_grad=p, skip_action="project")
    assert torch.isfinite(out.grad).all() and torch.isfinite(out.cos)
    assert -1.0 <= float(out.cos) <= 1.0
    assert float(grad_cosine(a=out.grad, b=p)) <= max(float(out.cos), GAC_TAU_PROJ) + 1e-5


def test_gac_bad_options() -> None:
    g = torch.randn(4)
    with pytest.raises(ValueError, match="tau_proj"):
        gac_project(grad=g, prev_grad=g, tau_proj=0.9, tau_skip=0.5)
    with pytest.raises(ValueError, match="alpha"):
        gac_project(grad=g, prev_grad=g, alpha=1.5)
    with pytest.raises(ValueError, match="skip_action"):
        gac_project(grad=g, prev_grad=g, skip_action="halve")


@pytest.mark.parametrize("target", [-0.5, 0.6, 0.95])
@pytest.mark.parametrize("skip_action", ["skip", "project"])
def test_parts_in_place_equal_the_flat_rule(target: float, skip_action: str) -> None:
    """The per-parameter form (no flat copy, edited in place) is the flat rule on the concatenation (float64)."""
    from steadyrl.core.gradient_alignment import gac_project_

    g, p = _pair(seed=5, P=60, target_cos=target)
    sizes = [7, 20, 1, 32]
    flat = gac_project(grad=g, prev_grad=p, alpha=0.7, skip_action=skip_action)
    parts = [t.clone().view(-1, 1) for t in g.split(sizes)]
    prev_parts = [t.view(-1, 1) for t in p.split(sizes)]
    co = gac_project_(parts, prev_parts, alpha=0.7, skip_action=skip_action)
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in parts]), flat.grad, atol=1e-12, rtol=0)
    assert abs(float(co.cos) - float(flat.cos)) < 1e-12
    assert bool(co.skipped) == bool(flat.skipped) and bool(co.projected) == bool(flat.projected)
    assert abs(float(grad_cosine(a=[t.view(-1) for t in g.split(sizes)], b=p.split(sizes))) - target) < 1e-12


def test_parts_with_opposite_extreme_scales_stay_finite() -> None:
    """g ~ 1e30 and g_prev ~ 1e-30 in float32: the coefficients never overflow (g_prev is rescaled first)."""
    from steadyrl.core.gradient_alignment import gac_project_

    g, p = _pair(seed=6, P=30, target_cos=0.6)
    parts = [(g * 1e30).float()]
    co = gac_project_(parts, [(p * 1e-30).float()])
    assert bool(co.projected) and torch.isfinite(parts[0]).all()
    ref = gac_project(grad=g, prev_grad=p)
    torch.testing.assert_close(parts[0].double() / 1e30, ref.grad, rtol=1e-4, atol=1e-5)
