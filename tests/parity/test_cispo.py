"""CISPO parity with every installed framework that ships it: verl 0.9.1 (``loss_mode="cispo"``), TRL 1.16.0
(``loss_type="cispo"``), SkyRL 0.3.0 (``PolicyLossType.CISPO``).

Each test calls the framework's own function and ``compute_loss("cispo")`` (``advantage.type=given``, the framework's
token advantages) on hypothesis batches (heavy-tailed advantages, log-ratios up to ±20, garbage off the mask, empty
rows) and compares the loss, its gradient w.r.t. log π_θ and the clip fraction. All three compute the value
−sg(clip(r))·A·log π_θ (MiniMax-M1's Eq. 4), so no value option is needed; the mapping of their clip settings:

* verl: ``clip_ratio_low``/``clip_ratio_high`` = ``clip_low``/``clip_high`` (verl clips below unless
  ``clip_ratio_low ≥ 1``: 1.0 is ``clip_low=None``); ``loss_agg_mode`` = ``agg``.
* TRL: ``epsilon_high`` is the cap itself, ``clip_high = epsilon_high − 1``, ``clip_low=None`` (TRL has no lower
  bound); normalized by the batch's tokens (``num_items_in_batch``): ``agg=token-mean``.
* SkyRL: ``cispo.cispo_eps_clip_low``/``cispo_eps_clip_high`` = ``clip_low``/``clip_high`` (its defaults 0 and 5, a
  weight clamped to [1, 6], are reproduced as such); ``loss_reduction=token_mean``. SkyRL exponentiates the log-ratio
  in float32 (``safe_exp_delta``), hence 1e-5 there.
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


def ours(case: Case, adv: torch.Tensor, **overrides: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logp = leaf(case.ours(case.theta))
    out = compute_loss("cispo", batch(case, logp, adv), overrides={"advantage.type": "given", **overrides})
    return out.loss, grad(out.loss, logp), out.metrics


# -------------------------------------------------------------------------------------------------------- verl
@pytest.mark.parametrize(("low", "high"), [(None, 4.0), (0.2, 0.28), (0.5, None)])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_verl(case: Case, low: float | None, high: float | None, agg: str) -> None:
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    assume(bool(case.mask.any()))  # verl's means of nothing are NaN; steadyrl's exact 0 is tested elsewhere
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="cispo"), loss_agg_mode=agg,
        clip_ratio_low=1.0 if low is None else low, clip_ratio_high=1e9 if high is None else high,
    )  # fmt: skip
    theta = leaf(case.theta)
    loss, metrics = core_algos.get_policy_loss_fn("cispo")(
        old_log_prob=case.prox, log_prob=theta, advantages=case.adv_tok, response_mask=case.mask,
        loss_agg_mode=agg, config=config, rollout_is_weights=None,
    )  # fmt: skip
    ref, g, m = ours(case, case.adv_tok, agg=agg, **{"objective.clip_low": low, "objective.clip_high": high})
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)
    assert_close(m["loss/clip_frac"], metrics["actor/pg_clipfrac"], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------------------- TRL
@pytest.mark.parametrize("epsilon_high", [5.0, 1.5])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_trl(case: Case, epsilon_high: float) -> None:
    pytest.importorskip("trl", reason="needs trl==1.16.0")
    assume(bool(case.mask.any()))
    theta = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_tok, "old_per_token_logps": case.prox,
              "num_items_in_batch": case.mask.sum()}  # fmt: skip
    loss, _ = trl_loss(theta, inputs, loss_type="cispo", epsilon_high=epsilon_high)
    overrides = {"objective.clip_low": None, "objective.clip_high": epsilon_high - 1.0, "agg": "token-mean"}
    ref, g, _ = ours(case, case.adv_tok, **overrides)
    assert_close(ref, loss, rtol=1e-9, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------------- SkyRL
@pytest.mark.parametrize(("low", "high"), [(0.0, 5.0), (1.0, 4.0), (0.2, 0.28)])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_skyrl(case: Case, low: float, high: float) -> None:
    pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")
    ppo = skyrl_ppo_utils()
    from skyrl.train.config import AlgorithmConfig, CISPOConfig

    assume(bool(case.mask.any()))
    B, T = case.mask.shape
    config = dataclasses.replace(
        AlgorithmConfig(), loss_reduction="token_mean", max_seq_len=T, policy_loss_type="cispo",
        cispo=CISPOConfig(cispo_eps_clip_low=low, cispo_eps_clip_high=high),
    )  # fmt: skip
    mask = case.mask.to(torch.float64)
    scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=case.adv_tok, loss_mask=mask, loss_reduction="token_mean", micro_batch_size=B, max_seq_len=T
    )
    theta = leaf(case.theta)
    loss, metrics = ppo.PolicyLossRegistry.get("cispo")(
        theta, case.prox, scaled, config=config, loss_mask=mask, rollout_logprobs=None
    )
    ref, g, m = ours(case, case.adv_tok, agg="token-mean", **{"objective.clip_low": low, "objective.clip_high": high})
    assert_close(ref, loss, rtol=1e-5, atol=1e-6)
    assert_close(g, grad(loss, theta), rtol=1e-5, atol=1e-6)
    assert_close(m["loss/clip_frac"], metrics["clip_ratio"], rtol=0, atol=1e-6)
