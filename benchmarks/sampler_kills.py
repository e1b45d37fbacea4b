"""``runtime.mode=local`` under SIGKILL: sampler 0 is killed after every batch the learner takes; how does each run end?

Each run is the tests' tiny job (:data:`runtime_ray.TINY`: a 2-layer, width-32 Llama warm-started once into a
temporary cache) with two samplers, in a child process of its own so that a hang cannot stop the benchmark. After
every batch from step 1 on, the learner's side SIGKILLs sampler 0, whatever it is doing (copying weights, claiming
ids, sampling, writing its spool file). A run ends in one of three ways:

* ``finished``: all steps trained (killed samplers restarted, their claimed groups redone);
* ``gave up``: ``SamplerDiedError``, the designed end of a sampler that dies 4 times in a row without delivering a
  group (being killed after every step, sampler 0 sometimes never gets to deliver);
* ``hung``: no end within ``--timeout`` seconds (the child is killed): a lock or signal left taken by a killed
  sampler. Before the locks were ``flock(2)`` file locks (``steadyrl.runtime.procs.FileLock``) this happened.

    .venv/bin/python benchmarks/sampler_kills.py [--runs 6] [--steps 8] [--timeout 120]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from runtime_ray import TINY

#: Exit code of a child whose run ended with SamplerDiedError.
GAVE_UP = 3


class _KillSampler0:
    """A rollout source that SIGKILLs sampler 0 after every batch it hands out from ``step`` 1 on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def next_batch(self, *, step: int) -> Any:
        batch = self.inner.next_batch(step=step)
        proc = self.inner.procs[0]
        if step >= 1 and proc is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def one_run(out: str, cache: str, steps: int) -> int:
    """The child: train with the killing source; 0 when all steps trained, :data:`GAVE_UP` on SamplerDiedError."""
    from steadyrl.config.io import load_config
    from steadyrl.config.train import TrainConfig
    from steadyrl.runtime.concurrent import SamplerDiedError
    from steadyrl.train.entry import local_source
    from steadyrl.train.loop import train

    overrides = [*TINY, f"model.cache_dir={cache}", "runtime.mode=local", "runtime.concurrent.samplers=2",
                 "pool.capacity=24",
                 f"steps={steps}", f"out_dir={out}"]  # fmt: skip
    cfg = load_config(TrainConfig, overrides=overrides)
    try:
        result = train(cfg, make_source=lambda cfg, **kw: _KillSampler0(local_source(cfg, **kw)))
    except SamplerDiedError:
        return GAVE_UP
    return 0 if result.steps_done == steps else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take before it counts as hung")
    ap.add_argument("--one", nargs=2, metavar=("OUT", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        sys.exit(one_run(*args.one, steps=args.steps))
    outcomes: Counter[str] = Counter()
    with tempfile.TemporaryDirectory(prefix="steadyrl-kill-bench-") as tmp:
        cache = Path(tmp) / "cache"
        for i in range(args.runs):
            out = Path(tmp) / f"run{i}"
            cmd = [sys.executable, __file__, "--one", str(out), str(cache), "--steps", str(args.steps)]
            # the first run also warm-starts the tiny model into the cache
            timeout = args.timeout + (300.0 if i == 0 else 0.0)
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).returncode
                outcome = {0: "finished", GAVE_UP: "gave up"}.get(rc, f"failed (exit {rc})")
            except subprocess.TimeoutExpired:  # the child is killed; its samplers get SIGTERM (PR_SET_PDEATHSIG)
                outcome = "hung"
            outcomes[outcome] += 1
            print(f"run {i}: {outcome:18s} {time.perf_counter() - t0:6.1f} s", flush=True)
    print("  ".join(f"{k}: {v}/{args.runs}" for k, v in sorted(outcomes.items())))


if __name__ == "__main__":  # the local runtime spawns processes
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
