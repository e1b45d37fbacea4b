"""Staleness diagnostics against float64 loop references written from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.diagnostics import lag_metrics, staleness_diagnostics

ATOL = 1e-10


def _batch(seed: int = 0, B: int = 7, T: int = 6):
    g = torch.Generator().manual_seed(seed)
    behav = torch.randn(B, T, generator=g, dtype=torch.float64) - 2.0
    logp = behav + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False
    mask[1, 0] = True
    versions = torch.randint(3, 10, (B, T), generator=g)
    nan = torch.full_like(logp, float("nan"))
    return torch.where(mask, logp, nan), torch.where(mask, behav, nan), mask, versions


def _ess(vals: list[float]) -> float:
    w = [math.exp(v) for v in vals]
    return sum(w) ** 2 / sum(x * x for x in w)


def test_staleness_diagnostics_match_reference() -> None:
    logp, behav, mask, versions = _batch(seed=1)
    cap = 1.5
    out = staleness_diagnostics(logp=logp, behav_logp=behav, mask=mask, versions=versions, learner_version=12, cap=cap)
    B, T = mask.shape
    rows = [[float(logp[i, t] - behav[i, t]) for t in range(T) if mask[i, t]] for i in range(B)]
    S = [sum(r) for r in rows if r]
    toks = [x for r in rows for x in r]
    w = [math.exp(s) for s in S]
    lags = [[12 - int(versions[i, t]) for t in range(T) if mask[i, t]] for i in range(B)]
    flat_lags = [x for r in lags for x in r]
    expect = {
        "is/ess_ratio": _ess(S) / len(S),
        "is/ess_ratio_token": _ess(toks) / len(toks),
        "is/weight_min": min(w),
        "is/weight_mean": sum(w) / len(w),
        "is/weight_max": max(w),
        "is/log_weight_max": max(S),
        "is/seq_truncated_frac": sum(math.exp(s) > cap for s in S) / len(S),
        "kl/k1": sum(-x for x in toks) / len(toks),  # k1 = −ℓ
        "kl/k3": sum(math.exp(x) - x - 1 for x in toks) / len(toks),  # k3 = e^ℓ − ℓ − 1
        "kl/max_abs_logp_diff": max(abs(x) for x in toks),
        "lag/mean": sum(flat_lags) / len(flat_lags),
        "lag/max": max(flat_lags),
        "lag/min": min(flat_lags),
        "lag/oldest_token_mean": sum(max(r) for r in lags if r) / len(S),
        "lag/newest_token_mean": sum(min(r) for r in lags if r) / len(S),
    }
    assert set(out) == set(expect)
    for key, val in expect.items():
        assert abs(float(out[key]) - val) < ATOL * max(1.0, abs(val)), key
        assert out[key].dim() == 0 and not out[key].requires_grad
    assert 0 < expect["is/seq_truncated_frac"] < 1
    assert expect["lag/oldest_token_mean"] > expect["lag/newest_token_mean"]


def test_lag_without_learner_version_uses_newest_version() -> None:
    versions = torch.tensor([[5, 7, 0], [9, 9, 9]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    out = lag_metrics(versions=versions, mask=mask, dtype=torch.float64)
    # reference version = 9 (newest masked); lags: [4, 2], [0, 0]
    assert float(out["lag/max"]) == 4.0 and float(out["lag/min"]) == 0.0
    assert float(out["lag/mean"]) == 1.5
    assert float(out["lag/oldest_token_mean"]) == 2.0 and float(out["lag/newest_token_mean"]) == 1.0


def test_no_versions_means_no_lag_metrics() -> None:
    logp, behav, mask, _ = _batch(seed=2)
    out = staleness_diagnostics(logp=logp, behav_logp=behav, mask=mask)
    assert not any(k.startswith("lag/") for k in out)


def test_on_policy_diagnostics() -> None:
    logp, _, mask, _ = _batch(seed=3)
    out = staleness_diagnostics(logp=logp, behav_logp=logp.clone(), mask=mask)
    assert abs(float(out["is/ess_ratio"]) - 1.0) < 1e-12 and abs(float(out["is/ess_ratio_token"]) - 1.0) < 1e-12
    assert float(out["kl/k1"]) == 0.0 and float(out["kl/k3"]) == 0.0
    assert float(out["is/weight_min"]) == 1.0 == float(out["is/weight_max"])
    assert float(out["is/seq_truncated_frac"]) == 0.0


@given(seed=st.integers(0, 2**16), sign=st.sampled_from([-1.0, 1.0]))
def test_diagnostics_finite_at_huge_log_ratios(seed: int, sign: float) -> None:
    g = torch.Generator().manual_seed(seed)
    behav = torch.randn(4, 5, generator=g)
    logp = (behav + sign * 1000.0 * (torch.rand(4, 5, generator=g) > 0.5)).requires_grad_(True)
    mask = torch.rand(4, 5, generator=g) > 0.3
    out = staleness_diagnostics(logp=logp, behav_logp=behav, mask=mask, versions=torch.zeros(4, 5, dtype=torch.long))
    for key, v in out.items():
        assert torch.isfinite(v), key
        assert not v.requires_grad, key


def test_fully_masked_batch_is_finite() -> None:
    logp = torch.randn(3, 4)
    out = staleness_diagnostics(
        logp=logp, behav_logp=logp + 1, mask=torch.zeros(3, 4), versions=torch.ones(3, 4, dtype=torch.long)
    )
    assert all(torch.isfinite(v) for v in out.values())
    assert float(out["is/ess_ratio"]) == 0.0


def test_diagnostics_reject_bad_cap() -> None:
    logp, behav, mask, _ = _batch()
    with pytest.raises(ValueError):
        staleness_diagnostics(logp=logp, behav_logp=behav, mask=mask, cap=0.0)
