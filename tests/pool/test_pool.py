"""Pool records, policies (fifo, drop, max_staleness, PACE) and the learner-side pool, against loop references."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.pool import GroupRecord, PoolConfig, RolloutPool, pace_scores, select
from steadyrl.pool.config import PaceConfig
from steadyrl.pool.policies import pace_rate, prefix_forgetting
from steadyrl.pool.pool import DuplicateRolloutError
from steadyrl.rollout.rollouts import PAD_VERSION, Rollouts


def record(gid: int, versions: list[list[int]], *, completed_at: float = 0.0) -> GroupRecord:
    """A group whose row i has tokens with ``versions[i]`` (padding after), rewards = row index."""
    G, T = len(versions), max(len(v) for v in versions)
    mask = torch.tensor([[t < len(v) for t in range(T)] for v in versions])
    ver = torch.tensor([v + [PAD_VERSION] * (T - len(v)) for v in versions])
    rollouts = Rollouts(
        prompt_ids=torch.ones(G, 2, dtype=torch.long),
        prompt_mask=torch.ones(G, 2, dtype=torch.bool),
        response_ids=torch.where(mask, 3, 0),
        response_mask=mask,
        behav_logp=torch.where(mask, -1.0, 0.0),
        versions=ver,
        group_ids=torch.zeros(G, dtype=torch.long),
        truncated=torch.zeros(G, dtype=torch.bool),
        texts=["x"] * G,
        pad_id=0,
    )
    return GroupRecord(
        group_id=gid, problem_index=gid, rollouts=rollouts, rewards=torch.arange(G, dtype=torch.float32), sampler=0,
        started_at=0.0, completed_at=completed_at,
    )  # fmt: skip


def test_generation_staleness_is_the_token_weighted_gap_to_completion() -> None:
    r = record(0, [[3, 3, 5], [4, 5], [5]])
    assert (r.v_start, r.v_complete) == (3, 5)
    # reference: (1/L_i) Σ_t (v_complete − v_t)
    want = [((5 - 3) + (5 - 3) + 0) / 3, (1 + 0) / 2, 0.0]
    assert r.generation_staleness().tolist() == pytest.approx(want)


def test_pace_score_is_waiting_plus_lambda_generation_staleness() -> None:
    rs = [record(0, [[3, 5], [5, 5]]), record(1, [[6], [6]])]
    got = pace_scores(rs, v_now=8, lam=0.5).tolist()
    ref0 = ((8 - 5) + 0.5 * 1.0 + (8 - 5) + 0.5 * 0.0) / 2
    ref1 = float(8 - 6)
    assert got == pytest.approx([ref0, ref1])


def test_prefix_forgetting_is_the_mean_drift_over_older_version_tokens() -> None:
    versions = torch.tensor([[3, 3, 5, -1], [5, -2, 5, 5], [4, 5, 5, -1]])  # −1 pad, −2 tool output
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    behav = torch.full((3, 4), -1.0)
    now = torch.tensor([[-1.5, -0.2, -9.0, -9.0], [-3.0, -3.0, -3.0, -3.0], [-1.25, -4.0, -4.0, 0.0]])
    d = prefix_forgetting(logp_now=now, behav_logp=behav, versions=versions, response_mask=mask, v_complete=5)
    # row 0: tokens of versions 3, 3 → (0.5 + 0.8)/2; row 1: no token older than 5 (the tool token does not count)
    assert d.tolist() == pytest.approx([(0.5 + 0.8) / 2, 0.0, 0.25])


def _drift_of(table: dict[int, list[float]]):
    """A drift function returning fixed per-row scores by group id, recording which groups it was asked about."""
    asked: list[int] = []

    def drift(records):
        asked.extend(r.group_id for r in records)
        return [torch.tensor(table[r.group_id], dtype=torch.float64) for r in records]

    return drift, asked


def test_pace_drift_score_weights_generation_staleness_by_the_sharpened_percentile() -> None:
    # GS: group 0 rows (2/2, 0), group 1 rows (1, 1/2), group 2 none (not re-scored); WS = 8 − v_complete
    rs = [record(0, [[3, 5], [5, 5]]), record(1, [[4, 5], [4, 5]]), record(2, [[6], [6]])]
    drift, asked = _drift_of({0: [0.9, 0.0], 1: [0.1, 0.5]})
    got = pace_scores(rs, v_now=8, lam=1.0, gamma=4.0, drift=drift).tolist()
    assert asked == [0, 1]
    # candidates (rows with GS > 0): d = 0.9, 0.1, 0.5 → percentile ranks 1, 1/3, 2/3
    gs = {(0, 0): 1.0, (1, 0): 0.5, (1, 1): 0.5}
    p = {(0, 0): 1.0, (1, 0): 1 / 3, (1, 1): 2 / 3}
    ref0 = ((3 + gs[0, 0] * p[0, 0] ** 4) + 3) / 2
    ref1 = ((3 + gs[1, 0] * p[1, 0] ** 4) + (3 + gs[1, 1] * p[1, 1] ** 4)) / 2
    assert got == pytest.approx([ref0, ref1, 2.0])


def test_pace_drift_spares_the_group_whose_prefix_the_learner_still_scores_alike() -> None:
    # two groups of equal waiting and generation staleness; the learner forgot group 0's prefix, not group 1's
    rs = [record(0, [[2, 6]]), record(1, [[2, 6]]), record(2, [[7]])]
    cfg = PoolConfig(policy="pace", pace=PaceConfig(target_occupancy=2, ema=0.0))
    drift, _ = _drift_of({0: [2.0], 1: [0.01]})
    sel = select(rs, cfg=cfg, v_now=8, batch_groups=1, drift=drift)
    assert [r.group_id for r in sel.rejected] == [0]
    # by version gaps alone the two tie and the earlier arrival goes
    version_gap = PoolConfig(policy="pace", pace=PaceConfig(target_occupancy=2, ema=0.0, score="version_gap"))
    old = select(rs, cfg=version_gap, v_now=8, batch_groups=1)
    assert [r.group_id for r in old.rejected] == [0]
    drift2, _ = _drift_of({0: [0.01], 1: [2.0]})
    assert [r.group_id for r in select(rs, cfg=cfg, v_now=8, batch_groups=1, drift=drift2).rejected] == [1]


def test_pool_rescores_each_group_once_per_learner_version() -> None:
    drift, asked = _drift_of({g: [1.0] for g in range(6)})
    cfg = PoolConfig(policy="pace", pace=PaceConfig(target_occupancy=1, ema=0.0))
    pool = RolloutPool(cfg, batch_groups=5, drift=drift)
    for g in range(3):
        pool.add(record(g, [[1, 3]]))
    assert pool.take(v_now=4)[0] is None  # 3 pooled < 5: no batch; 2 rejected, all 3 scored
    pool.add(record(3, [[2, 3]]))
    pool.take(v_now=4)  # same version: only the new group is scored
    pool.add(record(4, [[2, 3]]))
    pool.take(v_now=5)  # a new version: the pooled groups are scored again
    # v 4: groups 0, 1, 2 (0 and 1 rejected); v 4 again: only 3 (2 cached; 2 rejected); v 5: 3 again and 4
    assert asked == [0, 1, 2, 3, 3, 4]


def test_pace_rate_is_an_ema_of_the_excess_share() -> None:
    cfg = PoolConfig(policy="pace", pace=PaceConfig(target_occupancy=4, score="version_gap", ema=0.5))
    rate, budgets = 0.0, []
    for n in (8, 8, 8, 3):
        rs = [record(i, [[1]]) for i in range(n)]
        sel = select(rs, cfg=cfg, v_now=5, batch_groups=1, rate=rate)
        ref = 0.5 * rate + 0.5 * max(0.0, 1 - 4 / n)
        assert sel.pace_rate == pytest.approx(ref) == pytest.approx(pace_rate(rate, occupancy=n, target=4, beta=0.5))
        rate = sel.pace_rate
        budgets.append(len(sel.rejected))
    assert budgets == [round(0.25 * 8), round(0.375 * 8), round(0.4375 * 8), round((0.21875 + 0) * 3)]


def test_pace_drift_needs_the_rescoring_function() -> None:
    with pytest.raises(ValueError, match=r"pace\.score=drift"):
        select([record(0, [[1]])], cfg=PoolConfig(policy="pace"), v_now=3, batch_groups=1)


def test_fifo_takes_the_earliest_and_waits_for_a_full_batch() -> None:
    rs = [record(i, [[0]]) for i in range(5)]
    sel = select(rs, cfg=PoolConfig(), v_now=9, batch_groups=3)
    assert [r.group_id for r in sel.batch] == [0, 1, 2] and [r.group_id for r in sel.remaining] == [3, 4]
    assert not sel.dropped and not sel.rejected
    assert select(rs[:2], cfg=PoolConfig(), v_now=9, batch_groups=3).batch is None


@pytest.mark.parametrize("policy", ["drop", "max_staleness"])
def test_drop_discards_groups_whose_oldest_token_is_too_stale(policy: str) -> None:
    rs = [record(0, [[1, 5]]), record(1, [[4]]), record(2, [[6]]), record(3, [[2]])]
    sel = select(rs, cfg=PoolConfig(policy=policy, max_staleness=3), v_now=6, batch_groups=2)
    assert [r.group_id for r in sel.dropped] == [0, 3]  # lags 5 and 4 > 3; the oldest token counts
    assert [r.group_id for r in sel.batch] == [1, 2]


def test_pace_rejects_the_excess_with_the_highest_scores() -> None:
    rs = [record(0, [[5]]), record(1, [[1]]), record(2, [[7]]), record(3, [[2]]), record(4, [[1]])]
    # the hard budget
    cfg = PoolConfig(policy="pace", pace=PaceConfig(target_occupancy=3, score="version_gap", ema=0.0))
    sel = select(rs, cfg=cfg, v_now=8, batch_groups=2)
    # scores (WS only, single tokens) 3, 7, 1, 6, 7: budget 2 rejects the two 7s (ties: earlier arrival first)
    assert [r.group_id for r in sel.rejected] == [1, 4]
    assert [r.group_id for r in sel.batch] == [0, 2] and [r.group_id for r in sel.remaining] == [3]
    # at or under the target nothing is rejected
    assert not select(rs[:3], cfg=cfg, v_now=8, batch_groups=2).rejected


@given(
    v_starts=st.lists(st.integers(0, 20), min_size=0, max_size=30),
    s=st.integers(0, 10),
    P=st.integers(1, 6),
    target_extra=st.integers(0, 10),
)
def test_policy_invariants(v_starts: list[int], s: int, P: int, target_extra: int) -> None:
    rs = [record(i, [[v, v + 1]]) for i, v in enumerate(v_starts)]
    v_now = 22
    for policy in ("fifo", "drop", "max_staleness", "pace"):
        pace = PaceConfig(target_occupancy=P + target_extra, score="version_gap", ema=0.0)
        cfg = PoolConfig(policy=policy, max_staleness=s, pace=pace)
        sel = select(rs, cfg=cfg, v_now=v_now, batch_groups=P)
        out = (sel.batch or []) + sel.remaining + sel.dropped + sel.rejected
        assert sorted(r.group_id for r in out) == list(range(len(rs)))  # nothing lost, nothing duplicated
        if policy in ("drop", "max_staleness"):
            assert all(v_now - r.v_start <= s for r in (sel.batch or []) + sel.remaining)
        if policy == "pace":
            assert len(sel.rejected) == max(0, len(rs) - cfg.pace.target_occupancy)
            kept = pace_scores((sel.batch or []) + sel.remaining, v_now=v_now, lam=1.0)
            gone = pace_scores(sel.rejected, v_now=v_now, lam=1.0)
            if len(kept) and len(gone):
                assert float(gone.min()) >= float(kept.max())


def test_pool_refuses_an_id_twice_and_reports_staleness_metrics() -> None:
    pool = RolloutPool(PoolConfig(policy="drop", max_staleness=2), batch_groups=2)
    now = time.time()
    pool.add(record(0, [[1], [1]], completed_at=now))
    with pytest.raises(DuplicateRolloutError, match="group 0 arrived twice"):
        pool.add(record(0, [[1], [1]]))
    pool.add(record(1, [[4, 5], [5]], completed_at=now))
    pool.add(record(2, [[5], [5, 5]], completed_at=now))
    batch, discarded = pool.take(v_now=6)
    assert [r.group_id for r in discarded] == [0]  # lag 5 > 2
    assert [r.group_id for r in batch.records] == [1, 2]
    assert batch.rollouts.group_ids.tolist() == [0, 0, 1, 1] and batch.rewards.tolist() == [0, 1, 0, 1]
    m = batch.metrics
    assert m["pool/occupancy"] == 3 and m["pool/dropped"] == 1 and m["pool/rejected"] == 0
    assert m["lag/wait_mean"] == pytest.approx(1.0)  # v_now − v_complete = 6 − 5 for every row
    assert m["lag/gen_mean"] == pytest.approx((0.5 + 0 + 0 + 0) / 4)
    assert m["lag/group_max"] == 2


def test_pool_state_round_trips_through_torch_save(tmp_path) -> None:
    pool = RolloutPool(PoolConfig(), batch_groups=1)
    for i in range(3):
        pool.add(record(i, [[i, i + 1]]))
    pool.take(v_now=3)
    path = tmp_path / "pool.pt"
    torch.save(pool.state_dict(), path)
    back = RolloutPool(PoolConfig(), batch_groups=1)
    back.load_state_dict(torch.load(path, weights_only=True))
    assert [r.group_id for r in back.records] == [1, 2] and back.seen == {0, 1, 2} and back.trained == {0}
    assert torch.equal(back.records[0].rollouts.versions, pool.records[0].rollouts.versions)
    with pytest.raises(DuplicateRolloutError):
        back.add(record(0, [[0]]))


def test_pool_batch_reports_tool_counts_of_its_groups_and_they_survive_a_checkpoint(tmp_path) -> None:
    from steadyrl.rollout.tool_metrics import RowMetrics, tool_summary

    def counts(calls: list[int], errors: list[int], timeouts: list[int]) -> RowMetrics:
        turns = torch.ones(len(calls), dtype=torch.long)
        calls_t = torch.tensor(calls)
        return RowMetrics(calls_t, torch.tensor(errors), torch.tensor(timeouts), turns, calls_t * 3)

    a = dataclasses.replace(record(0, [[1], [1]]), tool_counts=counts([2, 1], [1, 0], [1, 0]))
    b = dataclasses.replace(record(1, [[1], [1, 1]]), tool_counts=counts([0, 3], [0, 2], [0, 0]))
    with pytest.raises(ValueError, match="tool_counts has 1 rows, expected 2"):
        dataclasses.replace(record(2, [[1], [1]]), tool_counts=counts([1], [0], [0]))
    pool = RolloutPool(PoolConfig(), batch_groups=2)
    pool.add(a)
    pool.add(GroupRecord.from_state(torch.load(_saved(b.to_state(), tmp_path), weights_only=True)))
    batch, _ = pool.take(v_now=1)
    m = batch.metrics
    assert m["tool/calls_mean"] == pytest.approx(6 / 4) and m["tool/errors"] == 3 and m["tool/timeouts"] == 1
    assert m["tool/tokens_mean"] == pytest.approx(18 / 4) and m["turns/mean"] == 1
    assert m == m | tool_summary(RowMetrics.cat([a.tool_counts, b.tool_counts]), batch.rollouts)
    # groups sampled without tools (or saved before counts were carried) report no tool metric
    plain = RolloutPool(PoolConfig(), batch_groups=2)
    plain.add(record(3, [[1]]))
    plain.add(GroupRecord.from_state({k: v for k, v in record(4, [[1]]).to_state().items() if k != "tool_counts"}))
    assert not any(k.startswith("tool/") for k in plain.take(v_now=1)[0].metrics)


def _saved(state: dict, tmp_path) -> str:
    path = tmp_path / "record.pt"
    torch.save(state, path)
    return str(path)
