"""A-3PO's log-linear proximal policy (arXiv 2512.06547; AReaL ``prox_logp_method=loglinear``) against a float64
reference written from the formula with Python loops."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.proximal import loglinear_prox_logp

DT = torch.float64


def reference(logp, behav, versions, v_theta, mask):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            v = int(versions[i, t])
            alpha = 0.0
            if v >= 0 and v_theta - v > 0:
                alpha = min(max((v_theta - 1 - v) / (v_theta - v), 0.0), 1.0)
            out[i, t] = behav[i, t] + alpha * (logp[i, t] - behav[i, t])
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v_theta=st.integers(0, 9), B=st.integers(1, 4), T=st.integers(1, 6))
def test_matches_the_formula(seed: int, v_theta: int, B: int, T: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=DT) * 3).requires_grad_(True)
    behav = logp.detach() + torch.randn(B, T, generator=g, dtype=DT)
    versions = torch.randint(-1, 10, (B, T), generator=g)  # −1: no generation version (AReaL's prompt tokens)
    mask = torch.rand(B, T, generator=g) > 0.3
    garbage_logp = torch.where(mask, logp, torch.nan)
    garbage_behav = torch.where(mask, behav, torch.inf)
    out = loglinear_prox_logp(
        logp=garbage_logp, behav_logp=garbage_behav, versions=versions, learner_version=v_theta, mask=mask
    )
    torch.testing.assert_close(out.prox_logp, reference(logp.detach(), behav, versions, v_theta, mask), rtol=0,
                               atol=1e-12)  # fmt: skip
    assert not out.prox_logp.requires_grad and torch.isfinite(out.prox_logp).all()
    assert ((out.alpha >= 0) & (out.alpha <= 1)).all()


def test_fresh_tokens_take_mu_and_stale_ones_move_toward_pi_theta() -> None:
    logp, behav = torch.full((1, 4), -1.0, dtype=DT), torch.full((1, 4), -3.0, dtype=DT)
    versions = torch.tensor([[10, 9, 8, 6]])  # lag 0, 1, 2, 4 at v_θ = 10
    out = loglinear_prox_logp(logp=logp, behav_logp=behav, versions=versions, learner_version=10,
                              mask=torch.ones(1, 4, dtype=torch.bool))  # fmt: skip
    torch.testing.assert_close(out.alpha, torch.tensor([[0.0, 0.0, 0.5, 0.75]], dtype=DT))
    torch.testing.assert_close(out.prox_logp, torch.tensor([[-3.0, -3.0, -2.0, -1.5]], dtype=DT))
    assert out.metrics["a3po/interpolated_frac"].item() == 0.5
