"""Wall-clock of ``runtime.mode=ray`` against ``runtime.mode=local`` on the tiny test job, one sampler.

Each variant is a real ``steadyrl train`` run of the tests' tiny job (``tiny_overrides`` in tests/conftest.py: a
2-layer, width-32 Llama warm-started once into a temporary cache; 16 prompts × 8, 4 new tokens) with one sampler and
the learner at one torch thread each, in each runtime, synchronous and asynchronous (fifo pool). Per variant it
prints: the time to build the rollout source (for ``ray``: ``ray.init`` of a local Ray + the coordinator actor), the
first batch's wait (sampler start-up), and over steps 3 … steps − 1 the medians of ``time/step_s``,
``time/learn_s``, ``time/wait_s``, ``time/learner_idle_frac``, ``time/sampler_idle_frac``; then the run's wall-clock.
Variants run one after the other, ``rounds`` times, so load changes hit all alike. Needs Ray
(``pip install --no-deps -r requirements/ray.txt``).

    .venv/bin/python benchmarks/runtime_ray.py [STEPS=30] [ROUNDS=1] [--default-model]

``--default-model`` runs the main job's model and task instead (the default config: 1M-parameter Llama, 64 prompts
× 8; its warm start is cached under ``~/.cache/steadyrl`` after the first run of ``bash scripts/main.sh``).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.train.entry import SOURCES
from steadyrl.train.loop import train
from steadyrl.train.metrics import read_metrics

#: tests/conftest.py's tiny_overrides (without its cache dir): the tiny model and task.
TINY_MODEL = [
    "task.min_terms=2", "task.max_terms=2", "task.min_digits=1", "task.max_digits=1", "task.eval_size=128",
    "model.arch.hidden_size=32", "model.arch.num_layers=2", "model.arch.num_heads=2",
    "model.arch.intermediate_size=64", "model.warm_start.target_accuracy=0.25", "model.warm_start.max_steps=400",
    "model.warm_start.eval_every=20", "model.warm_start.eval_problems=128", "model.warm_start.batch_size=64",
    "model.warm_start.lr=1e-2", "model.warm_start.warmup_steps=10", "model.warm_start.train_problems=2048",
    "eval.n=128", "rollout.max_new_tokens=4", "data.train_pool=512", "lr=1e-3", "prompts_per_step=16",
]  # fmt: skip
#: This benchmark's fixed settings: one sampler, one torch thread for it and for the learner, no eval, no checkpoint.
SETTINGS = [
    "eval.every=0", "runtime.threads=1", "rollout.threads=1", "log.progress=false", "log.timings=separate",
    "checkpoint.every=0", "log.plot=false", "runtime.lag.k=0", "runtime.concurrent.samplers=1", "overwrite=true",
]  # fmt: skip
TINY = [*TINY_MODEL, *SETTINGS]
VARIANTS = {"sync": ["runtime.concurrent.sync=true"], "fifo": ["pool.policy=fifo"]}
SKIP = 3


def one_run(mode: str, variant: str, *, steps: int, root: Path, cache: Path | None) -> str:
    """One run; ``cache`` None = the main job's default model and task (its usual model cache), else the tiny job."""
    out = root / f"{mode}-{variant}"
    job = SETTINGS if cache is None else [*TINY, f"model.cache_dir={cache}"]
    overrides = [*job, f"runtime.mode={mode}", f"steps={steps}", f"out_dir={out}"]
    cfg = load_config(TrainConfig, overrides=[*overrides, *VARIANTS[variant]])
    made: dict[str, float] = {}

    def factory(cfg: TrainConfig, **kw: Any) -> Any:
        t0 = time.perf_counter()
        source = SOURCES[cfg.runtime.mode](cfg, **kw)
        made["init"] = time.perf_counter() - t0
        return source

    t0 = time.perf_counter()
    train(cfg, make_source=factory)
    wall = time.perf_counter() - t0
    recs = [r for r in read_metrics(out / "timings.jsonl") if "time/step_s" in r]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in recs[SKIP:] if key in r)

    return (
        f"{mode:5s} {variant:4s}  source {made['init']:5.2f} s  first batch {recs[0]['time/wait_s']:5.2f} s  "
        f"step {med('time/step_s') * 1e3:4.0f} ms (learn {med('time/learn_s') * 1e3:3.0f}, wait "
        f"{med('time/wait_s') * 1e3:4.0f})  learner idle {med('time/learner_idle_frac'):.2f}  "
        f"sampler idle {med('time/sampler_idle_frac'):.2f}  wall {wall:5.1f} s"
    )


def main() -> None:
    default_model = "--default-model" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--default-model"]
    steps = int(argv[0]) if argv else 30
    rounds = int(argv[1]) if len(argv) > 1 else 1
    with tempfile.TemporaryDirectory(prefix="steadyrl-ray-bench-") as tmp:
        root = Path(tmp)
        cache = None if default_model else root / "cache"
        for _ in range(rounds):
            for mode in ("local", "ray"):
                for variant in VARIANTS:
                    print(one_run(mode, variant, steps=steps, root=root / "runs", cache=cache), flush=True)


if __name__ == "__main__":  # the local runtime spawns processes
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
