"""What the end-to-end tests of the concurrent runtimes (test_local.py, test_ray.py) share: a source wrapper that
records each batch's group ids and calls a hook after it, and a runner that trains with such a source."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.train.loop import StopFlag, train
from steadyrl.train.metrics import read_metrics


class Hooked:
    """A concurrent source that calls ``hook(source, step)`` after each batch it hands out."""

    def __init__(self, inner: Any, hook: Any) -> None:
        self.inner, self.hook = inner, hook
        self.batches: list[list[int]] = []

    def next_batch(self, *, step: int) -> Any:
        batch = self.inner.next_batch(step=step)
        self.batches.append(list(self.inner.last_batch_ids))
        self.hook(self.inner, step)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_with(
    make: Callable[..., Any], overrides: Sequence[str], *, hook: Any = None, stop: StopFlag | None = None
) -> tuple[Any, Hooked]:
    """Train the config ``overrides`` describe with sources built by ``make``; the result and the (first) source."""
    cfg = load_config(TrainConfig, overrides=list(overrides))
    made: list[Hooked] = []

    def factory(cfg: TrainConfig, **kw: Any) -> Any:
        made.append(Hooked(make(cfg, **kw), hook or (lambda s, t: None)))
        return made[-1]

    return train(cfg, make_source=factory, stop=stop), made[0]


def steps_of(out: Path) -> list[dict[str, Any]]:
    """The learner-step records of a run (the final eval line left out)."""
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
