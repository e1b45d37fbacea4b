"""Wall-clock of ``runtime.mode=local``: synchronous vs asynchronous, same model, config and machine, in one run.

Each variant is a real ``steadyrl train`` run (the main job's model, task and batch: 64 prompts × 8 on the embedded
default model, warm-started once and cached) in ``runtime.mode=local`` with one sampler process and one learner
process, one torch thread each (2 cores). Per variant it reports, over steps ``--skip`` … ``--steps − 1`` (the first
steps include process start-up):

* the wall-clock per learner step (``time/step_s``, median and total) and the speed-up over the sync variant;
* the learner's idle fraction (``time/learner_idle_frac``: waiting for a batch ÷ step wall-clock) and the samplers'
  (``time/sampler_idle_frac``: waiting for admission ÷ (waiting + generating));
* for the sync variant, gen = time the learner waited for a batch (the sampler generating it) and train = the learner
  step, and the **overlap limit** (gen + train) / max(gen, train): what perfect overlap of the two would give;
* the lag actually trained at (``lag/mean``, ``lag/max``).

The variants run one after the other (``--rounds`` times, interleaved) so load changes hit all alike.

    .venv/bin/python benchmarks/async_speedup.py [--steps 30] [--rounds 1] [--variants sync,s1,fifo]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.train.entry import run
from steadyrl.train.metrics import read_metrics

VARIANTS = {
    "sync": ["runtime.concurrent.sync=true"],
    "s1": ["pool.policy=max_staleness", "pool.max_staleness=1"],
    "s2": ["pool.policy=max_staleness", "pool.max_staleness=2"],
    "fifo": ["pool.policy=fifo"],
}


def one_run(name: str, *, steps: int, out: Path, extra: list[str]) -> list[dict]:
    overrides = [
        "runtime.lag.k=0", "runtime.mode=local", "runtime.threads=1", "rollout.threads=1", f"steps={steps}",
        "eval.every=0", "eval.n=64", "checkpoint.every=0", "log.plot=false", "log.progress=false", f"out_dir={out}",
        "overwrite=true", *VARIANTS[name], *extra,
    ]  # fmt: skip
    cfg = load_config(TrainConfig, overrides=overrides)
    run(cfg)
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def summarize(recs: list[dict], skip: int) -> dict[str, float]:
    body = recs[skip:]

    def med(key: str) -> float:
        vals = [r[key] for r in body if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    def mean(key: str) -> float:
        vals = [r[key] for r in body if r.get(key) is not None]
        return statistics.fmean(vals) if vals else float("nan")

    total = sum(r["time/step_s"] for r in body)
    return {
        "step_s": med("time/step_s"),
        "total_s": total,
        "wait_s": med("time/wait_s"),
        "learn_s": med("time/learn_s"),
        "learner_idle": sum(r["time/wait_s"] for r in body) / total,
        "sampler_idle": mean("time/sampler_idle_frac"),
        "lag_mean": mean("lag/mean"),
        "lag_max": max(r["lag/max"] for r in body),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="leading steps left out (process start-up)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", default="sync,s1,fifo")
    ap.add_argument("overrides", nargs="*", help="extra key=value for every run (e.g. method=vcpo)")
    args = ap.parse_args()
    names = args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"unknown variant {n!r}; choose from {', '.join(VARIANTS)}")
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="steadyrl-async-bench-") as tmp:
        for rnd in range(args.rounds):
            for n in names:
                recs = one_run(n, steps=args.steps, out=Path(tmp) / f"{n}-{rnd}", extra=args.overrides)
                results[n].append(summarize(recs, args.skip))
    agg = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    base = agg.get("sync")
    print(f"runtime.mode=local, 1 sampler + 1 learner (1 thread each); steps {args.skip}..{args.steps - 1}, "
          f"{args.rounds} round(s); medians")  # fmt: skip
    print(f"{'variant':8} {'step s':>8} {'learn s':>8} {'speed-up':>9} {'learner idle':>13} {'sampler idle':>13} "
          f"{'lag mean':>9} {'lag max':>8}")  # fmt: skip
    for n, a in agg.items():
        speed = base["total_s"] / a["total_s"] if base else float("nan")
        print(f"{n:8} {a['step_s']:8.3f} {a['learn_s']:8.3f} {speed:8.2f}x {a['learner_idle']:13.1%} "
              f"{a['sampler_idle']:13.1%} "
              f"{a['lag_mean']:9.2f} {a['lag_max']:8.0f}")  # fmt: skip
    if base:
        gen, train = base["wait_s"], base["learn_s"]
        limit = (gen + train) / max(gen, train)
        print(f"sync: gen (learner wait) {gen:.3f} s, train {train:.3f} s per step -> overlap limit "
              f"(gen + train) / max(gen, train) = {limit:.2f}x")  # fmt: skip
        for n, a in agg.items():
            if n != "sync":
                speed = base["total_s"] / a["total_s"]
                print(f"{n}: speed-up {speed:.2f}x = {speed / limit:.2f} of the limit; learner idle "
                      f"{a['learner_idle']:.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
