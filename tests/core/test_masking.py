"""Masked reductions and aggregation modes against float64 references written from docs/algorithms.md."""

from __future__ import annotations

import pytest
import torch

from steadyrl.core.masking import (
    AGG_MODES,
    aggregate,
    geo_log_ratio,
    masked_mean,
    safe_exp,
    seq_log_ratio,
)


def _batch(seed: int = 0, B: int = 5, T: int = 7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False  # an empty sequence
    mask[1, 0] = True
    return x, mask


def _ref(x: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    B, T = x.shape
    rows = [[float(x[i, t]) for t in range(T) if mask[i, t]] for i in range(B)]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "token-sum":
        return sum(sum(r) for r in rows)
    return sum(sum(r) for r in rows) / (B * T)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_reference(mode: str) -> None:
    x, mask = _batch()
    x = x.masked_fill(~mask, float("nan"))  # garbage at masked positions must not leak
    assert torch.allclose(aggregate(x, mask, mode), torch.tensor(_ref(x, mask, mode), dtype=torch.float64))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_all_masked_is_zero_with_zero_grad(mode: str) -> None:
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = aggregate(x, torch.zeros(3, 4, dtype=torch.bool), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_aggregate_rejects_unknown_mode() -> None:
    x, mask = _batch()
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(x, mask, "mean")  # type: ignore[arg-type]


def test_seq_and_geo_log_ratio() -> None:
    x, mask = _batch()
    S = seq_log_ratio(x, mask)
    for i in range(x.shape[0]):
        vals = x[i][mask[i]]
        assert torch.allclose(S[i], vals.sum())
        expect = vals.mean() if len(vals) else torch.tensor(0.0, dtype=torch.float64)
        assert torch.allclose(geo_log_ratio(x, mask)[i], expect)
    assert torch.allclose(masked_mean(x, mask), x[mask].mean())


def test_safe_exp_is_finite_for_huge_log_ratios() -> None:
    y = safe_exp(torch.tensor([-1000.0, 0.0, 1000.0]))
    assert torch.isfinite(y).all()
    assert torch.allclose(y[1], torch.tensor(1.0))
