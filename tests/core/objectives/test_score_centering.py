"""Score centering (arXiv 2609.20807, Eq. 14) in float64: the loss against the equation written token by token, the
gradient identity (the sampler-expected weighted score is subtracted), the top-k form against the exact one, and the
chunked head's term against the direct form."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from steadyrl.core.objectives.score_centering import (
    centering_term,
    score_centering_loss,
    topk_coefficients,
    weight_from_log_ratio,
)
from steadyrl.core.vocab_chunks import chunked_log_probs

WEIGHTS = ["none", "tis", "mis"]
M, H, V = 7, 6, 24


def f_ref(r: float, weight: str) -> float:
    """f of the paper: 1, min(r, 2), r·1[0.5 ≤ r ≤ 5]."""
    if weight == "none":
        return 1.0
    if weight == "tis":
        return min(r, 2.0)
    return r if 0.5 <= r <= 5.0 else 0.0


def setup(seed: int = 0, *, q_support: int | None = None, near: float | None = None):  # type: ignore[no-untyped-def]
    """Hidden states, an output layer, sampled tokens and a behavior distribution q [M, V] (float64)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    logits_q = torch.randn(M, V, generator=g, dtype=torch.float64) * 1.5
    if near is not None:  # q close to the current policy p
        logits_q = hidden @ weight.T + near * logits_q
    if q_support is not None:  # q only on its q_support most likely tokens
        cut = logits_q.topk(q_support, dim=-1).values[:, -1:]
        logits_q = logits_q.masked_fill(logits_q < cut, -math.inf)
    log_q = torch.log_softmax(logits_q, dim=-1)
    tokens = torch.multinomial(log_q.exp(), 1, generator=g).squeeze(-1)
    adv = torch.randn(M, generator=g, dtype=torch.float64)
    return hidden, weight, tokens, log_q, adv


def reference_loss(logits: Tensor, tokens: Tensor, log_q: Tensor, adv: Tensor, weight: str) -> Tensor:
    """Eq. 14 token by token, Python floats for the detached pieces: mean_t −A_t [w_a log p_a − Σ_v c_v log p_v]."""
    logp = torch.log_softmax(logits, dim=-1)
    p, q = logp.detach().exp(), log_q.exp()
    total = logits.new_zeros(())
    for t in range(logits.shape[0]):
        a = int(tokens[t])
        w_a = f_ref(float(p[t, a] / q[t, a]), weight)
        centre = logits.new_zeros(())
        for v in range(logits.shape[1]):
            qv = float(q[t, v])
            if qv > 0:
                centre = centre + qv * f_ref(float(p[t, v]) / qv, weight) * logp[t, v]
        total = total - float(adv[t]) * (w_a * logp[t, a] - centre)
    return total / logits.shape[0]


def loss_via_chunks(hidden: Tensor, weight: Tensor, tokens: Tensor, log_q: Tensor, adv: Tensor, f: str, *,
                    k: int = 0, chunk: int = 3) -> Tensor:  # fmt: skip
    """The library's loss: the chunked head's logp and centering term, then ``score_centering_loss`` (one row)."""
    if k:
        top = log_q.topk(k, dim=-1)
        term = centering_term(behav_logp=top.values, head_ids=top.indices, weight=f)
    else:
        term = centering_term(behav_logp=log_q, head_ids=None, weight=f)
    out = chunked_log_probs(hidden=hidden, weight=weight, tokens=tokens, chunk_tokens=chunk, terms={"c": term})
    behav = log_q.gather(-1, tokens[:, None]).squeeze(-1)
    mask = torch.ones(1, M, dtype=torch.bool)
    return score_centering_loss(
        logp=out.logp[None], behav_logp=behav[None], centering=out.terms["c"][None], advantages=adv[None],
        mask=mask, weight=f,  # type: ignore[arg-type]
    ).loss  # fmt: skip


@pytest.mark.parametrize("f", WEIGHTS)
def test_loss_and_gradient_match_equation_14(f: str) -> None:
    hidden, weight, tokens, log_q, adv = setup(1, near=0.6)
    w1 = weight.clone().requires_grad_()
    loss = loss_via_chunks(hidden, w1, tokens, log_q, adv, f)
    loss.backward()
    w2 = weight.clone().requires_grad_()
    ref = reference_loss(hidden @ w2.T, tokens, log_q, adv, f)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("f", WEIGHTS)
def test_gradient_subtracts_the_sampler_expected_weighted_score(f: str) -> None:
    """∇ℓ(a) = −A [w_a ∇log p_a − Σ_v q_v w_v ∇log p_v] (scores by autograd, one per token v), and so the
    sampler's expectation Σ_a q_a ∇ℓ(a) vanishes: the centering is a control variate of mean zero under q."""
    hidden, weight, _, log_q, adv = setup(2, near=0.8)
    t = 0  # one state; every token a of the vocabulary in turn
    h, lq = hidden[t : t + 1].expand(V, H), log_q[t : t + 1].expand(V, V)
    a = torch.arange(V)
    w = weight.clone().requires_grad_()
    out = chunked_log_probs(hidden=h, weight=w, tokens=a, chunk_tokens=5,
                            terms={"c": centering_term(behav_logp=lq, head_ids=None, weight=f)})  # fmt: skip
    per_token = -adv[t] * (
        weight_from_log_ratio(out.logp.detach() - lq.gather(-1, a[:, None]).squeeze(-1), f) * out.logp - out.terms["c"]
    )
    q = lq[0].exp()
    grads = [torch.autograd.grad(per_token[i], w, retain_graph=True)[0] for i in range(V)]
    expected = sum(q[i] * grads[i] for i in range(V))
    assert float(expected.abs().max()) < 1e-12
    # explicit form for one sampled token
    logits_w = weight.clone().requires_grad_()
    logp = torch.log_softmax(hidden[t] @ logits_w.T, dim=-1)
    scores = [torch.autograd.grad(logp[v], logits_w, retain_graph=True)[0] for v in range(V)]
    p = logp.detach().exp()
    wv = [f_ref(float(p[v] / q[v]), f) for v in range(V)]
    b = 3
    explicit = -adv[t] * (wv[b] * scores[b] - sum(q[v] * wv[v] * scores[v] for v in range(V)))
    torch.testing.assert_close(grads[b], explicit, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("f", WEIGHTS)
def test_topk_equals_exact_when_the_head_covers_the_support(f: str) -> None:
    hidden, weight, tokens, log_q, adv = setup(3, q_support=10)
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    exact = loss_via_chunks(hidden, w1, tokens, log_q, adv, f)
    top = loss_via_chunks(hidden, w2, tokens, log_q, adv, f, k=16)
    exact.backward()
    top.backward()
    torch.testing.assert_close(top, exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-10, atol=1e-12)


def test_topk_is_exact_on_policy_and_close_near_it() -> None:
    """The tail rule q_v = ρ p_v holds exactly when q = p (ρ = 1); near it the top-k gradient stays close (measured:
    4e-3 relative at near=0.5, 0.12 for an unrelated q)."""
    for near, tol in ((0.0, 1e-10), (0.5, 0.02)):
        hidden, weight, tokens, log_q, adv = setup(4, near=near)
        w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
        loss_via_chunks(hidden, w1, tokens, log_q, adv, "tis").backward()
        loss_via_chunks(hidden, w2, tokens, log_q, adv, "tis", k=16).backward()
        err = float((w2.grad - w1.grad).norm() / w1.grad.norm())
        assert err < tol, (near, err)


@pytest.mark.parametrize("f", WEIGHTS)
def test_topk_head_coefficient_and_alpha_follow_the_tail_rule(f: str) -> None:
    """ρ = (1 − Σ_H q)/(1 − Σ_H p), α = ρ f(1/ρ), c_v = q_v f(p_v/q_v) − α p_v, against Python floats."""
    _, _, _, log_q, _ = setup(5)
    g = torch.Generator().manual_seed(9)
    logp = torch.log_softmax(torch.randn(M, V, generator=g, dtype=torch.float64), -1)
    top = log_q.topk(5, dim=-1)
    head, alpha = topk_coefficients(logp, top.indices, top.values, f)  # type: ignore[arg-type]
    for t in range(M):
        ids = top.indices[t].tolist()
        q = [math.exp(float(x)) for x in top.values[t]]
        p = [math.exp(float(logp[t, v])) for v in ids]
        rho = (1 - sum(q)) / (1 - sum(p))
        a = rho * f_ref(1 / rho, f)
        assert abs(float(alpha[t]) - a) < 1e-12
        for j in range(5):
            assert abs(float(head[t, j]) - (q[j] * f_ref(p[j] / q[j], f) - a * p[j])) < 1e-12


def test_weights_are_finite_at_extreme_log_ratios() -> None:
    lr = torch.tensor([-1000.0, -math.inf, math.log(0.5), 0.0, math.log(5.0), 1000.0, math.inf], dtype=torch.float64)
    assert weight_from_log_ratio(lr, "none").tolist() == [1.0] * 7
    assert torch.allclose(weight_from_log_ratio(lr, "tis"), torch.tensor([0, 0, 0.5, 1, 2, 2, 2], dtype=torch.float64))
    assert torch.allclose(weight_from_log_ratio(lr, "mis"), torch.tensor([0, 0, 0.5, 1, 5, 0, 0], dtype=torch.float64))
