"""OPOB (VCPO's off-policy optimal baseline) against a float64 loop written from docs/algorithms.md."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.advantages.grpo import grpo_advantages
from steadyrl.core.advantages.opob import (
    OPOB_AGGREGATIONS,
    OPOB_EPS,
    OPOB_SCOPES,
    OPOB_WEIGHTINGS,
    WINSOR_HIGH,
    WINSOR_LOW,
    opob_advantages,
)

# Unsorted, non-contiguous ids; group 6 gets zero gradient norms (no weight at all); group 2 has one member.
IDS = torch.tensor([3, 3, 3, 0, 0, 0, 0, 2, 6, 6, 6, 3])
TIS_CAP = 1.7  # small so that the authors' w̄ = min(w, C) binds on some members


def _quantile(vals: list[float], ws: list[float], q: float) -> float:
    total = sum(ws)
    if total == 0:
        return 0.0
    cum = 0.0
    for v, w in sorted(zip(vals, ws, strict=True), key=lambda p: p[0]):
        cum += w
        if cum >= q * total:
            return v
    return max(vals)


def _location(vals: list[float], ws: list[float], aggregation: str) -> float:
    total = sum(ws)
    if aggregation == "mean":
        return sum(w * v for v, w in zip(vals, ws, strict=True)) / (total + OPOB_EPS)
    if aggregation == "median":
        return _quantile(vals, ws, 0.5)
    if total == 0:
        return 0.0
    lo, hi = _quantile(vals, ws, WINSOR_LOW), _quantile(vals, ws, WINSOR_HIGH)
    return sum(w * min(max(v, lo), hi) for v, w in zip(vals, ws, strict=True)) / (total + OPOB_EPS)


def _pop_std(xs: list[float]) -> float:
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))


def _ref_opob(
    R: list[float], ids: list[int], S: list[float], g2: list[float], L: list[float] | None, *, weighting: str,
    scope: str, aggregation: str, clip: float | None, normalize_std: bool,
) -> tuple[list[float], list[float]]:
    B = len(R)
    W = []
    for i in range(B):
        w = math.exp(S[i])
        wc = w if clip is None else min(w, clip)
        Wi = wc**2 * g2[i]  # W_i = w_i² ‖∇‖²
        if weighting == "authors_code":
            Wi *= min(w, TIS_CAP) ** 2  # · w̄_i²
        if L is not None:
            Wi /= max(L[i], 1.0) ** 2
        W.append(Wi)
    members = [[j for j in range(B) if ids[j] == ids[i]] for i in range(B)]
    if scope == "group":
        values = list(R)
        scopes = members
    else:
        values = []
        for i in range(B):
            rs = [R[j] for j in members[i]]
            values.append((R[i] - sum(rs) / len(rs)) / (_pop_std(rs) + OPOB_EPS))
        scopes = [list(range(B))] * B
    adv: list[float] = []
    base: list[float] = []
    for i in range(B):
        b = _location([values[j] for j in scopes[i]], [W[j] for j in scopes[i]], aggregation)
        base.append(b)
        if scope == "group" and normalize_std:
            sigma = _pop_std([R[j] for j in members[i]])
            adv.append((R[i] - b) / sigma if sigma >= OPOB_EPS else R[i] - b)
        else:
            adv.append(values[i] - b)
    return adv, base


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    B = IDS.shape[0]
    R = torch.randn(B, generator=g, dtype=torch.float64)
    R[7] = 0.3
    S = torch.randn(B, generator=g, dtype=torch.float64) * 1.5
    g2 = torch.rand(B, generator=g, dtype=torch.float64) * 4 + 0.1
    g2[IDS == 6] = 0.0
    L = torch.randint(0, 30, (B,), generator=g).to(torch.float64)
    return R, S, g2, L


_GRID = list(itertools.product(OPOB_WEIGHTINGS, OPOB_SCOPES, OPOB_AGGREGATIONS, [None, 1.2], [False, True]))


@pytest.mark.parametrize(("weighting", "scope", "aggregation", "clip", "length_normalize"), _GRID)
def test_opob_matches_reference(
    weighting: str, scope: str, aggregation: str, clip: float | None, length_normalize: bool
) -> None:
    for seed in range(3):
        R, S, g2, L = _inputs(seed)
        out = opob_advantages(
            rewards=R, group_ids=IDS, log_weights=S, grad_sq_norms=g2, weighting=weighting, scope=scope,
            aggregation=aggregation, length_normalize=length_normalize, lengths=L if length_normalize else None,
            clip=clip, tis_cap=TIS_CAP,
        )
        adv, base = _ref_opob(
            R.tolist(), IDS.tolist(), S.tolist(), g2.tolist(), L.tolist() if length_normalize else None,
            weighting=weighting, scope=scope, aggregation=aggregation, clip=clip, normalize_std=True,
        )
        torch.testing.assert_close(out.baseline, torch.tensor(base, dtype=torch.float64), atol=1e-10, rtol=0)
        torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), atol=1e-10, rtol=0)
        assert torch.isfinite(out.weights).all()


def test_opob_without_std_division_matches_reference() -> None:
    R, S, g2, _ = _inputs(5)
    out = opob_advantages(rewards=R, group_ids=IDS, log_weights=S, grad_sq_norms=g2, normalize_std=False)
    adv, _ = _ref_opob(R.tolist(), IDS.tolist(), S.tolist(), g2.tolist(), None, weighting="paper", scope="group",
                       aggregation="mean", clip=None, normalize_std=False)
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), atol=1e-10, rtol=0)


def test_equal_weights_and_norms_give_grpo_with_population_std() -> None:
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    R = (torch.rand(12, generator=g) < 0.5).to(torch.float64)
    R[8:] = 1.0  # one constant group: σ_g = 0, no division, advantage 0
    out = opob_advantages(rewards=R, group_ids=ids, log_weights=torch.zeros(12, dtype=torch.float64),
                          grad_sq_norms=torch.full((12,), 1e4, dtype=torch.float64))
    grpo = grpo_advantages(rewards=R, group_ids=ids, scale="group", eps=0.0, unbiased=False)
    torch.testing.assert_close(out.advantages, grpo.advantages, atol=1e-10, rtol=0)
    torch.testing.assert_close(out.metrics["adv/opob_ess_frac"], torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("n", [2, 6, 12, 20])
def test_median_of_equal_weights_is_the_lower_middle_value(n: int) -> None:
    """Cumulative weight n/2 · (1/n) = 1/2 reaches the cut exactly in real arithmetic, whatever the rounding."""
    R = torch.arange(n, dtype=torch.float64).flip(0) * 0.5
    out = opob_advantages(rewards=R, group_ids=torch.zeros(n, dtype=torch.long),
                          log_weights=torch.full((n,), 0.3, dtype=torch.float64),
                          grad_sq_norms=torch.full((n,), 0.7, dtype=torch.float64), aggregation="median")
    assert torch.equal(out.baseline, torch.full((n,), (n // 2 - 1) * 0.5, dtype=torch.float64))


def test_median_tie_takes_the_lower_value_and_weights_move_the_median() -> None:
    ids = torch.zeros(4, dtype=torch.long)
    R = torch.tensor([4.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    zeros, ones = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    out = opob_advantages(rewards=R, group_ids=ids, log_weights=zeros, grad_sq_norms=ones, aggregation="median")
    assert torch.equal(out.baseline, torch.full((4,), 2.0, dtype=torch.float64))  # cumulative 0.5 reached at 2
    heavy = torch.tensor([3.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # w = e³ on the reward 4
    out = opob_advantages(rewards=R, group_ids=ids, log_weights=heavy, grad_sq_norms=ones, aggregation="median")
    assert torch.equal(out.baseline, torch.full((4,), 4.0, dtype=torch.float64))


@given(seed=st.integers(0, 2**31 - 1), sign=st.sampled_from([1.0, -1.0]),
       aggregation=st.sampled_from(OPOB_AGGREGATIONS), weighting=st.sampled_from(OPOB_WEIGHTINGS))
def test_huge_log_weights_are_finite(seed: int, sign: float, aggregation: str, weighting: str) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (10,), generator=g)
    R = torch.randn(10, generator=g)
    S = sign * 1000.0 + torch.randn(10, generator=g) * 50
    out = opob_advantages(rewards=R, group_ids=ids, log_weights=S, grad_sq_norms=torch.rand(10, generator=g) + 0.5,
                          aggregation=aggregation, weighting=weighting)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.baseline).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    if sign > 0:  # weights normalize to 1 in every group
        sums = torch.zeros(10).index_add(0, ids, out.weights)[ids]
        torch.testing.assert_close(sums, torch.ones(10), atol=1e-5, rtol=0)
        # the baseline is a weighted location of the group's rewards
        for gid in ids.unique():
            r = R[ids == gid]
            b = out.baseline[ids == gid]
            assert (b >= r.min() - 1e-5).all() and (b <= r.max() + 1e-5).all()
            if aggregation == "median":
                assert bool((r == b[0]).any())


def test_all_weights_underflowing_give_a_zero_baseline_as_the_formula() -> None:
    R = torch.tensor([1.0, 0.0, 2.0, 5.0], dtype=torch.float64)
    S = torch.full((4,), -1000.0, dtype=torch.float64)  # W ≈ e^-2000: Σ W R / (Σ W + 1e-8) = 0
    out = opob_advantages(rewards=R, group_ids=torch.zeros(4, dtype=torch.long), log_weights=S,
                          grad_sq_norms=torch.ones(4, dtype=torch.float64))
    assert torch.equal(out.baseline, torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(out.advantages, R / R.std(correction=0))


@given(seed=st.integers(0, 2**31 - 1), shift=st.floats(0.0, 1000.0), aggregation=st.sampled_from(OPOB_AGGREGATIONS))
def test_a_common_log_weight_shift_within_a_group_changes_nothing(seed: int, shift: float, aggregation: str) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 3, (9,), generator=g)
    R = torch.randn(9, generator=g, dtype=torch.float64)
    S = torch.randn(9, generator=g, dtype=torch.float64)
    g2 = torch.rand(9, generator=g, dtype=torch.float64) * 1e6 + 1e6  # Σ W ≫ ε, so ε is negligible
    base = opob_advantages(rewards=R, group_ids=ids, log_weights=S, grad_sq_norms=g2, aggregation=aggregation)
    moved = opob_advantages(rewards=R, group_ids=ids, log_weights=S + shift * (ids == 1), grad_sq_norms=g2,
                            aggregation=aggregation)
    torch.testing.assert_close(moved.advantages, base.advantages, atol=1e-9, rtol=0)


def test_minibatch_scope_has_one_baseline_and_detaches() -> None:
    R, S, g2, _ = _inputs(7)
    S.requires_grad_(True)
    g2.requires_grad_(True)
    out = opob_advantages(rewards=R, group_ids=IDS, log_weights=S, grad_sq_norms=g2, scope="minibatch")
    assert torch.all(out.baseline == out.baseline[0])
    assert not out.advantages.requires_grad and not out.weights.requires_grad
    assert all(not v.requires_grad for v in out.metrics.values())


def test_bad_arguments_raise() -> None:
    R, S, g2, _ = _inputs(0)
    kw = {"rewards": R, "group_ids": IDS, "log_weights": S, "grad_sq_norms": g2}
    for name, value in (("weighting", "w4"), ("scope", "batch"), ("aggregation", "trimmed")):
        with pytest.raises(ValueError, match=name):
            opob_advantages(**kw, **{name: value})
    with pytest.raises(ValueError, match="lengths"):
        opob_advantages(**kw, length_normalize=True)
    with pytest.raises(ValueError, match="clip"):
        opob_advantages(**kw, clip=0.0)
