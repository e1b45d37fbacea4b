"""VACO's one-step V-trace re-alignment against a float64 loop written from the formula (arXiv 2603.01365)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.advantages.grpo import GRPO_SCALES, grpo_advantages
from steadyrl.core.advantages.vaco import VACO_RATIOS, vaco_advantages
from steadyrl.core.advantages.vtrace import vtrace

# Unsorted, non-contiguous ids with two groups of one (5 and 6).
IDS = torch.tensor([3, 3, 0, 0, 0, 5, 1, 1, 1, 1, 6])
T = 6


def _std(xs: list[float], unbiased: bool) -> float:
    n = len(xs)
    mu = sum(xs) / n
    ss = sum((x - mu) ** 2 for x in xs)
    if unbiased:
        return math.sqrt(ss / (n - 1)) if n > 1 else 0.0
    return math.sqrt(ss / n)


def _ref_vaco(
    R: torch.Tensor, ids: torch.Tensor, ell: torch.Tensor, mask: torch.Tensor, *, rho_bar: float, ratio: str,
    scale: str, eps: float, unbiased: bool,
) -> tuple[list[float], list[float], list[float]]:
    """(A_i, v_g(i), ρ_i) straight from the formula, in Python floats."""
    B = len(R)
    r = [float(x) for x in R]
    g = [int(x) for x in ids]
    rho = []
    for i in range(B):
        toks = [float(ell[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
        lbar = (sum(toks) / len(toks) if toks else 0.0) if ratio == "geometric" else sum(toks)
        rho.append(math.exp(max(-20.0, min(20.0, lbar))))  # ρ_i = exp(clamp(ℓ̄_i, ±20))
    adv, target = [], []
    for i in range(B):
        members = [j for j in range(B) if g[j] == g[i]]
        b = sum(r[j] for j in members) / len(members)  # b_g
        v = b + sum(min(rho_bar, rho[j]) * (r[j] - b) for j in members) / len(members)  # v_g
        if scale == "none":
            div = 1.0
        elif scale == "group":
            div = _std([r[j] for j in members], unbiased) + eps
        else:
            div = _std(r, unbiased) + eps
        div = div if div > 0 else 1.0
        adv.append((r[i] - v) / div)
        target.append(v)
    return adv, target, rho


def _inputs(seed: int, scale: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = IDS.shape[0]
    R = torch.randn(B, generator=g, dtype=torch.float64)
    ell = scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = 0  # one fully masked row in a group of two
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    ell = torch.where(mask, ell, torch.full_like(ell, float("nan")))  # masked-out values must be ignored
    return R, ell, mask


@pytest.mark.parametrize("ratio", VACO_RATIOS)
@pytest.mark.parametrize("scale", GRPO_SCALES)
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("rho_bar", [1.0, 0.5, 3.0])
def test_vaco_matches_float64_reference(ratio: str, scale: str, unbiased: bool, rho_bar: float) -> None:
    R, ell, mask = _inputs(seed=2)
    out = vaco_advantages(
        rewards=R, group_ids=IDS, log_ratio=ell, mask=mask, rho_bar=rho_bar, ratio=ratio, scale=scale, eps=1e-6,
        unbiased=unbiased,
    )  # fmt: skip
    adv, target, rho = _ref_vaco(R, IDS, ell, mask, rho_bar=rho_bar, ratio=ratio, scale=scale, eps=1e-6,
                                 unbiased=unbiased)
    f64 = torch.float64
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=f64), atol=1e-12, rtol=0)
    torch.testing.assert_close(out.value_target, torch.tensor(target, dtype=f64), atol=1e-12, rtol=0)
    torch.testing.assert_close(out.rho, torch.tensor(rho, dtype=f64), atol=0, rtol=1e-12)
    nonempty = [i for i in range(len(R)) if mask[i].any()]
    frac = sum(rho[i] > rho_bar for i in nonempty) / len(nonempty)
    assert out.metrics["adv/rho_clipped_frac"].item() == pytest.approx(frac, abs=1e-12)
    assert out.metrics["adv/baseline_mean"].item() == pytest.approx(sum(target) / len(target), abs=1e-12)
    shift = sum(abs(target[i] - float(out.behavior_value[i])) for i in range(len(R))) / len(R)
    assert out.metrics["adv/realign_shift"].item() == pytest.approx(shift, abs=1e-12)
    assert all(not v.requires_grad and v.dim() == 0 for v in out.metrics.values())


def test_target_is_the_group_mean_of_impala_one_step_vtrace() -> None:
    """Each response as a one-token trajectory with V = b_g: IMPALA's v_s = b_g + min(ρ̄, ρ)(R − b_g); v_g its mean."""
    R, ell, mask = _inputs(seed=5, scale=1.0)
    out = vaco_advantages(rewards=R, group_ids=IDS, log_ratio=ell, mask=mask, rho_bar=1.5)
    lbar = torch.stack([ell[i][mask[i]].mean() if mask[i].any() else torch.zeros((), dtype=R.dtype)
                        for i in range(len(R))])
    one = torch.ones(len(R), 1, dtype=torch.bool)
    vs = vtrace(rewards=R.unsqueeze(-1), values=out.behavior_value.unsqueeze(-1), log_rhos=lbar.unsqueeze(-1),
                mask=one, rho_bar=1.5).vs[:, 0]
    per_group = torch.stack([vs[IDS[i] == IDS].mean() for i in range(len(R))])
    torch.testing.assert_close(out.value_target, per_group, atol=1e-12, rtol=0)


@given(seed=st.integers(0, 10_000), scale=st.sampled_from(GRPO_SCALES), unbiased=st.booleans(),
       rho_bar=st.sampled_from([1.0, 2.0, 1e6]), ratio=st.sampled_from(VACO_RATIOS))
def test_on_policy_is_exactly_grpo(seed: int, scale: str, unbiased: bool, rho_bar: float, ratio: str) -> None:
    """All ratios 1 (π_prox = μ) and ρ̄ ≥ 1: the re-aligned advantages are GRPO's, bit for bit."""
    R, _, mask = _inputs(seed)
    R = torch.randint(0, 3, R.shape, generator=torch.Generator().manual_seed(seed)).double() if seed % 2 else R
    out = vaco_advantages(rewards=R, group_ids=IDS, log_ratio=torch.zeros(len(R), T, dtype=R.dtype), mask=mask,
                          rho_bar=rho_bar, ratio=ratio, scale=scale, unbiased=unbiased)
    ref = grpo_advantages(rewards=R, group_ids=IDS, scale=scale, unbiased=unbiased)
    assert torch.equal(out.advantages, ref.advantages)
    assert torch.equal(out.value_target, ref.baseline)


@given(seed=st.integers(0, 10_000))
def test_ratios_all_above_rho_bar_one_also_give_grpo(seed: int) -> None:
    """Truncation: with ρ̄ = 1 a group whose every ratio is ≥ 1 is not re-aligned (min(ρ̄, ρ) = 1)."""
    R, ell, mask = _inputs(seed)
    up = ell.abs() + 1e-3
    out = vaco_advantages(rewards=R, group_ids=IDS, log_ratio=up, mask=mask)
    ref = grpo_advantages(rewards=R, group_ids=IDS)
    assert torch.equal(out.advantages, ref.advantages)


@given(seed=st.integers(0, 10_000), ratio=st.sampled_from(VACO_RATIOS))
def test_extreme_log_ratios_stay_finite(seed: int, ratio: str) -> None:
    R, ell, mask = _inputs(seed)
    sign = torch.where(torch.rand(ell.shape, generator=torch.Generator().manual_seed(seed)) > 0.5, 1.0, -1.0)
    out = vaco_advantages(rewards=R, group_ids=IDS, log_ratio=1000.0 * sign.double(), mask=mask, ratio=ratio,
                          rho_bar=1e30)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.value_target).all()
    assert (out.rho <= math.exp(20.0) * (1 + 1e-12)).all() and (out.rho >= math.exp(-20.0) * (1 - 1e-12)).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())
    adv, _, _ = _ref_vaco(R, IDS, 1000.0 * sign.double(), mask, rho_bar=1e30, ratio=ratio, scale="group", eps=1e-6,
                          unbiased=True)
    # Terms of size e^20 · |R − b| ≈ 1e9 cancel in v_g: float64 rounding leaves ~1e-16 · 1e9 of them.
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), atol=1e-6, rtol=0)


@given(seed=st.integers(0, 10_000))
def test_fully_masked_rows_have_ratio_one(seed: int) -> None:
    R, ell, _ = _inputs(seed)
    empty = torch.zeros(len(R), T, dtype=torch.bool)
    out = vaco_advantages(rewards=R, group_ids=IDS, log_ratio=ell, mask=empty, ratio="product")
    assert torch.equal(out.rho, torch.ones_like(R))
    assert torch.equal(out.advantages, grpo_advantages(rewards=R, group_ids=IDS).advantages)
    assert out.metrics["adv/rho_clipped_frac"].item() == 0.0


def test_an_off_policy_group_is_realigned_towards_the_target_policy() -> None:
    """Two responses, rewards 1 and 0; π_prox prefers the rewarded one (ρ = 1 vs 1/2): v_g rises above b_g = 1/2."""
    R = torch.tensor([1.0, 0.0], dtype=torch.float64)
    ell = torch.tensor([[0.0], [math.log(0.5)]], dtype=torch.float64)
    out = vaco_advantages(rewards=R, group_ids=torch.tensor([0, 0]), log_ratio=ell, mask=torch.ones(2, 1), scale="none")
    # v = ½ + ½ (1·(1 − ½) + ½·(0 − ½)) = ½ + ½ · ¼ = 0.625
    torch.testing.assert_close(out.value_target, torch.tensor([0.625, 0.625], dtype=torch.float64))
    torch.testing.assert_close(out.advantages, torch.tensor([0.375, -0.625], dtype=torch.float64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"ratio": "mean"}, "ratio='mean' is not one of geometric, product"), ({"rho_bar": 0.0}, "rho_bar=0.0"),
     ({"scale": "prompt"}, "scale='prompt' is not one of group, batch, none"), ({"eps": -1.0}, "eps=-1.0")],
)
def test_bad_options_are_named(kwargs: dict, match: str) -> None:
    R, ell, mask = _inputs(0)
    with pytest.raises(ValueError, match=match):
        vaco_advantages(rewards=R, group_ids=IDS, log_ratio=ell, mask=mask, **kwargs)
