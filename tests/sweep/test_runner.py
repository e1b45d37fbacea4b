"""The runner: which runs are skipped, resumed or restarted; parallel fake workers; Ctrl-C leaves no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from steadyrl.sweep.config import SweepError
from steadyrl.sweep.jobs import Job
from steadyrl.sweep.runner import execute, plan_jobs, train_command
from steadyrl.train.metrics import read_metrics
from tests.sweep.conftest import fake_spec_run, plan

#: A fake worker: writes ``steps`` learner-step lines and the final eval line into OUT_DIR, after SLEEP seconds.
FAKE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    out, steps, sleep, rc = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    print("started", out.name, sys.argv[5:], flush=True)
    print("gpu", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    time.sleep(sleep)
    with open(out / "metrics.jsonl", "w") as f:
        for t in range(steps):
            f.write(json.dumps({"step": t, "reward/mean": 0.5, "eval/acc": 0.5 if t == 0 else None}) + "\\n")
        if rc == 0:
            f.write(json.dumps({"step": steps, "eval/acc": 0.6}) + "\\n")
    sys.exit(rc)
""")


def test_plan_skips_finished_resumes_checkpointed_and_restarts_the_rest(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": ["grpo", "seq_tis", "vcpo", "gac", "oapl"]})
    fake_spec_run(specs[0])  # finished
    fake_spec_run(specs[1], finished=False, steps_done=3, checkpoint=True)  # partial with a checkpoint
    fake_spec_run(specs[2], finished=False, steps_done=3)  # partial without one
    fake_spec_run(specs[3], evals=[0.4, 0.5], alarms=[(1, "stop")])  # stopped early by the collapse guard
    jobs = plan_jobs(specs)
    assert [(j.action, j.status, j.steps_done) for j in jobs] == [
        ("skip", "finished", 6), ("resume", "partial", 3), ("fresh", "partial", 0), ("skip", "stopped", 2),
        ("fresh", "missing", 0)]
    assert train_command(jobs[1])[-1] == "resume=true" and train_command(jobs[2])[-1] == "overwrite=true"
    cmd = train_command(jobs[1])
    assert cmd[:5] == [sys.executable, "-m", "steadyrl.sweep.child", str(os.getpid()), "train"]
    assert f"out_dir={json.dumps(str(specs[1].out_dir))}" in cmd


def test_a_directory_of_another_config_is_an_error_naming_the_keys(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": ["grpo", "seq_tis"]})
    fake_spec_run(specs[0])
    other = plan(tmp_path, grid={"method": ["grpo"]}, base={"steps": 6, "eval.every": 2, "lr": 0.5})
    message = r"(?s)1 run directory holds results of another config; delete it.*lr: 0\.0003 -> 0\.5"
    with pytest.raises(SweepError, match=message):
        plan_jobs(other)
    assert [j.action for j in plan_jobs(specs)] == ["skip", "fresh"]


def _fake_command(sleep: float, fail: str = "") -> object:
    def command(job: Job) -> list[str]:
        rc = 1 if job.spec.entry.method == fail else 0
        return [sys.executable, "-c", FAKE, str(job.spec.out_dir), str(job.spec.entry.steps), str(sleep), str(rc),
                job.action]
    return command


def test_execute_runs_the_jobs_in_parallel_and_reports_failures(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": ["grpo", "seq_tis", "vcpo"]})
    fake_spec_run(specs[0])
    jobs = plan_jobs(specs)
    messages: list[str] = []
    t0 = time.monotonic()
    out = execute(jobs, n_jobs=2, progress=False, command=_fake_command(1.0, fail="vcpo"), say=messages.append,
                  poll_s=0.05)
    took = time.monotonic() - t0
    assert set(out.returncodes) == {"method=seq_tis,seed=0", "method=vcpo,seed=0"}  # the finished one was skipped
    assert out.failed == ["method=vcpo,seed=0"] and not out.interrupted
    assert took < 1.9 + 1.5  # two at a time: about one sleep, not two
    assert any(m.startswith("[steadyrl sweep] FAILED method=vcpo,seed=0: exit status 1") for m in messages)
    log = (specs[1].out_dir / "train.log").read_text()
    assert log.startswith("started method=seq_tis,seed=0 ['fresh']")
    assert [j.action for j in plan_jobs(specs)] == ["skip", "skip", "fresh"]


def test_parallel_runs_get_distinct_gpus(tmp_path: Path, monkeypatch) -> None:
    """On a machine with two GPUs (device_count mocked), two parallel runs each see their own GPU as cuda:0
    (CUDA_VISIBLE_DEVICES 0 and 1); without a GPU the environment is left alone."""
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    specs = plan(tmp_path / "two", grid={"method": ["grpo", "seq_tis"]})
    execute(plan_jobs(specs), n_jobs=2, progress=False, command=_fake_command(0.5), say=lambda _: None, poll_s=0.05)
    seen = sorted((s.out_dir / "train.log").read_text().splitlines()[1] for s in specs)
    assert seen == ["gpu 0", "gpu 1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    specs = plan(tmp_path / "none", grid={"method": ["grpo"]})
    execute(plan_jobs(specs), n_jobs=2, progress=False, command=_fake_command(0.0), say=lambda _: None, poll_s=0.05)
    assert (specs[0].out_dir / "train.log").read_text().splitlines()[1] == "gpu None"


DRIVER = textwrap.dedent("""
    import signal, sys, textwrap
    # A test run launched in the background inherits SIGINT ignored; the driver stands for an interactive sweep.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from pathlib import Path
    from steadyrl.sweep.config import SweepConfig, expand
    from steadyrl.sweep.runner import execute, plan_jobs
    out = Path(sys.argv[1])
    specs = expand(SweepConfig(out_dir=out, grid={"method": ["grpo", "seq_tis", "vcpo"]}, base={"steps": 4}))
    # grpo's worker checkpoints on SIGINT; seq_tis's ignores it (killed after the grace period); vcpo never starts
    child = textwrap.dedent('''
        import os, signal, sys, time
        from pathlib import Path
        out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
        polite = sys.argv[2] == "grpo"
        def on_int(signum, frame):
            (out / "got_sigint").write_text("1")
            if polite:
                sys.exit(130)
        signal.signal(signal.SIGINT, on_int)
        (out / "pid").write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)
    ''')
    def command(job):
        return [sys.executable, "-c", child, str(job.spec.out_dir), job.spec.entry.method]
    result = execute(plan_jobs(specs), n_jobs=2, grace_s=1.0, progress=False, command=command, poll_s=0.05)
    print("RESULT", result.interrupted, sorted(result.returncodes.items()), flush=True)
""")


def test_ctrl_c_stops_the_workers_and_leaves_no_orphans(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parents[2])
    pid_files = [out / "method=grpo,seed=0" / "pid", out / "method=seq_tis,seed=0" / "pid"]
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in pid_files):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in pid_files]
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert "RESULT True" in stdout, stderr
    assert "'method=grpo,seed=0', 130" in stdout  # stopped itself on SIGINT
    assert "'method=seq_tis,seed=0', -15" in stdout  # ignored SIGINT: terminated after the grace period
    assert "vcpo" not in stdout.split("RESULT")[1]  # never started
    assert (out / "method=grpo,seed=0" / "got_sigint").is_file()
    assert (out / "method=seq_tis,seed=0" / "got_sigint").is_file()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_ctrl_c_that_lands_in_a_finalizer_still_stops_the_sweep(tmp_path: Path) -> None:
    # Python swallows an exception raised inside __del__, so a Ctrl-C raised as KeyboardInterrupt there was lost and
    # the sweep went on; the handler only counts, and the loop reads the count.
    class SendsCtrlC:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)

    def command(job: Job) -> list[str]:
        SendsCtrlC()  # collected at once: the signal arrives while its finalizer runs
        return [sys.executable, "-c", "import time; time.sleep(20)"]

    specs = plan(tmp_path, grid={"method": ["grpo", "seq_tis"]})
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        started = time.monotonic()
        outcome = execute(plan_jobs(specs), n_jobs=1, grace_s=0.5, progress=False, command=command,
                          say=lambda _: None, poll_s=0.05)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcome.interrupted
    assert list(outcome.returncodes) == [specs[0].entry.name]  # the second run never started
    assert time.monotonic() - started < 15


def test_tiny_sweep_end_to_end_then_resume_then_report(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:
    from steadyrl.sweep.entry import report_main, sweep_main

    base = ",".join(o.replace("=", ": ", 1) for o in tiny_overrides
                    if not o.startswith(("runtime.threads=", "log.progress=")))
    out = tmp_path / "sweep"
    args = [f"base={{{base}, steps: 6, lag: 2, eval.every: 3, checkpoint.every: 3}}", "grid.method=[grpo,seq_tis]",
            "seeds=[0]", "jobs=2", f"out_dir={out}", "progress=false"]
    assert sweep_main(args) == 0
    runs = [out / "method=grpo,seed=0", out / "method=seq_tis,seed=0"]
    first = [(r / "metrics.jsonl").read_bytes() for r in runs]
    for r in runs:
        records = read_metrics(r / "metrics.jsonl")
        assert [x["step"] for x in records] == list(range(7)) and "eval/acc" in records[-1]
        assert "steadyrl train: 6 steps" in (r / "train.log").read_text()
    text = capsys.readouterr().out
    assert "| grpo | 2 | 1/1 |" in text and "| seq_tis | 2 | 1/1 |" in text
    arms = {f["rule"]: f["verdict"] for f in json.loads((out / "arms_check.json").read_text())}
    assert arms["config_diff"] == arms["seeds"] == arms["data_order"] == "PASS", arms  # the sweep checked its arms
    # a partial run (its final line lost) continues from its checkpoint; the finished one is skipped
    lines = first[1].splitlines(keepends=True)
    (runs[1] / "metrics.jsonl").write_bytes(b"".join(lines[:-1]))
    assert sweep_main(args) == 0
    err = capsys.readouterr().err
    assert "2 runs in" in err and "1 done (skipped), 1 to resume, 0 to start" in err
    assert "resumed from" in (runs[1] / "train.log").read_text()
    assert [(r / "metrics.jsonl").read_bytes() for r in runs] == first  # the same bytes as the uninterrupted run
    assert sweep_main(args) == 0
    assert "2 done (skipped), 0 to resume, 0 to start" in capsys.readouterr().err
    assert report_main([str(out)]) == 0
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 2  # accuracy vs lag + the curves at lag 2
    assert "<h2>Fair comparison</h2>" in html and "config_diff" in html
