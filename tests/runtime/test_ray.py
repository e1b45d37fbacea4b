"""``runtime.mode=ray`` end to end on the tiny model: sampler actors, the coordinator, the pool, faults, resume.

The learner side is :class:`~steadyrl.runtime.concurrent.ConcurrentSource` (tested through ``runtime.mode=local`` in
test_local.py); these tests check the Ray transport keeps its semantics. One sampler (the machine has 2 cores).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from steadyrl.train import checkpoint as ckpt
from steadyrl.train.entry import main, ray_source
from steadyrl.train.loop import StopFlag
from steadyrl.train.metrics import read_metrics
from tests.runtime.concurrent_harness import Hooked, run_with, steps_of

pytestmark = pytest.mark.timeout(300)
RAY = ["runtime.lag.k=0", "runtime.mode=ray", "runtime.concurrent.samplers=1", "eval.every=0", "checkpoint.every=3",
       "log.plot=false"]
NO_RAY = "Ray is not installed (pip install 'steadyrl[ray]')"
P = 16  # prompts_per_step of tiny_overrides


@pytest.fixture(scope="module")
def ray_running() -> Iterator[Any]:
    """A local Ray shared by the tests of this module (a run that finds Ray running uses it and leaves it running)."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def run(tiny: list[str], out: Path, *extra: str, hook: Any = None, stop: StopFlag | None = None) -> tuple[Any, Hooked]:
    return run_with(ray_source, [*tiny, *RAY, f"out_dir={out}", *extra], hook=hook, stop=stop)


def test_without_ray_the_error_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.delitem(sys.modules, "steadyrl.runtime.ray", raising=False)
    line = r"^runtime\.mode=ray needs Ray: pip install 'steadyrl\[ray\]' \(the tested pins: requirements/ray\.txt\)$"
    with pytest.raises(ImportError, match=line):
        importlib.import_module("steadyrl.runtime.ray")


def test_ctrl_c_kills_every_actor_and_leaves_a_loadable_checkpoint(tiny_overrides: list[str], tmp_path: Path) -> None:
    """First in the file: with no Ray running yet, the run starts Ray itself and must shut it down again."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    started_by_run = not ray.is_initialized()
    stop, pids = StopFlag(), []

    def hook(source: Any, step: int) -> None:
        if step == 3:
            pids.append(ray._private.state.actors(actor_id=source.actors[0]._actor_id.hex())["Pid"])
            stop.request()

    result, src = run(tiny_overrides, tmp_path / "ctrlc", "steps=50", hook=hook, stop=stop)
    assert result.interrupted and result.steps_done == 4
    assert ckpt.load_latest(tmp_path / "ctrlc").state["step"] == 4
    assert src.inner.owns_ray == started_by_run and ray.is_initialized() != started_by_run
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pids[0]}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pids[0]}")  # the sampler actor's process is gone


def test_sync_mode_trains_on_policy_through_the_cli(
    ray_running: Any, tiny_overrides: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "sync"
    assert main([*tiny_overrides, *RAY, "steps=4", "runtime.concurrent.sync=true", f"out_dir={out}"]) == 0
    recs = steps_of(out)
    assert len(recs) == 4
    assert all(r["lag/max"] == 0 and r["lag/gen_mean"] == 0 for r in recs)
    assert all(r["is/ess_ratio"] == pytest.approx(1.0, abs=1e-3) for r in recs)
    times = [r for r in read_metrics(out / "timings.jsonl") if "time/step_s" in r]
    assert all(0 < r["time/sampler_idle_frac"] < 1 for r in times[1:])  # sync: the sampler waits for each step
    assert all(0 < r["time/learner_idle_frac"] < 1 for r in times[1:])


def test_max_staleness_bounds_every_trained_sample(ray_running: Any, tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "bounded"
    run(tiny_overrides, out, "steps=8", "pool.policy=max_staleness", "pool.max_staleness=1")
    recs = steps_of(out)
    assert max(r["lag/max"] for r in recs) <= 1
    assert max(r["lag/max"] for r in recs) == 1  # the sampler did run ahead
    assert sum(r["pool/dropped"] for r in recs) == 0  # admission control, not dropping, kept the bound


def test_killed_actor_is_restarted_and_no_rollout_is_lost_or_trained_twice(
    ray_running: Any, tiny_overrides: list[str], tmp_path: Path
) -> None:
    def kill(source: Any, step: int) -> None:
        if step in (1, 3):
            ray_running.kill(source.actors[0])

    out = tmp_path / "kill"
    result, src = run(tiny_overrides, out, "steps=6", "pool.capacity=24", hook=kill)
    recs = steps_of(out)
    assert result.steps_done == 6 and recs[-1]["runtime/sampler_restarts"] == 2
    pool = src.inner.pool
    trained = [g for b in src.batches for g in b]
    assert len(trained) == len(set(trained)) == 6 * P  # nothing trained twice
    assert not pool.trained & pool.discarded
    # every id ever claimed either arrived (trained, pooled or discarded) or is still in the live sampler's claim
    claimed = set(range(src.inner._counters().next_group))
    in_flight = {g for i in range(src.inner.n) for g in src.inner._undelivered(i)}
    assert claimed == pool.seen | in_flight


def test_resume_continues_with_the_checkpointed_pool(
    ray_running: Any, tiny_overrides: list[str], tmp_path: Path
) -> None:
    def fill(source: Any, step: int) -> None:  # before the last checkpoint, let the sampler run a batch ahead
        deadline = time.monotonic() + 60
        while step == 3 and len(source.pool) < P and time.monotonic() < deadline:
            source._collect()
            time.sleep(0.05)

    out = tmp_path / "resume"
    run(tiny_overrides, out, "steps=4", hook=fill)
    state = ckpt.load_latest(out).state
    pooled = [int(r["group_id"]) for r in state["source"]["pool"]["records"]]
    assert state["step"] == 4 and len(pooled) >= P  # fifo with capacity 64
    result, src = run(tiny_overrides, out, "steps=6", "resume=true")
    assert result.steps_done == 6
    assert src.batches[0] == pooled[:P]  # the first batch after resume is the checkpoint's oldest pooled groups
    trained_before = set(state["source"]["pool"]["trained"].tolist())
    assert not trained_before & {g for b in src.batches for g in b}
