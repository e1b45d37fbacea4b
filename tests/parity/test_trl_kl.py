"""Reference-KL parity with TRL 1.16.0 (``beta > 0``, with and without ``use_bias_correction_kl``).

TRL adds β·k3 per token (k3 = e^x − x − 1, x = log π_ref − log π_θ, unclamped) to the policy loss before its
reduction, optionally multiplied by its ``coef_1`` = π_θ/π_prox *with gradient* (per token, or the geometric-mean
sequence ratio under ``importance_sampling_level="sequence"``). steadyrl: ``kl.type=in_loss, kind=k3, beta=β,
bias_correction=none|token|sequence`` on the objective TRL's level implies (PPO-clip or GSPO with TRL's ε) and TRL's
reduction (``bnpo``/``dapo``: token-mean; ``dr_grpo``: ``seq-mean-token-sum-norm`` with ``norm_len`` =
``max_completion_length``; ``grpo``: ``seq-mean-token-mean`` with ``objective.empty_rows="count"``, TRL's ``.mean()``
over all B rows). Same loss, gradient and TRL's logged ``kl`` (= steadyrl's ``kl/ref_mean``) in float64.

Note: TRL 1.16's ``use_bias_correction_kl`` defaults to True; steadyrl's ``bias_correction`` defaults to ``none``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("trl", reason="the TRL parity tests need trl==1.16.0 (requirements.lock)")

from steadyrl import compute_loss, resolve_method
from tests.parity._parity import DT, Case, assert_close, batch, cases, grad, leaf, trl_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

MAX_LEN = 7  # TRL's max_completion_length (dr_grpo's normalizer); ≥ every case's T
AGG = {
    "bnpo": {"agg": "token-mean"}, "dapo": {"agg": "token-mean"},
    "dr_grpo": {"agg": "seq-mean-token-sum-norm", "norm_len": MAX_LEN},
    "grpo": {"agg": "seq-mean-token-mean", "objective.empty_rows": "count"},  # TRL's .mean() over all B rows
}  # fmt: skip


def _ref_logp(case: Case) -> torch.Tensor:
    """log π_ref within 15 nats of log π_θ on the mask (steadyrl clamps e^x at ±20, TRL does not), garbage off it."""
    return torch.where(case.mask, case.theta + (case.ref - case.theta).clamp(-15.0, 15.0), case.ref)


def _run(case: Case, *, loss_type: str, level: str, beta: float, bias: bool) -> None:
    ref = _ref_logp(case)
    m = case.mask.to(DT)
    theirs = leaf(case.theta)
    inputs = {"completion_mask": m, "advantages": case.adv_seq, "old_per_token_logps": case.prox,
              "ref_per_token_logps": ref, "num_items_in_batch": m.sum()}  # fmt: skip
    loss_t, metrics_t = trl_loss(
        theirs, inputs, loss_type=loss_type, importance_sampling_level=level, beta=beta,
        use_bias_correction_kl=bias, max_completion_length=MAX_LEN, epsilon=0.2, epsilon_high=0.28,
    )  # fmt: skip
    overrides: dict[str, Any] = {
        "advantage.type": "given", "objective.type": "ppo_clip" if level == "token" else "gspo",
        "objective.clip_low": 0.2, "objective.clip_high": 0.28, "kl.type": "in_loss", "kl.kind": "k3",
        "kl.beta": beta, "kl.bias_correction": level if bias else "none", **AGG[loss_type],
    }  # fmt: skip
    ours = leaf(case.ours(case.theta))
    out = compute_loss(resolve_method("kl_bias_corrected", overrides), batch(case, ours, case.adv_seq,
                                                                             ref_logp=case.ours(ref)))  # fmt: skip
    assert_close(out.loss, loss_t)
    assert_close(grad(out.loss, ours), grad(loss_t, theirs))
    if case.mask.shape[1] > 1:  # TRL's metric helper reads a [B, 1] tensor as one value per sequence (mask ignored)
        assert_close(out.metrics["kl/ref_mean"], metrics_t["kl"][-1])


@settings(max_examples=40, deadline=None)
@given(
    case=cases(), loss_type=st.sampled_from(list(AGG)), level=st.sampled_from(["token", "sequence"]),
    beta=st.sampled_from([1e-3, 0.04, 1.0]), bias=st.booleans(),
)  # fmt: skip
def test_kl_in_loss_equals_trl(case: Case, loss_type: str, level: str, beta: float, bias: bool) -> None:
    _run(case, loss_type=loss_type, level=level, beta=beta, bias=bias)


def test_bias_correction_changes_the_gradient_even_on_policy() -> None:
    """TRL's own claim (its config docs), checked on its code and ours: π_θ = π_prox, so the weight's value is 1 and
    the loss is unchanged, but its gradient moves."""
    from tests.parity._parity import make_case

    case = make_case(5, [4, 6, 3], 6, 1e-3)
    case = case._replace(prox=case.theta.clone())
    grads = []
    for bias in (False, True):
        theirs = leaf(case.theta)
        m = case.mask.to(DT)
        inputs = {"completion_mask": m, "advantages": case.adv_seq, "old_per_token_logps": case.prox,
                  "ref_per_token_logps": _ref_logp(case), "num_items_in_batch": m.sum()}  # fmt: skip
        loss, _ = trl_loss(theirs, inputs, loss_type="bnpo", beta=1.0, use_bias_correction_kl=bias)
        grads.append((loss.detach(), grad(loss, theirs)))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-12)
    assert not torch.allclose(grads[0][1], grads[1][1], atol=1e-6)
