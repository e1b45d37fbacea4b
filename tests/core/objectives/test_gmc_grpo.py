"""GMC-GRPO's group-mass-capped weights and loss against float64 loop references from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.objectives.gmc_grpo import gmc_grpo_loss, gmc_weights
from steadyrl.core.objectives.ppo import reinforce_loss
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, dims, grad_of, make_batch, seeds


def _ref_weights(b: Batch, *, eps: float, cap: str) -> list[float]:
    """w_i = ρ_i · min(1, G(1+ε)/Σ_g ρ) or ρ_i · min(1, (1+ε)/sqrt(mean_g ρ²)), over non-empty rows; 0 for empty."""
    B, T = b.mask.shape
    rho = {}
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if toks:
            rho[i] = math.exp(sum(float(b.prox_logp[i, t]) - float(b.behav_logp[i, t]) for t in toks))
    out = []
    for i in range(B):
        if i not in rho:
            out.append(0.0)
            continue
        group = [rho[j] for j in rho if int(b.group_ids[j]) == int(b.group_ids[i])]
        G = len(group)
        if cap == "mass":
            factor = min(1.0, G * (1.0 + eps) / sum(group))
        else:
            factor = min(1.0, (1.0 + eps) / math.sqrt(sum(r * r for r in group) / G))
        out.append(rho[i] * factor)
    return out


def _ref_loss(b: Batch, w: list[float]) -> torch.Tensor:
    B, T = b.mask.shape
    per_seq = []
    for i in range(B):
        toks = [t for t in range(T) if b.mask[i, t]]
        if toks:
            per_seq.append(-w[i] * float(b.adv_seq[i]) * sum(b.logp[i, t] for t in toks) / len(toks))
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("cap", ["mass", "rms"])
@pytest.mark.parametrize("eps", [0.2, 0.0])
def test_weights_and_loss_match_reference(cap: str, eps: float) -> None:
    b = make_batch(31, B=8, T=5, scale=0.5)
    kw = {"prox_logp": b.prox_logp, "behav_logp": b.behav_logp, "mask": b.mask, "group_ids": b.group_ids}
    gw = gmc_weights(**kw, eps=eps, cap=cap)
    ref_w = _ref_weights(b, eps=eps, cap=cap)
    assert_close(gw.weights, torch.tensor(ref_w, dtype=DT))
    assert 0.0 < float(gw.metrics["gmc/capped_frac"]) < 1.0  # some groups capped, some not
    out = gmc_grpo_loss(
        logp=b.logp,
        prox_logp=b.prox_logp,
        behav_logp=b.behav_logp,
        advantages=b.adv_seq,
        mask=b.mask,
        group_ids=b.group_ids,
        eps=eps,
        cap=cap,
    )
    ref = _ref_loss(b, ref_w)
    assert_close(out.loss, ref)
    assert_close(grad_of(out.loss, b.logp), grad_of(ref, b.logp))


def test_metrics_match_reference() -> None:
    b = make_batch(32, B=8, T=5, scale=0.5)
    gw = gmc_weights(prox_logp=b.prox_logp, behav_logp=b.behav_logp, mask=b.mask, group_ids=b.group_ids)
    rows = [i for i in range(8) if b.mask[i].any()]
    rho = {i: math.exp(float((b.prox_logp[i] - b.behav_logp[i])[b.mask[i]].sum())) for i in rows}
    mass = {i: sum(rho[j] for j in rows if b.group_ids[j] == b.group_ids[i]) for i in rows}
    size = {i: sum(1 for j in rows if b.group_ids[j] == b.group_ids[i]) for i in rows}
    assert_close(gw.metrics["gmc/group_mass_mean"], sum(mass[i] / size[i] for i in rows) / len(rows))
    capped = sum(1 for i in rows if mass[i] / size[i] > 1.2)
    assert_close(gw.metrics["gmc/capped_frac"], capped / len(rows))


def test_capping_keeps_relative_weights_inside_a_group() -> None:
    # One group, S = (1000, 999, 998): ρ overflows in linear space, log space gives exact relative weights.
    behav = torch.zeros(3, 1, dtype=DT)
    prox = torch.tensor([[1000.0], [999.0], [998.0]], dtype=DT)
    one_group = torch.zeros(3, dtype=torch.long)
    gw = gmc_weights(prox_logp=prox, behav_logp=behav, mask=torch.ones(3, 1), group_ids=one_group)
    assert torch.isfinite(gw.weights).all()
    assert_close(gw.weights.sum(), 3 * 1.2)  # the group's mass is capped at G(1 + ε)
    assert_close(gw.weights[0] / gw.weights[1], math.e)
    assert_close(gw.weights[1] / gw.weights[2], math.e)
    assert gw.capped.all()


@given(seed=seeds, G=st.integers(1, 4), n_groups=st.integers(1, 3), T=dims)
def test_all_ratios_one_gives_grpo_gradient(seed: int, G: int, n_groups: int, T: int) -> None:
    B = G * n_groups
    b = make_batch(seed, B, T, empty_row=B > 1)
    group_ids = torch.arange(B) // G
    out = gmc_grpo_loss(
        logp=b.logp,
        prox_logp=b.behav_logp,
        behav_logp=b.behav_logp,
        advantages=b.adv_seq,
        mask=b.mask,
        group_ids=group_ids,
    )
    grpo = reinforce_loss(
        logp=b.logp, prox_logp=b.logp.detach(), advantages=b.adv_tok, mask=b.mask, agg="seq-mean-token-mean"
    )
    assert_close(grad_of(out.loss, b.logp), grad_of(grpo.loss, b.logp))
    assert out.metrics["gmc/capped_frac"] == 0.0
    assert_close(out.metrics["gmc/weight_mean"], 1.0)


@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]), cap=st.sampled_from(["mass", "rms"]))
def test_huge_log_ratios_give_finite_loss_and_gradients(seed: int, B: int, T: int, sign: float, cap: str) -> None:
    b = make_batch(seed, B, T)
    g = torch.Generator().manual_seed(seed)
    behav = b.prox_logp + sign * 1000.0 * torch.rand(B, T, generator=g, dtype=DT)
    out = gmc_grpo_loss(
        logp=b.logp + 1000.0 * sign,
        prox_logp=b.prox_logp,
        behav_logp=behav,
        advantages=b.adv_seq,
        mask=b.mask,
        group_ids=b.group_ids,
        cap=cap,
    )
    hostile.assert_finite(out, b.logp)


def test_fully_masked_batch_is_zero_with_zero_grad() -> None:
    b = make_batch(33)
    out = gmc_grpo_loss(
        logp=b.logp,
        prox_logp=b.prox_logp,
        behav_logp=b.behav_logp,
        advantages=b.adv_seq,
        mask=torch.zeros_like(b.mask),
        group_ids=b.group_ids,
    )
    hostile.assert_all_masked_is_exact_zero(out, b.logp)


def test_empty_rows_are_left_out_of_the_group_mass() -> None:
    b = make_batch(34, B=4, T=3)  # row 0 empty, shares group 0 with row 1
    gw = gmc_weights(prox_logp=b.prox_logp, behav_logp=b.behav_logp, mask=b.mask, group_ids=b.group_ids)
    assert gw.weights[0] == 0.0
    rho1 = math.exp(float((b.prox_logp[1] - b.behav_logp[1])[b.mask[1]].sum()))
    assert_close(gw.weights[1], min(rho1, 1.2))  # a group of one: w = ρ · min(1, 1.2/ρ)


@given(seed=seeds)
def test_gradient_flows_only_through_logp(seed: int) -> None:
    b = make_batch(seed)
    prox = b.prox_logp.clone().requires_grad_(True)
    behav = b.behav_logp.clone().requires_grad_(True)
    adv = b.adv_seq.clone().requires_grad_(True)
    out = gmc_grpo_loss(
        logp=b.logp, prox_logp=prox, behav_logp=behav, advantages=adv, mask=b.mask, group_ids=b.group_ids
    )
    hostile.assert_grad_only_through_logp(out, b.logp, b.mask, [prox, behav, adv])


def test_unknown_cap_is_rejected() -> None:
    b = make_batch(0)
    with pytest.raises(ValueError, match="mass"):
        gmc_weights(prox_logp=b.prox_logp, behav_logp=b.behav_logp, mask=b.mask, group_ids=b.group_ids, cap="clip")
