"""KL estimators (mismatch and reference penalty) and KL-in-reward against float64 loop references."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.kl import kl_in_reward, last_token_mask, mismatch_kl, reference_kl

ATOL = 1e-10


def _batch(seed: int = 0, B: int = 5, T: int = 7, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    y = scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False
    mask[1, -1] = True
    nan = torch.full_like(x, float("nan"))
    return torch.where(mask, x, nan), torch.where(mask, y, nan), mask


def _ref_mismatch(x: float, convention: str) -> tuple[float, float, float]:
    if convention == "verl":
        return -x, x * x / 2, math.exp(x) - x - 1
    return x, x * x / 2, math.exp(-x) - 1 + x


@pytest.mark.parametrize("convention", ["verl", "areal"])
def test_mismatch_kl_matches_reference(convention: str) -> None:
    ell, _, mask = _batch(seed=1, scale=1.5)
    out = mismatch_kl(log_ratio=ell, mask=mask, convention=convention)
    B, T = mask.shape
    sums = [0.0, 0.0, 0.0]
    n = 0
    for i in range(B):
        for t in range(T):
            got = (float(out.k1[i, t]), float(out.k2[i, t]), float(out.k3[i, t]))
            if not mask[i, t]:
                assert got == (0.0, 0.0, 0.0)
                continue
            ref = _ref_mismatch(float(ell[i, t]), convention)
            for j in range(3):
                assert abs(got[j] - ref[j]) < ATOL
                sums[j] += ref[j]
            n += 1
    for j, key in enumerate(("kl/k1", "kl/k2", "kl/k3")):
        assert abs(float(out.metrics[key]) - sums[j] / n) < ATOL


def test_mismatch_conventions_differ_on_outlier() -> None:
    """docs/algorithms.md: on an outlier token the verl and AReaL k3 differ by more than 10×."""
    ell = torch.tensor([[4.0]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    verl = mismatch_kl(log_ratio=ell, mask=mask).k3
    areal = mismatch_kl(log_ratio=ell, mask=mask, convention="areal").k3
    assert float(verl / areal) > 10
    assert float(mismatch_kl(log_ratio=ell, mask=mask).k1) == -4.0


@given(seed=st.integers(0, 2**16), sign=st.sampled_from([-1.0, 1.0]), convention=st.sampled_from(["verl", "areal"]))
def test_mismatch_kl_finite_at_huge_log_ratios(seed: int, sign: float, convention: str) -> None:
    g = torch.Generator().manual_seed(seed)
    ell = sign * 1000.0 * (torch.rand(3, 4, generator=g) > 0.5).float()
    out = mismatch_kl(log_ratio=ell, mask=torch.ones(3, 4, dtype=torch.bool), convention=convention)
    for v in (out.k1, out.k2, out.k3, *out.metrics.values()):
        assert torch.isfinite(v).all()
    assert (out.k3 >= 0).all()


def test_mismatch_kl_on_policy_is_zero() -> None:
    out = mismatch_kl(log_ratio=torch.zeros(2, 3), mask=torch.ones(2, 3))
    assert all(float(v) == 0.0 for v in out.metrics.values())


# ---------------------------------------------------------------------------------------------------- reference


def _ref_penalty(lp: float, rf: float, kind: str, clamp: float) -> tuple[float, float]:
    """(value, d value / d logp) from the formulas, x = log π_ref − log π_θ."""
    x = rf - lp
    if kind == "k1":
        return lp - rf, 1.0
    if kind == "abs":
        return abs(lp - rf), math.copysign(1.0, lp - rf)
    if kind == "k2":
        return x * x / 2, -x
    k3, dk3 = math.exp(x) - x - 1, 1 - math.exp(x)  # d/dlogp (eˣ − x − 1) = −eˣ + 1
    if kind == "low_var_kl" and abs(k3) > clamp:
        return math.copysign(clamp, k3), 0.0
    return k3, dk3


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "low_var_kl"])
def test_reference_kl_values_and_gradients(kind: str) -> None:
    logp, ref_logp, mask = _batch(seed=2, scale=2.0)
    logp = logp.requires_grad_(True)
    ref_logp = ref_logp.requires_grad_(True)
    clamp = 1.5
    out = reference_kl(logp=logp, ref_logp=ref_logp, mask=mask, kind=kind, clamp=clamp)
    out.kl.sum().backward()
    kl = out.kl.detach()
    assert ref_logp.grad is None or torch.equal(ref_logp.grad, torch.zeros_like(ref_logp))
    B, T = mask.shape
    total, n, clamped = 0.0, 0, 0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                assert float(kl[i, t]) == 0.0 and float(logp.grad[i, t]) == 0.0
                continue
            val, grad = _ref_penalty(float(logp.detach()[i, t]), float(ref_logp.detach()[i, t]), kind, clamp)
            assert abs(float(kl[i, t]) - val) < ATOL
            assert abs(float(logp.grad[i, t]) - grad) < ATOL
            clamped += grad == 0.0
            total += val
            n += 1
    assert abs(float(out.metrics["kl/ref_mean"]) - total / n) < ATOL
    if kind == "low_var_kl":
        assert 0 < clamped < n  # both branches exercised


def _exact_k3(x: float) -> float:
    """eˣ − 1 − x in exact rational arithmetic (x as the float it is; the series to x⁴⁰/40!, below 1e-29 for |x| ≤ 3),
    rounded once to float64."""
    q, term, total = Fraction(x), Fraction(1), Fraction(0)
    for n in range(1, 41):
        term = term * q / n
        if n >= 2:
            total += term
    return float(total)


@pytest.mark.parametrize("convention", ["verl", "areal"])
def test_k3_keeps_its_digits_for_tiny_log_ratios(convention: str) -> None:
    """k3 ≈ x²/2 for |x| ≪ 1: in float32 eˣ − x − 1 rounds eˣ to 1.2e-7 and loses every digit below |x| ~ 5e-4 (and
    goes negative), and expm1(x) − x still loses 2ε/|x|. Against the exact value: float32 within 1e-6 and never
    negative, float64 within 1e-14 (a series cut too early would miss that near |x| = 0.1), both conventions."""
    xs = [1e-6, -3e-6, 2e-5, -7e-5, 1e-4, -4e-4, 1e-3, -2e-3, 0.099, -0.0999, 0.1, -0.15, 0.7, -3.0]
    sign = 1.0 if convention == "verl" else -1.0  # AReaL's k3 is e^{−x} − 1 + x
    x32 = torch.tensor([xs], dtype=torch.float32)
    mask = torch.ones_like(x32, dtype=torch.bool)
    want32 = torch.tensor([[_exact_k3(sign * x) for x in x32[0].tolist()]], dtype=torch.float64)
    got = mismatch_kl(log_ratio=x32, mask=mask, convention=convention).k3
    assert bool((got >= 0).all())
    torch.testing.assert_close(got.double(), want32, rtol=1e-6, atol=0.0)
    ref = reference_kl(logp=torch.zeros_like(x32), ref_logp=sign * x32, mask=mask, kind="k3").kl
    torch.testing.assert_close(ref.double(), want32, rtol=1e-6, atol=0.0)
    want64 = torch.tensor([[_exact_k3(sign * x) for x in xs]], dtype=torch.float64)
    got64 = mismatch_kl(log_ratio=torch.tensor([xs], dtype=torch.float64), mask=mask, convention=convention).k3
    torch.testing.assert_close(got64, want64, rtol=1e-14, atol=0.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs", "low_var_kl"])
def test_reference_kl_finite_grad_at_huge_log_ratio(kind: str) -> None:
    logp = torch.tensor([[0.0, -1000.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1000.0, 0.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    out = reference_kl(logp=logp, ref_logp=ref, mask=mask, kind=kind)
    out.kl.sum().backward()
    assert torch.isfinite(out.kl).all() and torch.isfinite(logp.grad).all()
    assert float(logp.grad[0, 2]) == 0.0


def test_reference_kl_zero_when_policy_equals_reference() -> None:
    logp = torch.randn(3, 4, dtype=torch.float64)
    for kind in ("k1", "k2", "k3", "abs", "low_var_kl"):
        out = reference_kl(logp=logp, ref_logp=logp.clone(), mask=torch.ones(3, 4), kind=kind)
        assert torch.equal(out.kl, torch.zeros_like(logp))


# ---------------------------------------------------------------------------------------------------- KL in reward


def test_last_token_mask() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    assert last_token_mask(mask).tolist() == [
        [False, False, False, True, False],
        [False] * 5,
        [True, False, False, False, False],
    ]


@pytest.mark.parametrize("kind", ["k1", "low_var_kl"])
def test_kl_in_reward_outcome_reward(kind: str) -> None:
    logp, ref_logp, mask = _batch(seed=3)
    logp = logp.requires_grad_(True)
    rewards = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5], dtype=torch.float64)
    beta = 0.1
    out = kl_in_reward(logp=logp, ref_logp=ref_logp, mask=mask, rewards=rewards, beta=beta, kind=kind)
    assert not out.token_rewards.requires_grad
    B, T = mask.shape
    pen_total, n_seq = 0.0, 0
    for i in range(B):
        idx = [t for t in range(T) if mask[i, t]]
        ret, pen = 0.0, 0.0
        for t in range(T):
            if not mask[i, t]:
                assert float(out.token_rewards[i, t]) == 0.0
                continue
            k, _ = _ref_penalty(float(logp.detach()[i, t]), float(ref_logp[i, t]), kind, 10.0)
            r = float(rewards[i]) if t == idx[-1] else 0.0
            expect = r - beta * k  # r_t − β·k_t
            assert abs(float(out.token_rewards[i, t]) - expect) < ATOL
            ret += expect
            pen += beta * k
        assert abs(float(out.returns[i]) - ret) < ATOL
        if idx:
            pen_total += pen
            n_seq += 1
    assert float(out.returns[0]) == 0.0  # empty sequence: its reward has no token to sit on
    assert abs(float(out.metrics["kl/reward_penalty"]) - pen_total / n_seq) < ATOL


def test_kl_in_reward_token_rewards_and_argument_check() -> None:
    logp, ref_logp, mask = _batch(seed=4)
    tok = torch.randn(*mask.shape, dtype=torch.float64)
    out = kl_in_reward(logp=logp, ref_logp=ref_logp, mask=mask, token_rewards=tok, beta=0.0)
    assert torch.allclose(out.token_rewards, torch.where(mask, tok, 0.0), atol=0, rtol=0)
    with pytest.raises(ValueError, match="exactly one"):
        kl_in_reward(logp=logp, ref_logp=ref_logp, mask=mask)
    with pytest.raises(ValueError, match="exactly one"):
        kl_in_reward(logp=logp, ref_logp=ref_logp, mask=mask, rewards=tok[:, 0], token_rewards=tok)
    with pytest.raises(ValueError, match="kind"):
        reference_kl(logp=logp, ref_logp=ref_logp, mask=mask, kind="k4")
    with pytest.raises(ValueError, match="convention"):
        mismatch_kl(log_ratio=logp, mask=mask, convention="trl")
