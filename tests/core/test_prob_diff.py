"""ROLL's probability-difference filters against a float64 loop reference written from its public
``compute_train_infer_correction`` (ROLL is not installed here), plus the correction's properties."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl import compute_loss
from steadyrl.core.prob_diff import PROB_DIFF_LEVELS, prob_diff_filter

DT = torch.float64


def _batch(seed: int, B: int = 5, T: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25  # holes: several turn segments per row
    mask[0] = False  # an empty row
    prox = torch.log(torch.rand(B, T, generator=g, dtype=DT).clamp(min=1e-3))
    behav = prox + 0.8 * torch.randn(B, T, generator=g, dtype=DT)
    return mask, prox.masked_fill(~mask, float("nan")), behav.masked_fill(~mask, float("nan"))


def _segments(row: list[bool]) -> list[list[int]]:
    out: list[list[int]] = []
    for t, on in enumerate(row):
        if on and (t == 0 or not row[t - 1]):
            out.append([])
        if on:
            out[-1].append(t)
    return out


def _ref_keep(mask: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor, level: str, lo: float, hi: float):
    B, T = mask.shape
    keep = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        tokens = [t for t in range(T) if mask[i, t]]
        d = {t: math.exp(min(float(prox[i, t]), 0.0)) - math.exp(min(float(behav[i, t]), 0.0)) for t in tokens}
        stat: dict[int, float] = {}
        if level == "token":
            stat = d
        elif level in ("geometric", "sequence"):
            total = sum(d.values())
            stat = {t: total / len(tokens) if level == "geometric" else total for t in tokens}
        else:
            for seg in _segments(mask[i].tolist()):
                mean = sum(d[t] for t in seg) / len(seg)
                stat |= {t: mean for t in seg}
        for t in tokens:
            keep[i, t] = lo <= stat[t] <= hi
    return keep


@pytest.mark.parametrize("level", PROB_DIFF_LEVELS)
@pytest.mark.parametrize(("lo", "hi"), [(-0.2, 0.2), (-0.05, 0.3)])
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(level: str, lo: float, hi: float, seed: int) -> None:
    mask, prox, behav = _batch(seed)
    out = prob_diff_filter(prox_logp=prox, behav_logp=behav, mask=mask, level=level, lower=lo, upper=hi)
    ref = _ref_keep(mask, prox, behav, level, lo, hi)
    assert torch.equal(out.mask, ref)
    assert torch.equal(out.weights, ref.to(DT)) and out.unit_weights


def test_the_levels_differ_on_this_batch() -> None:
    """The four statistics are not the same filter (the reference test would not notice a swapped level)."""
    mask, prox, behav = _batch(7)
    masks = [prob_diff_filter(prox_logp=prox, behav_logp=behav, mask=mask, level=lv, lower=-0.1, upper=0.1).mask
             for lv in PROB_DIFF_LEVELS]  # fmt: skip
    assert len({tuple(m.flatten().tolist()) for m in masks}) == 4


def test_on_policy_keeps_everything_and_extremes_stay_finite() -> None:
    mask, prox, _ = _batch(3)
    assert torch.equal(prob_diff_filter(prox_logp=prox, behav_logp=prox, mask=mask).mask, mask)
    far = prox + 1000.0
    out = prob_diff_filter(prox_logp=prox, behav_logp=far, mask=mask, level="sequence", lower=None, upper=None)
    assert torch.equal(out.mask, mask) and all(torch.isfinite(v) for v in out.metrics.values())


def test_preset_uses_the_proximal_policy() -> None:
    """compute_loss('prob_diff') hands the filter π_prox and μ: a μ equal to π_prox keeps every token."""
    mask, prox, behav = _batch(4)
    logp = torch.where(mask, prox, -1.0).requires_grad_(True)
    batch = {"logp": logp, "prox_logp": prox, "mask": mask, "advantages": torch.ones(mask.shape[0], dtype=DT)}
    same = compute_loss("prob_diff", batch | {"behav_logp": prox}, overrides={"advantage.type": "given"})
    other = compute_loss("prob_diff", batch | {"behav_logp": behav}, overrides={"advantage.type": "given"})
    assert float(same.metrics["loss/masked_frac"]) == 0.0
    assert float(other.metrics["loss/masked_frac"]) > 0.0
