"""M2PO's token mask and clip-narrowing rule against loop references written from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.objectives.m2po import (
    M2PO_TAU,
    harmful_tokens,
    m2po_clip_range,
    m2po_mask,
)
from steadyrl.core.objectives.ppo import clipped_surrogate, ppo_clip_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, assert_close, clamp20, dims, make_batch, seeds

TOL = 1e-12


def _delta(seed: int, B: int = 6, T: int = 5, scale: float = 0.3):
    """δ = log μ − log π_prox on a random batch (nan where masked out), with token advantages."""
    b = make_batch(seed, B, T, scale=scale)
    return b.behav_logp - b.prox_logp, b.mask, b.adv_tok


def _ref_harmful(delta, mask, adv) -> set[tuple[int, int]]:
    out = set()
    for i, t in mask.nonzero().tolist():
        d, A = float(delta[i, t]), float(adv[i, t])
        if (A > TOL and -d > TOL) or (A < -TOL and -d < -TOL):  # (A>0 ∧ r>1) ∨ (A<0 ∧ r<1), r = e^{−δ}
            out.add((i, t))
    return out


def _ref_mask(delta, mask, tau, candidates: set, budget: set) -> set[tuple[int, int]]:
    """Positions kept: drop the k largest δ² among candidates, k the first with mean(rest of budget set) < τ."""
    order = sorted(candidates, key=lambda p: -float(delta[p]) ** 2)
    sq = {p: float(delta[p]) ** 2 for p in budget}
    n, k_star = len(order), len(order)
    for k in range(n + 1):
        rest = [sq[p] for p in budget if p not in set(order[:k])]
        if rest and sum(rest) / len(rest) < tau:
            k_star = k
            break
    dropped = set(order[:k_star])
    return {tuple(p) for p in mask.nonzero().tolist()} - dropped


def _ref_clip(delta, mask, adv, tau, floor_low=None, floor_high=None):
    """(ε_low, ε_high, τ') from the authors' rule, written as plain loops in float64 with float32 bounds."""
    v = sorted(float(delta[p]) ** 2 for p in _ref_harmful(delta, mask, adv))
    n = len(v)
    if n == 0 or sum(v) / n <= tau + TOL:
        tp = math.inf
    elif tau * n <= TOL:
        tp = 0.0
    else:
        csum = 0.0
        for k in range(n):
            csum += v[k]
            if csum + (n - k - 1) * (v[k] - TOL) >= tau * n - TOL:
                tp = 0.0 if k == 0 else math.sqrt(max(v[k - 1] - TOL, 0.0))
                break
    # The authors' order: float32 bounds exp(∓τ') as Python floats, then ε = 1 − lo, hi − 1 and the floors in Python.
    lo = float(torch.exp(torch.tensor(-tp, dtype=torch.float32)))
    hi = float(torch.exp(torch.tensor(tp, dtype=torch.float32)))
    el, eh = 1.0 - lo, hi - 1.0
    if floor_low is not None and el < floor_low:
        el = floor_low
    if floor_high is not None and eh < floor_high:
        eh = floor_high
    return torch.tensor(el, dtype=DT), torch.tensor(eh, dtype=DT), tp, v


def _as_set(mask: torch.Tensor) -> set[tuple[int, int]]:
    return {tuple(p) for p in mask.nonzero().tolist()}


# --- masking ------------------------------------------------------------------------------------------------


def test_mask_hand_example() -> None:
    delta = torch.tensor([[0.5, 0.1, 0.0, -0.2]], dtype=DT)  # δ² = 0.25, 0.01, 0, 0.04; mean 0.075 ≥ 0.04
    out = m2po_mask(log_ratio=delta, mask=torch.ones(1, 4))
    assert out.mask.tolist() == [[False, True, True, True]]  # dropping 0.25 leaves mean 0.05/3 < 0.04
    assert_close(out.metrics["m2po/m2_before"], 0.075)
    assert_close(out.metrics["m2po/m2_after"], 0.05 / 3)
    assert_close(out.metrics["m2po/masked_frac"].to(DT), 0.25, atol=1e-7)
    assert torch.equal(out.weights, torch.ones_like(delta))


@pytest.mark.parametrize(
    ("harmful_only", "budget_over"), [(False, "candidates"), (True, "candidates"), (True, "valid")]
)
@given(seed=seeds, B=dims, T=dims, scale=st.sampled_from([0.05, 0.2, 0.5]), tau=st.sampled_from([0.01, M2PO_TAU]))
def test_mask_matches_reference(
    harmful_only: bool, budget_over: str, seed: int, B: int, T: int, scale: float, tau: float
) -> None:
    delta, mask, adv = _delta(seed, B, T, scale)
    out = m2po_mask(
        log_ratio=delta, mask=mask, tau=tau, harmful_only=harmful_only, advantages=adv, budget_over=budget_over
    )
    valid = _as_set(mask)
    candidates = _ref_harmful(delta, mask, adv) if harmful_only else valid
    budget = candidates if budget_over == "candidates" else valid
    kept = _ref_mask(delta, mask, tau, candidates, budget)
    assert _as_set(out.mask) == kept
    rest = [float(delta[p]) ** 2 for p in budget & kept]
    reachable = bool(rest) and sum(rest) / len(rest) < tau
    assert out.metrics["m2po/budget_unreachable"] == float(bool(candidates) and not reachable)
    if rest:
        assert_close(out.metrics["m2po/m2_after"], sum(rest) / len(rest))


@given(seed=seeds, B=dims, T=dims)
def test_mask_is_minimal(seed: int, B: int, T: int) -> None:
    delta, mask, _ = _delta(seed, B, T, scale=0.4)
    out = m2po_mask(log_ratio=delta, mask=mask)
    kept = sorted((float(delta[p]) ** 2 for p in _as_set(out.mask)), reverse=True)
    dropped = sorted(float(delta[p]) ** 2 for p in _as_set(mask) - _as_set(out.mask))
    if kept:
        assert sum(kept) / len(kept) < M2PO_TAU  # the budget holds on what is kept
    if dropped:  # putting back the smallest dropped token breaks it: no smaller k would do
        back = [*kept, dropped[0]]
        assert sum(back) / len(back) >= M2PO_TAU
        assert min(dropped) >= (max(kept) if kept else 0.0)  # only the largest δ² are dropped


def test_mask_kept_count_is_loss_denominator() -> None:
    b = make_batch(11, scale=0.4)
    out = m2po_mask(log_ratio=b.behav_logp - b.prox_logp, mask=b.mask)
    assert out.metrics["m2po/masked_frac"] > 0
    loss = ppo_clip_loss(
        logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=out.mask, clip_low=1.0, clip_high=math.inf
    ).loss
    kept = _as_set(out.mask)
    ref = sum(-float(b.adv_tok[p]) * torch.exp(clamp20(b.logp[p] - b.prox_logp[p])) for p in kept) / len(kept)
    assert_close(loss, ref)  # (1/kept) Σ m r A


def test_mask_argument_errors() -> None:
    delta, mask, _ = _delta(0)
    with pytest.raises(ValueError, match="advantages"):
        m2po_mask(log_ratio=delta, mask=mask, harmful_only=True)
    with pytest.raises(ValueError, match="candidates"):
        m2po_mask(log_ratio=delta, mask=mask, budget_over="all")


def test_mask_unreachable_drops_every_candidate() -> None:
    delta = torch.tensor([[0.5, -0.6, 0.7]], dtype=DT)  # every δ² ≥ τ
    out = m2po_mask(log_ratio=delta, mask=torch.ones(1, 3, dtype=torch.bool))
    assert not out.mask.any()
    assert out.metrics["m2po/budget_unreachable"] == 1.0


# --- clip narrowing -----------------------------------------------------------------------------------------


def test_clip_range_hand_example() -> None:
    delta = torch.tensor([[-0.1, -0.2, -0.5, -1.0]], dtype=DT)  # all harmful with A > 0 (r = e^{−δ} > 1)
    adv = torch.ones(1, 4, dtype=DT)
    out = m2po_clip_range(log_ratio=delta, mask=torch.ones(1, 4), advantages=adv)
    # v = .01 .04 .25 1; τn = .16: k=0 → .04, k=1 → .13, k=2 → .55 ≥ .16 → τ'² = v_1 = 0.04
    assert int(out.k) == 2
    assert_close(out.tau_prime, math.sqrt(0.04 - TOL))
    assert out.clip_low.dtype == torch.float64 and out.clip_high.dtype == torch.float64
    assert_close(out.clip_low, 1.0 - math.exp(-0.2), atol=1e-7)
    assert_close(out.clip_high, math.exp(0.2) - 1.0, atol=1e-7)
    assert_close(out.m2, 1.3 / 4)
    assert_close(out.m2_after, (0.01 + 3 * (0.04 - TOL)) / 4)


@pytest.mark.parametrize(("floor_low", "floor_high"), [(None, None), (0.3, 0.5)])
@given(seed=seeds, B=dims, T=dims, scale=st.sampled_from([0.05, 0.3, 1.0]))
def test_clip_range_matches_reference(floor_low, floor_high, seed: int, B: int, T: int, scale: float) -> None:
    delta, mask, adv = _delta(seed, B, T, scale)
    out = m2po_clip_range(log_ratio=delta, mask=mask, advantages=adv, floor_low=floor_low, floor_high=floor_high)
    el, eh, tp, v = _ref_clip(delta, mask, adv, M2PO_TAU, floor_low, floor_high)
    assert torch.equal(out.clip_low, el) and torch.equal(out.clip_high, eh)
    if math.isinf(tp):
        assert torch.isinf(out.tau_prime)
    else:
        assert_close(out.tau_prime, tp)
        assert float(out.m2_after) <= M2PO_TAU + 1e-9  # capping |δ| at τ' meets the budget
    assert_close(out.m2, sum(v) / len(v) if v else 0.0)


def test_clip_range_composes_with_ppo_clip_loss() -> None:
    b = make_batch(12, scale=0.6)
    delta = b.behav_logp - b.prox_logp
    rng = m2po_clip_range(log_ratio=delta, mask=b.mask, advantages=b.adv_tok)
    assert torch.isfinite(rng.tau_prime)
    kw = {"logp": b.logp, "prox_logp": b.prox_logp, "advantages": b.adv_tok, "mask": b.mask}
    with_tensors = ppo_clip_loss(**kw, clip_low=rng.clip_low, clip_high=rng.clip_high)
    with_floats = ppo_clip_loss(**kw, clip_low=float(rng.clip_low), clip_high=float(rng.clip_high))
    assert_close(with_tensors.loss, with_floats.loss)


# --- shared properties --------------------------------------------------------------------------------------


@given(seed=seeds, B=dims, T=dims)
def test_on_policy_masks_nothing_and_does_not_clip(seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T)
    zero = torch.zeros_like(b.prox_logp)
    for harmful_only in (False, True):
        out = m2po_mask(log_ratio=zero, mask=b.mask, harmful_only=harmful_only, advantages=b.adv_tok)
        assert torch.equal(out.mask, b.mask)
        assert out.metrics["m2po/masked_frac"] == 0.0
    assert not harmful_tokens(log_ratio=zero, advantages=b.adv_tok, mask=b.mask).any()
    rng = m2po_clip_range(log_ratio=zero, mask=b.mask, advantages=b.adv_tok)
    assert rng.clip_low == 1.0 and torch.isinf(rng.clip_high)


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_stay_finite(seed: int, B: int, T: int, sign: float) -> None:
    delta, mask, adv = _delta(seed, B, T)
    outliers = mask & (torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.5)
    delta = torch.where(outliers, sign * 1000.0, delta)
    out = m2po_mask(log_ratio=delta, mask=mask)
    hostile.assert_metrics_finite(out.metrics)
    assert not (out.mask & (delta.abs() == 1000.0)).any()  # the outliers are the tokens dropped
    rng = m2po_clip_range(log_ratio=delta, mask=mask, advantages=adv)
    assert not torch.isnan(rng.tau_prime) and torch.isfinite(rng.m2)


def test_fully_masked_batch() -> None:
    delta, mask, adv = _delta(3)
    none = torch.zeros_like(mask)
    out = m2po_mask(log_ratio=delta, mask=none)
    assert not out.mask.any() and all(v == 0.0 for v in out.metrics.values())
    rng = m2po_clip_range(log_ratio=delta, mask=none, advantages=adv)
    assert rng.clip_low == 1.0 and torch.isinf(rng.clip_high) and rng.m2 == 0.0 and int(rng.k) == 0


def test_outputs_are_detached() -> None:
    delta, mask, adv = _delta(4, scale=0.6)
    delta = delta.clone().requires_grad_(True)
    out = m2po_mask(log_ratio=delta, mask=mask)
    rng = m2po_clip_range(log_ratio=delta, mask=mask, advantages=adv)
    assert not out.weights.requires_grad and not rng.clip_low.requires_grad and not rng.clip_high.requires_grad
    assert all(not v.requires_grad for v in [*out.metrics.values(), *rng.metrics.values()])


def test_clip_bound_order_keeps_a_token_on_the_bound_unclipped() -> None:
    """The authors compute the float32 ratio bounds e^{∓τ'} first and ε from them in Python floats, so a ratio on the
    bound is clipped on neither side. τ' ≈ 1.1 > ln 2 here, where 1 − e^{−τ'} taken in float32 rounds."""
    # Harmful tokens (A > 0, r > 1 ⇔ δ < 0) with δ² = c, c, c, c, 4c, 4c (c = 1.2): M2 = 2.4c; τ = 1.2c → k = 4,
    # τ'² = c − 1e-12.
    c = math.sqrt(1.2)
    delta = -torch.tensor([[c, c, c, c, 2 * c, 2 * c]], dtype=DT)
    adv = torch.ones(1, 6, dtype=DT)
    mask = torch.ones(1, 6, dtype=torch.bool)
    rng = m2po_clip_range(log_ratio=delta, mask=mask, advantages=adv, tau=1.44)
    assert int(rng.k) == 4 and float(rng.tau_prime) > math.log(2.0)
    lo = float(torch.exp(-rng.tau_prime.float()))  # the authors' float32 bounds
    hi = float(torch.exp(rng.tau_prime.float()))
    assert 1.0 - float(rng.clip_low) == lo and 1.0 + float(rng.clip_high) == hi  # exact, both sides
    f32_order = 1.0 - float(1.0 - torch.exp(-rng.tau_prime.float()))  # ε_low in float32 first: off by rounding
    assert f32_order != lo
    # A ratio sitting on each bound, as PPO's clipped surrogate sees it: not clipped (the clipped branch is no larger).
    r = torch.tensor([lo, hi], dtype=DT)
    a = torch.tensor([-1.0, 1.0], dtype=DT)  # A < 0 tests the lower bound, A > 0 the upper one
    bounds = {"lower": 1.0 - rng.clip_low, "upper": 1.0 + rng.clip_high}
    out = clipped_surrogate(ratio=r, advantages=a, **bounds)
    assert not out.clipped.any() and torch.equal(torch.clamp(r, bounds["lower"], bounds["upper"]), r)
    old = clipped_surrogate(ratio=r, advantages=a, lower=torch.tensor(f32_order, dtype=DT), upper=bounds["upper"])
    assert bool(old.clipped[0])  # the float32-first order clips the token on the lower bound
