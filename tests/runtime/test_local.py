"""``runtime.mode=local`` end to end on the tiny model: real sampler processes, the pool, admission, faults, resume."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from steadyrl.runtime.local import LocalSource
from steadyrl.train import checkpoint as ckpt
from steadyrl.train.entry import local_source, main
from steadyrl.train.loop import StopFlag
from tests.runtime.concurrent_harness import Hooked, run_with, steps_of

pytestmark = pytest.mark.timeout(300)
LOCAL = ["runtime.lag.k=0", "runtime.mode=local", "eval.every=0", "checkpoint.every=3"]


def run(tiny: list[str], out: Path, *extra: str, hook: Any = None, stop: StopFlag | None = None) -> tuple[Any, Hooked]:
    return run_with(local_source, [*tiny, *LOCAL, f"out_dir={out}", *extra], hook=hook, stop=stop)


def test_sync_mode_trains_on_policy(tiny_overrides: list[str], tmp_path: Path) -> None:
    result, _ = run(tiny_overrides, tmp_path / "sync", "steps=5", "runtime.concurrent.sync=true")
    recs = steps_of(tmp_path / "sync")
    assert result.steps_done == 5 and len(recs) == 5
    assert all(r["lag/max"] == 0 and r["lag/gen_mean"] == 0 for r in recs)
    assert all(r["is/ess_ratio"] == pytest.approx(1.0, abs=1e-3) for r in recs)


def test_max_staleness_bounds_every_trained_sample(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "bounded"
    run(tiny_overrides, out, "steps=10", "pool.policy=max_staleness", "pool.max_staleness=2")
    recs = steps_of(out)
    assert max(r["lag/max"] for r in recs) <= 2
    assert max(r["lag/max"] for r in recs) >= 1  # the sampler did run ahead
    assert sum(r["pool/dropped"] for r in recs) == 0  # admission control, not dropping, kept the bound
    # the batch ledger: ten distinct batches, none consumed twice; `steadyrl check run` reads the bound from the config
    assert [r["data/distinct_batches"] for r in recs] == list(range(1, 11))
    assert {r["data/max_reuse"] for r in recs} == {1}
    from steadyrl.check.logs import read_run
    from steadyrl.check.rules import check_table

    log = read_run(out)
    verdicts = {f.rule: f.verdict for f in check_table(log.rows, log.facts)}
    assert log.facts.staleness_bound == 2 and verdicts["staleness"] == verdicts["batch_reuse"] == "PASS"


def test_killed_sampler_is_restarted_and_no_rollout_is_lost_or_trained_twice(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    def kill(source: LocalSource, step: int) -> None:
        if step in (2, 5):
            os.kill(source.procs[0].pid, signal.SIGKILL)

    out = tmp_path / "kill"
    result, src = run(tiny_overrides, out, "steps=9", "pool.capacity=24", hook=kill)
    recs = steps_of(out)
    assert result.steps_done == 9 and recs[-1]["runtime/sampler_restarts"] >= 2
    pool = src.inner.pool
    P = 16
    trained = [g for b in src.batches for g in b]
    assert len(trained) == len(set(trained)) == 9 * P  # nothing trained twice
    assert not pool.trained & pool.discarded
    # every id ever claimed either arrived (trained, pooled or discarded) or is still in a live sampler's claim
    claimed = set(range(int(src.inner.shared.next_group.value)))
    in_flight = {g for i in range(src.inner.n) for g in src.inner._undelivered(i)}
    assert claimed == pool.seen | in_flight


def test_resume_continues_with_the_checkpointed_pool(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "resume"
    run(tiny_overrides, out, "steps=6")
    state = ckpt.load_latest(out).state
    pooled = [int(r["group_id"]) for r in state["source"]["pool"]["records"]]
    assert state["step"] == 6 and len(pooled) >= 16  # fifo with capacity 64: the sampler ran ahead
    result, src = run(tiny_overrides, out, "steps=8", "resume=true")
    assert result.steps_done == 8
    assert src.batches[0] == pooled[:16]  # the first batch after resume is the checkpoint's oldest pooled groups
    trained_before = set(state["source"]["pool"]["trained"].tolist())
    assert not trained_before & {g for b in src.batches for g in b}


def test_ctrl_c_stops_the_samplers_and_leaves_a_loadable_checkpoint(tiny_overrides: list[str], tmp_path: Path) -> None:
    stop = StopFlag()
    out = tmp_path / "ctrlc"
    result, src = run(tiny_overrides, out, "steps=50", hook=lambda s, t: stop.request() if t == 3 else None, stop=stop)
    assert result.interrupted and result.steps_done == 4
    assert all(p is not None and not p.is_alive() for p in src.inner.procs)
    assert not src.inner.spool.exists()
    assert ckpt.load_latest(out).state["step"] == 4


def test_pace_rejects_the_excess_over_its_target(tiny_overrides: list[str], tmp_path: Path) -> None:
    """PACE as shipped (drift score: the learner re-scores pooled groups; EMA-smoothed rate): it rejects, the rate
    stays a share of the pool, and the pool settles near the target instead of filling to capacity."""
    out = tmp_path / "pace"
    run(tiny_overrides, out, "steps=8", "pool.policy=pace", "pool.pace.target_occupancy=24", "pool.capacity=64",
        "pool.pace.ema=0.5")  # fmt: skip
    recs = steps_of(out)
    assert sum(r["pool/rejected"] for r in recs) > 0
    assert all(0.0 <= r["pool/pace_rate"] < 1.0 for r in recs)
    assert max(r["pool/pace_rate"] for r in recs) > 0.0


def test_lag_is_refused_outside_the_lag_runtime(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:
    assert main([*tiny_overrides, "runtime.mode=local", "runtime.lag.k=3", f"out_dir={tmp_path / 'x'}"]) == 2
    assert "pool.policy=max_staleness" in capsys.readouterr().err
