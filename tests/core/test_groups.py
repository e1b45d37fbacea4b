"""Group reductions against a float64 per-group loop."""

from __future__ import annotations

import torch

from steadyrl.core.groups import group_count, group_logsumexp, group_mean, group_std, group_sum, rank_in_group


def test_group_reductions_match_loop() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.tensor([3, 3, 0, 0, 0, 5, 1, 1])
    x = torch.randn(8, generator=g, dtype=torch.float64) * 3
    for i in range(8):
        members = x[ids == ids[i]]
        assert torch.allclose(group_sum(x, group_ids=ids)[i], members.sum())
        assert torch.allclose(group_mean(x, group_ids=ids)[i], members.mean())
        assert group_count(ids)[i] == len(members)
        pop = members.std(unbiased=False)
        unb = members.std(unbiased=True) if len(members) > 1 else torch.tensor(0.0, dtype=torch.float64)
        assert torch.allclose(group_std(x, group_ids=ids, unbiased=False)[i], pop)
        assert torch.allclose(group_std(x, group_ids=ids, unbiased=True)[i], unb)
        assert torch.allclose(group_logsumexp(x, group_ids=ids)[i], torch.logsumexp(members, 0))


def test_group_logsumexp_is_finite_for_huge_values() -> None:
    ids = torch.tensor([0, 0, 1, 1])
    x = torch.tensor([1000.0, 999.0, -1000.0, -1001.0], dtype=torch.float64)
    out = group_logsumexp(x, group_ids=ids)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[0], torch.logsumexp(x[:2], 0))


def test_rank_in_group_counts_members_in_batch_order() -> None:
    ids = torch.tensor([2, 0, 2, 2, 0, 1])
    assert rank_in_group(ids).tolist() == [0, 0, 1, 2, 1, 0]
