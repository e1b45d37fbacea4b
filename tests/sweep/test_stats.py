"""Student-t intervals against a float64 reference integrated from the density and printed tables."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.sweep.stats import mean_ci, t_cdf_abs, t_quantile


def t_pdf(x: float, df: int) -> float:
    """Student's t density, straight from the formula."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))


def cdf_abs_reference(t: float, df: int, n: int = 20_000) -> float:
    """P(|T| <= t) = 2·∫_0^t pdf, composite Simpson in float64."""
    h = t / n
    total = t_pdf(0.0, df) + t_pdf(t, df)
    total += sum((4 if i % 2 else 2) * t_pdf(i * h, df) for i in range(1, n))
    return 2.0 * total * h / 3.0


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 8, 9, 30])
@pytest.mark.parametrize("t", [0.3, 1.0, 2.5, 7.0])
def test_cdf_matches_the_integrated_density(df: int, t: float) -> None:
    assert t_cdf_abs(t, df) == pytest.approx(cdf_abs_reference(t, df), abs=1e-11)


@pytest.mark.parametrize(
    ("df", "q975"),  # two-sided 95% critical values, standard tables (3 decimals)
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (9, 2.262), (19, 2.093), (29, 2.045), (60, 2.000)],
)
def test_quantile_matches_printed_tables(df: int, q975: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=5e-4)
    assert t_cdf_abs(t_quantile(0.975, df), df) == pytest.approx(0.95, abs=1e-12)


@given(st.integers(1, 200), st.floats(0.55, 0.999))
def test_quantile_inverts_the_cdf_and_exceeds_the_normal(df: int, p: float) -> None:
    q = t_quantile(p, df)
    assert (1 + t_cdf_abs(q, df)) / 2 == pytest.approx(p, abs=1e-12)
    assert q >= statistics.NormalDist().inv_cdf(p) - 1e-9
    assert t_quantile(p, df + 1) <= q + 1e-12


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=12))
def test_mean_ci_is_mean_plus_minus_t_times_standard_error(xs: list[float]) -> None:
    ci = mean_ci(xs)
    assert ci.n == len(xs)
    assert ci.mean == pytest.approx(statistics.fmean(xs), abs=1e-12)
    expected = t_quantile(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    assert ci.half_width == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_mean_ci_edge_cases() -> None:
    assert mean_ci([]) == (None, None, 0)
    assert mean_ci([0.5]) == (0.5, None, 1)
    assert mean_ci([0.5, float("nan"), None]) == (0.5, None, 1)  # type: ignore[list-item]
    two = mean_ci([0.4, 0.6])
    assert two.half_width == pytest.approx(12.706204736 * 0.1 * math.sqrt(2) / math.sqrt(2), rel=1e-9)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf_abs(1.0, 0)
    with pytest.raises(ValueError, match="p must be"):
        t_quantile(0.2, 3)
