"""``steadyrl check losses``: a stand-in loss with the documented normaliser passes, the same loss with its normaliser
changed fails on value, gradient and per-sequence scale; an installed framework's own losses (the rows of the
framework-qualified name table) pass."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from steadyrl.check.losses import LossBatch, LossCase, check_losses, compare
from steadyrl.methods.frameworks import FRAMEWORK_LOSSES

CLIP = (0.2, 0.28)
CLIP_OPTIONS = {"objective.clip_low": CLIP[0], "objective.clip_high": CLIP[1]}


def ppo_terms(batch: LossBatch, logp: Tensor) -> Tensor:
    """PPO-clip per token, written here from arXiv 1707.06347 Eq. 7, masked: max(−A r, −A clip(r))."""
    r = torch.exp(logp - batch.old)
    terms = torch.maximum(-batch.adv * r, -batch.adv * r.clamp(1 - CLIP[0], 1 + CLIP[1]))
    return torch.where(batch.mask, terms, torch.zeros_like(terms))


def seq_mean_token_mean(batch: LossBatch, logp: Tensor) -> Tensor:
    """Each row's mean over its own tokens, then the mean over the non-empty rows."""
    m = batch.mask.to(logp.dtype)
    rows = batch.mask.any(-1)
    per_row = ppo_terms(batch, logp).sum(-1) / m.sum(-1).clamp(min=1)
    return per_row[rows].mean()


def padded_length_normaliser(batch: LossBatch, logp: Tensor) -> Tensor:
    """The planted change: each row divided by the padded length T instead of its own length."""
    rows = batch.mask.any(-1)
    per_row = ppo_terms(batch, logp).sum(-1) / batch.mask.shape[1]
    return per_row[rows].mean()


CLAIM = {"agg": "seq-mean-token-mean", **CLIP_OPTIONS}


def test_stand_in_with_the_documented_normaliser_passes() -> None:
    f = compare(LossCase("stand-in", "test", seq_mean_token_mean, CLAIM))
    assert f.verdict == "PASS", f.message


def test_a_changed_normaliser_is_caught_by_the_per_sequence_scale() -> None:
    f = compare(LossCase("stand-in", "test", padded_length_normaliser, CLAIM))
    assert f.verdict == "FAIL"
    assert "a normaliser differs" in f.message
    # the scale is length / T: the shortest row is scaled down most
    short, long = (float(x) for x in f.message.split("shortest row ")[1].split(")")[0].split(", longest "))
    assert short < long < 1.0


def test_token_mean_claimed_for_a_sequence_mean_is_caught() -> None:
    f = compare(LossCase("stand-in", "test", seq_mean_token_mean, {"agg": "token-mean", **CLIP_OPTIONS}))
    assert f.verdict == "FAIL"


def test_installed_verl_loss_passes() -> None:
    pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1 (requirements/integrations)")
    findings = check_losses(["verl"])
    rows = [row for row in FRAMEWORK_LOSSES if row.framework == "verl"]
    assert len(findings) == sum(1 + len(row.reductions) for row in rows)
    assert all(f.verdict == "PASS" for f in findings), [f.format() for f in findings]


def test_unknown_framework_is_named() -> None:
    (f,) = check_losses(["megatron"])
    assert f.verdict == "SKIP" and "known: verl" in f.message
