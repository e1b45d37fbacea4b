"""Importance-weight corrections against float64 references written from docs/algorithms.md with plain loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.importance_weights import (
    flipped_bounds,
    geo_mis,
    icepop,
    prefix_ratio,
    seq_mis,
    seq_tis,
    symmetric_bounds,
    token_mis,
    token_tis,
    token_veto,
)
from steadyrl.core.masking import aggregate

ATOL = 1e-10


def _batch(seed: int = 0, B: int = 6, T: int = 8, scale: float = 1.0):
    """Random ℓ (float64) and a mask with an empty row; masked-out ℓ is garbage (nan / inf)."""
    g = torch.Generator().manual_seed(seed)
    ell = scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[0] = False  # an empty sequence
    mask[1, :2] = True
    garbage = torch.where(torch.arange(T) % 2 == 0, float("nan"), float("inf")).to(torch.float64).expand(B, T)
    return torch.where(mask, ell, garbage), mask


def _rows(ell: torch.Tensor, mask: torch.Tensor) -> list[list[tuple[int, float]]]:
    B, T = ell.shape
    return [[(t, float(ell[i, t])) for t in range(T) if mask[i, t]] for i in range(B)]


def _check(out, ref_w: list[list[float | None]], mask: torch.Tensor) -> None:
    """ref_w[i][t] is the expected weight, or None where the token must leave the mask."""
    B, T = mask.shape
    for i in range(B):
        for t in range(T):
            expect = ref_w[i][t]
            if not mask[i, t] or expect is None:
                assert not out.mask[i, t], (i, t)
                assert out.weights[i, t] == 0.0, (i, t)
            else:
                assert out.mask[i, t], (i, t)
                assert abs(float(out.weights[i, t]) - expect) <= ATOL * max(1.0, abs(expect)), (i, t)


def _empty(B: int, T: int) -> list[list[float | None]]:
    return [[None] * T for _ in range(B)]


def _kept_stats(ref_w: list[list[float | None]]) -> tuple[float, float, float]:
    vals = [w for row in ref_w for w in row if w is not None]
    return sum(vals) / len(vals), max(vals), min(vals)


# ---------------------------------------------------------------------------------------------------- token TIS


@pytest.mark.parametrize("floor", [None, 0.7])
@pytest.mark.parametrize("renormalize", [None, "token", "sequence"])
def test_token_tis_matches_reference(floor: float | None, renormalize: str | None) -> None:
    ell, mask = _batch(seed=1)
    C = 1.5
    out = token_tis(log_ratio=ell, mask=mask, cap=C, floor=floor, renormalize=renormalize)
    ref = _empty(*mask.shape)
    n_trunc = n_tok = 0
    for i, row in enumerate(_rows(ell, mask)):
        for t, x in row:
            w = min(math.exp(x), C)
            if floor is not None:
                w = max(w, floor)
            n_trunc += math.exp(x) > C or (floor is not None and math.exp(x) < floor)
            n_tok += 1
            ref[i][t] = w
    if renormalize == "token":
        vals = [w for r in ref for w in r if w is not None]
        mean = sum(vals) / len(vals)
    elif renormalize == "sequence":
        per_seq = [[w for w in r if w is not None] for r in ref]
        per_seq = [sum(r) / len(r) for r in per_seq if r]
        mean = sum(per_seq) / len(per_seq)
    else:
        mean = 1.0
    ref = [[None if w is None else w / mean for w in r] for r in ref]
    _check(out, ref, mask)
    wmean, wmax, wmin = _kept_stats(ref)
    assert abs(float(out.metrics["is/weight_mean"]) - wmean) < ATOL
    assert abs(float(out.metrics["is/weight_max"]) - wmax) < ATOL
    assert abs(float(out.metrics["is/weight_min"]) - wmin) < ATOL
    assert abs(float(out.metrics["is/truncated_frac"]) - n_trunc / n_tok) < ATOL
    assert 0 < n_trunc < n_tok  # the test exercises both branches
    if renormalize is None:
        assert float(out.weights.max()) <= C
    elif renormalize == "token":
        assert abs(float(out.weights[mask].mean()) - 1.0) < 1e-12
    else:
        seq_means = [out.weights[i][mask[i]].mean() for i in range(mask.shape[0]) if mask[i].any()]
        assert abs(float(torch.stack(seq_means).mean()) - 1.0) < 1e-12


def test_token_tis_renormalized_can_exceed_cap() -> None:
    ell = torch.tensor([[5.0, -3.0, -3.0, -3.0]], dtype=torch.float64)
    out = token_tis(log_ratio=ell, mask=torch.ones(1, 4, dtype=torch.bool), cap=2.0, renormalize="token")
    assert float(out.weights.max()) > 2.0


# ---------------------------------------------------------------------------------------------------- seq TIS


def test_seq_tis_matches_reference() -> None:
    ell, mask = _batch(seed=2, scale=1.2)
    C = 4.0
    out = seq_tis(log_ratio=ell, mask=mask, cap=C)
    ref = _empty(*mask.shape)
    n_trunc_seq = n_seq = 0
    for i, row in enumerate(_rows(ell, mask)):
        if not row:
            continue
        S = sum(x for _, x in row)
        n_seq += 1
        n_trunc_seq += math.exp(S) > C
        for t, _ in row:
            ref[i][t] = min(math.exp(S), C)
    _check(out, ref, mask)
    assert abs(float(out.metrics["is/seq_truncated_frac"]) - n_trunc_seq / n_seq) < ATOL
    assert 0 < n_trunc_seq < n_seq


@pytest.mark.parametrize("ratio", ["product", "geometric"])
@pytest.mark.parametrize(("cap", "floor"), [(4.0, 0.5), (None, 0.5), (None, None), (1.1, None)])
def test_seq_tis_floor_uncapped_and_geometric(ratio: str, cap: float | None, floor: float | None) -> None:
    """clamp(exp(S_i), C_min, C) (TRL sequence_truncate with clip_min), cap None (no upper clip), and the
    geometric-mean ratio exp(S̄_i) (AReaL's sequence clamp) instead of the product."""
    ell, mask = _batch(seed=12, scale=0.9)
    if ratio == "geometric":  # exp(S̄_i) stays near 1: bounds at the same relative place, k-th root of the product's
        cap, floor = (None if cap is None else cap**0.25), (None if floor is None else floor**0.25)
    out = seq_tis(log_ratio=ell, mask=mask, cap=cap, floor=floor, ratio=ratio)
    ref = _empty(*mask.shape)
    n_trunc_seq = n_seq = 0
    for i, row in enumerate(_rows(ell, mask)):
        if not row:
            continue
        S = sum(x for _, x in row)
        if ratio == "geometric":
            S /= len(row)  # S̄_i
        w = math.exp(max(min(S, 20.0), -20.0))
        clipped = (cap is not None and w > cap) or (floor is not None and w < floor)
        w = min(w, cap) if cap is not None else w
        w = max(w, floor) if floor is not None else w
        n_seq += 1
        n_trunc_seq += clipped
        for t, _ in row:
            ref[i][t] = w
    _check(out, ref, mask)
    assert abs(float(out.metrics["is/seq_truncated_frac"]) - n_trunc_seq / n_seq) < ATOL
    if cap is not None or floor is not None:
        assert 0 < n_trunc_seq < n_seq


def test_token_tis_uncapped_keeps_the_ratio() -> None:
    ell, mask = _batch(seed=13, scale=1.5)
    out = token_tis(log_ratio=ell, mask=mask, cap=None, floor=0.3)
    ref = _empty(*mask.shape)
    for i, row in enumerate(_rows(ell, mask)):
        for t, x in row:
            ref[i][t] = max(math.exp(x), 0.3)
    _check(out, ref, mask)
    assert float(out.weights.max()) > 2.0  # above the default cap


def test_seq_tis_huge_log_ratios_are_finite_and_capped() -> None:
    ell = torch.tensor([[1000.0, 1.0], [-1000.0, 0.0]], dtype=torch.float32)
    out = seq_tis(log_ratio=ell, mask=torch.ones(2, 2, dtype=torch.bool))
    assert torch.isfinite(out.weights).all()
    assert torch.allclose(out.weights[0], torch.tensor([8.0, 8.0]))
    assert (out.weights[1] < 1e-8).all()


# ---------------------------------------------------------------------------------------------------- MIS


def _ref_token_mis(ell, mask, lower, upper, weight):
    ref = _empty(*mask.shape)
    for i, row in enumerate(_rows(ell, mask)):
        for t, x in row:
            rho = math.exp(x)
            if (lower is None or rho >= lower) and (upper is None or rho <= upper):
                ref[i][t] = rho if weight == "ratio" else 1.0
    return ref


@pytest.mark.parametrize(("lower", "upper"), [(0.5, 2.0), (None, 2.0), (0.5, None), (None, None)])
@pytest.mark.parametrize("weight", ["ratio", "one"])
def test_token_mis_each_bound_side(lower, upper, weight) -> None:
    ell, mask = _batch(seed=3)
    out = token_mis(log_ratio=ell, mask=mask, lower=lower, upper=upper, weight=weight)
    ref = _ref_token_mis(ell, mask, lower, upper, weight)
    _check(out, ref, mask)
    n_in = int(mask.sum())
    n_kept = sum(w is not None for r in ref for w in r)
    assert abs(float(out.metrics["is/masked_frac"]) - (n_in - n_kept) / n_in) < ATOL
    if lower is not None or upper is not None:
        assert n_kept < n_in  # the bound actually removes something
    wmean, wmax, wmin = _kept_stats(ref)
    assert abs(float(out.metrics["is/weight_mean"]) - wmean) < ATOL
    assert abs(float(out.metrics["is/weight_max"]) - wmax) < ATOL
    assert abs(float(out.metrics["is/weight_min"]) - wmin) < ATOL
    assert float(out.metrics["loss/all_masked"]) == 0.0


def test_icepop_defaults_are_half_and_five() -> None:
    ell = torch.log(torch.tensor([[0.49, 0.5, 1.0, 5.0, 5.1]], dtype=torch.float64))
    out = icepop(log_ratio=ell, mask=torch.ones(1, 5, dtype=torch.bool))
    assert out.mask.tolist() == [[False, True, True, True, False]]
    assert torch.allclose(out.weights, torch.tensor([[0.0, 0.5, 1.0, 5.0, 0.0]], dtype=torch.float64))


def _ref_seq_level(ell, mask, lower, upper, weight, geometric: bool):
    ref = _empty(*mask.shape)
    for i, row in enumerate(_rows(ell, mask)):
        if not row:
            continue
        S = sum(x for _, x in row)
        stat = S / len(row) if geometric else S
        rho = math.exp(stat)
        if (lower is None or rho >= lower) and (upper is None or rho <= upper):
            for t, _ in row:
                ref[i][t] = rho if weight == "ratio" else 1.0
    return ref


@pytest.mark.parametrize(("lower", "upper"), [(0.3, 3.0), (None, 3.0), (0.3, None)])
@pytest.mark.parametrize("weight", ["ratio", "one"])
def test_seq_mis_each_bound_side(lower, upper, weight) -> None:
    ell, mask = _batch(seed=4, B=10)
    out = seq_mis(log_ratio=ell, mask=mask, lower=lower, upper=upper, weight=weight)
    ref = _ref_seq_level(ell, mask, lower, upper, weight, geometric=False)
    _check(out, ref, mask)
    seq_in = [bool(mask[i].any()) for i in range(mask.shape[0])]
    seq_kept = [any(w is not None for w in r) for r in ref]
    removed = sum(a and not b for a, b in zip(seq_in, seq_kept, strict=True))
    assert removed > 0
    assert abs(float(out.metrics["is/seq_masked_frac"]) - removed / sum(seq_in)) < ATOL


@pytest.mark.parametrize(("lower", "upper"), [(0.8, 1.25), (None, 1.25), (0.8, None)])
@pytest.mark.parametrize("weight", ["ratio", "one"])
def test_geo_mis_each_bound_side(lower, upper, weight) -> None:
    ell, mask = _batch(seed=5, B=12, scale=0.5)
    out = geo_mis(log_ratio=ell, mask=mask, lower=lower, upper=upper, weight=weight)
    ref = _ref_seq_level(ell, mask, lower, upper, weight, geometric=True)
    _check(out, ref, mask)
    assert any(w is None for i, r in enumerate(ref) for t, w in enumerate(r) if mask[i, t])


def test_flipped_bounds_reproduce_verl_sign_flipped_test() -> None:
    """verl tests exp(−S) ∈ [a, b]; flipped_bounds(a, b) must keep the same sequences on exp(S)."""
    ell, mask = _batch(seed=6, B=16)
    a, b = 0.4, 5.0
    out = seq_mis(log_ratio=ell, mask=mask, **flipped_bounds(a, b)._asdict(), weight="one")
    for i, row in enumerate(_rows(ell, mask)):
        if row:
            flipped = math.exp(-sum(x for _, x in row))
            assert bool(out.mask[i].any()) == (a <= flipped <= b)
    assert flipped_bounds(None, 4.0) == (0.25, None)
    assert symmetric_bounds(2.0) == (0.5, 2.0)
    with pytest.raises(ValueError, match="exceed 1"):
        symmetric_bounds(0.5)


def test_geo_mis_can_mask_everything_and_loss_is_zero() -> None:
    ell, mask = _batch(seed=7, scale=3.0)
    out = geo_mis(log_ratio=ell, mask=mask)
    assert not out.mask.any()
    assert float(out.metrics["loss/all_masked"]) == 1.0
    assert float(out.metrics["is/masked_frac"]) == 1.0
    assert torch.equal(out.weights, torch.zeros_like(out.weights))
    logp = torch.randn(*mask.shape, dtype=torch.float64, requires_grad=True)
    loss = aggregate(-out.weights * logp, out.mask, "token-mean")
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


# ---------------------------------------------------------------------------------------------------- veto


def test_token_veto_drops_whole_sequence() -> None:
    ell = torch.zeros(3, 4, dtype=torch.float64)
    ell[0, 2] = math.log(1e-5)  # below 1e-4: sequence 0 vetoed
    ell[1, 1] = math.log(2e-4)  # above: kept
    ell[2, 3] = math.log(1e-9)  # below but masked out: ignored
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 3] = False
    out = token_veto(log_ratio=ell, mask=mask)
    assert out.mask.tolist() == [[False] * 4, [True] * 4, [True, True, True, False]]
    assert torch.equal(out.weights, out.mask.double())  # default weight "one"
    assert abs(float(out.metrics["is/seq_masked_frac"]) - 1 / 3) < ATOL
    ratio = token_veto(log_ratio=ell, mask=mask, weight="ratio")
    assert abs(float(ratio.weights[1, 1]) - 2e-4) < 1e-15


def test_token_veto_matches_reference_on_random_batch() -> None:
    ell, mask = _batch(seed=8, B=12, scale=4.0)
    thr = 0.01
    out = token_veto(log_ratio=ell, mask=mask, threshold=thr)
    for i, row in enumerate(_rows(ell, mask)):
        vetoed = any(math.exp(x) < thr for _, x in row)
        for t, _ in row:
            assert bool(out.mask[i, t]) == (not vetoed)
    assert 0 < int(out.mask.sum()) < int(mask.sum())


# ---------------------------------------------------------------------------------------------------- prefix ratio


@pytest.mark.parametrize("cap", [None, 1.3])
def test_prefix_ratio_counts_masked_tokens_only(cap: float | None) -> None:
    ell, mask = _batch(seed=9)
    out = prefix_ratio(log_ratio=ell, mask=mask, cap=cap)
    ref = _empty(*mask.shape)
    for i, row in enumerate(_rows(ell, mask)):
        total = 0.0
        for n, (t, x) in enumerate(row, start=1):
            total += x
            w = math.exp(total / n)  # w_t = exp((1/t) Σ_{k≤t} ℓ_k), t counting masked tokens
            ref[i][t] = w if cap is None else min(w, cap)
    _check(out, ref, mask)
    if cap is not None:
        assert float(out.metrics["is/truncated_frac"]) > 0


# ---------------------------------------------------------------------------------------------------- properties

_ALL = {
    "token_tis": lambda ell, m: token_tis(log_ratio=ell, mask=m),
    "token_tis_floor_renorm": lambda ell, m: token_tis(log_ratio=ell, mask=m, floor=0.5, renormalize="sequence"),
    "seq_tis": lambda ell, m: seq_tis(log_ratio=ell, mask=m),
    "token_mis": lambda ell, m: token_mis(log_ratio=ell, mask=m),
    "seq_mis": lambda ell, m: seq_mis(log_ratio=ell, mask=m),
    "geo_mis": lambda ell, m: geo_mis(log_ratio=ell, mask=m),
    "icepop": lambda ell, m: icepop(log_ratio=ell, mask=m),
    "token_veto": lambda ell, m: token_veto(log_ratio=ell, mask=m, weight="ratio"),
    "prefix_ratio": lambda ell, m: prefix_ratio(log_ratio=ell, mask=m, cap=2.0),
}


def _random_mask(seed: int, B: int, T: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(B, T, generator=g) > 0.4).to(torch.int64)  # a 0/1 mask: accepted too


@pytest.mark.parametrize("name", list(_ALL))
@given(seed=st.integers(0, 2**16), B=st.integers(1, 4), T=st.integers(1, 6))
def test_on_policy_is_identity(name: str, seed: int, B: int, T: int) -> None:
    mask = _random_mask(seed, B, T)
    ell = torch.zeros(B, T, dtype=torch.float64)
    out = _ALL[name](ell, mask)
    assert torch.equal(out.mask, mask.bool())
    assert torch.equal(out.weights, mask.double())
    assert float(out.metrics.get("is/masked_frac", torch.tensor(0.0))) == 0.0


@pytest.mark.parametrize("name", list(_ALL))
@given(seed=st.integers(0, 2**16), sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_are_finite(name: str, seed: int, sign: float) -> None:
    mask = _random_mask(seed, 3, 5)
    g = torch.Generator().manual_seed(seed)
    ell = sign * 1000.0 * torch.rand(3, 5, generator=g, dtype=torch.float32).round()
    ell = ell.masked_fill(mask == 0, float("nan")).requires_grad_(True)
    out = _ALL[name](ell, mask)
    assert torch.isfinite(out.weights).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    assert not out.weights.requires_grad  # weights are detached: no gradient reaches log_ratio
    logp = torch.zeros(3, 5, requires_grad=True)
    aggregate(-out.weights * logp, out.mask, "token-mean").backward()
    assert torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("name", list(_ALL))
def test_fully_masked_batch(name: str) -> None:
    ell = torch.randn(3, 4, dtype=torch.float64)
    out = _ALL[name](ell, torch.zeros(3, 4, dtype=torch.bool))
    assert not out.mask.any() and torch.equal(out.weights, torch.zeros_like(ell))
    assert all(torch.isfinite(v) for v in out.metrics.values())
    if "loss/all_masked" in out.metrics:
        assert float(out.metrics["loss/all_masked"]) == 1.0


def test_metrics_are_detached_zero_dim() -> None:
    ell, mask = _batch(seed=10)
    for fn in _ALL.values():
        out = fn(ell.clone().requires_grad_(True), mask)
        for key, v in out.metrics.items():
            assert v.dim() == 0 and not v.requires_grad, key
            assert key.split("/")[0] in {"is", "loss"}, key


@pytest.mark.parametrize(
    ("fn", "kwargs"),
    [
        (token_tis, {"cap": -1.0}),
        (token_tis, {"floor": 3.0, "cap": 2.0}),
        (token_tis, {"renormalize": "batch"}),
        (token_mis, {"lower": 2.0, "upper": 1.0}),
        (seq_mis, {"weight": "clip"}),
        (token_veto, {"threshold": 0.0}),
        (seq_tis, {"ratio": "arithmetic"}),
        (seq_tis, {"floor": 0.0}),
    ],
)
def test_bad_options_raise(fn, kwargs) -> None:
    ell, mask = _batch()
    with pytest.raises(ValueError):
        fn(log_ratio=ell, mask=mask, **kwargs)
