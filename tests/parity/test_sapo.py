"""SAPO parity with every installed framework that ships it: verl 0.9.1 (``loss_mode="sapo"``), TRL 1.16.0
(``loss_type="sapo"``), SkyRL 0.3.0 (``PolicyLossType.SAPO``), AReaL 1.0.4 (``sapo_loss_fn``).

All four compute the same gate σ(τ(r − 1))·4/τ with τ = τ_pos where A > 0 and τ_neg elsewhere (``objective.tau_pos``
/ ``tau_neg`` = verl ``tau_pos``/``tau_neg``, TRL ``sapo_temperature_pos``/``_neg``, SkyRL ``sapo.tau_pos``/``_neg``,
AReaL's ``tau_pos``/``tau_neg`` arguments; TRL builds τ as a float32 tensor, hence 1e-6 there). They differ in the
reduction only:

* verl forces ``seq-mean-token-mean`` over the non-empty rows (whatever ``loss_agg_mode`` says): ``agg`` default.
* TRL divides the per-row token means by every row (``.mean()``): ``objective.empty_rows=count``.
* SkyRL's ``sequence_mean`` (advantages divided by B·L_i) likewise: ``empty_rows=count``; ``token_mean``: token-mean.
* AReaL takes a token mean of the micro-batch: ``agg=token-mean``.

Loss, gradient w.r.t. log π_θ and, for AReaL, the mean gate (``sapo_soft_gate``) are compared on hypothesis batches
(heavy-tailed token advantages, log-ratios up to ±20, garbage off the mask, empty rows). SkyRL exponentiates in
float32 (``safe_exp_delta``): 1e-5 there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings

from steadyrl import compute_loss
from tests.parity._parity import Case, assert_close, batch, cases, grad, leaf, skyrl_ppo_utils, trl_loss

EXAMPLES = 30
TAUS = [(1.0, 1.05), (0.5, 3.0)]


def ours(case: Case, tau_pos: float, tau_neg: float, **overrides: Any):
    logp = leaf(case.ours(case.theta))
    spec = {"advantage.type": "given", "objective.tau_pos": tau_pos, "objective.tau_neg": tau_neg, **overrides}
    out = compute_loss("sapo", batch(case, logp, case.adv_tok), overrides=spec)
    return out.loss, grad(out.loss, logp), out.metrics


@pytest.mark.parametrize(("tau_pos", "tau_neg"), TAUS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_verl(case: Case, tau_pos: float, tau_neg: float) -> None:
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    assume(bool(case.mask.any()))
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="sapo"), loss_agg_mode="token-mean", tau_pos=tau_pos, tau_neg=tau_neg,
    )  # fmt: skip
    theta = leaf(case.theta)
    # verl ignores loss_agg_mode here: seq-mean-token-mean over the non-empty rows
    loss, _ = core_algos.get_policy_loss_fn("sapo")(
        old_log_prob=case.prox, log_prob=theta, advantages=case.adv_tok, response_mask=case.mask,
        loss_agg_mode="token-mean", config=config, rollout_is_weights=None,
    )  # fmt: skip
    ref, g, _ = ours(case, tau_pos, tau_neg)
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("tau_pos", "tau_neg"), TAUS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_trl(case: Case, tau_pos: float, tau_neg: float) -> None:
    pytest.importorskip("trl", reason="needs trl==1.16.0")
    theta = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_tok, "old_per_token_logps": case.prox}
    loss, _ = trl_loss(theta, inputs, loss_type="sapo", sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg)
    # TRL's torch.where over two Python floats makes τ a float32 tensor (1.05 → 1.0499999523): the reference takes
    # the same rounded τ, so the comparison stays at float64's tolerances where the loss's terms cancel
    tau_pos, tau_neg = (float(torch.tensor(t, dtype=torch.float32)) for t in (tau_pos, tau_neg))
    ref, g, _ = ours(case, tau_pos, tau_neg, **{"objective.empty_rows": "count"})
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("reduction", "overrides"), [
    ("sequence_mean", {"objective.empty_rows": "count"}), ("token_mean", {"agg": "token-mean"}),
])  # fmt: skip
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_skyrl(case: Case, reduction: str, overrides: dict[str, Any]) -> None:
    pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")
    ppo = skyrl_ppo_utils()
    from skyrl.train.config import AlgorithmConfig, SAPOConfig

    B, T = case.mask.shape
    tau_pos, tau_neg = TAUS[1]
    config = dataclasses.replace(
        AlgorithmConfig(), loss_reduction=reduction, max_seq_len=T, policy_loss_type="sapo",
        sapo=SAPOConfig(tau_pos=tau_pos, tau_neg=tau_neg),
    )  # fmt: skip
    mask = case.mask.to(torch.float64)
    scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=case.adv_tok, loss_mask=mask, loss_reduction=reduction, micro_batch_size=B, max_seq_len=T
    )
    theta = leaf(case.theta)
    loss, _ = ppo.PolicyLossRegistry.get("sapo")(theta, case.prox, scaled, config=config, loss_mask=mask,
                                                  rollout_logprobs=None)  # fmt: skip
    ref, g, _ = ours(case, tau_pos, tau_neg, **overrides)
    assert_close(ref, loss, rtol=1e-5, atol=1e-6)
    assert_close(g, grad(loss, theta), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("tau_pos", "tau_neg"), TAUS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_areal(case: Case, tau_pos: float, tau_neg: float) -> None:
    pytest.importorskip("areal", reason="needs areal==1.0.4")
    from areal.utils.functional.functional import sapo_loss_fn

    assume(bool(case.mask.any()))
    theta = leaf(case.theta)
    loss, stat = sapo_loss_fn(logprobs=theta, old_logprobs=case.prox, advantages=case.adv_tok, tau_pos=tau_pos,
                              tau_neg=tau_neg, loss_mask=case.mask)  # fmt: skip
    ref, g, m = ours(case, tau_pos, tau_neg, agg="token-mean")
    assert_close(ref, loss, rtol=1e-9, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-9, atol=1e-9)
    assert_close(m["loss/gate_mean"], stat["sapo_soft_gate"][case.mask].mean(), rtol=1e-9, atol=1e-12)
