"""BAPO against float64 references written from arXiv 2510.18927 (Eq. 8, Algorithm 1, §5 constants) and from the
authors' released recipe (``recipe/bapo/policy_loss.py``: lower bound first, P/N target), plus the properties every
objective must have."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.bapo import (
    BAPO_HIGH_MAX,
    BAPO_HIGH_START,
    BAPO_LOW_MAX,
    BAPO_LOW_START,
    bapo_bounds,
    bapo_loss,
    search_path,
)
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import (
    DT,
    Batch,
    assert_close,
    clamp20,
    dims,
    grad_of,
    make_batch,
    ref_aggregate,
    seeds,
)


def _contributions(b: Batch, c_low: float, c_high: float) -> tuple[float, float]:
    """Eq. 8's two sums by loops: Σ_{A>0} w·A·min(r, c_high) and Σ_{A<0} w·|A|·max(r, c_low)."""
    pos = neg = 0.0
    for i, t in b.mask.nonzero().tolist():
        r = float(torch.exp(clamp20(b.logp.detach()[i, t] - b.prox_logp[i, t])))
        A, w = float(b.adv_tok[i, t]), float(b.weights[i, t])
        if A > 0:
            pos += w * A * min(r, c_high)
        elif A < 0:
            neg += w * -A * max(r, c_low)
    return pos, neg


def _share(pos: float, neg: float) -> float:
    return 1.0 if pos + neg == 0 else pos / (pos + neg)


def _ref_algorithm_1(b: Batch, rho0: float, a_lo=0.6, b_lo=0.9, d_lo=0.02, a_hi=1.2, b_hi=3.0, d_hi=0.05):
    """Algorithm 1, lines 9–17, literally (each addition rounded to 12 decimals, the code's grid convention)."""
    c_low, c_high = a_lo, a_hi
    while _share(*_contributions(b, c_low, c_high)) < rho0 and round(c_low + d_lo, 12) <= b_lo:
        if round(c_high + d_hi, 12) <= b_hi:
            c_high = round(c_high + d_hi, 12)
        else:
            c_low = round(c_low + d_lo, 12)
    return c_low, c_high


def _ref_released(b: Batch, target: float, lo=0.8, lo_max=0.95, lo_step=0.05, hi=1.2, hi_max=2.0, hi_step=0.1):
    """The released recipe's search: raise the lower bound first, then the upper one, until P/(N + 1e-8) ≥ target."""

    def odds(c_low: float, c_high: float) -> float:
        pos, neg = _contributions(b, c_low, c_high)
        return float("inf") if neg <= 0 else pos / (neg + 1e-8)

    while odds(lo, hi) < target and lo < lo_max:
        lo = min(round(lo + lo_step, 12), lo_max)
    while odds(lo, hi) < target and hi < hi_max:
        hi = min(round(hi + hi_step, 12), hi_max)
    return lo, hi


def _ref_ppo(b: Batch, c_low: float, c_high: float, mode: str, dual: float | None = None) -> torch.Tensor:
    B, T = b.mask.shape
    terms = {}
    for i, t in b.mask.nonzero().tolist():
        r = torch.exp(clamp20(b.logp[i, t] - b.prox_logp[i, t]))
        A = float(b.adv_tok[i, t])
        L = torch.maximum(-A * r, -A * torch.clamp(r, c_low, c_high))
        if dual is not None and A < 0:
            L = torch.minimum(L, torch.tensor(-dual * A, dtype=DT))
        terms[(i, t)] = float(b.weights[i, t]) * L
    return ref_aggregate(terms, B, T, mode)


@given(seed=seeds, rho0=st.sampled_from([0.05, 0.3, 0.4, 0.5, 0.7, 0.95]))
@settings(max_examples=40)
def test_bounds_follow_algorithm_1(seed: int, rho0: float) -> None:
    b = make_batch(seed, B=6, T=6, scale=0.8)
    out = bapo_bounds(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, weights=b.weights,
                      target=rho0)  # fmt: skip
    c_low, c_high = _ref_algorithm_1(b, rho0)
    assert_close(out.c_low, c_low, atol=1e-12)
    assert_close(out.c_high, c_high, atol=1e-12)
    assert_close(out.share, _share(*_contributions(b, c_low, c_high)), atol=1e-12)
    met = _share(*_contributions(b, c_low, c_high)) >= rho0
    assert out.metrics["bapo/target_met"].item() == float(met)


@given(seed=seeds, target=st.sampled_from([0.3, 0.5, 1.0, 2.0]))
@settings(max_examples=30)
def test_bounds_follow_the_released_recipe(seed: int, target: float) -> None:
    b = make_batch(seed, B=6, T=6, scale=0.8)
    path = search_path(low_start=0.8, low_max=0.95, low_step=0.05, high_start=1.2, high_max=2.0, high_step=0.1,
                       order="low_first")  # fmt: skip
    out = bapo_bounds(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, weights=b.weights,
                      target=target, balance="odds", path=path)  # fmt: skip
    c_low, c_high = _ref_released(b, target)
    assert_close(out.c_low, c_low, atol=1e-12)
    assert_close(out.c_high, c_high, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("seed", "rho0", "dual"), [(36, 0.5, None), (30, 0.7, None), (36, 0.5, 3.0), (32, 0.5, None)])
def test_loss_is_ppo_clip_at_the_searched_bounds(mode: str, seed: int, rho0: float, dual: float | None) -> None:
    """Seeds chosen so the search stops inside the c_high range (36, 30) or runs to its end (32)."""
    b = make_batch(seed, B=8, T=7, scale=0.8)
    out = bapo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, weights=b.weights,
                    target=rho0, dual_clip=dual, agg=mode)  # fmt: skip
    c_low, c_high = _ref_algorithm_1(b, rho0)
    assert (c_low, c_high) != (BAPO_LOW_START, BAPO_HIGH_START)  # the search moved on this batch
    ref = _ref_ppo(b, c_low, c_high, mode, dual)
    assert_close(out.loss, ref, atol=1e-12)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["bapo/c_high"], c_high, atol=1e-12)
    assert 0.0 < out.metrics["loss/clip_frac"].item() < 1.0


def test_search_ends_and_quirks() -> None:
    """Met at the start: (a⁻, a⁺). Unreachable: the last point (b⁻, b⁺), flagged. A lower range shorter than one
    step δ2: Algorithm 1's loop condition fails at once, so neither bound moves."""
    logp = torch.zeros(1, 4, dtype=DT, requires_grad=True)
    prox = torch.tensor([[-1.5, 0.0, 0.0, 0.0]], dtype=DT)  # r = e^1.5 ≈ 4.5 on the positive token
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0]], dtype=DT)
    kw = {"logp": logp, "prox_logp": prox, "advantages": adv, "mask": torch.ones(1, 4, dtype=torch.bool)}
    start = bapo_bounds(**kw, target=0.2)  # share at the start 1.2 / (1.2 + 3) ≈ 0.29
    assert (start.c_low.item(), start.c_high.item()) == (BAPO_LOW_START, BAPO_HIGH_START)
    high = bapo_bounds(**kw, target=0.5)  # c_high ≥ 3 gives 3 / 6 = 0.5
    assert (high.c_low.item(), high.c_high.item()) == (BAPO_LOW_START, 3.0) and high.metrics["bapo/target_met"] == 1
    never = bapo_bounds(**kw, target=0.9)
    assert (never.c_low.item(), never.c_high.item()) == (BAPO_LOW_MAX, BAPO_HIGH_MAX)
    assert never.metrics["bapo/target_met"] == 0 and never.metrics["bapo/steps"] == len(search_path()) - 1
    stuck = bapo_bounds(**kw, target=0.9, path=search_path(low_start=0.6, low_max=0.61))
    assert (stuck.c_low.item(), stuck.c_high.item()) == (0.6, BAPO_HIGH_START)


@given(seed=seeds, B=dims, T=dims, rho0=st.sampled_from([0.4, 0.9]))
@settings(max_examples=30)
def test_on_policy_reduces_to_the_plain_advantage_objective(seed: int, B: int, T: int, rho0: float) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = bapo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, target=rho0)
    terms = {(i, t): -float(b.adv_tok[i, t]) * torch.ones((), dtype=DT) for i, t in b.mask.nonzero().tolist()}
    assert_close(out.loss, ref_aggregate(terms, B, T, "token-mean"))
    assert out.metrics["loss/clip_frac"] == 0.0


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
@settings(max_examples=30)
def test_huge_log_ratios_stay_finite(seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    out = bapo_loss(logp=b.logp, prox_logp=b.logp.detach() + sign * 1000.0 * flips, advantages=b.adv_tok,
                    mask=b.mask, weights=b.weights)  # fmt: skip
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str) -> None:
    b = make_batch(7)
    out = bapo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                    weights=b.weights, agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)
    assert out.metrics["bapo/pos_share"] == 1.0


@given(seed=seeds)
@settings(max_examples=30)
def test_garbage_never_leaks_and_only_logp_gets_a_gradient(seed: int) -> None:
    b = make_batch(seed, scale=0.6)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = bapo_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])


def test_bad_arguments() -> None:
    b = make_batch(0)
    kw = {"logp": b.logp, "prox_logp": b.prox_logp, "advantages": b.adv_tok, "mask": b.mask}
    with pytest.raises(ValueError, match="balance"):
        bapo_bounds(**kw, balance="ratio")
    with pytest.raises(ValueError, match="order"):
        search_path(order="both")
