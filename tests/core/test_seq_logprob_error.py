"""Sequence log-prob-error mask against a float64 reference written from NeMo-RL's code (NVIDIA-NeMo/RL at 7ea279a,
``nemo_rl/algorithms/grpo.py`` ``compute_and_apply_seq_logprob_error_masking``: lp_error = |generation − prev|,
seq_mult_prob_error = Σ_t exp(lp_error·mask)·mask / Σ_t mask over valid sequences, keep iff ≤ threshold). NeMo-RL is
not installed, so this reference stands in for a parity test."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss
from steadyrl.core.rejection import seq_logprob_error_mask

DT = torch.float64


def _nemo_reference(prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor, threshold: float):
    """Per-row loops of NeMo-RL's computation: (keep per sequence, error per valid sequence)."""
    B, T = mask.shape
    keep, errors = [], []
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            keep.append(False)  # NeMo-RL: error 0 passes, but the row has no token to keep
            continue
        err = sum(math.exp(abs(float(gen[i, t]) - float(prev[i, t]))) for t in toks) / len(toks)
        errors.append(err)
        keep.append(err <= threshold)
    return keep, errors


def _batch(seed: int, B: int = 8, T: int = 7, scale: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(B, T, generator=g, dtype=DT) * 2
    gen = prev + scale * torch.randn(B, T, generator=g, dtype=DT) * (torch.rand(B, 1, generator=g) < 0.5)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = False
    nan = float("nan")
    return prev.masked_fill(~mask, nan), gen.masked_fill(~mask, nan), mask


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000), threshold=st.sampled_from([1.0, 1.05, 1.5, 2.0, 10.0]))
def test_matches_the_nemo_rl_reference(seed: int, threshold: float) -> None:
    prev, gen, mask = _batch(seed)
    out = seq_logprob_error_mask(log_ratio=prev - gen, mask=mask, threshold=threshold)
    keep, errors = _nemo_reference(prev, gen, mask, threshold)
    expect = mask & torch.tensor(keep)[:, None]
    assert torch.equal(out.mask, expect)
    assert torch.equal(out.weights, expect.to(DT)) and out.unit_weights
    assert out.metrics["is/seq_mult_prob_error_mean"].item() == pytest.approx(sum(errors) / len(errors), abs=1e-12)
    assert out.metrics["is/seq_mult_prob_error_max"].item() == pytest.approx(max(errors), abs=1e-12)
    n_valid = len(errors)
    dropped = sum(1 for i, k in enumerate(keep) if mask[i].any() and not k)
    assert out.metrics["is/seq_masked_frac"].item() == pytest.approx(dropped / n_valid, abs=1e-12)


def test_the_statistic_is_the_mean_of_token_errors_not_exp_of_the_mean() -> None:
    """|ℓ| = (0, 1.4): mean_t e^{|ℓ|} = (1 + e^1.4)/2 ≈ 2.53 > 2 (dropped), while e^{mean |ℓ|} = e^0.7 ≈ 2.01 and
    e^{|mean ℓ|} would keep or drop differently: the sequence is dropped at threshold 2.05, as in NeMo-RL."""
    ell = torch.tensor([[0.0, 1.4]], dtype=DT)
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = seq_logprob_error_mask(log_ratio=ell, mask=mask, threshold=2.05)
    assert not out.mask.any()
    assert out.metrics["is/seq_mult_prob_error_mean"].item() == pytest.approx((1 + math.exp(1.4)) / 2, abs=1e-14)
    assert math.exp(0.7) < 2.05  # the other readings would have kept it


def test_on_policy_keeps_everything_and_the_error_is_one() -> None:
    prev, _, mask = _batch(1)
    out = seq_logprob_error_mask(log_ratio=torch.zeros_like(prev), mask=mask, threshold=1.0)
    assert torch.equal(out.mask, mask)
    assert out.metrics["is/seq_mult_prob_error_mean"].item() == 1.0


def test_sign_of_the_mismatch_does_not_matter() -> None:
    prev, gen, mask = _batch(2)
    a = seq_logprob_error_mask(log_ratio=prev - gen, mask=mask, threshold=1.3)
    b = seq_logprob_error_mask(log_ratio=gen - prev, mask=mask, threshold=1.3)
    assert torch.equal(a.mask, b.mask)


def test_huge_mismatch_is_dropped_and_finite() -> None:
    prev, _, mask = _batch(3)
    out = seq_logprob_error_mask(log_ratio=torch.full_like(prev, -1000.0), mask=mask, threshold=1e6)
    assert not out.mask.any() and out.metrics["loss/all_masked"].item() == 1.0
    assert all(math.isfinite(v.item()) for v in out.metrics.values())


def test_fully_masked_input() -> None:
    prev, gen, mask = _batch(4)
    out = seq_logprob_error_mask(log_ratio=prev - gen, mask=torch.zeros_like(mask))
    assert not out.mask.any() and out.metrics["is/seq_mult_prob_error_max"].item() == 0.0


def test_threshold_below_one_is_refused() -> None:
    prev, gen, mask = _batch(5)
    with pytest.raises(ValueError, match="threshold"):
        seq_logprob_error_mask(log_ratio=prev - gen, mask=mask, threshold=0.9)


def test_compute_loss_trains_only_on_kept_sequences() -> None:
    """Through ``compute_loss`` (ℓ from the given π_prox and μ): the loss equals the plain loss on the kept rows."""
    prev, gen, mask = _batch(6)
    g = torch.Generator().manual_seed(0)
    logp = (prev.nan_to_num(0.0) + 0.1 * torch.randn(prev.shape, generator=g, dtype=DT)).requires_grad_(True)
    adv = torch.randn(mask.shape[0], generator=g, dtype=DT)
    batch = {"logp": logp, "behav_logp": gen, "prox_logp": prev, "mask": mask, "advantages": adv}
    spec = {"advantage.type": "given", "seq_logprob_error.threshold": 1.3}
    out = compute_loss("seq_logprob_error", batch, overrides=spec, return_details=True)
    keep, _ = _nemo_reference(prev, gen, mask, 1.3)
    kept = mask & torch.tensor(keep)[:, None]
    assert 0 < kept.sum() < mask.sum()
    assert torch.equal(out.mask, kept)
    plain = compute_loss("ppo", {**batch, "mask": kept}, overrides={"advantage.type": "given"})
    assert out.loss.item() == pytest.approx(plain.loss.item(), abs=1e-12)
