"""DPPO-Binary-TV / Binary-KL against float64 loop references written from arXiv 2602.04879's masks (as the authors'
verl code states them), plus prime-rl's default loss and the properties every objective must have."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.dppo import (
    DPPO_KL_DELTA,
    DPPO_TV_DELTA,
    PRIME_RL_KL_TAU,
    binary_kl,
    dppo_loss,
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

EPS = 1e-8


def _outside(p: float, q: float, A: float, divergence: str, dl: float, dh: float) -> bool:
    """The paper's binary trust region, one token: dropped only in the direction its advantage pushes."""
    if divergence == "tv":
        return (A > 0 and p - q > dh) or (A < 0 and p - q < -dl)
    kl = q * (math.log(q) - math.log(p)) + (1 - q) * (math.log(1 - q + EPS) - math.log(1 - p + EPS))
    return (A > 0 and p > q and kl > dh) or (A < 0 and p < q and kl > dl)


def _ref_dppo(
    b: Batch,
    *,
    divergence: str,
    dl: float,
    dh: float,
    trunc: float | None,
    surrogate: str,
    kappa: float,
    weighted: bool,
    mode: str,
) -> tuple[torch.Tensor, float]:
    B, T = b.mask.shape
    terms, n_out = {}, 0
    for i in range(B):
        for t in range(T):
            if not b.mask[i, t]:
                continue
            lp, lq, A = b.logp[i, t], float(b.prox_logp[i, t]), float(b.adv_tok[i, t])
            out = _outside(math.exp(min(float(lp.detach()), 0.0)), math.exp(min(lq, 0.0)), A, divergence, dl, dh)
            n_out += int(out)
            r = float(torch.exp(clamp20(lp.detach() - lq)))
            c = r if trunc is None else min(r, trunc)
            if out:
                pg = torch.zeros((), dtype=DT)
            elif surrogate == "log_prob":
                pg = -A * c * lp  # verl / the authors: −A · sg(min(r, C)) · log π_θ
            else:
                pg = -A * c * torch.exp(lp - lp.detach())  # value −A·min(r, C), gradient −A·min(r, C)·∇log π_θ
            term = pg + kappa * (lp - lq) ** 2
            terms[(i, t)] = (float(b.weights[i, t]) if weighted else 1.0) * term
    return ref_aggregate(terms, B, T, mode), n_out / max(len(terms), 1)


CASES = [
    ("tv", DPPO_TV_DELTA, DPPO_TV_DELTA, None, "ratio", 0.0),
    ("tv", 0.1, 0.2, 1.3, "log_prob", 0.0),
    ("kl", DPPO_KL_DELTA, DPPO_KL_DELTA, None, "log_prob", 0.0),
    ("kl", 0.02, 0.08, 1.3, "ratio", PRIME_RL_KL_TAU),
    ("tv", 0.2, 0.2, None, "ratio", PRIME_RL_KL_TAU),  # prime-rl's default loss (dppo_mask_low/high 0.2, kl_tau)
]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("divergence", "dl", "dh", "trunc", "surrogate", "kappa"), CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_dppo_matches_reference(
    mode: str,
    divergence: str,
    dl: float,
    dh: float,
    trunc: float | None,
    surrogate: str,
    kappa: float,
    weighted: bool,
) -> None:
    b = make_batch(11, B=8, T=7, scale=0.7)
    out = dppo_loss(
        logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask,
        weights=b.weights if weighted else None, divergence=divergence, delta_low=dl, delta_high=dh, trunc=trunc,
        surrogate=surrogate, sq_log_ratio_coef=kappa, agg=mode,
    )  # fmt: skip
    ref, frac = _ref_dppo(
        b, divergence=divergence, dl=dl, dh=dh, trunc=trunc, surrogate=surrogate, kappa=kappa, weighted=weighted,
        mode=mode,
    )  # fmt: skip
    assert_close(out.loss, ref, atol=1e-12)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["loss/clip_frac"].to(DT), frac, atol=1e-6)
    assert 0.0 < frac < 1.0  # the batch has tokens on both sides of the trust region


def test_binary_kl_is_the_bernoulli_kl() -> None:
    p, q = torch.tensor([[0.5, 0.9, 1e-5]], dtype=DT), torch.tensor([[0.25, 0.6, 1e-3]], dtype=DT)
    got = binary_kl(logp=p.log(), anchor_logp=q.log())
    want = q * (q / p).log() + (1 - q) * ((1 - q + EPS) / (1 - p + EPS)).log()
    assert_close(got, want, atol=1e-12)
    exact = q * (q / p).log() + (1 - q) * ((1 - q) / (1 - p)).log()  # ε changes it by < 1e-7 here
    assert_close(got, exact, atol=1e-7)
    assert torch.isfinite(binary_kl(logp=torch.zeros(1, 1, dtype=DT), anchor_logp=torch.full((1, 1), -1.0, dtype=DT)))


def test_the_mask_follows_the_advantage_direction_and_the_probability_scale() -> None:
    """The paper's motivating cases: a rare token rising 1e-5 → 1e-3 (ratio 100, |Δp| ≈ 1e-3) stays in the trust
    region; a likely token falling 0.99 → 0.8 (ratio 0.81, inside PPO's clip) leaves it when A < 0; a token that moved
    against its advantage, or one with A = 0, is never dropped."""
    p = torch.tensor([[1e-3, 0.8, 0.8, 0.99, 0.5, 0.9]], dtype=DT)
    q = torch.tensor([[1e-5, 0.99, 0.99, 0.5, 0.99, 0.3]], dtype=DT)
    A = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0, 1.0]], dtype=DT)
    want = torch.tensor([[False, True, False, False, False, True]])
    mask = torch.ones_like(want)
    for divergence, delta in (("tv", DPPO_TV_DELTA), ("kl", DPPO_KL_DELTA)):
        logp = p.log().requires_grad_(True)
        out = dppo_loss(logp=logp, prox_logp=q.log(), advantages=A, mask=mask, divergence=divergence,
                        delta_low=delta, delta_high=delta, agg="seq-mean-token-sum")  # fmt: skip
        dropped = grad_of(out.loss, logp) == 0
        assert torch.equal(dropped & (A != 0), want), divergence
        assert_close(out.metrics["loss/clip_frac"].to(DT), 2 / 6, atol=1e-6)
        assert_close(out.metrics["dppo/masked_low_frac"].to(DT), 1 / 6, atol=1e-6)


@given(seed=seeds, trunc=st.sampled_from([None, 1.1, 3.0]), kappa=st.sampled_from([0.0, 1e-3]))
@settings(max_examples=30)
def test_both_surrogates_have_the_same_gradient(seed: int, trunc: float | None, kappa: float) -> None:
    b = make_batch(seed, scale=0.5)
    kw = {"prox_logp": b.prox_logp, "advantages": b.adv_tok, "mask": b.mask, "weights": b.weights, "trunc": trunc,
          "sq_log_ratio_coef": kappa}  # fmt: skip
    g_ratio = grad_of(dppo_loss(logp=b.logp, surrogate="ratio", **kw).loss, b.logp)
    g_logp = grad_of(dppo_loss(logp=b.logp, surrogate="log_prob", **kw).loss, b.logp)
    assert_close(g_ratio, g_logp, atol=1e-12)


@given(seed=seeds, B=dims, T=dims, divergence=st.sampled_from(["tv", "kl"]))
@settings(max_examples=30)
def test_on_policy_reduces_to_the_plain_advantage_objective(seed: int, B: int, T: int, divergence: str) -> None:
    b = make_batch(seed, B, T, empty_row=B > 1)
    out = dppo_loss(logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, divergence=divergence,
                    sq_log_ratio_coef=1e-3)  # fmt: skip
    terms = {(i, t): -float(b.adv_tok[i, t]) * torch.ones((), dtype=DT) for i, t in b.mask.nonzero().tolist()}
    assert_close(out.loss, ref_aggregate(terms, B, T, "token-mean"))
    assert out.metrics["loss/clip_frac"] == 0.0 and out.metrics["dppo/divergence_mean"] == 0.0


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]), divergence=st.sampled_from(["tv", "kl"]))
@settings(max_examples=30)
def test_huge_log_ratios_stay_finite(seed: int, B: int, T: int, sign: float, divergence: str) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    prox = b.logp.detach() + sign * 1000.0 * flips  # log-probabilities far above 0 included
    for surrogate in ("ratio", "log_prob"):
        out = dppo_loss(logp=b.logp, prox_logp=prox, advantages=b.adv_tok, mask=b.mask, weights=b.weights,
                        divergence=divergence, trunc=5.0, surrogate=surrogate, sq_log_ratio_coef=1e-3)  # fmt: skip
        hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_fully_masked_batch_is_zero_with_zero_grad(mode: str, divergence: str) -> None:
    b = make_batch(7)  # nan garbage everywhere the mask is off
    out = dppo_loss(logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                    weights=b.weights, divergence=divergence, trunc=2.0, sq_log_ratio_coef=1e-3, agg=mode)  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@given(seed=seeds, divergence=st.sampled_from(["tv", "kl"]), surrogate=st.sampled_from(["ratio", "log_prob"]))
@settings(max_examples=30)
def test_garbage_never_leaks_and_only_logp_gets_a_gradient(seed: int, divergence: str, surrogate: str) -> None:
    b = make_batch(seed, scale=0.6)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = dppo_loss(logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w, divergence=divergence,
                    surrogate=surrogate, trunc=2.0, sq_log_ratio_coef=1e-3)  # fmt: skip
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])


def test_truncation_metric_and_bad_arguments() -> None:
    logp = torch.tensor([[0.0, -0.1]], dtype=DT, requires_grad=True)
    prox = torch.tensor([[-2.0, -0.1]], dtype=DT)  # r = e² on token 0 (A < 0: it rose, no drop), 1 on token 1
    adv = torch.tensor([[-1.0, 1.0]], dtype=DT)
    out = dppo_loss(logp=logp, prox_logp=prox, advantages=adv, mask=torch.ones(1, 2), trunc=2.0,
                    agg="seq-mean-token-sum")  # fmt: skip
    assert_close(out.loss, 2.0 - 1.0)  # −A·min(r, 2): 2 on token 0, −1 on token 1
    assert_close(grad_of(out.loss, logp), torch.tensor([[2.0, -1.0]], dtype=DT))
    assert_close(out.metrics["dppo/trunc_frac"].to(DT), 0.5, atol=1e-6)
    kw = {"logp": logp, "prox_logp": prox, "advantages": adv, "mask": torch.ones(1, 2)}
    with pytest.raises(ValueError, match="surrogate"):
        dppo_loss(**kw, surrogate="clip")
    with pytest.raises(ValueError, match="divergence"):
        dppo_loss(**kw, divergence="js")
    with pytest.raises(ValueError, match="trunc"):
        dppo_loss(**kw, trunc=0.0)
