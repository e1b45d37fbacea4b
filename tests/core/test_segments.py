"""Turn segments and segment-level TIS against a float64 reference written from ROLL's code (alibaba/ROLL at 8eb27cc:
``compute_segment_masked_mean`` finds the runs of 1s with a diff of the mask and averages ℓ = old − infer over each;
``compute_train_infer_correction`` exponentiates and clamps to [0, upper_bound]). ROLL is not installed, so this
reference stands in for a parity test; ROLL's +1e-8 in the segment-mean denominator is reproduced at 1e-7."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import geo_log_ratio
from steadyrl.core.segments import segment_count, segment_index, segment_mean, segment_tis

DT = torch.float64


def _roll_runs(row: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s, found as ROLL does: starts where diff = +1, ends where diff = −1 (or T)."""
    T = len(row)
    prev = [False, *row[:-1]]
    starts = [t for t in range(T) if row[t] and not prev[t]]
    ends = [t for t in range(T) if prev[t] and not row[t]] + ([T] if row and row[-1] else [])
    return list(zip(starts, ends, strict=True))


def _ref_segment_weights(ell: torch.Tensor, mask: torch.Tensor, cap: float | None, eps: float = 0.0):
    B, T = mask.shape
    w = [[0.0] * T for _ in range(B)]
    runs_per_row = []
    for i in range(B):
        runs = _roll_runs(mask[i].tolist())
        runs_per_row.append(len(runs))
        for a, e in runs:
            mean = sum(float(ell[i, t]) for t in range(a, e)) / ((e - a) + eps)
            value = math.exp(mean)
            if cap is not None:
                value = min(max(value, 0.0), cap)
            for t in range(a, e):
                w[i][t] = value
    return torch.tensor(w, dtype=DT), runs_per_row


def _batch(seed: int, B: int = 6, T: int = 12, scale: float = 0.5, p_tool: float = 0.3):
    """Multi-turn rows: masked-out tool/observation tokens between turns, padding at the end, one empty row, nan
    garbage off the mask."""
    g = torch.Generator().manual_seed(seed)
    ell = scale * torch.randn(B, T, generator=g, dtype=DT)
    mask = torch.rand(B, T, generator=g) > p_tool
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask &= torch.arange(T) < lengths[:, None]
    mask[0] = False
    return ell.masked_fill(~mask, float("nan")), mask


def test_segment_index_and_count_on_a_hand_example() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]]).bool()
    idx = segment_index(mask)
    assert idx[0][mask[0]].tolist() == [0, 0, 1, 2]
    assert idx[1][mask[1]].tolist() == [0, 0, 0, 0]
    assert segment_count(mask).tolist() == [3, 1, 0]
    x = torch.arange(8, dtype=DT).expand(3, 8)
    assert segment_mean(x, mask)[0].tolist() == [0.0, 1.5, 1.5, 0.0, 0.0, 5.0, 0.0, 7.0]


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([None, 1.2, 2.0]), p_tool=st.floats(0.0, 0.7))
def test_segment_tis_matches_the_roll_reference(seed: int, cap: float | None, p_tool: float) -> None:
    ell, mask = _batch(seed, p_tool=p_tool)
    out = segment_tis(log_ratio=ell, mask=mask, cap=cap)
    ref, runs = _ref_segment_weights(ell, mask, cap)
    assert torch.allclose(out.weights, ref, atol=1e-12, rtol=0)
    roll, _ = _ref_segment_weights(ell, mask, cap, eps=1e-8)  # ROLL's exact denominator |s| + 1e-8
    assert torch.allclose(out.weights, roll, atol=1e-7, rtol=0)
    assert torch.equal(out.mask, mask) and not out.unit_weights
    nonempty = [r for r in runs if r]
    expect = sum(nonempty) / len(nonempty) if nonempty else 0.0
    assert out.metrics["is/segments_mean"].item() == pytest.approx(expect, abs=1e-12)
    kept = ref[mask]
    if kept.numel():
        assert out.metrics["is/weight_max"].item() == pytest.approx(kept.max().item(), abs=1e-12)
        if cap is not None:
            raw, _ = _ref_segment_weights(ell, mask, None)
            frac = (raw[mask] > cap).double().mean().item()
            assert out.metrics["is/truncated_frac"].item() == pytest.approx(frac, abs=1e-12)


@settings(max_examples=30)
@given(seed=st.integers(0, 10_000))
def test_one_turn_is_the_geometric_mean_sequence_weight(seed: int) -> None:
    """Single-turn rows (no masked-out gap): every token carries exp(S̄_i), the sequence's geometric-mean ratio."""
    ell, mask = _batch(seed, p_tool=0.0)
    out = segment_tis(log_ratio=ell, mask=mask, cap=None)
    geo = torch.exp(geo_log_ratio(ell.masked_fill(~mask, 0.0), mask))
    expect = torch.where(mask, geo[:, None].expand_as(ell), torch.zeros_like(ell))
    assert torch.allclose(out.weights, expect, atol=1e-12, rtol=0)


def test_on_policy_weights_are_one() -> None:
    ell, mask = _batch(3)
    out = segment_tis(log_ratio=torch.zeros_like(ell), mask=mask)
    assert torch.equal(out.weights, mask.to(DT))


@pytest.mark.parametrize("sign", [-1.0, 1.0])
def test_huge_log_ratios_stay_finite(sign: float) -> None:
    ell, mask = _batch(4)
    out = segment_tis(log_ratio=torch.full_like(ell, sign * 1000.0), mask=mask, cap=None)
    assert torch.isfinite(out.weights).all()
    assert all(math.isfinite(v.item()) for v in out.metrics.values())


def test_fully_masked_gives_zero_weights() -> None:
    ell, mask = _batch(5)
    out = segment_tis(log_ratio=ell, mask=torch.zeros_like(mask))
    assert torch.count_nonzero(out.weights) == 0 and out.metrics["is/segments_mean"].item() == 0.0


def test_garbage_off_the_mask_is_never_read_and_weights_are_detached() -> None:
    ell, mask = _batch(6)
    ell = ell.masked_fill(~mask, float("inf")).requires_grad_(True)
    out = segment_tis(log_ratio=ell, mask=mask)
    assert torch.isfinite(out.weights).all() and torch.count_nonzero(out.weights[~mask]) == 0
    assert not out.weights.requires_grad


def test_cap_must_be_positive() -> None:
    ell, mask = _batch(7)
    with pytest.raises(ValueError, match="cap"):
        segment_tis(log_ratio=ell, mask=mask, cap=0.0)
