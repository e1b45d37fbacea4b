"""PPO-clip, REINFORCE and GSPO against float64 loop references written from docs/algorithms.md."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.ppo import (
    GSPO_CLIP_HIGH,
    GSPO_CLIP_LOW,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
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

LOSSES: dict[str, Callable[..., object]] = {"ppo": ppo_clip_loss, "reinforce": reinforce_loss, "gspo": gspo_loss}


def _ref_ppo(b: Batch, *, el: float, eh: float, dual: float | None, weighted: bool, mode: str):
    B, T = b.mask.shape
    terms, clipped = {}, 0
    for i in range(B):
        for t in range(T):
            if not b.mask[i, t]:
                continue
            r = torch.exp(clamp20(b.logp[i, t] - b.prox_logp[i, t]))
            A = float(b.adv_tok[i, t])
            l1, l2 = -A * r, -A * torch.clamp(r, 1.0 - el, 1.0 + eh)
            clipped += int(l2 > l1)
            L = torch.maximum(l1, l2)
            if dual is not None and A < 0:
                L = torch.minimum(L, torch.tensor(-dual * A, dtype=DT))
            terms[(i, t)] = (float(b.weights[i, t]) if weighted else 1.0) * L
    return ref_aggregate(terms, B, T, mode), clipped / max(len(terms), 1)


def _ref_reinforce(b: Batch, *, mode: str):
    B, T = b.mask.shape
    terms = {
        (i, t): -float(b.adv_tok[i, t]) * float(b.weights[i, t]) * torch.exp(clamp20(b.logp[i, t] - b.prox_logp[i, t]))
        for i in range(B)
        for t in range(T)
        if b.mask[i, t]
    }
    return ref_aggregate(terms, B, T, mode)


def _ref_gspo(b: Batch, *, el: float, eh: float, mode: str):
    B, T = b.mask.shape
    terms, clipped = {}, 0
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if not toks:
            continue
        s = torch.exp(clamp20(sum(b.logp[i, t] - b.prox_logp[i, t] for t in toks) / len(toks)))  # geometric mean
        for t in toks:
            A = float(b.adv_tok[i, t])
            l1, l2 = -A * s, -A * torch.clamp(s, 1.0 - el, 1.0 + eh)
            clipped += int(l2 > l1)
            terms[(i, t)] = float(b.weights[i, t]) * torch.maximum(l1, l2)
    return ref_aggregate(terms, B, T, mode), clipped / max(len(terms), 1)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("el", "eh", "dual"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_clip_matches_reference(mode: str, el: float, eh: float, dual: float | None, weighted: bool) -> None:
    b = make_batch(1, scale=0.5)
    out = ppo_clip_loss(
        logp=b.logp,
        prox_logp=b.prox_logp,
        advantages=b.adv_tok,
        mask=b.mask,
        weights=b.weights if weighted else None,
        clip_low=el,
        clip_high=eh,
        dual_clip=dual,
        agg=mode,
    )
    ref, clip_frac = _ref_ppo(b, el=el, eh=eh, dual=dual, weighted=weighted, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))
    assert_close(out.metrics["loss/clip_frac"].to(DT), clip_frac, atol=1e-6)
    assert_close(out.metrics["loss/policy"], ref)
    assert 0.0 < clip_frac < 1.0  # the batch exercises both branches


def test_ppo_clip_frac_and_ratio_metrics() -> None:
    b = make_batch(2, scale=0.5)
    out = ppo_clip_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask)
    ratios = [float(torch.exp(b.logp.detach()[i, t] - b.prox_logp[i, t])) for i, t in b.mask.nonzero().tolist()]
    assert_close(out.metrics["loss/ratio_mean"], sum(ratios) / len(ratios))
    assert_close(out.metrics["loss/ratio_max"], max(ratios))
    assert out.metrics["loss/all_masked"] == 0.0


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    logp = torch.tensor([[3.0, 3.0, -3.0]], dtype=DT, requires_grad=True)
    prox = torch.zeros(1, 3, dtype=DT)
    adv = torch.tensor([[-1.0, 1.0, -1.0]], dtype=DT)
    mask = torch.ones(1, 3, dtype=torch.bool)
    on = ppo_clip_loss(logp=logp, prox_logp=prox, advantages=adv, mask=mask, dual_clip=3.0, agg="seq-mean-token-sum")
    off = ppo_clip_loss(logp=logp, prox_logp=prox, advantages=adv, mask=mask, agg="seq-mean-token-sum")
    r = torch.exp(torch.tensor(3.0, dtype=DT))
    # token 0: A<0, r=e^3 -> max(r, 0.8)=r, dual caps at 3; token 1: A>0, r>1.2 -> -1.2; token 2: A<0, r<0.8 -> 0.8
    assert_close(off.loss, r - 1.2 + 0.8)
    assert_close(on.loss, 3.0 - 1.2 + 0.8)
    assert_close(on.metrics["loss/dual_clip_frac"].to(DT), 1 / 3, atol=1e-6)
    assert torch.equal(grad_of(on.loss, logp), torch.zeros_like(logp))  # every token sits on a constant branch


def test_dual_clip_must_exceed_one() -> None:
    b = make_batch(0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, dual_clip=1.0)


def test_clip_range_accepts_tensors() -> None:
    b = make_batch(3, scale=0.5)
    kw = {"logp": b.logp, "prox_logp": b.prox_logp, "advantages": b.adv_tok, "mask": b.mask}
    as_float = ppo_clip_loss(**kw, clip_low=0.1, clip_high=0.3)
    as_tensor = ppo_clip_loss(**kw, clip_low=torch.tensor(0.1, dtype=DT), clip_high=torch.tensor(0.3, dtype=DT))
    assert_close(as_tensor.loss, as_float.loss)
    unclipped = ppo_clip_loss(**kw, clip_low=torch.tensor(1.0), clip_high=torch.tensor(float("inf")))
    assert_close(unclipped.loss, reinforce_loss(**kw).loss)  # no clip at all = REINFORCE surrogate
    assert unclipped.metrics["loss/clip_frac"] == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_reinforce_matches_reference_and_first_update_gradient(mode: str) -> None:
    b = make_batch(4)
    kw = {"logp": b.logp, "advantages": b.adv_tok, "mask": b.mask, "weights": b.weights, "agg": mode}
    out = reinforce_loss(**kw, prox_logp=b.prox_logp)
    ref = _ref_reinforce(b, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))
    # First update (π_θ = π_prox): value −A·w and gradient −A·w·∇log π_θ, i.e. verl's −A·w·log π_θ gradient.
    first = reinforce_loss(**kw, prox_logp=b.logp.detach())
    B, T = b.mask.shape
    verl_terms = {
        (i, t): -float(b.adv_tok[i, t]) * float(b.weights[i, t]) * b.logp[i, t]
        for i in range(B)
        for t in range(T)
        if b.mask[i, t]
    }
    verl = ref_aggregate(verl_terms, B, T, mode)
    assert_close(grad_of(first.loss, b.logp), grad_of(verl, b.logp))
    value_terms = {k: -float(b.adv_tok[k]) * float(b.weights[k]) * torch.ones((), dtype=DT) for k in verl_terms}
    assert_close(first.loss, ref_aggregate(value_terms, B, T, mode))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("el", "eh"), [(GSPO_CLIP_LOW, GSPO_CLIP_HIGH), (0.05, 0.08)])
def test_gspo_matches_reference(mode: str, el: float, eh: float) -> None:
    b = make_batch(5, scale=0.05)
    out = gspo_loss(
        logp=b.logp,
        prox_logp=b.prox_logp,
        advantages=b.adv_tok,
        mask=b.mask,
        weights=b.weights,
        clip_low=el,
        clip_high=eh,
        agg=mode,
    )
    ref, _ = _ref_gspo(b, el=el, eh=eh, mode=mode)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))


def test_gspo_default_is_papers_sequence_mean_and_clip_frac() -> None:
    b = make_batch(6, scale=0.05)
    out = gspo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, weights=b.weights)
    ref, _ = _ref_gspo(b, el=GSPO_CLIP_LOW, eh=GSPO_CLIP_HIGH, mode="seq-mean-token-mean")
    assert_close(out.loss, ref)
    B, T = b.mask.shape
    clipped = n = 0
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if toks:
            s = float(torch.exp(sum(b.logp.detach()[i, t] - b.prox_logp[i, t] for t in toks) / len(toks)))
            A = float(b.adv_seq[i])
            clipped += len(toks) * int((A > 0 and s > 1 + GSPO_CLIP_HIGH) or (A < 0 and s < 1 - GSPO_CLIP_LOW))
            n += len(toks)
    assert_close(out.metrics["loss/clip_frac"].to(DT), clipped / n, atol=1e-6)


def test_gspo_sequence_ratio_gradient_is_shared_by_tokens() -> None:
    # One sequence, A = 1, no clip: ∂L/∂log π_θ(y_t) = −s/L for every token (ratio = geometric mean, with gradient).
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], dtype=DT, requires_grad=True)
    prox = logp.detach() + torch.tensor([[0.1, -0.3, 0.2, 0.0]], dtype=DT)
    out = gspo_loss(
        logp=logp, prox_logp=prox, advantages=torch.ones(1, 4, dtype=DT), mask=torch.ones(1, 4), clip_low=1.0,
        clip_high=float("inf"),
    )
    s = torch.exp(-torch.tensor([0.1, -0.3, 0.2, 0.0], dtype=DT).mean())
    assert_close(out.loss, -s)
    assert_close(grad_of(out.loss, logp), (-s / 4).expand(1, 4))


# --- properties shared by the three surrogates ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(LOSSES))
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_reduces_to_plain_advantage_objective(name: str, seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = LOSSES[name](logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, agg="token-mean")
    terms = {(i, t): -float(b.adv_tok[i, t]) * torch.ones((), dtype=DT) for i, t in b.mask.nonzero().tolist()}
    assert_close(out.loss, ref_aggregate(terms, B, T, "token-mean"))
    assert out.metrics.get("loss/clip_frac", torch.tensor(0.0)) == 0.0
    assert_close(out.metrics["loss/ratio_mean"], 1.0 if b.mask.any() else 0.0)


@pytest.mark.parametrize("name", list(LOSSES))
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_give_finite_loss_and_gradients(name: str, seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    prox = b.logp.detach() + sign * 1000.0 * flips
    out = LOSSES[name](logp=b.logp, prox_logp=prox, advantages=b.adv_tok, mask=b.mask, weights=b.weights)
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(name: str, mode: str) -> None:
    b = make_batch(7)
    mask = torch.zeros_like(b.mask)
    out = LOSSES[name](logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=mask, weights=b.weights, agg=mode)
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@pytest.mark.parametrize("name", list(LOSSES))
@given(seed=seeds)
def test_gradient_flows_only_through_logp(name: str, seed: int) -> None:
    b = make_batch(seed)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = LOSSES[name](logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w)
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
