"""VACO, COPC and ESTR keep masks against loop references written from the sources in docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.objectives.filters import ESTR_TAU, copc_actor_mask, estr_mask, vaco_filter
from tests.core.objectives import _batches as hostile
from tests.core.objectives._batches import DT, Batch, assert_close, dims, make_batch, seeds


def _lr(b: Batch, i: int, t: int) -> float:
    return float(b.logp.detach()[i, t]) - float(b.behav_logp[i, t])


def _ref_vaco(b: Batch, *, delta: float, rule: str, gid: list[int] | None = None) -> tuple[set, float]:
    """The three VACO rules by hand (docs/algorithms.md, ``vaco``)."""
    B, T = b.mask.shape
    rows = [i for i in range(B) if b.mask[i].any()]
    toks = {i: [t for t in range(T) if b.mask[i, t]] for i in rows}
    kept: set = set()
    if rule == "tvpo":  # released code: ½ mean_t |ρ−1| per row, mean per group, mean over groups
        assert gid is not None
        tv_i = {i: 0.5 * sum(abs(math.exp(_lr(b, i, t)) - 1.0) for t in toks[i]) / len(toks[i]) for i in rows}
        groups = sorted({gid[i] for i in rows})
        tv_g = {g: sum(tv_i[i] for i in rows if gid[i] == g) / sum(1 for i in rows if gid[i] == g) for g in groups}
        tv = sum(tv_g.values()) / len(groups)
        for i in rows:
            for t in toks[i]:
                A, lr = float(b.adv_tok[i, t]), _lr(b, i, t)
                if tv <= delta or tv_g[gid[i]] <= delta or A * ((lr > 0) - (lr < 0)) <= 0:
                    kept.add((i, t))
        return kept, tv
    tv_terms = []
    for i in rows:
        r_seq = math.exp(sum(_lr(b, i, t) for t in toks[i]) / len(toks[i]))
        if rule == "sequence":
            tv_terms.append(0.5 * abs(r_seq - 1.0))
        for t in toks[i]:
            r = r_seq if rule == "sequence" else math.exp(_lr(b, i, t))
            if rule == "token":
                tv_terms.append(0.5 * abs(r - 1.0))
            A = float(b.adv_tok[i, t])
            sign = (A > 0) - (A < 0)
            if not (0.5 * abs(r - 1.0) > delta and sign * (r - 1.0) > 0):
                kept.add((i, t))
    return kept, sum(tv_terms) / len(tv_terms)


def _as_set(mask: torch.Tensor) -> set[tuple[int, int]]:
    return {tuple(p) for p in mask.nonzero().tolist()}


GID = torch.arange(5).repeat_interleave(2)  # 10 rows, 5 groups of 2


@pytest.mark.parametrize("rule", ["tvpo", "sequence", "token"])
@pytest.mark.parametrize("delta", [0.2, 0.05])
def test_vaco_matches_reference(rule: str, delta: float) -> None:
    b = make_batch(51, B=10, T=6, scale=0.5)
    out = vaco_filter(
        logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_tok, mask=b.mask, group_ids=GID, delta=delta, rule=rule
    )
    kept, tv = _ref_vaco(b, delta=delta, rule=rule, gid=GID.tolist())
    assert _as_set(out.mask) == kept
    assert kept != _as_set(b.mask)  # something is dropped
    assert_close(out.metrics["vaco/tv"], tv)
    n = int(b.mask.sum())
    assert_close(out.metrics["vaco/masked_frac"].to(DT), (n - len(kept)) / n, atol=1e-6)
    assert torch.equal(out.weights, torch.ones_like(out.weights))


def test_vaco_tvpo_keeps_everything_inside_the_trust_region_and_groups_inside_it() -> None:
    """Batch TV ≤ δ keeps all; past δ only the groups past δ lose their tokens that moved with their advantage."""
    logp = torch.zeros(4, 2, dtype=DT)
    # group 0 (rows 0, 1): |ρ − 1| ≈ 0.82 / 0.45 per token, TV_g ≈ 0.32; group 1 (rows 2, 3): ρ = 1, TV_g = 0
    behav = torch.tensor([[-0.6, 0.6], [-0.6, 0.6], [0.0, 0.0], [0.0, 0.0]], dtype=DT)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0]], dtype=DT)
    kw = {"logp": logp, "behav_logp": behav, "advantages": adv, "mask": torch.ones(4, 2),
          "group_ids": torch.tensor([0, 0, 1, 1])}  # fmt: skip
    assert vaco_filter(**kw, delta=0.2).mask.all()  # batch TV ≈ 0.16 ≤ 0.2
    out = vaco_filter(**kw, delta=0.1)  # batch TV > 0.1, group 0's TV > 0.1, group 1's = 0
    # row 0 (A > 0): token 0 has ρ > 1 (moved up with A) → dropped; row 1 (A < 0): token 1 has ρ < 1 → dropped
    assert out.mask.tolist() == [[False, True], [True, False], [True, True], [True, True]]


def test_vaco_drops_only_updates_that_grow_tv() -> None:
    logp = torch.tensor([[0.0], [0.0], [0.0], [0.0]], dtype=DT)
    behav = torch.tensor([[-0.6], [-0.6], [0.6], [0.6]], dtype=DT)  # r = e^{.6}, e^{-.6}: ½|r − 1| > 0.2
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]], dtype=DT)
    for rule in ("tvpo", "sequence", "token"):
        out = vaco_filter(logp=logp, behav_logp=behav, advantages=adv, mask=torch.ones(4, 1),
                          group_ids=torch.zeros(4, dtype=torch.long), rule=rule)  # fmt: skip
        # r > 1 with A > 0 and r < 1 with A < 0 push further away: dropped; the other two pull back: kept.
        assert out.mask.squeeze(-1).tolist() == [False, True, True, False], rule


@given(seed=seeds, B=dims, T=dims, c_low=st.sampled_from([0.5, 0.8]), c_high=st.sampled_from([1.25, 2.0]))
def test_copc_matches_reference(seed: int, B: int, T: int, c_low: float, c_high: float) -> None:
    b = make_batch(seed, B, T, scale=0.5)
    out = copc_actor_mask(logp=b.logp, behav_logp=b.behav_logp, mask=b.mask, c_low=c_low, c_high=c_high)
    kept = {(i, t) for i, t in _as_set(b.mask) if c_low <= math.exp(_lr(b, i, t)) <= c_high}
    assert _as_set(out.mask) == kept


def test_copc_bounds_are_inclusive() -> None:
    behav = torch.log(torch.tensor([[2.0, 0.5, 2.5, 0.4]], dtype=DT))  # ρ = 1/μ: 0.5, 2, 0.4, 2.5
    out = copc_actor_mask(logp=torch.zeros(1, 4, dtype=DT), behav_logp=behav, mask=torch.ones(1, 4))
    assert out.mask.tolist() == [[True, True, False, False]]
    assert_close(out.metrics["copc/masked_frac"].to(DT), 0.5, atol=1e-7)


@given(seed=seeds, B=dims, T=dims, tau=st.sampled_from([ESTR_TAU, 0.5]))
def test_estr_matches_reference(seed: int, B: int, T: int, tau: float) -> None:
    b = make_batch(seed, B, T, scale=0.3)
    out = estr_mask(logp=b.logp, behav_logp=b.behav_logp, behav_entropy=b.entropy, mask=b.mask, tau=tau)
    kept = {(i, t) for i, t in _as_set(b.mask) if _lr(b, i, t) ** 2 / (float(b.entropy[i, t]) + 0.01) <= tau}
    assert _as_set(out.mask) == kept


def test_estr_scales_trust_region_with_entropy() -> None:
    logp = torch.zeros(1, 2, dtype=DT)
    behav = torch.full((1, 2), -0.2, dtype=DT)  # same δ = 0.2 on both tokens, δ² = 0.04
    entropy = torch.tensor([[2.0, 0.5]], dtype=DT)  # 0.04/2 = 0.02 ≤ τ; 0.04/0.5 = 0.08 > τ
    out = estr_mask(logp=logp, behav_logp=behav, behav_entropy=entropy, mask=torch.ones(1, 2), tau=0.04)
    assert out.mask.tolist() == [[True, False]]


FILTERS = ["vaco", "copc", "estr"]


def _run(name: str, b: Batch, logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor):
    if name == "vaco":
        gid = torch.arange(mask.shape[0]) // 2
        return vaco_filter(logp=logp, behav_logp=behav, advantages=b.adv_tok, mask=mask, group_ids=gid)
    if name == "copc":
        return copc_actor_mask(logp=logp, behav_logp=behav, mask=mask)
    return estr_mask(logp=logp, behav_logp=behav, behav_entropy=b.entropy, mask=mask)


@pytest.mark.parametrize("name", FILTERS)
@given(seed=seeds, B=dims, T=dims)
def test_on_policy_keeps_every_token(name: str, seed: int, B: int, T: int) -> None:
    b = make_batch(seed, B, T)
    out = _run(name, b, b.logp, b.logp.detach(), b.mask)
    assert torch.equal(out.mask, b.mask)
    assert out.metrics[f"{name}/masked_frac"] == 0.0


@pytest.mark.parametrize("name", FILTERS)
@given(seed=seeds, B=dims, T=dims, sign=st.sampled_from([-1.0, 1.0]))
def test_huge_log_ratios_are_dropped_and_finite(name: str, seed: int, B: int, T: int, sign: float) -> None:
    b = make_batch(seed, B, T)
    out = _run(name, b, b.logp, b.logp.detach() + sign * 1000.0, b.mask)
    hostile.assert_metrics_finite(out.metrics)
    if name != "vaco":  # VACO keeps updates that pull back toward μ
        assert not out.mask.any()


@pytest.mark.parametrize("name", FILTERS)
def test_fully_masked_batch(name: str) -> None:
    b = make_batch(52)
    out = _run(name, b, b.logp, b.behav_logp, torch.zeros_like(b.mask))
    assert not out.mask.any()
    assert all(v == 0.0 for v in out.metrics.values())


@pytest.mark.parametrize("name", FILTERS)
def test_filters_are_detached(name: str) -> None:
    b = make_batch(53, scale=0.6)
    behav = b.behav_logp.clone().requires_grad_(True)
    out = _run(name, b, b.logp, behav, b.mask)
    assert not out.weights.requires_grad
    assert all(not v.requires_grad for v in out.metrics.values())


def test_vaco_rejects_unknown_rule_and_tvpo_needs_groups() -> None:
    b = make_batch(0)
    with pytest.raises(ValueError, match="tvpo, sequence, token"):
        vaco_filter(logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_tok, mask=b.mask, rule="geometric")
    with pytest.raises(ValueError, match="group_ids"):
        vaco_filter(logp=b.logp, behav_logp=b.behav_logp, advantages=b.adv_tok, mask=b.mask)
