"""Optimal token baseline against a float64 loop written from docs/algorithms.md (and verl's reference semantics)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.advantages.grpo import grpo_advantages, token_advantages
from steadyrl.core.advantages.otb import OTB_ALIGNMENTS, OTB_EPS, otb_advantages, sum_squared_probs

NAN = float("nan")


def test_sum_squared_probs_matches_softmax_and_is_finite_for_huge_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 3
    out = sum_squared_probs(logits)
    for i, t in itertools.product(range(2), range(3)):
        z = [float(v) for v in logits[i, t]]
        zmax = max(z)
        e = [math.exp(v - zmax) for v in z]
        ref = sum((x / sum(e)) ** 2 for x in e)
        assert out[i, t].item() == pytest.approx(ref, abs=1e-12)
    huge = torch.tensor([[1e4, 0.0, -1e4], [5e3, 5e3, -2e4]], dtype=torch.float32)
    torch.testing.assert_close(sum_squared_probs(huge), torch.tensor([1.0, 0.5]))


def _ref_otb(
    G: list[list[float]], logp: list[list[float]], sp2: list[list[float]], m: list[list[bool]], ids: list[int],
    w: list[list[float]] | None, *, eps: float, alignment: str, zero_lone: bool,
) -> tuple[list[list[float]], list[list[float]]]:
    B, T = len(m), len(m[0])
    W = [[0.0] * T for _ in range(B)]
    pos = [[0] * T for _ in range(B)]
    for i in range(B):
        acc, rank = 0.0, 0
        for t in range(T):
            if m[i][t]:
                wt = 1.0 if w is None else w[i][t] ** 2
                acc += wt * (1 - 2 * math.exp(logp[i][t]) + sp2[i][t])  # W_t = Σ_{j≤t} m_j w_j² (1 − 2π_j + Σπ²)
                pos[i][t] = rank if alignment == "trained_tokens" else t
                rank += 1
            W[i][t] = acc
    adv = [[0.0] * T for _ in range(B)]
    base = [[0.0] * T for _ in range(B)]
    for i, t in itertools.product(range(B), range(T)):
        if not m[i][t]:
            continue
        active = [(j, s) for j in range(B) for s in range(T) if ids[j] == ids[i] and m[j][s] and pos[j][s] == pos[i][t]]
        num = sum(G[j][s] * W[j][s] for j, s in active)
        den = sum(W[j][s] for j, s in active)
        b = num / (den + eps)
        if zero_lone and len(active) == 1:
            b = 0.0
        base[i][t] = b
        adv[i][t] = G[i][t] - b
    return adv, base


def _inputs(seed: int, B: int = 7, T: int = 6) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([2, 2, 2, 0, 0, 0, 5])[:B]
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[1] = False  # an empty response
    mask[4, 3:] = False  # a shorter one
    G = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    pi = logp.exp()
    sp2 = pi**2 + torch.rand(B, T, generator=g, dtype=torch.float64) * (1 - pi) ** 2  # π² ≤ Σπ² ≤ π² + (1 − π)²
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    for x in (G, logp, sp2, w):  # garbage outside the mask must not leak
        x.masked_fill_(~mask, NAN)
    return G, logp, sp2, w, mask, ids


@pytest.mark.parametrize(
    ("alignment", "zero_lone", "weighted"), list(itertools.product(OTB_ALIGNMENTS, [True, False], [True, False]))
)
def test_otb_matches_reference(alignment: str, zero_lone: bool, weighted: bool) -> None:
    for seed in range(3):
        G, logp, sp2, w, mask, ids = _inputs(seed)
        out = otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=mask, group_ids=ids,
                             token_weights=w if weighted else None, alignment=alignment, zero_lone_baseline=zero_lone)
        adv, base = _ref_otb(G.tolist(), logp.tolist(), sp2.tolist(), mask.tolist(), ids.tolist(),
                             w.tolist() if weighted else None, eps=OTB_EPS, alignment=alignment, zero_lone=zero_lone)
        torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), atol=1e-10, rtol=0)
        torch.testing.assert_close(out.baseline, torch.tensor(base, dtype=torch.float64), atol=1e-10, rtol=0)
        assert torch.isfinite(out.energy).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())


def test_equal_energy_and_outcome_reward_reduce_to_dr_grpo() -> None:
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([1, 1, 1, 1, 0, 0, 0])
    B, T = 7, 5
    R = (torch.rand(B, generator=g) < 0.5).to(torch.float64)
    R[0] = 1.0 - R[1]  # group 1 is not constant
    logp_row = -torch.rand(T, generator=g, dtype=torch.float64)
    sp2_row = logp_row.exp() ** 2 + 0.5 * (1 - logp_row.exp()) ** 2
    mask = torch.ones(B, T, dtype=torch.bool)
    out = otb_advantages(returns=R.unsqueeze(-1).expand(B, T), token_logp=logp_row.expand(B, T),
                         sum_p2=sp2_row.expand(B, T), mask=mask, group_ids=ids, eps=0.0)
    dr_grpo = grpo_advantages(rewards=R, group_ids=ids, scale="none").advantages
    torch.testing.assert_close(out.advantages, token_advantages(advantages=dr_grpo, mask=mask), atol=1e-12, rtol=0)


def test_unit_weights_equal_no_weights_and_alignments_agree_without_holes() -> None:
    G, logp, sp2, _, mask, ids = _inputs(9)
    plain = otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=mask, group_ids=ids)
    unit = otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=mask, group_ids=ids,
                          token_weights=torch.ones_like(G))
    assert torch.equal(plain.advantages, unit.advantages)
    lengths = torch.tensor([6, 0, 4, 5, 2, 6, 3])
    right_padded = torch.arange(6).expand(7, 6) < lengths.unsqueeze(-1)
    G2 = torch.nan_to_num(G, nan=0.5)
    kw = {"returns": G2, "token_logp": torch.nan_to_num(logp, nan=-0.5), "sum_p2": torch.nan_to_num(sp2, nan=0.2),
          "mask": right_padded, "group_ids": ids}
    a = otb_advantages(**kw, alignment="trained_tokens").advantages
    b = otb_advantages(**kw, alignment="absolute").advantages
    assert torch.equal(a, b)
    # with holes the two alignments differ
    c = otb_advantages(**{**kw, "mask": mask}, alignment="trained_tokens").advantages
    d = otb_advantages(**{**kw, "mask": mask}, alignment="absolute").advantages
    assert not torch.allclose(c, d)


@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-6, 1.0, 1e6]))
def test_fully_masked_and_extreme_weights_stay_finite(seed: int, scale: float) -> None:
    G, logp, sp2, w, mask, ids = _inputs(seed % 1000)
    out = otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=mask, group_ids=ids, token_weights=w * scale)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.baseline).all()
    none = torch.zeros_like(mask)
    empty = otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=none, group_ids=ids, token_weights=w)
    assert torch.equal(empty.advantages, torch.zeros_like(G))
    assert all(v.item() == 0.0 for v in empty.metrics.values())


def test_outputs_are_detached() -> None:
    G, logp, sp2, w, mask, ids = (x.clone() for x in _inputs(1))
    for x in (G, logp, sp2, w):
        x.requires_grad_(True)
    out = otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=mask, group_ids=ids, token_weights=w)
    assert not out.advantages.requires_grad and not out.baseline.requires_grad and not out.energy.requires_grad


def test_bad_arguments_raise() -> None:
    G, logp, sp2, _, mask, ids = _inputs(0)
    with pytest.raises(ValueError, match="alignment"):
        otb_advantages(returns=G, token_logp=logp, sum_p2=sp2, mask=mask, group_ids=ids, alignment="left")
