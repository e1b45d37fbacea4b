"""RLOO (arXiv 2402.14740 Eq. 5) and REINFORCE++ / REINFORCE++-baseline (arXiv 2501.03262, as verl 0.9.1 computes
them) against float64 loop references written from the equations."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.advantages.reinforce_pp import (
    discounted_returns,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
)
from steadyrl.core.advantages.rloo import rloo_advantages

DT = torch.float64


def _groups(seed: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((n,), k) for k, n in enumerate(sizes)])
    perm = torch.randperm(len(ids), generator=g)  # members need not be contiguous
    return torch.randn(len(ids), generator=g, dtype=DT) * 3, ids[perm]


def _whiten_ref(vals: list[float]) -> list[float]:
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / max(n - 1, 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in vals]


@settings(max_examples=40)
@given(seed=st.integers(0, 2**31 - 1), sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       singleton=st.sampled_from(["zero", "reward"]))  # fmt: skip
def test_rloo_matches_the_leave_one_out_mean(seed: int, sizes: list[int], singleton: str) -> None:
    R, ids = _groups(seed, sizes)
    out = rloo_advantages(rewards=R, group_ids=ids, singleton=singleton)  # type: ignore[arg-type]
    for i in range(len(R)):
        others = [float(R[j]) for j in range(len(R)) if ids[j] == ids[i] and j != i]
        alone = 0.0 if singleton == "zero" else float(R[i])
        expect = float(R[i]) - sum(others) / len(others) if others else alone
        assert math.isclose(float(out.advantages[i]), expect, rel_tol=1e-12, abs_tol=1e-12)


def test_rloo_is_grpo_centering_times_g_over_g_minus_one() -> None:
    R = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=DT)
    out = rloo_advantages(rewards=R, group_ids=torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(out.advantages, (R - 0.5) * 4 / 3)


def _masked(seed: int, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    return torch.randn(B, T, generator=g, dtype=DT), mask


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("seed", range(4))
def test_reinforce_pp_is_whitened_discounted_return_to_go(gamma: float, seed: int) -> None:
    r, mask = _masked(seed, 4, 6)
    garbage = r.masked_fill(~mask, float("nan"))
    out = reinforce_pp_advantages(token_rewards=garbage, mask=mask, gamma=gamma)
    returns = {}
    for i in range(4):
        running = 0.0
        for t in reversed(range(6)):
            if mask[i, t]:  # untrained positions neither add their reward nor discount
                running = float(r[i, t]) + gamma * running
                returns[(i, t)] = running
    keys = sorted(returns)
    white = dict(zip(keys, _whiten_ref([returns[k] for k in keys]), strict=True))
    for i in range(4):
        for t in range(6):
            expect = white.get((i, t), 0.0)
            assert math.isclose(float(out.advantages[i, t]), expect, rel_tol=1e-10, abs_tol=1e-10)
    assert torch.equal(discounted_returns(garbage, mask, gamma=gamma)[~mask], torch.zeros(int((~mask).sum()), dtype=DT))


@pytest.mark.parametrize("seed", range(4))
def test_reinforce_pp_baseline_whitens_group_centred_rewards(seed: int) -> None:
    R, ids = _groups(seed, [3, 1, 2])
    _, mask = _masked(seed, len(R), 5)
    out = reinforce_pp_baseline_advantages(rewards=R, group_ids=ids, mask=mask)
    centred = {}
    for i in range(len(R)):
        grp = [float(R[j]) for j in range(len(R)) if ids[j] == ids[i]]
        c = float(R[i]) - (sum(grp) / len(grp) if len(grp) > 1 else 0.0)
        for t in range(5):
            if mask[i, t]:
                centred[(i, t)] = c
    keys = sorted(centred)
    white = dict(zip(keys, _whiten_ref([centred[k] for k in keys]), strict=True))
    for i in range(len(R)):
        for t in range(5):
            assert math.isclose(float(out.advantages[i, t]), white.get((i, t), 0.0), rel_tol=1e-10, abs_tol=1e-10)


def test_whitening_with_at_most_one_token_is_finite() -> None:
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[1, 2] = True
    for mask in (one, torch.zeros(2, 3, dtype=torch.bool)):
        out = reinforce_pp_advantages(token_rewards=torch.ones(2, 3, dtype=DT), mask=mask)
        assert torch.equal(out.advantages, torch.zeros(2, 3, dtype=DT))
        assert all(torch.isfinite(v) for v in out.metrics.values())
