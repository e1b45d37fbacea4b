"""LUSPO parity with TRL 1.16.0 (``loss_type="luspo"``): ``(per_token_loss * mask).sum(-1).mean()``.

With ``importance_sampling_level="sequence"`` (the paper's setting) that is the ``luspo`` preset (GSPO, token sums per
sequence), with TRL's ε as the clip range. TRL's ``.mean()`` divides by all B rows, all-masked ones included, where
``seq-mean-token-sum`` divides by the non-empty rows: ``objective.empty_rows="count"`` reproduces TRL on every batch
(as does ``agg="seq-mean-token-sum-norm"`` with ``norm_len=1``, Σ / (B·1)), the preset itself on batches without an
empty row. TRL's default token-level ratio under ``luspo`` is PPO-clip with the same reduction. Same loss and gradient
in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("trl", reason="the TRL parity tests need trl==1.16.0 (requirements.lock)")

from steadyrl import compute_loss, resolve_method
from tests.parity._parity import DT, Case, assert_close, batch, cases, grad, leaf, trl_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

EPS = [(2e-3, 2.5e-3), (0.2, 0.28), (3e-4, 4e-4)]
ALL_ROWS = {"objective.empty_rows": "count"}  # TRL's .mean() over all B rows, all-masked ones included


def _trl(case: Case, eps: tuple[float, float], level: str):
    theirs = leaf(case.theta)
    inputs = {"completion_mask": case.mask.to(DT), "advantages": case.adv_seq, "old_per_token_logps": case.prox}
    loss, _ = trl_loss(theirs, inputs, loss_type="luspo", importance_sampling_level=level, epsilon=eps[0],
                               epsilon_high=eps[1])  # fmt: skip
    return loss, grad(loss, theirs)


def _ours(case: Case, overrides: dict[str, Any]):
    ours = leaf(case.ours(case.theta))
    spec = resolve_method("luspo", {"advantage.type": "given", **overrides})
    out = compute_loss(spec, batch(case, ours, case.adv_seq))
    return out.loss, grad(out.loss, ours)


@settings(max_examples=40, deadline=None)
@given(case=cases(), eps=st.sampled_from(EPS))
def test_sequence_level_luspo_equals_trl(case: Case, eps: tuple[float, float]) -> None:
    loss_t, grad_t = _trl(case, eps, "sequence")
    loss, g = _ours(case, {"objective.clip_low": eps[0], "objective.clip_high": eps[1], **ALL_ROWS})
    assert_close(loss, loss_t)
    assert_close(g, grad_t)


@settings(max_examples=30, deadline=None)
@given(case=cases(empty=False), eps=st.sampled_from(EPS))
def test_the_preset_equals_trl_when_no_row_is_empty(case: Case, eps: tuple[float, float]) -> None:
    loss_t, grad_t = _trl(case, eps, "sequence")
    loss, g = _ours(case, {"objective.clip_low": eps[0], "objective.clip_high": eps[1]})
    assert_close(loss, loss_t)
    assert_close(g, grad_t)


@settings(max_examples=30, deadline=None)
@given(case=cases(), eps=st.sampled_from(EPS))
def test_token_level_luspo_is_ppo_clip_with_token_sums(case: Case, eps: tuple[float, float]) -> None:
    """TRL's ``importance_sampling_level`` default ("token") under ``luspo``: PPO-clip, summed per sequence."""
    loss_t, grad_t = _trl(case, eps, "token")
    overrides = {"objective.type": "ppo_clip", "objective.clip_low": eps[0], "objective.clip_high": eps[1], **ALL_ROWS}
    loss, g = _ours(case, overrides)
    assert_close(loss, loss_t)
    assert_close(g, grad_t)
