"""OPSM parity with TRL 1.16.0 (``off_policy_mask_threshold`` δ; ``GRPOTrainer.get_off_policy_mask``).

TRL keeps sequence i iff A_i ≥ 0 or mean_t(log μ − log π_θ) ≤ δ (μ = ``sampling_per_token_logps``, π_θ detached, the
mean over the completion mask) — the same rule as steadyrl's ``opsm`` correction, checked here on TRL's own static
function. TRL multiplies the per-token loss by that (B, 1) mask, so dropped sequences stay in its denominators
(``bnpo``/``dapo``: the token count; ``grpo``: each L_i and all B rows); steadyrl removes them from the mask, and
``denominator="input"`` (with ``objective.empty_rows="count"`` for ``grpo``) counts them again. ``dr_grpo`` divides by
B·``max_completion_length`` either way. Same keep mask, loss and gradient in float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("trl", reason="the TRL parity tests need trl==1.16.0 (requirements.lock)")

from steadyrl import compute_loss, resolve_method
from tests.parity._parity import DT, Case, assert_close, batch, cases, grad, leaf, make_case, trl_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

MAX_LEN = 7
REDUCTION: dict[str, dict[str, Any]] = {
    "bnpo": {"agg": "token-mean", "denominator": "input"},
    "dapo": {"agg": "token-mean", "denominator": "input"},
    "grpo": {"agg": "seq-mean-token-mean", "denominator": "input", "objective.empty_rows": "count"},
    "dr_grpo": {"agg": "seq-mean-token-sum-norm", "norm_len": MAX_LEN},
}
DELTAS = [0.05, 0.5, 2.0]


def _trl_keep(case: Case, delta: float) -> torch.Tensor:
    from trl import GRPOTrainer

    keep = GRPOTrainer.get_off_policy_mask(
        advantages=case.adv_seq[:, None], per_token_logps=case.theta, sampling_per_token_logps=case.behav,
        mask=case.mask.to(DT), off_policy_threshold=delta,
    )  # fmt: skip
    return keep.squeeze(-1).bool()


@settings(max_examples=40, deadline=None)
@given(case=cases(), delta=st.sampled_from(DELTAS), loss_type=st.sampled_from(list(REDUCTION)))
def test_opsm_equals_trl(case: Case, delta: float, loss_type: str) -> None:
    m = case.mask.to(DT)
    theirs = leaf(case.theta)
    inputs = {"completion_mask": m, "advantages": case.adv_seq, "old_per_token_logps": case.prox,
              "sampling_per_token_logps": case.behav, "num_items_in_batch": m.sum()}  # fmt: skip
    loss_t, _ = trl_loss(theirs, inputs, loss_type=loss_type, off_policy_mask_threshold=delta,
                                 max_completion_length=MAX_LEN)  # fmt: skip
    ours = leaf(case.ours(case.theta))
    spec = resolve_method("opsm", {"advantage.type": "given", "opsm.delta": delta, **REDUCTION[loss_type]})
    out = compute_loss(spec, batch(case, ours, case.adv_seq, behav_logp=case.ours(case.behav)), return_details=True)
    assert torch.equal(out.mask, case.mask & _trl_keep(case, delta)[:, None])
    assert_close(out.loss, loss_t)
    assert_close(grad(out.loss, ours), grad(loss_t, theirs))


def test_the_comparison_drops_sequences_and_the_denominator_matters() -> None:
    """Guard against a vacuous pass: on this batch OPSM drops a sequence, and without ``denominator="input"`` the loss
    differs from TRL's."""
    case = make_case(11, [6, 5, 6, 4, 3], 6, 0.1)
    shift = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0], dtype=DT)[:, None]  # μ 1 nat above π_θ in rows 0 and 2
    case = case._replace(behav=case.theta + shift, adv_seq=torch.tensor([-1.0, -2.0, 0.5, -0.3, 1.0], dtype=DT))
    keep = _trl_keep(case, 0.5)
    assert keep.tolist() == [False, True, True, True, True]  # row 2 drifted too, but its advantage is positive
    m = case.mask.to(DT)
    inputs = {"completion_mask": m, "advantages": case.adv_seq, "old_per_token_logps": case.prox,
              "sampling_per_token_logps": case.behav, "num_items_in_batch": m.sum()}  # fmt: skip
    loss_t, _ = trl_loss(leaf(case.theta), inputs, loss_type="dapo", off_policy_mask_threshold=0.5)
    kept_denominator = compute_loss(resolve_method("opsm", {"advantage.type": "given"}),
                                    batch(case, leaf(case.ours(case.theta)), case.adv_seq,
                                          behav_logp=case.ours(case.behav)))  # fmt: skip
    assert abs(kept_denominator.loss.item() - loss_t.item()) > 1e-3
