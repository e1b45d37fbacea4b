"""The lag runtime: which weights sample each step (pipeline and periodic), the snapshot ring, the sampler."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from steadyrl.runtime.lag import LagSchedule, SnapshotRing


class Tied(nn.Module):
    """A model with tied input/output weights (like the default Llama) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(1))


def _set(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


@pytest.mark.parametrize(("lag", "expected"), [(0, [0, 1, 2, 3, 4, 5]), (2, [0, 0, 0, 1, 2, 3]), (10, [0] * 6)])
def test_pipeline_source_step_is_t_minus_k(lag: int, expected: list[int]) -> None:
    schedule = LagSchedule(kind="pipeline", lag=lag)
    assert [schedule.source_step(t) for t in range(6)] == expected
    assert schedule.capacity == lag + 1


def test_periodic_source_step_refreshes_every_l() -> None:
    schedule = LagSchedule(kind="periodic", refresh_every=3)
    assert [schedule.source_step(t) for t in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert [schedule.keeps(t) for t in range(4)] == [True, False, False, True]
    assert schedule.capacity == 1


@pytest.mark.parametrize(
    ("kwargs", "word"), [({"kind": "sideways"}, "sideways"), ({"lag": -1}, "lag"), ({"refresh_every": 0}, "refresh")]
)
def test_schedule_rejects_bad_values(kwargs: dict, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        LagSchedule(**kwargs)


SCHEDULES = [LagSchedule(kind="pipeline", lag=3), LagSchedule(kind="periodic", refresh_every=4)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ring_serves_the_weights_of_the_source_step(schedule: LagSchedule) -> None:
    """Simulated run: the weights at the start of step s are all equal to s; step t must be served source_step(t)."""
    model = Tied()
    ring = SnapshotRing(schedule)
    _set(model, 0.0)
    ring.publish(step=0, version=0, model=model)
    for t in range(15):
        snap = ring.get(t)
        want = schedule.source_step(t)
        assert snap.step == want and snap.version == 10 * want
        assert torch.all(snap.state["emb.weight"] == float(want))
        assert len(ring) <= schedule.capacity
        _set(model, float(t + 1))  # the learner step
        ring.publish(step=t + 1, version=10 * (t + 1), model=model)


def test_ring_snapshots_are_copies_and_keep_tied_tensors_shared() -> None:
    model = Tied()
    _set(model, 1.0)
    ring = SnapshotRing(LagSchedule(kind="pipeline", lag=1))
    ring.publish(step=0, version=0, model=model)
    _set(model, 2.0)
    state = ring.get(0).state
    assert torch.all(state["emb.weight"] == 1.0)
    assert state["emb.weight"].data_ptr() == state["out.weight"].data_ptr()
    assert state["emb.weight"].data_ptr() != model.emb.weight.data_ptr()


def test_ring_state_dict_round_trip_and_missing_step_error() -> None:
    model = Tied()
    ring = SnapshotRing(LagSchedule(kind="pipeline", lag=2))
    for s in range(4):
        _set(model, float(s))
        ring.publish(step=s, version=s, model=model)
    assert ring.steps == [1, 2, 3]
    other = SnapshotRing(LagSchedule(kind="pipeline", lag=2))
    other.load_state_dict(ring.state_dict())
    assert other.steps == [1, 2, 3]
    assert torch.all(other.get(4).state["emb.weight"] == 2.0)
    with pytest.raises(KeyError, match="no snapshot of step 0"):
        other.get(2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_restart_serves_the_given_weights_until_newer_ones_are_published(schedule: LagSchedule) -> None:
    """A rollback at step 7: weights = 100, version 3. Steps 7 … serve them until their source step is published."""
    model = Tied()
    ring = SnapshotRing(schedule)
    for s in range(8):  # the diverged run published steps 0..7 (weights s, version s)
        _set(model, float(s))
        ring.publish(step=s, version=s, model=model)
    _set(model, 100.0)
    ring.restart(step=7, version=3, model=model)
    assert len(ring) <= schedule.capacity
    for t in range(7, 15):
        snap = ring.get(t)
        source = schedule.source_step(t)
        # sources up to 7: the restart's weights; later ones: what the learner published (weights s, version s − 4)
        want = (100.0, 3) if source <= 7 else (float(source), source - 4)
        assert (float(snap.state["emb.weight"][0, 0]), snap.version) == want, t
        _set(model, float(t + 1))
        ring.publish(step=t + 1, version=t + 1 - 4, model=model)


def test_lag_sampler_restart_reloads_the_sampler() -> None:
    from steadyrl.config.train import RolloutConfig
    from steadyrl.runtime.lag import LagSampler

    model = Tied()
    sampler = LagSampler(model=model, tokenizer=None, schedule=LagSchedule(kind="pipeline", lag=2),
                         sampling=RolloutConfig(), group_size=1, seed=0)  # fmt: skip
    for s in range(3):
        _set(model, float(s))
        sampler.publish(step=s, version=s, model=model)
    sampler._loaded = 0  # as if step 2 had been sampled (from the weights of step 0)
    _set(model, 9.0)
    sampler.restart(step=3, version=1, model=model)
    assert sampler._loaded is None and sampler.ring.steps == [1, 2, 3]
    assert all(float(sampler.ring.get(t).state["emb.weight"][0, 0]) == 9.0 for t in (3, 4, 5))
