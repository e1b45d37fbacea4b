"""Speed helpers must equal the plain PyTorch operations they replace."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.kl import mismatch_estimator, mismatch_estimators
from steadyrl.core.masking import any_true, safe_exp, safe_exp_
from steadyrl.core.objectives.m2po import sort_floats

FLOATS = st.floats(allow_nan=False, allow_infinity=True, width=32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_floats_equals_stable_torch_sort(dtype: torch.dtype, descending: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, generator=g).round(decimals=1).to(dtype)  # many ties
    x[:3] = torch.tensor([float("inf"), -float("inf"), 0.0], dtype=dtype)
    x = x + 0.0  # −0.0 → +0.0: the two signed zeros are documented to differ in tie order only
    ref = torch.sort(x, descending=descending, stable=True)
    out = sort_floats(x, descending=descending)
    assert torch.equal(out.values, ref.values)
    assert torch.equal(out.indices, ref.indices)


@given(values=st.lists(FLOATS, min_size=1, max_size=64), descending=st.booleans())
def test_sort_floats_property(values: list[float], descending: bool) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    x = torch.where(x == 0, torch.zeros_like(x), x)  # −0.0 and +0.0 are documented to differ in tie order only
    ref = torch.sort(x, descending=descending, stable=True)
    out = sort_floats(x, descending=descending)
    assert torch.equal(out.values, ref.values)
    assert torch.equal(out.indices, ref.indices)


def test_any_true_matches_any() -> None:
    g = torch.Generator().manual_seed(1)
    m = torch.rand(7, 5, generator=g) > 0.8
    m[2] = False
    assert torch.equal(any_true(m), m.any())
    assert torch.equal(any_true(m, dim=-1), m.any(dim=-1))
    assert torch.equal(any_true(m, dim=0, keepdim=True), m.any(dim=0, keepdim=True))
    empty = torch.zeros(3, 0, dtype=torch.bool)
    assert torch.equal(any_true(empty, dim=-1), empty.any(dim=-1))


def test_safe_exp_in_place_equals_safe_exp() -> None:
    x = torch.tensor([-1000.0, -3.0, 0.0, 2.5, 1000.0])
    expect = safe_exp(x)
    y = x.clone()
    out = safe_exp_(y)
    assert out.data_ptr() == y.data_ptr()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("convention", ["verl", "areal"])
def test_single_estimator_equals_the_triple(convention: str) -> None:
    x = torch.linspace(-5, 5, 41, dtype=torch.float64)
    trio = mismatch_estimators(x, convention=convention)
    for kind, value in zip(("k1", "k2", "k3"), trio, strict=True):
        assert torch.equal(mismatch_estimator(x, kind=kind, convention=convention), value)
