"""GRPO / Dr.GRPO / batch-scaled advantages against float64 loops written from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.advantages.grpo import (
    GRPO_SCALES,
    TRL_STD_EPS,
    VERL_STD_EPS,
    grpo_advantages,
    token_advantage_metrics,
    token_advantages,
)

# Unsorted, non-contiguous ids with two groups of one (5 and 6).
IDS = torch.tensor([3, 3, 0, 0, 0, 5, 1, 1, 1, 1, 6])


def _std(xs: list[float], unbiased: bool) -> float:
    n = len(xs)
    mu = sum(xs) / n
    ss = sum((x - mu) ** 2 for x in xs)
    if unbiased:
        return math.sqrt(ss / (n - 1)) if n > 1 else 0.0  # groups.group_std convention: 0 for n = 1
    return math.sqrt(ss / n)


def _ref_grpo(rewards: torch.Tensor, ids: torch.Tensor, scale: str, eps: float, unbiased: bool) -> list[float]:
    R = [float(x) for x in rewards]
    g = [int(x) for x in ids]
    out = []
    for i in range(len(R)):
        members = [R[j] for j in range(len(R)) if g[j] == g[i]]
        mean = sum(members) / len(members)
        if scale == "none":
            out.append(R[i] - mean)
        elif scale == "group":
            out.append((R[i] - mean) / (_std(members, unbiased) + eps))
        else:
            out.append((R[i] - mean) / (_std(R, unbiased) + eps))
    return out


@pytest.mark.parametrize("scale", GRPO_SCALES)
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("eps", [VERL_STD_EPS, TRL_STD_EPS])
def test_grpo_matches_reference(scale: str, unbiased: bool, eps: float) -> None:
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(IDS.shape[0], generator=g, dtype=torch.float64) * 2 + 0.5
    out = grpo_advantages(rewards=rewards, group_ids=IDS, scale=scale, eps=eps, unbiased=unbiased)
    ref = torch.tensor(_ref_grpo(rewards, IDS, scale, eps, unbiased), dtype=torch.float64)
    torch.testing.assert_close(out.advantages, ref, atol=1e-10, rtol=0)
    means = torch.tensor([sum(float(rewards[j]) for j in range(len(IDS)) if IDS[j] == IDS[i])
                          / int((IDS[i] == IDS).sum()) for i in range(len(IDS))], dtype=torch.float64)
    torch.testing.assert_close(out.baseline, means, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.metrics["adv/mean"], ref.mean(), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.metrics["adv/std"], ref.std(correction=0), atol=1e-10, rtol=0)


def test_identical_rewards_give_zero_advantages_and_count_in_zero_std_frac() -> None:
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    for scale in GRPO_SCALES:
        out = grpo_advantages(rewards=rewards, group_ids=ids, scale=scale)
        assert torch.isfinite(out.advantages).all()
        assert out.advantages[:5].abs().max() <= 1e-9
        assert (out.advantages[5:].abs() > 0.1).all()
        torch.testing.assert_close(out.metrics["adv/zero_std_frac"], torch.tensor(2 / 3, dtype=torch.float64))
    # eps = 0 on an exactly constant group: no 0/0.
    out = grpo_advantages(rewards=rewards, group_ids=ids, eps=0.0)
    assert torch.isfinite(out.advantages).all()
    assert torch.equal(out.advantages[3:5], torch.zeros(2, dtype=torch.float64))


def test_zero_std_frac_counts_groups_not_members() -> None:
    ids = torch.tensor([4, 4, 4, 4, 4, 4, 0, 0])  # one big constant group, one small varying group
    rewards = torch.tensor([1.0, 1, 1, 1, 1, 1, 0, 1])
    out = grpo_advantages(rewards=rewards, group_ids=ids)
    assert out.metrics["adv/zero_std_frac"].item() == pytest.approx(0.5)


def test_batch_scale_uses_one_divisor_and_none_ignores_eps() -> None:
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(IDS.shape[0], generator=g, dtype=torch.float64)
    out = grpo_advantages(rewards=rewards, group_ids=IDS, scale="batch", eps=TRL_STD_EPS)
    torch.testing.assert_close(out.scale, torch.full_like(rewards, float(rewards.std()) + TRL_STD_EPS))
    a = grpo_advantages(rewards=rewards, group_ids=IDS, scale="none", eps=1e-6).advantages
    b = grpo_advantages(rewards=rewards, group_ids=IDS, scale="none", eps=0.5).advantages
    assert torch.equal(a, b)


@given(seed=st.integers(0, 2**31 - 1), shift=st.floats(-50, 50), scale=st.sampled_from(GRPO_SCALES))
def test_grpo_properties(seed: int, shift: float, scale: str) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (12,), generator=g)
    rewards = (torch.rand(12, generator=g, dtype=torch.float64) < 0.5).to(torch.float64)
    out = grpo_advantages(rewards=rewards, group_ids=ids, scale=scale)
    # Advantages sum to zero within every group.
    sums = torch.zeros(12, dtype=torch.float64).index_add(0, ids, out.advantages)
    assert sums.abs().max() <= 1e-9
    # A constant shift of every reward changes nothing (baseline and std are shift-equivariant / -invariant).
    shifted = grpo_advantages(rewards=rewards + shift, group_ids=ids, scale=scale)
    torch.testing.assert_close(shifted.advantages, out.advantages, atol=1e-8, rtol=0)
    # Group scaling with population std and no ε: unit std inside every non-constant group.
    unit = grpo_advantages(rewards=rewards, group_ids=ids, scale="group", eps=0.0, unbiased=False).advantages
    for gid in ids.unique():
        members = unit[ids == gid]
        if rewards[ids == gid].std(correction=0) > 0:
            assert members.std(correction=0).item() == pytest.approx(1.0, abs=1e-9)


def test_outputs_are_detached() -> None:
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5], requires_grad=True)
    out = grpo_advantages(rewards=rewards, group_ids=torch.tensor([0, 0, 1, 1]))
    assert not out.advantages.requires_grad and not out.baseline.requires_grad
    assert all(not v.requires_grad and v.ndim == 0 for v in out.metrics.values())


def test_token_advantages_broadcast_with_zeros_outside_the_mask() -> None:
    adv = torch.tensor([float("nan"), 2.0, -1.5], dtype=torch.float64)
    mask = torch.tensor([[0, 0, 0, 0], [1, 1, 0, 1], [0, 1, 1, 0]], dtype=torch.float32)  # 0/1 float mask
    out = token_advantages(advantages=adv, mask=mask)
    expected = torch.tensor([[0, 0, 0, 0], [2, 2, 0, 2], [0, -1.5, -1.5, 0]], dtype=torch.float64)
    assert torch.equal(out, expected)


def test_token_metrics_over_masked_tokens_only() -> None:
    adv = torch.tensor([[1.0, float("inf")], [3.0, 5.0]], dtype=torch.float64)
    base = torch.tensor([[2.0, float("nan")], [0.0, 4.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, True]])
    m = token_advantage_metrics(advantages=adv, baseline=base, mask=mask)
    assert m["adv/mean"].item() == pytest.approx(3.0)
    assert m["adv/std"].item() == pytest.approx(math.sqrt(8 / 3))
    assert m["adv/baseline_mean"].item() == pytest.approx(2.0)
    empty = token_advantage_metrics(advantages=adv, baseline=base, mask=torch.zeros(2, 2, dtype=torch.bool))
    assert all(v.item() == 0.0 for v in empty.values())


def test_bad_arguments_raise() -> None:
    r, ids = torch.zeros(2), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="scale"):
        grpo_advantages(rewards=r, group_ids=ids, scale="prompt")
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(rewards=r, group_ids=ids, eps=-1.0)
