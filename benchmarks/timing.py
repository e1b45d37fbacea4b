"""Wall-clock timing shared by the benchmark scripts (imported as ``timing``: the scripts run from this folder)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple


class Timing(NamedTuple):
    """Median and spread of the repeats of one measurement, in seconds."""

    median: float
    low: float
    high: float


def timed(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> Timing:
    """Run ``fn`` ``warmup`` times untimed (first-call overheads), then ``repeats`` times; median, min and max."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return Timing(statistics.median(times), min(times), max(times))
