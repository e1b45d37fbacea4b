"""Mean and two-sided Student-t confidence interval over seeds, without scipy.

For n values x_1 … x_n with mean x̄ and sample standard deviation s (divisor n − 1), the 95% interval is
x̄ ± t_{0.975, n−1} · s / √n. The t quantile is found by bisection on the exact CDF of Student's t with an integer
number of degrees of freedom ν (Abramowitz & Stegun 26.7.3–26.7.4, θ = atan(t/√ν)):

* ν = 1:          A(t) = 2θ/π
* ν odd ≥ 3:      A(t) = (2/π)·(θ + sinθ·cosθ·(1 + (2/3)cos²θ + … + (2·4⋯(ν−3))/(1·3⋯(ν−2))·cos^{ν−3}θ))
* ν even:         A(t) = sinθ·(1 + (1/2)cos²θ + (1·3)/(2·4)cos⁴θ + … + (1·3⋯(ν−3))/(2·4⋯(ν−2))·cos^{ν−2}θ)

where A(t) = P(|T| ≤ t), so P(T ≤ t) = (1 + A(t))/2 for t ≥ 0.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import NamedTuple

#: Confidence level of the intervals in results and reports.
LEVEL = 0.95
#: Bisection steps for the t quantile (the bracket [0, 1e6] shrinks below 1e-12 well before this).
_BISECT_STEPS = 200
_T_MAX = 1e6


def t_cdf_abs(t: float, df: int) -> float:
    """A(t) = P(|T| ≤ t) for Student's t with ``df`` (integer ≥ 1) degrees of freedom, t ≥ 0."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 1:
        if df == 1:
            return 2.0 * theta / math.pi
        term, total = 1.0, 1.0
        for k in range(1, (df - 1) // 2):  # terms (2·4⋯2k)/(1·3⋯(2k+1))·cos^{2k}θ
            term *= (2 * k) / (2 * k + 1) * c2
            total += term
        return 2.0 / math.pi * (theta + s * math.cos(theta) * total)
    term, total = 1.0, 1.0
    for k in range(1, df // 2):  # terms (1·3⋯(2k−1))/(2·4⋯2k)·cos^{2k}θ
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 ≤ p < 1) of Student's t with ``df`` degrees of freedom."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    target = 2.0 * p - 1.0  # A(t) at the quantile
    lo, hi = 0.0, _T_MAX
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        if t_cdf_abs(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


class MeanCI(NamedTuple):
    """Mean of n values and the half-width of its two-sided ``level`` t interval (None when n < 2)."""

    mean: float | None
    half_width: float | None
    n: int


def mean_ci(values: Sequence[float], level: float = LEVEL) -> MeanCI:
    """x̄ and t_{(1+level)/2, n−1}·s/√n over the finite ``values`` (the others are ignored)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return MeanCI(None, None, 0)
    mean = statistics.fmean(xs)
    if n < 2:
        return MeanCI(mean, None, 1)
    half = t_quantile(0.5 + level / 2.0, n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return MeanCI(mean, half, n)
