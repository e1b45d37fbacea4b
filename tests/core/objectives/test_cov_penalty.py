"""Clip-Cov and KL-Cov against float64 loop references written from arXiv 2505.22617 §5 (as the authors' verl code
states them), the random selection by its distribution, and the properties every objective must have."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import AGG_MODES
from steadyrl.core.objectives.cov_penalty import (
    clip_cov_loss,
    clip_cov_selection,
    count_from_fraction,
    kl_cov_loss,
    random_subset,
    selection_generator,
    token_covariance,
    top_k_mask,
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


def _ref_cov(b: Batch) -> dict[tuple[int, int], float]:
    """Cov_t = (log π_θ − mean log π_θ)(A − mean A) over the trained tokens, by loops."""
    toks = b.mask.nonzero().tolist()
    lp = {(i, t): float(b.logp.detach()[i, t]) for i, t in toks}
    adv = {(i, t): float(b.adv_tok[i, t]) for i, t in toks}
    mean_lp, mean_a = sum(lp.values()) / len(toks), sum(adv.values()) / len(toks)
    return {k: (lp[k] - mean_lp) * (adv[k] - mean_a) for k in lp}


def _ref_ppo_terms(b: Batch, el: float, eh: float) -> tuple[dict, set]:
    terms, clipped = {}, set()
    for i, t in b.mask.nonzero().tolist():
        r = torch.exp(clamp20(b.logp[i, t] - b.prox_logp[i, t]))
        A = float(b.adv_tok[i, t])
        l1, l2 = -A * r, -A * torch.clamp(r, 1 - el, 1 + eh)
        terms[(i, t)] = torch.maximum(l1, l2)
        if l2 > l1:
            clipped.add((i, t))
    return terms, clipped


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(
    ("el", "eh", "lb", "ub"), [(0.2, 0.2, 0.1, 1.0), (1.0, 1.0, -0.05, 0.6), (0.2, 0.28, 0.3, 9.0)]
)
@pytest.mark.parametrize("weighted", [False, True])
def test_clip_cov_with_every_candidate_selected_matches_reference(
    mode: str, el: float, eh: float, lb: float, ub: float, weighted: bool
) -> None:
    """frac = 1 makes k ≥ N: the deterministic part (covariance, candidate rule, zeroed tokens, denominators)."""
    b = make_batch(21, B=8, T=7, scale=0.5)
    out = clip_cov_loss(
        logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, weights=b.weights if weighted else None,
        clip_low=el, clip_high=eh, frac=1.0, cov_lb=lb, cov_ub=ub, agg=mode,
    )  # fmt: skip
    cov = _ref_cov(b)
    terms, clipped = _ref_ppo_terms(b, el, eh)
    chosen = {k for k, c in cov.items() if k not in clipped and lb < c < ub}
    B, T = b.mask.shape
    for k in terms:
        w = float(b.weights[k]) if weighted else 1.0
        terms[k] = torch.zeros((), dtype=DT) if k in chosen else w * terms[k]
    ref = ref_aggregate(terms, B, T, mode)
    assert_close(out.loss, ref, atol=1e-12)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["cov/selected_frac"].to(DT), len(chosen) / len(terms), atol=1e-6)
    assert_close(out.metrics["loss/clip_frac"].to(DT), len(clipped) / len(terms), atol=1e-6)
    assert 0 < len(chosen) < len(terms) - len(clipped)  # some unclipped tokens fall outside the window


def test_token_covariance_matches_reference() -> None:
    b = make_batch(22, B=8, T=7)
    got = token_covariance(logp=b.logp, advantages=b.adv_tok, mask=b.mask)
    for (i, t), c in _ref_cov(b).items():
        assert math.isclose(float(got[i, t]), c, abs_tol=1e-12)
    assert torch.equal(got[~b.mask], torch.zeros_like(got[~b.mask]))


@pytest.mark.parametrize(("n", "frac", "k"), [(0, 2e-4, 1), (7, 2e-4, 1), (5000, 2e-4, 1), (5001, 2e-4, 1),
                                              (10_000, 2e-4, 2), (12_345, 2e-3, 24), (40, 0.5, 20)])  # fmt: skip
def test_count_is_the_floor_with_one_at_least(n: int, frac: float, k: int) -> None:
    mask = torch.zeros(1, max(n, 1), dtype=torch.bool)
    mask[0, :n] = True
    assert count_from_fraction(mask, frac).item() == k == max(int(n * frac), 1)


def test_top_k_and_random_subset_counts() -> None:
    scores = torch.tensor([[0.3, 2.0, -1.0, 5.0], [1.0, 4.0, 0.0, 3.0]], dtype=DT)
    valid = torch.tensor([[True, True, True, False], [True, True, False, True]])
    top = top_k_mask(scores, valid, torch.tensor(3))
    assert torch.equal(top, torch.tensor([[False, True, False, False], [False, True, False, True]]))
    assert torch.equal(top_k_mask(scores, valid, torch.tensor(99)), valid)
    for k in range(0, 8):
        sub = random_subset(valid, torch.tensor(k), torch.Generator().manual_seed(k))
        assert int(sub.sum()) == min(k, int(valid.sum())) and not (sub & ~valid).any()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("frac", "coef"), [(0.05, 1.0), (0.3, 0.1), (1.0, 2.0)])
@pytest.mark.parametrize("weighted", [False, True])
def test_kl_cov_matches_reference(mode: str, frac: float, coef: float, weighted: bool) -> None:
    b = make_batch(23, B=8, T=7, scale=0.5)
    out = kl_cov_loss(
        logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=b.mask, weights=b.weights if weighted else None,
        frac=frac, coef=coef, agg=mode,
    )  # fmt: skip
    cov = _ref_cov(b)
    k = max(int(len(cov) * frac), 1)
    top = set(sorted(cov, key=lambda key: -cov[key])[:k])
    B, T = b.mask.shape
    terms = {}
    for key in cov:
        lr = b.logp[key] - b.prox_logp[key]
        term = -float(b.adv_tok[key]) * torch.exp(clamp20(lr)) + (coef * lr.abs() if key in top else 0.0)
        terms[key] = (float(b.weights[key]) if weighted else 1.0) * term
    ref = ref_aggregate(terms, B, T, mode)
    assert_close(out.loss, ref, atol=1e-12)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp), atol=1e-12)
    assert_close(out.metrics["cov/selected_frac"].to(DT), k / len(cov), atol=1e-6)


def _selection_inputs(seed: int) -> dict[str, torch.Tensor]:
    b = make_batch(seed, B=8, T=7, scale=0.5)
    r = torch.exp(clamp20(torch.where(b.mask, b.logp.detach() - b.prox_logp, 0.0)))
    adv = torch.where(b.mask, b.adv_tok, 0.0)
    clipped = (-adv * r.clamp(0.8, 1.2)) > (-adv * r)
    return {"logp": b.logp, "advantages": adv, "mask": b.mask, "ppo_clipped": clipped}


def test_clip_cov_draw_is_uniform_over_the_candidates() -> None:
    """k of n candidates, each drawn with probability k/n: 800 draws, every frequency within 5 standard deviations,
    and exactly min(k, n) drawn every time (deterministic seeds: the test cannot flake)."""
    kw = _selection_inputs(24)
    first = clip_cov_selection(**kw, frac=0.1, cov_lb=0.05, cov_ub=2.0, generator=torch.Generator().manual_seed(0))
    cand, k, n, draws = first.candidates, int(first.k), int(first.candidates.sum()), 800
    assert 1 < k < n  # a real subset
    assert int(first.selected.sum()) == k and not (first.selected & ~cand).any()
    counts = torch.zeros(cand.shape, dtype=DT)
    for s in range(draws):
        sel = random_subset(cand, first.k, torch.Generator().manual_seed(s))
        assert int(sel.sum()) == k
        counts += sel.to(DT)
    p = k / n
    sd = math.sqrt(draws * p * (1 - p))
    assert ((counts[cand] - draws * p).abs() < 5 * sd).all(), (counts[cand], draws * p)
    assert counts[~cand].sum() == 0


def test_selection_generator_reproduces_and_advances_with_the_step() -> None:
    cand = torch.ones(4, 50, dtype=torch.bool)
    k = torch.tensor(10)
    draw = lambda seed, step: random_subset(cand, k, selection_generator(seed, step, "cpu"))  # noqa: E731
    assert torch.equal(draw(0, 3), draw(0, 3))
    assert not torch.equal(draw(0, 3), draw(0, 4)) and not torch.equal(draw(0, 3), draw(1, 3))
    assert selection_generator(None, 3, "cpu") is None


@given(seed=seeds, B=dims, T=dims)
@settings(max_examples=30)
def test_on_policy_reductions(seed: int, B: int, T: int) -> None:
    """π_θ = π_prox: KL-Cov's |log r| vanishes (the plain −A objective); Clip-Cov with an empty covariance window is
    PPO-clip, i.e. −A too."""
    b = make_batch(seed, B, T, empty_row=B > 1)
    terms = {(i, t): -float(b.adv_tok[i, t]) * torch.ones((), dtype=DT) for i, t in b.mask.nonzero().tolist()}
    ref = ref_aggregate(terms, B, T, "token-mean")
    kw = {"logp": b.logp, "prox_logp": b.logp.detach(), "advantages": b.adv_tok, "mask": b.mask}
    assert_close(kl_cov_loss(**kw, frac=0.5).loss, ref)
    out = clip_cov_loss(**kw, cov_lb=math.inf, generator=torch.Generator().manual_seed(seed))
    assert_close(out.loss, ref)
    assert out.metrics["cov/selected_frac"] == 0.0


LOSSES = {"clip_cov": clip_cov_loss, "kl_cov": kl_cov_loss}
EXTRA = {"clip_cov": {"frac": 0.2, "cov_lb": -1.0, "generator": None}, "kl_cov": {"frac": 0.2}}


@pytest.mark.parametrize("name", list(LOSSES))
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
@settings(max_examples=30)
def test_huge_log_ratios_stay_finite(name: str, seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    flips = hostile.random_signs(seed, B, T)
    out = LOSSES[name](logp=b.logp, prox_logp=b.logp.detach() + sign * 1000.0 * flips, advantages=b.adv_tok,
                       mask=b.mask, weights=b.weights, **EXTRA[name])  # fmt: skip
    hostile.assert_finite(out, b.logp)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_fully_masked_batch_is_zero_with_zero_grad(name: str, mode: str) -> None:
    b = make_batch(7)
    out = LOSSES[name](logp=b.logp, prox_logp=b.prox_logp, advantages=b.adv_tok, mask=torch.zeros_like(b.mask),
                       weights=b.weights, agg=mode, **EXTRA[name])  # fmt: skip
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


@pytest.mark.parametrize("name", list(LOSSES))
@given(seed=seeds)
@settings(max_examples=30)
def test_garbage_never_leaks_and_only_logp_gets_a_gradient(name: str, seed: int) -> None:
    b = make_batch(seed, scale=0.6)
    prox = b.prox_logp.clone().requires_grad_(True)
    adv = b.adv_tok.clone().requires_grad_(True)
    w = b.weights.clone().requires_grad_(True)
    out = LOSSES[name](logp=b.logp, prox_logp=prox, advantages=adv, mask=b.mask, weights=w, **EXTRA[name])
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, adv, w])
