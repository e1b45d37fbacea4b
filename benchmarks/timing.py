"""Timing shared by the benchmark scripts (imported as ``timing``: the scripts run from this folder): wall clock,
and CPU time in interleaved pairs."""

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


def cpu_seconds(fn: Callable[[], object]) -> float:
    """Process CPU time of one call of ``fn`` (with one torch thread, time spent descheduled is not counted)."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def paired(
    a: Callable[[], object], b: Callable[[], object], *, pairs: int, warmup: int = 1
) -> list[tuple[float, float]]:
    """CPU seconds of ``a`` and ``b`` in ``pairs`` interleaved pairs (a b, b a, a b, ...: load from other jobs hits both
    alike), after ``warmup`` untimed calls of each; one ``(a, b)`` tuple per pair."""
    for _ in range(warmup):
        a(), b()
    out = []
    for i in range(pairs):
        if i % 2 == 0:
            ta = cpu_seconds(a)
            tb = cpu_seconds(b)
        else:
            tb = cpu_seconds(b)
            ta = cpu_seconds(a)
        out.append((ta, tb))
    return out


def ratio_line(
    name: str, pairs: list[tuple[float, float]], *, a: str, b: str, unit: float = 1.0, suffix: str = "s"
) -> str:
    """``name: a X, b Y, ratio b/a R (pairs lo-hi)`` from :func:`paired`'s output (medians; the ratio is per pair)."""
    ratios = [tb / ta for ta, tb in pairs]
    ma = statistics.median(t for t, _ in pairs) * unit
    mb = statistics.median(t for _, t in pairs) * unit
    return (f"{name:<46} {a} {ma:8.3f} {suffix}  {b} {mb:8.3f} {suffix}  ratio {statistics.median(ratios):.2f} "
            f"(pairs {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip
