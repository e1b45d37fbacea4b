"""ESS (sequence and token level) and VCPO's lr rule against direct float64 / arbitrary-precision references."""

from __future__ import annotations

import math
from decimal import Decimal, getcontext

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.ess import sequence_ess, token_ess, vcpo_lr_scale, weights_ess

getcontext().prec = 50


def _direct_ess(S: list[float]) -> float:
    """(Σw)²/Σw² with w = exp(S), in float64 (only where exp(S) is representable)."""
    w = [math.exp(s) for s in S]
    return sum(w) ** 2 / sum(x * x for x in w)


def _decimal_ess(S: list[float]) -> float:
    """(Σw)²/Σw² in 50-digit decimal arithmetic: exact reference for any |S| (exp(1000) included)."""
    w = [Decimal(s).exp() for s in S]
    return float(sum(w) ** 2 / sum(x * x for x in w))


def test_equal_weights_give_ess_equal_to_batch() -> None:
    for s in (0.0, 3.7, -1000.0, 1000.0):
        out = sequence_ess(log_weights=torch.full((6,), s), valid=torch.ones(6, dtype=torch.bool))
        assert abs(float(out.ess) - 6.0) < 1e-5  # float32: the max shift keeps full precision at S = ±1000
        assert abs(float(out.ess_ratio) - 1.0) < 1e-6
        assert float(out.n_valid) == 6.0


def test_sequence_ess_matches_direct_formula() -> None:
    g = torch.Generator().manual_seed(0)
    S = 2.0 * torch.randn(9, generator=g, dtype=torch.float64)
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    S_garbage = torch.where(valid, S, torch.tensor(float("nan"), dtype=torch.float64))
    out = sequence_ess(log_weights=S_garbage, valid=valid)
    kept = [float(S[i]) for i in range(9) if valid[i]]
    ref = _direct_ess(kept)
    assert abs(float(out.ess) - ref) < 1e-10
    assert abs(float(out.ess_ratio) - ref / len(kept)) < 1e-10
    assert abs(float(out.log_ess) - math.log(ref)) < 1e-10
    assert 1.0 < ref < len(kept) - 1  # a non-trivial case


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_ess_at_plus_minus_1000(dtype: torch.dtype) -> None:
    S = [1000.0, 999.0, 998.5, -1000.0, 0.0]
    out = sequence_ess(log_weights=torch.tensor(S, dtype=dtype), valid=torch.ones(5, dtype=torch.bool))
    assert torch.isfinite(out.ess) and torch.isfinite(out.ess_ratio)
    ref = _decimal_ess(S)
    assert abs(float(out.ess) - ref) < (1e-5 if dtype == torch.float32 else 1e-12)
    neg = sequence_ess(log_weights=-torch.tensor(S, dtype=dtype), valid=torch.ones(5, dtype=torch.bool))
    assert abs(float(neg.ess) - _decimal_ess([-s for s in S])) < 1e-5


@given(seed=st.integers(0, 2**16), n=st.integers(1, 12), scale=st.sampled_from([0.1, 3.0, 50.0, 1000.0]))
def test_sequence_ess_bounds_and_decimal_reference(seed: int, n: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    S = scale * torch.randn(n, generator=g, dtype=torch.float64)
    out = sequence_ess(log_weights=S, valid=torch.ones(n, dtype=torch.bool))
    assert 1.0 - 1e-9 <= float(out.ess) <= n + 1e-9
    assert abs(float(out.ess) - _decimal_ess(S.tolist())) < 1e-9 * n


def test_sequence_ess_clipped_weights() -> None:
    S = [3.0, 0.5, -0.2, 2.5]
    C = 5.0
    out = sequence_ess(log_weights=torch.tensor(S, dtype=torch.float64), valid=torch.ones(4), cap=C)
    ref = _direct_ess([min(s, math.log(C)) for s in S])  # min(w, C)
    assert abs(float(out.ess) - ref) < 1e-10
    assert float(out.ess) > float(sequence_ess(log_weights=torch.tensor(S), valid=torch.ones(4)).ess)


def test_sequence_ess_no_valid_sequence() -> None:
    out = sequence_ess(log_weights=torch.tensor([float("nan"), 1.0]), valid=torch.zeros(2, dtype=torch.bool))
    assert float(out.ess) == 0.0 and float(out.ess_ratio) == 0.0 and float(out.n_valid) == 0.0
    assert float(vcpo_lr_scale(ess_ratio=out.ess_ratio)) == 0.0


def test_sequence_ess_is_detached() -> None:
    S = torch.randn(4, requires_grad=True)
    out = sequence_ess(log_weights=S, valid=torch.ones(4))
    assert not out.ess.requires_grad and not out.ess_ratio.requires_grad


def test_token_ess_matches_direct_formula() -> None:
    g = torch.Generator().manual_seed(1)
    ell = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.4
    mask[0] = False
    out = token_ess(log_ratio=torch.where(mask, ell, float("inf")), mask=mask)
    vals = [float(ell[i, t]) for i in range(4) for t in range(6) if mask[i, t]]
    assert abs(float(out.ess) - _direct_ess(vals)) < 1e-10
    assert abs(float(out.ess_ratio) - _direct_ess(vals) / len(vals)) < 1e-10


@pytest.mark.parametrize(("cap", "floor"), [(None, None), (2.0, None), (2.0, 0.5)])
def test_weights_ess_is_verls_token_weighted_ratio(cap: float | None, floor: float | None) -> None:
    """verl's rollout_is_eff_sample_size: 1 / mean_t((w̃_t / mean w̃)²), w̃ = clamp(w, floor, cap), over masked tokens;
    zero weights (IcePop) count as samples."""
    g = torch.Generator().manual_seed(5)
    B, T = 5, 7
    w = torch.exp(torch.randn(B, T, generator=g, dtype=torch.float64))
    w[1, 2] = 0.0
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1, 2] = True
    w_in = torch.where(mask, w, float("nan"))
    vals = [float(w[i, t]) for i in range(B) for t in range(T) if mask[i, t]]
    vals = [min(v, cap) if cap is not None else v for v in vals]
    vals = [max(v, floor) if floor is not None else v for v in vals]
    mean = sum(vals) / len(vals)
    expect = 1.0 / (sum((v / mean) ** 2 for v in vals) / len(vals))
    out = weights_ess(weights=w_in, mask=mask, cap=cap, floor=floor)
    assert abs(float(out.ess_ratio) - expect) < 1e-12
    assert float(out.n_valid) == len(vals)


def test_ess_of_all_zero_weights_is_zero() -> None:
    out = weights_ess(weights=torch.zeros(2, 3, dtype=torch.float64), mask=torch.ones(2, 3, dtype=torch.bool))
    assert float(out.ess) == 0.0 and float(out.ess_ratio) == 0.0 and float(out.n_valid) == 6.0


def test_sequence_ess_floor() -> None:
    S = torch.tensor([-5.0, 0.0, 1.0], dtype=torch.float64)
    out = sequence_ess(log_weights=S, valid=torch.ones(3, dtype=torch.bool), floor=0.5, cap=2.0)
    assert abs(float(out.ess) - _direct_ess([math.log(0.5), 0.0, math.log(2.0)])) < 1e-12


@pytest.mark.parametrize("fn", ["sqrt", "identity"])
@pytest.mark.parametrize("rho_base", [1.0, 0.55])
def test_vcpo_lr_scale(fn: str, rho_base: float) -> None:
    f = math.sqrt if fn == "sqrt" else (lambda v: v)
    for rho in (0.0, 0.01, 0.3, 0.55, 0.9, 1.0):
        got = float(vcpo_lr_scale(ess_ratio=torch.tensor(rho, dtype=torch.float64), rho_base=rho_base, fn=fn))
        assert abs(got - f(min(1.0, rho / rho_base))) < 1e-12  # f(min(1, ρ_ess/ρ_base))
    assert float(vcpo_lr_scale(ess_ratio=torch.tensor(0.25), fn="sqrt")) == 0.5


def test_vcpo_lr_scale_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="fn"):
        vcpo_lr_scale(ess_ratio=torch.tensor(0.5), fn="log")
    with pytest.raises(ValueError, match="rho_base"):
        vcpo_lr_scale(ess_ratio=torch.tensor(0.5), rho_base=0.0)
