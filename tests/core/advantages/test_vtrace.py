"""V-trace and COPC advantages against float64 loops written from docs/algorithms.md / IMPALA Eq. (1)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.advantages.vtrace import copc_advantages, vtrace

NAN = float("nan")


def _rows(x: torch.Tensor, mask: torch.Tensor) -> list[tuple[list[int], list[float]]]:
    """Per row: the columns of its trained tokens and x at them (the trajectory of the module's convention)."""
    out = []
    for i in range(mask.shape[0]):
        cols = [t for t in range(mask.shape[1]) if mask[i, t]]
        out.append((cols, [float(x[i, t]) for t in cols]))
    return out


def _ref_vtrace(
    r: torch.Tensor, V: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor, boot: torch.Tensor, *, gamma: float,
    lam: float, rho_bar: float, c_bar: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = mask.shape
    vs_out = torch.zeros(B, T, dtype=torch.float64)
    adv_out = torch.zeros(B, T, dtype=torch.float64)
    for i, ((cols, rr), (_, vv), (_, ll)) in enumerate(zip(_rows(r, mask), _rows(V, mask), _rows(lr, mask),
                                                          strict=True)):
        n = len(cols)
        vv = [*vv, float(boot[i])]  # V past the last trained token: bootstrap
        ratio = [math.exp(max(-20.0, min(20.0, x))) for x in ll]
        rho = [min(rho_bar, x) for x in ratio]
        c = [lam * min(c_bar, x) for x in ratio]
        vs = []
        for s in range(n):  # v_s = V_s + Σ_{t≥s} γ^{t−s} (Π_{i=s}^{t−1} c_i) ρ_t (r_t + γ V_{t+1} − V_t)
            total = vv[s]
            for t in range(s, n):
                prod = math.prod(c[s:t])
                total += gamma ** (t - s) * prod * rho[t] * (rr[t] + gamma * vv[t + 1] - vv[t])
            vs.append(total)
        vs_ext = [*vs, float(boot[i])]
        for s, col in enumerate(cols):
            vs_out[i, col] = vs[s]
            adv_out[i, col] = rho[s] * (rr[s] + gamma * vs_ext[s + 1] - vv[s])  # ρ_s (r_s + γ v_{s+1} − V_s)
    return vs_out, adv_out


def _ref_copc(
    r: torch.Tensor, V: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
    rho_min: float, rho_max: float,
) -> torch.Tensor:
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for i, ((cols, rr), (_, vv), (_, ll)) in enumerate(zip(_rows(r, mask), _rows(V, mask), _rows(lr, mask),
                                                          strict=True)):
        n = len(cols)
        vv = [*vv, 0.0]  # terminal
        rb = [min(rho_max, max(rho_min, math.exp(max(-20.0, min(20.0, x))))) for x in ll]
        delta = [rr[t] + gamma * vv[t + 1] - vv[t] for t in range(n)]
        for s, col in enumerate(cols):  # Â_s = Σ_k (γλ)^k ρ̄_{s+k} δ_{s+k}
            out[i, col] = sum((gamma * lam) ** k * rb[s + k] * delta[s + k] for k in range(n - s))
    return out


def _inputs(seed: int, B: int = 5, T: int = 9, log_scale: float = 0.7) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.75  # holes inside responses: skipped tokens
    mask[0] = False  # an empty response
    mask[2, 5:] = False  # a short one
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    V = torch.randn(B, T, generator=g, dtype=torch.float64)
    lr = torch.randn(B, T, generator=g, dtype=torch.float64) * log_scale
    boot = torch.randn(B, generator=g, dtype=torch.float64)
    for x in (r, V, lr):
        x.masked_fill_(~mask, NAN)  # garbage outside the mask must not leak
    return r, V, lr, mask, boot


@pytest.mark.parametrize(
    ("gamma", "lam", "rho_bar", "c_bar"),
    [(1.0, 1.0, 1.0, 1.0), (0.9, 1.0, 2.0, 0.5), (0.95, 0.8, 1.5, 1.2), (0.0, 1.0, 1.0, 1.0)],
)
def test_vtrace_matches_reference(gamma: float, lam: float, rho_bar: float, c_bar: float) -> None:
    for seed in range(3):
        r, V, lr, mask, boot = _inputs(seed)
        out = vtrace(rewards=r, values=V, log_rhos=lr, mask=mask, bootstrap=boot, gamma=gamma, lam=lam,
                     rho_bar=rho_bar, c_bar=c_bar)
        vs, adv = _ref_vtrace(r, V, lr, mask, boot, gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
        torch.testing.assert_close(out.vs, vs, atol=1e-10, rtol=0)
        torch.testing.assert_close(out.advantages, adv, atol=1e-10, rtol=0)
        assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize(("gamma", "lam", "rho_min", "rho_max"), [(1.0, 1.0, 0.5, 1.0), (0.9, 0.7, 0.8, 1.3)])
def test_copc_matches_reference(gamma: float, lam: float, rho_min: float, rho_max: float) -> None:
    for seed in range(3):
        r, V, lr, mask, _ = _inputs(seed)
        out = copc_advantages(rewards=r, values=V, log_rhos=lr, mask=mask, gamma=gamma, lam=lam, rho_min=rho_min,
                              rho_max=rho_max)
        ref = _ref_copc(r, V, lr, mask, gamma=gamma, lam=lam, rho_min=rho_min, rho_max=rho_max)
        torch.testing.assert_close(out.advantages, ref, atol=1e-10, rtol=0)
        torch.testing.assert_close(out.returns, torch.where(mask, V + ref, 0.0), atol=1e-10, rtol=0)


def test_on_policy_vtrace_is_the_discounted_return() -> None:
    """ρ = 1, c̄ = ρ̄ = 1, λ = 1: v_t = Σ_k γ^k r_{t+k} + γ^{n−t} bootstrap, A_t = v_t − V_t (TD(1))."""
    r, V, _, mask, boot = _inputs(11)
    gamma = 0.9
    out = vtrace(rewards=r, values=V, log_rhos=torch.zeros_like(r), mask=mask, bootstrap=boot, gamma=gamma)
    for i, ((cols, rr), (_, vv)) in enumerate(zip(_rows(r, mask), _rows(V, mask), strict=True)):
        ret = float(boot[i])
        for s in range(len(cols) - 1, -1, -1):
            ret = rr[s] + gamma * ret
            assert out.vs[i, cols[s]].item() == pytest.approx(ret, abs=1e-12)
            assert out.advantages[i, cols[s]].item() == pytest.approx(ret - vv[s], abs=1e-12)


@given(seed=st.integers(0, 2**31 - 1), gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0))
def test_on_policy_vtrace_equals_copc_with_unit_clip_equals_gae(seed: int, gamma: float, lam: float) -> None:
    r, V, lr, mask, _ = _inputs(seed % 10_000)
    zero = torch.zeros(mask.shape[0], dtype=torch.float64)
    vt = vtrace(rewards=r, values=V, log_rhos=torch.zeros_like(r), mask=mask, bootstrap=zero, gamma=gamma, lam=lam)
    huge = torch.where(mask, lr * 1000.0, lr)  # any ratio: ρ̄ is clipped to [1, 1]
    copc = copc_advantages(rewards=r, values=V, log_rhos=huge, mask=mask, gamma=gamma, lam=lam, rho_min=1.0,
                           rho_max=1.0)
    gae = _ref_copc(r, V, torch.zeros_like(r), mask, gamma=gamma, lam=lam, rho_min=1.0, rho_max=1.0)
    torch.testing.assert_close(copc.advantages, gae, atol=1e-10, rtol=0)
    torch.testing.assert_close(vt.vs - torch.where(mask, V, 0.0), gae, atol=1e-10, rtol=0)


@given(seed=st.integers(0, 2**31 - 1))
def test_copc_clip_is_inactive_inside_the_range_and_saturates_outside(seed: int) -> None:
    r, V, _, mask, _ = _inputs(seed % 10_000)
    g = torch.Generator().manual_seed(seed)
    inside = torch.empty_like(r).uniform_(math.log(0.5), 0.0, generator=g)  # ρ ∈ [0.5, 1]
    clipped = copc_advantages(rewards=r, values=V, log_rhos=inside, mask=mask, rho_min=0.5, rho_max=1.0)
    free = copc_advantages(rewards=r, values=V, log_rhos=inside, mask=mask, rho_min=0.0, rho_max=math.inf)
    torch.testing.assert_close(clipped.advantages, free.advantages, atol=1e-12, rtol=0)
    assert clipped.metrics["adv/rho_clipped_low_frac"] == 0 and clipped.metrics["adv/rho_clipped_high_frac"] == 0
    above = inside + 5.0  # every ρ > ρ_max: ρ̄ = ρ_max everywhere, Â = ρ_max · GAE
    sat = copc_advantages(rewards=r, values=V, log_rhos=above, mask=mask, rho_min=0.5, rho_max=1.0)
    unit = copc_advantages(rewards=r, values=V, log_rhos=above, mask=mask, rho_min=1.0, rho_max=1.0)
    torch.testing.assert_close(sat.advantages, unit.advantages, atol=1e-12, rtol=0)
    assert sat.metrics["adv/rho_clipped_high_frac"].item() == pytest.approx(1.0) or not mask.any()


@given(seed=st.integers(0, 2**31 - 1), sign=st.sampled_from([1.0, -1.0]))
def test_huge_log_ratios_give_finite_targets(seed: int, sign: float) -> None:
    r, V, lr, mask, boot = _inputs(seed % 10_000)
    lr = sign * 1000.0 + lr
    out = vtrace(rewards=r, values=V, log_rhos=lr, mask=mask, bootstrap=boot, gamma=0.99, rho_bar=2.0, c_bar=1.0)
    copc = copc_advantages(rewards=r, values=V, log_rhos=lr, mask=mask)
    for x in (out.vs, out.advantages, copc.advantages, copc.returns, *out.metrics.values(), *copc.metrics.values()):
        assert torch.isfinite(x).all()


def test_masked_out_tokens_inside_a_response_are_skipped() -> None:
    """Spreading a response's trained tokens apart with garbage-filled masked-out columns changes nothing."""
    r, V, lr, _, boot = _inputs(3, B=4, T=5)
    full = torch.ones(4, 5, dtype=torch.bool)
    r, V, lr = (torch.nan_to_num(x, nan=0.3) for x in (r, V, lr))
    spread_cols = [0, 2, 3, 6, 8]
    spread_mask = torch.zeros(4, 9, dtype=torch.bool)
    spread_mask[:, spread_cols] = True

    def spread(x: torch.Tensor) -> torch.Tensor:
        out = torch.full((4, 9), NAN, dtype=torch.float64)
        out[:, spread_cols] = x
        return out

    kw = {"gamma": 0.9, "lam": 0.8}
    a = vtrace(rewards=r, values=V, log_rhos=lr, mask=full, bootstrap=boot, rho_bar=1.5, **kw)
    b = vtrace(rewards=spread(r), values=spread(V), log_rhos=spread(lr), mask=spread_mask, bootstrap=boot,
               rho_bar=1.5, **kw)
    torch.testing.assert_close(b.vs[:, spread_cols], a.vs, atol=1e-12, rtol=0)
    torch.testing.assert_close(b.advantages[:, spread_cols], a.advantages, atol=1e-12, rtol=0)
    assert torch.equal(b.vs[~spread_mask], torch.zeros(4 * 4, dtype=torch.float64))
    c = copc_advantages(rewards=r, values=V, log_rhos=lr, mask=full, **kw)
    d = copc_advantages(rewards=spread(r), values=spread(V), log_rhos=spread(lr), mask=spread_mask, **kw)
    torch.testing.assert_close(d.advantages[:, spread_cols], c.advantages, atol=1e-12, rtol=0)


def test_fully_masked_batch_gives_zeros_and_outputs_are_detached() -> None:
    r, V, lr, _, boot = _inputs(2)
    V = torch.nan_to_num(V).requires_grad_(True)
    lr = torch.nan_to_num(lr).requires_grad_(True)
    none = torch.zeros_like(r, dtype=torch.bool)
    out = vtrace(rewards=r, values=V, log_rhos=lr, mask=none, bootstrap=boot)
    copc = copc_advantages(rewards=r, values=V, log_rhos=lr, mask=none)
    for x in (out.vs, out.advantages, copc.advantages, copc.returns):
        assert torch.equal(x, torch.zeros_like(x)) and not x.requires_grad
    assert all(v.item() == 0.0 for v in (*out.metrics.values(), *copc.metrics.values()))
    some = vtrace(rewards=torch.nan_to_num(r), values=V, log_rhos=lr, mask=torch.ones_like(none), bootstrap=boot)
    assert not some.vs.requires_grad and not some.advantages.requires_grad


def test_scalar_bootstrap_and_bad_arguments() -> None:
    r, V, lr, mask, _ = _inputs(4)
    a = vtrace(rewards=r, values=V, log_rhos=lr, mask=mask, bootstrap=0.5, gamma=0.9)
    b = vtrace(rewards=r, values=V, log_rhos=lr, mask=mask, bootstrap=torch.full((5,), 0.5, dtype=torch.float64),
               gamma=0.9)
    assert torch.equal(a.vs, b.vs)
    with pytest.raises(ValueError, match="gamma"):
        vtrace(rewards=r, values=V, log_rhos=lr, mask=mask, gamma=1.5)
    with pytest.raises(ValueError, match="rho_bar"):
        vtrace(rewards=r, values=V, log_rhos=lr, mask=mask, rho_bar=0.0)
    with pytest.raises(ValueError, match="rho_min"):
        copc_advantages(rewards=r, values=V, log_rhos=lr, mask=mask, rho_min=2.0, rho_max=1.0)
