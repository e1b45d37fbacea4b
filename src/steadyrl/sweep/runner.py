"""Run a sweep's ``steadyrl train`` runs as parallel subprocesses: resumable, with progress, stoppable with Ctrl-C.

Before anything starts, each run directory is classified (:func:`plan_jobs`):

* **skip**: its metrics.jsonl ends with the final eval line (``step == steps``, or an earlier one after the collapse
  guard stopped the run);
* **resume**: it has some lines and a checkpoint: ``steadyrl train ... resume=true`` continues it;
* **fresh**: otherwise (no run, or a partial one without a checkpoint): ``overwrite=true`` starts it afresh.

A directory whose ``config.yaml`` belongs to a different config (another config hash) is an error, listed with the
differing keys: the sweep never silently mixes two experiments.

:func:`execute` keeps ``jobs`` runs going at once, each a process of its own (``python -m steadyrl.sweep.child``,
``OMP_NUM_THREADS`` = ``threads``), output to ``<run>/train.log``. The warm starts the runs need
(:mod:`steadyrl.sweep.warm_start_jobs`) come first, one worker per distinct cache entry; a run starts once its warm
start is built (a failed warm start fails its runs without starting them). The workers keep at most ``jobs × threads``
torch threads busy (a warm start counts its own ``model.warm_start.threads``; one worker always runs). On a machine
with GPUs each worker gets the least-used one as its only visible GPU (``CUDA_VISIBLE_DEVICES``,
:class:`steadyrl.base.device.GpuSlots`): parallel runs land on distinct GPUs while there are enough. The progress
bar counts learner steps of all runs to do (its ETA) and shows the running warm starts (step, sampled accuracy and
its target) and runs done / running / left. The workers run in their own sessions, so a terminal's Ctrl-C
reaches only the sweep, which then sends each worker one SIGINT (``steadyrl train`` stops after its current step and
checkpoints), waits up to ``grace_s`` seconds, and kills what is left; a second Ctrl-C kills them at once. SIGTERM to
the sweep does the same. A worker also gets SIGTERM if the sweep dies without cleaning up (Linux, see
:mod:`steadyrl.sweep.child`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm.auto import tqdm

from steadyrl.base.device import GpuSlots
from steadyrl.config.io import ConfigError, load_config, read_yaml
from steadyrl.sweep.child import TRAIN_COMMAND
from steadyrl.sweep.config import RunSpec, SweepError, config_differences, config_hash
from steadyrl.sweep.jobs import EXIT_INTERRUPTED, Job
from steadyrl.sweep.results import is_train_record, run_status
from steadyrl.sweep.warm_start_jobs import WarmStartJob, describe, finished_message, warm_start_command
from steadyrl.train.checkpoint import list_checkpoints
from steadyrl.train.metrics import METRICS_FILE, read_metrics

#: Each run's combined stdout and stderr, in its directory.
LOG_FILE = "train.log"
#: ``config.yaml`` as ``steadyrl train`` writes it.
RUN_CONFIG = "config.yaml"
#: Seconds between looks at the workers.
POLL_S = 0.5
#: Seconds a worker gets after SIGTERM before SIGKILL.
TERM_WAIT_S = 5.0
@dataclass
class Outcome:
    """What :func:`execute` did."""

    returncodes: dict[str, int] = field(default_factory=dict)
    """Run name -> exit status of its worker (130: stopped by Ctrl-C; a run whose warm start failed: that one's)."""
    seconds: dict[str, float] = field(default_factory=dict)
    warm_starts: dict[str, int] = field(default_factory=dict)
    """Cache entry name -> exit status of the worker that built it."""
    interrupted: bool = False

    @property
    def failed(self) -> list[str]:
        """Runs whose worker exited with an error (not counting Ctrl-C)."""
        return [n for n, rc in self.returncodes.items() if rc not in (0, EXIT_INTERRUPTED)]


def _existing_hash(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    path = run_dir / RUN_CONFIG
    if not path.is_file():
        return None
    from steadyrl.config.train import TrainConfig

    try:
        cfg = load_config(TrainConfig, path=path)
    except ConfigError:
        data = read_yaml(path)
        return "unreadable", data
    return config_hash(cfg), cfg.model_dump(mode="json")


def plan_job(spec: RunSpec) -> Job:
    """Classify one run directory (see the module docstring); raises :class:`SweepError` on a config mismatch."""
    run_dir = spec.out_dir
    existing = _existing_hash(run_dir)
    if existing is not None and existing[0] != spec.entry.config_hash:
        diff = config_differences(existing[1], spec.config.model_dump(mode="json"))
        raise SweepError(f"{run_dir} holds a run of a different config ({'; '.join(diff) or 'unreadable config'})")
    records = read_metrics(run_dir / METRICS_FILE)
    status = run_status(records, spec.entry.steps, run_dir)
    done = sum(1 for r in records if is_train_record(r))
    if status in ("finished", "stopped"):
        return Job(spec, "skip", status, done)
    if status == "partial" and list_checkpoints(run_dir):
        return Job(spec, "resume", status, done)
    return Job(spec, "fresh", status, 0)


def plan_jobs(specs: Sequence[RunSpec]) -> list[Job]:
    """Classify every run; all config mismatches are reported together in one :class:`SweepError`."""
    jobs, errors = [], []
    for spec in specs:
        try:
            jobs.append(plan_job(spec))
        except SweepError as err:
            errors.append(str(err))
    if errors:
        shown = "\n  ".join(errors[:10]) + (f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else "")
        one = len(errors) == 1
        raise SweepError(f"{len(errors)} run director{'y holds' if one else 'ies hold'} results of another config; "
                         f"delete {'it' if one else 'them'} or choose another out_dir:\n  {shown}")
    return jobs


def train_command(job: Job) -> list[str]:
    """The worker's command line: ``steadyrl train CONFIG overrides... resume=true|overwrite=true``."""
    flag = "resume=true" if job.action == "resume" else "overwrite=true"
    return [sys.executable, "-m", "steadyrl.sweep.child", str(os.getpid()), TRAIN_COMMAND, str(job.spec.config_path),
            *job.spec.overrides, flag]


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as handle:
            return handle.read().count(b"\n")
    except OSError:
        return 0


class _StopRequests:
    """Ctrl-C (SIGINT) and SIGTERM counted by a handler that only sets a number, which the loops read.

    Raised as KeyboardInterrupt instead, a signal can land inside a ``Popen`` call that holds the process's wait lock
    (every later ``wait()`` then blocks for good) or inside a finalizer, which swallows it (the sweep never stops).
    Installed in the main thread only (elsewhere signals never reach Python code); an inherited ignored SIGINT (a
    background job) stays ignored.
    """

    def __init__(self) -> None:
        self.count = 0

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    @contextmanager
    def installed(self) -> Iterator[_StopRequests]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, self._handler)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float
    threads: int
    job: Job | None = None
    """The run it does, or None for a warm start."""
    warm: WarmStartJob | None = None
    lines0: int = 0
    gpu: str | None = None
    """The GPU it was given (its ``CUDA_VISIBLE_DEVICES``), or None on a machine without one."""


def _stop_workers(workers: Sequence[_Worker], grace_s: float, say: Callable[[str], None],
                  stop: _StopRequests | None = None) -> None:
    """SIGINT to each worker, wait up to ``grace_s`` for them to checkpoint (less if ``stop`` counts another Ctrl-C),
    then SIGTERM, then SIGKILL. Every wait is bounded, so a worker's exit status is always known afterwards (-9 for
    one that outlived SIGKILL's wait)."""
    alive = [w for w in workers if w.proc.poll() is None]
    if not alive:
        return
    say(f"[steadyrl sweep] stopping {len(alive)} run(s): each checkpoints after its current step "
        f"(up to {grace_s:.0f} s; Ctrl-C again to kill them now)")
    seen = stop.count if stop is not None else 0
    try:
        for w in alive:
            w.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace_s
        while any(w.proc.poll() is None for w in alive) and time.monotonic() < deadline:
            if stop is not None and stop.count > seen:
                break
            time.sleep(0.1)
    except KeyboardInterrupt:  # where no handler could be installed (not the main thread)
        pass
    finally:
        for w in alive:
            if w.proc.poll() is None:
                w.proc.terminate()
        deadline = time.monotonic() + TERM_WAIT_S
        for w in alive:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                try:
                    w.proc.wait(timeout=TERM_WAIT_S)
                except subprocess.TimeoutExpired:
                    w.proc.returncode = -signal.SIGKILL


def execute(
    jobs: Sequence[Job],
    *,
    n_jobs: int,
    threads: int = 1,
    grace_s: float = 120.0,
    progress: bool = True,
    command: Callable[[Job], list[str]] = train_command,
    say: Callable[[str], None] = tqdm.write,
    poll_s: float = POLL_S,
    warm_starts: Sequence[WarmStartJob] = (),
    warm_command: Callable[[WarmStartJob], list[str]] = warm_start_command,
) -> Outcome:
    """Build ``warm_starts``, then run the jobs that are not ``skip``, ``n_jobs`` at a time; returns their exit
    statuses (see module doc)."""
    todo = [j for j in jobs if j.action != "skip"]
    outcome = Outcome()
    if not todo:
        return outcome
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    total_steps = sum(max(0, j.spec.entry.steps - j.steps_done) for j in todo)
    capacity = n_jobs * threads
    needs = {run: w for w in warm_starts for run in w.runs}  # run name -> the warm start it waits for
    built: dict[Path, int] = {}  # cache entry -> exit status of its warm start
    pending_warm, pending = list(warm_starts), list(todo)
    running: list[_Worker] = []
    finished_steps = 0
    gpus = GpuSlots()

    def fits(cost: int) -> bool:
        return not running or sum(w.threads for w in running) + cost <= capacity

    def launch(cmd: list[str], log_path: Path, *, append: bool, cost: int) -> _Worker:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab" if append else "wb")  # noqa: SIM115
        gpu = gpus.acquire()  # parallel runs on distinct GPUs where there are enough
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=GpuSlots.env(env, gpu),
                                start_new_session=True)  # fmt: skip
        worker = _Worker(proc, log, time.monotonic(), cost, gpu=gpu)
        running.append(worker)
        return worker

    with tqdm(total=total_steps, disable=not progress, unit="step", desc="sweep", dynamic_ncols=True) as bar, \
            _StopRequests().installed() as stop:
        try:
            while pending_warm or pending or running:
                if stop.count:
                    raise KeyboardInterrupt
                while pending_warm and fits(pending_warm[0].threads):
                    warm = pending_warm.pop(0)
                    launch(warm_command(warm), warm.log_path, append=False, cost=warm.threads).warm = warm
                    say(f"[steadyrl sweep] warm start {warm.label} for {len(warm.runs)} run(s) "
                        f"(log: {warm.log_path})")
                for job in list(pending):
                    waits_for = needs.get(job.spec.entry.name)
                    if waits_for is not None and waits_for.entry not in built:
                        continue  # its warm start is queued or running
                    if waits_for is not None and built[waits_for.entry] != 0:
                        pending.remove(job)
                        outcome.returncodes[job.spec.entry.name] = built[waits_for.entry]
                        finished_steps += max(0, job.spec.entry.steps - job.steps_done)
                        continue
                    if not fits(threads):
                        break
                    pending.remove(job)
                    run_dir = job.spec.out_dir
                    worker = launch(command(job), run_dir / LOG_FILE, append=job.action == "resume", cost=threads)
                    worker.job, worker.lines0 = job, _count_lines(run_dir / METRICS_FILE)
                for w in [w for w in running if w.proc.poll() is not None]:
                    running.remove(w)
                    gpus.release(w.gpu)
                    w.log.close()
                    rc, took = int(w.proc.returncode), time.monotonic() - w.started
                    if w.warm is not None:
                        built[w.warm.entry] = outcome.warm_starts[w.warm.entry.name] = rc
                        say(finished_message(w.warm, took) if rc == 0 else
                            f"[steadyrl sweep] FAILED warm start {w.warm.label}: exit status {rc} after {took:.0f} s;"
                            f" see {w.warm.log_path}; its {len(w.warm.runs)} run(s) will not start")
                        continue
                    assert w.job is not None
                    name = w.job.spec.entry.name
                    outcome.returncodes[name], outcome.seconds[name] = rc, took
                    finished_steps += max(0, w.job.spec.entry.steps - w.job.steps_done)
                    if rc == 0:
                        say(f"[steadyrl sweep] done {name} ({took:.0f} s)")
                    else:
                        say(f"[steadyrl sweep] FAILED {name}: exit status {rc} after {took:.0f} s; see "
                            f"{w.job.spec.out_dir / LOG_FILE}")
                runs = [w for w in running if w.job is not None]
                current = sum(min(max(0, _count_lines(w.job.spec.out_dir / METRICS_FILE) - w.lines0),
                                  w.job.spec.entry.steps - w.job.steps_done) for w in runs if w.job is not None)
                bar.n = min(total_steps, finished_steps + current)
                bar.set_description_str(progress_line(
                    [w.warm for w in running if w.warm is not None], queued_warm=len(pending_warm),
                    done=len(outcome.returncodes), running=len(runs), left=len(pending)), refresh=False)
                bar.refresh()
                if pending_warm or pending or running:
                    time.sleep(poll_s)
        except BaseException as exc:  # Ctrl-C, SIGTERM, or a failure of the sweep itself: no orphan workers
            outcome.interrupted = isinstance(exc, KeyboardInterrupt)
            _stop_workers(running, grace_s if outcome.interrupted else 0.0, say, stop)
            for w in running:
                w.log.close()
                if w.job is not None:
                    outcome.returncodes[w.job.spec.entry.name] = int(w.proc.returncode)
                    outcome.seconds[w.job.spec.entry.name] = time.monotonic() - w.started
            if not outcome.interrupted:
                raise
    return outcome


def progress_line(warming: Sequence[WarmStartJob], *, queued_warm: int, done: int, running: int, left: int) -> str:
    """The bar's description: the running warm starts with their progress (:func:`describe`), then the runs."""
    head = ""
    if warming or queued_warm:
        more = f" (+{queued_warm} queued)" if queued_warm else ""
        head = f"warm start {'; '.join(describe(w) for w in warming) or 'queued'}{more} | "
    return f"sweep: {head}runs {done} done, {running} running, {left} left"
