"""Entropy bonus, its vocabulary term and the adaptive entropy coefficient against float64 references.

(a) The chunked entropy term (``core.entropy.entropy_term`` in ``chunked_log_probs``) equals −Σ_v p_v log p_v of the
    full softmax of z/T, in value and in its gradient w.r.t. the hidden states, the output weight and the bias
    (1e-12 relative in float64, 1e-6 in float32), at several temperatures and under top-k / top-p.
(b) ``entropy_bonus`` is −c·agg(m H) for every aggregation mode, an exact zero on an all-masked batch.
(c) The controller, through the step-controller protocol (``loss_inputs`` → loss metrics → ``before_step``),
    reproduces the rule written from TRL 1.16.0's ``GRPOConfig`` documentation and Skywork-OR1 (arXiv 2505.22312);
    its state round-trips.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import Tensor

from steadyrl.control.adaptive_entropy import AdaptiveEntropyController
from steadyrl.core.entropy import (
    ENTROPY_SUM,
    ENTROPY_TOKENS,
    adaptive_entropy_coef,
    applied_entropy_coef,
    entropy_bonus,
    entropy_term,
)
from steadyrl.core.masking import AGG_MODES, aggregate
from steadyrl.core.vocab_chunks import chunked_log_probs
from steadyrl.methods.spec import AdaptiveEntropy
from steadyrl.rollout.distribution import SamplingParams, sampling_log_probs

DT = torch.float64
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------------------------- (a) the vocabulary term
def reference_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """H_t = −Σ_v p_v log p_v with p = softmax((h Wᵀ + b)/T), written directly on the full [M, V] logits."""
    z = torch.nn.functional.linear(hidden, weight, bias) / temperature
    p = torch.softmax(z, dim=-1)
    return -(p * torch.log_softmax(z, dim=-1)).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_entropy_term_equals_the_full_vocabulary_entropy(
    dtype: torch.dtype, temperature: float, chunk: int, bias: bool
) -> None:
    """Value and gradient of Σ_t a_t H_t (random cotangents a) w.r.t. hidden states, output weight and bias."""
    g = torch.Generator().manual_seed(int(temperature * 10) + chunk)
    M, H, V = 23, 10, 57
    hidden = torch.randn(M, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.8
    b = torch.randn(V, generator=g, dtype=dtype) * 0.2 if bias else None
    tokens = torch.randint(0, V, (M,), generator=g)
    cot = torch.randn(M, generator=g, dtype=dtype)
    fn = functools.partial(sampling_log_probs, params=SamplingParams(temperature=temperature))
    results = []
    for chunked in (True, False):
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, *([b] if b is not None else []))]
        h, w, bb = leaves[0], leaves[1], (leaves[2] if bias else None)
        if chunked:
            ent = chunked_log_probs(hidden=h, weight=w, bias=bb, tokens=tokens, chunk_tokens=chunk, log_probs=fn,
                                    terms={"entropy": entropy_term}).terms["entropy"]  # fmt: skip
        else:
            ent = reference_entropy(h, w, bb, temperature)
        results.append((ent.detach(), torch.autograd.grad((ent * cot).sum(), leaves)))
    (e_chunked, g_chunked), (e_ref, g_ref) = results
    assert e_chunked.dtype == dtype
    assert rel(e_chunked, e_ref) <= TOL[dtype]
    for got, want in zip(g_chunked, g_ref, strict=True):
        assert rel(got, want) <= TOL[dtype]


@pytest.mark.parametrize("params", [SamplingParams(top_k=5), SamplingParams(temperature=0.8, top_p=0.7)])
def test_entropy_term_of_a_truncated_distribution_is_its_renormalized_entropy(params: SamplingParams) -> None:
    """Under top-k / top-p the term is the entropy of the kept, renormalized distribution (the sampler's), with a
    finite gradient (tokens outside the support contribute nothing)."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(9, 31, generator=g, dtype=DT, requires_grad=True)
    lp = sampling_log_probs(z, params=params)
    ent = entropy_term(lp, torch.arange(9))
    kept = torch.isfinite(lp.detach())
    p = torch.where(kept, lp.detach().exp(), 0.0)
    ref = -(p * torch.where(kept, lp.detach(), 0.0)).sum(-1)
    assert rel(ent.detach(), ref) <= 1e-12
    (gz,) = torch.autograd.grad(ent.sum(), z)
    assert torch.isfinite(gz).all() and torch.equal(gz[~kept], torch.zeros_like(gz[~kept]))


# ---------------------------------------------------------------------------------------------------- (b) the bonus
def test_bonus_is_minus_coef_times_the_token_mean_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.rand(3, 4, generator=g, dtype=DT) * 3
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    x = h.masked_fill(~mask, float("nan")).requires_grad_(True)
    out = entropy_bonus(entropy=x, mask=mask, coef=0.05)
    vals = [float(h[i, t]) for i in range(3) for t in range(4) if mask[i, t]]
    assert math.isclose(float(out.loss.detach()), -0.05 * sum(vals) / len(vals), rel_tol=1e-12)
    (gx,) = torch.autograd.grad(out.loss, x)
    assert torch.equal(gx, torch.where(mask, torch.full_like(h, -0.05 / len(vals)), 0.0))
    assert math.isclose(float(out.metrics["entropy/mean"]), sum(vals) / len(vals), rel_tol=1e-12)
    assert float(out.metrics[ENTROPY_SUM]) == pytest.approx(sum(vals), rel=1e-12)
    assert float(out.metrics[ENTROPY_TOKENS]) == len(vals)
    assert all(not v.requires_grad for v in out.metrics.values())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_bonus_follows_every_aggregation_mode(agg: str) -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.rand(4, 6, generator=g, dtype=DT, requires_grad=True)
    mask = torch.rand(4, 6, generator=g) > 0.4
    mask[1] = False
    coef = torch.tensor(0.03, dtype=DT)
    out = entropy_bonus(entropy=h, mask=mask, coef=coef, agg=agg, norm_len=5.0)  # type: ignore[arg-type]
    ref = -0.03 * aggregate(h, mask, agg, norm_len=5.0)
    assert rel(out.loss.detach(), ref.detach()) <= 1e-15
    (g_out,) = torch.autograd.grad(out.loss, h)
    (g_ref,) = torch.autograd.grad(ref, h)
    assert torch.equal(g_out, g_ref)


def test_all_masked_is_an_exact_zero_with_zero_gradient() -> None:
    x = torch.rand(2, 3, dtype=DT, requires_grad=True)
    for agg in AGG_MODES:
        out = entropy_bonus(entropy=x, mask=torch.zeros(2, 3, dtype=torch.bool), coef=0.1, agg=agg)  # type: ignore[arg-type]
        (gx,) = torch.autograd.grad(out.loss, x)
        assert float(out.loss.detach()) == 0.0 and torch.equal(gx, torch.zeros_like(x))
        assert float(out.metrics["loss/all_masked"]) == 1.0 and float(out.metrics[ENTROPY_TOKENS]) == 0.0


# -------------------------------------------------------------------------------------------- (c) the controller
def _ref_trajectory(c: float, entropies: list[float], target: float, delta: float, lo: float, hi: float):
    applied, coefs, last = [], [], math.inf
    for h in entropies:
        applied.append(c if last <= target else 0.0)
        c = min(c + delta, hi) if h <= target else max(c - delta, lo)
        coefs.append(c)
        last = h
    return applied, coefs


def _protocol_step(ctrl: AdaptiveEntropyController, total: float, tokens: float) -> tuple[float, float]:
    """One optimizer step through the protocol: the coefficient the loss gets, then ``before_step`` on the loss's
    metrics Σ m H and Σ m; returns (applied, c after the step)."""
    applied = ctrl.loss_inputs(device="cpu")["entropy_coef"]
    metrics = {ENTROPY_SUM: torch.tensor(total, dtype=torch.float32), ENTROPY_TOKENS: torch.tensor(tokens)}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    out = ctrl.before_step(optimizer=optimizer, params=[], metrics=metrics)
    ctrl.after_step(optimizer=optimizer)
    return float(applied), float(out["entropy/adaptive_coef"])


@pytest.mark.parametrize("seed", range(5))
def test_adaptive_coefficient_follows_the_rule_through_the_protocol(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_tokens = torch.randint(1, 50, (30,), generator=g).double()
    totals = (torch.rand(30, generator=g, dtype=DT) * 2 * n_tokens).float().double()  # as the float32 metric carries
    entropies = (totals / n_tokens).tolist()
    spec = AdaptiveEntropy(target=1.0, delta=0.003, coef_min=0.001, coef_max=0.02)
    ctrl = AdaptiveEntropyController(spec, 0.01)
    got = [_protocol_step(ctrl, float(s), float(n)) for s, n in zip(totals, n_tokens, strict=True)]
    ref_applied, ref_coefs = _ref_trajectory(0.01, entropies, 1.0, 0.003, 0.001, 0.02)
    assert [a for a, _ in got] == pytest.approx(ref_applied, abs=1e-15)
    assert [c for _, c in got] == pytest.approx(ref_coefs, abs=1e-15)
    assert min(ref_coefs) >= 0.001 and max(ref_coefs) <= 0.02
    assert ctrl.coef.dtype == DT and ctrl.last_entropy.dtype == DT


def test_the_tensor_rule_is_the_float_rule() -> None:
    for c, h in [(0.01, 0.5), (0.01, 1.5), (0.0, 0.1), (0.999, 0.0), (0.002, 3.0)]:
        want = adaptive_entropy_coef(c, h, target=1.0, delta=0.004, coef_min=0.001, coef_max=1.0)
        got = adaptive_entropy_coef(torch.tensor(c, dtype=DT), torch.tensor(h), target=1.0, delta=0.004,
                                    coef_min=0.001, coef_max=1.0)  # fmt: skip
        assert float(got) == want
        assert float(applied_entropy_coef(torch.tensor(c, dtype=DT), torch.tensor(h), target=1.0)) == (
            applied_entropy_coef(c, h, target=1.0)
        )


def test_an_empty_step_counts_as_entropy_zero_as_in_trl() -> None:
    """TRL divides by max(Σ m, 1): a step with no trained token reads Ĥ = 0 (≤ target) and raises c."""
    ctrl = AdaptiveEntropyController(AdaptiveEntropy(target=0.5, delta=0.01), 0.1)
    _, c = _protocol_step(ctrl, 0.0, 0.0)
    assert c == pytest.approx(0.11, abs=1e-15) and float(ctrl.last_entropy) == 0.0


def test_state_round_trips_and_accepts_trl_floats() -> None:
    spec = AdaptiveEntropy(target=1.0)
    a = AdaptiveEntropyController(spec, 0.01)
    _protocol_step(a, 5.0, 10.0)
    b = AdaptiveEntropyController(spec, 0.5)
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.coef, a.coef) and torch.equal(b.applied, a.applied)
    c = AdaptiveEntropyController(spec)
    c.load_state_dict({"coef": 0.25, "last_entropy": math.inf})  # TRL's entropy_ctrl_state.json, before any step
    assert float(c.coef) == 0.25 and float(c.applied) == 0.0
    with pytest.raises(ValueError, match="coef_min"):
        AdaptiveEntropy(coef_min=0.5, coef_max=0.2)
