"""The sampling distribution against a float64, one-row-at-a-time reference written from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.rollout.distribution import (
    SamplingParams,
    check_sampling_params,
    entropy_from_log_probs,
    sampling_log_probs,
)


def reference_log_probs(logits: list[float], *, temperature: float, top_k: int, top_p: float) -> list[float]:
    """log μ from the definition: scale, keep the k largest, keep the smallest prefix of mass ≥ p, renormalize."""
    z = [x / temperature for x in logits]
    ranked = sorted(range(len(z)), key=lambda v: -z[v])
    kept = ranked[:top_k] if top_k else ranked
    m = max(z[v] for v in kept)
    total = sum(math.exp(z[v] - m) for v in kept)
    nucleus, mass = [], 0.0
    for v in kept:
        if mass >= top_p:
            break
        nucleus.append(v)
        mass += math.exp(z[v] - m) / total
    lse = m + math.log(sum(math.exp(z[v] - m) for v in nucleus))
    return [z[v] - lse if v in nucleus else -math.inf for v in range(len(z))]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 0.9), (1.3, 0, 0.5), (0.5, 3, 1.0), (1.0, 1, 1.0)]
)
def test_matches_reference(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 17, generator=gen, dtype=torch.float64) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = sampling_log_probs(logits, params=params)
    assert got.dtype == torch.float64  # float64 logits are scored in float64 (float32 and below: float32)
    assert sampling_log_probs(logits.float(), params=params).dtype == torch.float32
    for row, out in zip(logits.tolist(), got, strict=True):
        ref = torch.tensor(
            reference_log_probs(row, temperature=temperature, top_k=top_k, top_p=top_p), dtype=torch.float64
        )
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        torch.testing.assert_close(out[~torch.isinf(out)], ref[~torch.isinf(ref)], atol=1e-12, rtol=0)
        assert math.isclose(out.exp().sum().item(), 1.0, abs_tol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = sampling_log_probs(probs.log(), params=SamplingParams(top_p=0.8)).exp()
    # 0.5 < 0.8 so the second token is kept; 0.5 + 0.3 = 0.8 reaches p, so the third is dropped.
    torch.testing.assert_close(got, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6, rtol=0)
    # The top token is kept however small p is.
    tiny_p = sampling_log_probs(probs.log(), params=SamplingParams(top_p=1e-6)).exp()
    torch.testing.assert_close(tiny_p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_entropy_and_gradient_are_finite_with_truncation() -> None:
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(1), requires_grad=True)
    log_mu = sampling_log_probs(logits, params=SamplingParams(temperature=0.7, top_k=4, top_p=0.9))
    entropy = entropy_from_log_probs(log_mu)
    ref = torch.stack([-(row[row.isfinite()].exp() * row[row.isfinite()]).sum() for row in log_mu.detach()])
    torch.testing.assert_close(entropy.detach(), ref, atol=1e-6, rtol=0)
    (entropy.sum() + log_mu[:, 0].sum()).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(
    ("params", "field"),
    [(SamplingParams(temperature=0.0), "temperature"), (SamplingParams(top_k=-1), "top_k"),
     (SamplingParams(top_p=0.0), "top_p"), (SamplingParams(top_p=1.5), "top_p")],
)
def test_bad_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        check_sampling_params(params)
