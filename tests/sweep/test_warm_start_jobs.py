"""A sweep's warm starts: planned once per distinct cache entry, built before their runs, shown on the bar."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from steadyrl.models.warmstart import METADATA_FILE, EvalPoint, WarmStartConfig
from steadyrl.sweep.jobs import Job
from steadyrl.sweep.runner import execute, plan_jobs, progress_line
from steadyrl.sweep.warm_start_jobs import (
    WARM_START_DIR,
    ProgressFile,
    WarmStartJob,
    describe,
    plan_warm_starts,
    read_progress,
    warm_start_command,
)
from tests.sweep.conftest import fake_spec_run, plan

#: A fake warm-start worker: writes a progress record, sleeps, then (rc 0) the cache entry's metadata file; its start
#: and end times go to <entry>.times.
FAKE_WARM = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    progress, entry, sleep, rc = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    start = time.time()
    progress.write_text(json.dumps({"step": 7, "max_steps": 50, "accuracy": 0.25, "eval_step": 5, "target": 0.3,
                                    "seconds": 1.0}))
    time.sleep(sleep)
    if rc == 0:
        entry.mkdir(parents=True)
        (entry / "steadyrl_warmstart.json").write_text(json.dumps({"report": {"steps": 9, "accuracy": 0.31}}))
    entry.with_suffix(".times").write_text(json.dumps([start, time.time()]))
    sys.exit(rc)
""")
#: A fake run: records when it started and whether its warm start's entry was there, then finishes.
FAKE_RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    out, entry, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    (out / "started.json").write_text(json.dumps({"entry": (entry / "steadyrl_warmstart.json").is_file()}))
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps({"step": t, "reward/mean": 0.5}) + "\\n" for t in range(steps))
        f.write(json.dumps({"step": steps, "eval/acc": 0.6}) + "\\n")
""")


def _warm_job(tmp_path: Path, jobs: list[Job], seed: int) -> WarmStartJob:
    runs = tuple(j.spec.entry.name for j in jobs if j.spec.entry.seed == seed)
    spec = next(j.spec for j in jobs if j.spec.entry.seed == seed)
    return WarmStartJob(tmp_path / "cache" / f"chain_sum-seed{seed}", spec, runs)


def _commands(
    tmp_path: Path, sleep: float, fail_seed: int | None = None
) -> tuple[Callable[[WarmStartJob], list[str]], Callable[[Job], list[str]], list[str]]:
    """Fake warm-start and run commands, and the list of entries the warm-start command was asked for."""
    warm_started: list[str] = []

    def warm_command(job: WarmStartJob) -> list[str]:
        warm_started.append(job.entry.name)
        rc = 1 if job.spec.config.seed == fail_seed else 0
        return [sys.executable, "-c", FAKE_WARM, str(job.progress_path), str(job.entry), str(sleep), str(rc)]

    def command(job: Job) -> list[str]:
        entry = tmp_path / "cache" / f"chain_sum-seed{job.spec.config.seed}"
        return [sys.executable, "-c", FAKE_RUN, str(job.spec.out_dir), str(entry), str(job.spec.entry.steps)]

    return warm_command, command, warm_started


def test_each_warm_start_is_built_once_before_its_runs(tmp_path: Path) -> None:
    jobs = plan_jobs(plan(tmp_path, grid={"method": ["grpo", "seq_tis", "vcpo"]}, seeds=[0, 1]))
    warm = [_warm_job(tmp_path, jobs, 0), _warm_job(tmp_path, jobs, 1)]
    assert [len(w.runs) for w in warm] == [3, 3]
    warm_command, command, warm_started = _commands(tmp_path, sleep=0.5)
    messages: list[str] = []
    out = execute(jobs, n_jobs=4, threads=1, progress=False, command=command, say=messages.append, poll_s=0.05,
                  warm_starts=warm, warm_command=warm_command)
    assert warm_started == ["chain_sum-seed0", "chain_sum-seed1"]  # once each, not once per run
    assert out.warm_starts == {"chain_sum-seed0": 0, "chain_sum-seed1": 0} and not out.failed
    assert sorted(out.returncodes) == sorted(j.spec.entry.name for j in jobs)
    for job in jobs:  # every run started after its warm start had written the entry
        assert json.loads((job.spec.out_dir / "started.json").read_text())["entry"] is True
    assert (tmp_path / "sweep" / WARM_START_DIR / "chain_sum-seed0.log").is_file()
    done = [m for m in messages if "warm start chain_sum seed" in m and "done" in m]
    assert done == [f"[steadyrl sweep] warm start chain_sum seed {s} done: 9 steps, sampled accuracy 0.310 "
                    f"({m.split('(')[1].split(')')[0]}); 3 run(s) can start" for s, m in zip((0, 1), done, strict=True)]


def test_warm_starts_share_the_thread_budget(tmp_path: Path) -> None:
    # jobs × threads = 2 threads; a warm start uses model.warm_start.threads = 2: the two run one after the other
    jobs = plan_jobs(plan(tmp_path, grid={"method": ["grpo"]}, seeds=[0, 1]))
    warm = [_warm_job(tmp_path, jobs, 0), _warm_job(tmp_path, jobs, 1)]
    assert warm[0].threads == WarmStartConfig().threads == 2
    warm_command, command, _ = _commands(tmp_path, sleep=0.3)
    execute(jobs, n_jobs=2, threads=1, progress=False, command=command, say=lambda m: None, poll_s=0.05,
            warm_starts=warm, warm_command=warm_command)
    first, second = (json.loads(w.entry.with_suffix(".times").read_text()) for w in warm)
    assert second[0] >= first[1]  # the second started after the first ended: not in parallel


def test_a_failed_warm_start_fails_its_runs_without_starting_them(tmp_path: Path) -> None:
    jobs = plan_jobs(plan(tmp_path, grid={"method": ["grpo", "seq_tis"]}, seeds=[0, 1]))
    warm = [_warm_job(tmp_path, jobs, 0), _warm_job(tmp_path, jobs, 1)]
    warm_command, command, _ = _commands(tmp_path, sleep=0.1, fail_seed=1)
    messages: list[str] = []
    out = execute(jobs, n_jobs=2, threads=1, progress=False, command=command, say=messages.append, poll_s=0.05,
                  warm_starts=warm, warm_command=warm_command)
    assert out.warm_starts == {"chain_sum-seed0": 0, "chain_sum-seed1": 1}
    assert sorted(out.failed) == ["method=grpo,seed=1", "method=seq_tis,seed=1"]
    assert not (jobs[1].spec.out_dir / "started.json").exists()  # seed 1's runs never started
    assert (jobs[0].spec.out_dir / "started.json").exists()
    assert any(m.startswith("[steadyrl sweep] FAILED warm start chain_sum seed 1: exit status 1") and
               m.endswith("its 2 run(s) will not start") for m in messages)


def test_the_bar_shows_the_running_warm_starts_and_their_progress(tmp_path: Path) -> None:
    jobs = plan_jobs(plan(tmp_path, grid={"method": ["grpo"]}, seeds=[0, 1]))
    warm = _warm_job(tmp_path, jobs, 0)
    assert describe(warm) == "chain_sum seed 0 starting"  # no progress file yet
    warm.progress_path.parent.mkdir(parents=True)
    hook = ProgressFile(warm.progress_path, WarmStartConfig(max_steps=600))
    hook(0, EvalPoint(0, 0.0, 0.5))
    hook(1, EvalPoint(0, 0.0, 0.6))  # within PROGRESS_EVERY_S of the last write and no new eval: not written
    assert read_progress(warm.progress_path)["step"] == 0
    hook(50, EvalPoint(50, 0.184, 9.0))  # a new measurement is written at once
    assert describe(warm) == "chain_sum seed 0 step 50/600 acc 0.184→0.3"
    assert progress_line([warm], queued_warm=1, done=0, running=0, left=2) == (
        "sweep: warm start chain_sum seed 0 step 50/600 acc 0.184→0.3 (+1 queued) | runs 0 done, 0 running, 2 left")
    assert progress_line([], queued_warm=0, done=1, running=1, left=0) == "sweep: runs 1 done, 1 running, 0 left"


def test_plan_lists_each_missing_entry_once_with_its_runs(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    small = {"steps": 6, "eval.every": 2, "model.cache_dir": str(cache)}
    specs = plan(tmp_path, grid={"method": ["grpo", "seq_tis"], "lr": [1e-4, 3e-4]}, seeds=[0, 1], base=small)
    fake_spec_run(specs[0])  # finished: needs nothing
    warm = plan_warm_starts(plan_jobs(specs))
    # in the order of the first run that needs each (seed innermost; the first run, seed 0, is done)
    assert [(w.label, len(w.runs)) for w in warm] == [("chain_sum seed 1", 4), ("chain_sum seed 0", 3)]
    assert {w.entry.parent for w in warm} == {cache} and warm[0].entry.name.startswith("chain_sum-")
    assert warm_start_command(warm[0])[4:7] == ["warm-start", str(warm[0].progress_path), str(specs[1].config_path)]
    (warm[0].entry).mkdir(parents=True)
    (warm[0].entry / METADATA_FILE).write_text("{}")  # built meanwhile
    assert [w.label for w in plan_warm_starts(plan_jobs(specs))] == ["chain_sum seed 0"]
    other = {**small, "model.warm_start.threads": 1}  # another setting: another entry
    specs = plan(tmp_path / "b", grid={"method": ["grpo"]}, seeds=[0], base=other)
    assert plan_warm_starts(plan_jobs(specs))[0].entry != warm[0].entry


def test_tiny_sweep_warm_starts_once_and_shows_it(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:
    from steadyrl.models.warmstart import read_warm_start_metadata
    from steadyrl.sweep.entry import sweep_main

    cache = tmp_path / "cache"  # empty: the sweep must build the warm start
    base = ",".join(o.replace("=", ": ", 1) for o in tiny_overrides
                    if not o.startswith(("runtime.threads=", "log.progress=", "model.cache_dir=")))
    out = tmp_path / "sweep"
    args = [f"base={{{base}, model.cache_dir: {cache}, steps: 4, lag: 1, eval.every: 2}}",
            "grid.method=[grpo,seq_tis]", "seeds=[0]", "jobs=2", f"out_dir={out}", "progress=true"]
    assert sweep_main(args) == 0
    err = capsys.readouterr().err
    [entry] = [p for p in cache.iterdir() if p.is_dir()]  # one entry for both runs
    assert "first 1 model warm start(s) they need" in err
    assert f"warm start chain_sum seed 0 for 2 run(s) (log: {out / WARM_START_DIR / entry.name}.log)" in err
    assert "sweep: warm start chain_sum seed 0 " in err  # the bar, while it ran
    report = read_warm_start_metadata(entry)["report"]
    assert f"warm start chain_sum seed 0 done: {report['steps']} steps" in err
    assert read_progress(out / WARM_START_DIR / f"{entry.name}.json")["step"] == report["steps"]
    assert f"warm start ready: {entry}" in (out / WARM_START_DIR / f"{entry.name}.log").read_text()
    for run in ("method=grpo,seed=0", "method=seq_tis,seed=0"):
        assert "steadyrl train: 4 steps" in (out / run / "train.log").read_text()
    assert sweep_main(args) == 0  # nothing left to build or run
    assert "warm start" not in capsys.readouterr().err
