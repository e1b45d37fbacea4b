"""SkyRL 0.3.0's ``trainer.algorithm.off_policy_correction`` block and its ``rollout_is`` policy loss against
steadyrl.

* The block (token / sequence TIS, geometric and product sequence masks, the per-token mask, the outlier mask) on
  SkyRL's ``ppo_policy_loss``, against steadyrl's SkyRL adapter (``PolicyLoss("ppo")``) given the same config: the
  adapter translates the block into existing corrections (``integrations.skyrl.off_policy_corrections``), so this
  is a parity test of that mapping. Both return the token sum of the per-token loss (SkyRL pre-scales advantages).
* ``rollout_is_policy_loss`` against ``compute_loss("rollout_is", agg="token-sum")``: π_prox := μ, the token ratio
  π_θ/μ (detached) kept inside [1 − ε_low, 1 + ε_high] and 0 outside, times −A·log π_θ. SkyRL's bounds are strict
  and steadyrl's inclusive: they differ only on a ratio exactly at a bound.

Loss and gradient w.r.t. log π_θ on hypothesis batches (log-ratios up to ±20, garbage off the mask), float64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from steadyrl import compute_loss
from tests.parity._parity import Case, assert_close, batch, cases, grad, leaf, skyrl_ppo_utils

pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")
EXAMPLES = 15

BLOCKS: dict[str, dict[str, Any]] = {
    "token_tis": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.0},
    "sequence_tis": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 5.0},
    "geometric_mask": {"sequence_mask_metric": "geometric", "geo_mask_low": 0.7, "geo_mask_high": 1.3},
    "product_mask": {"sequence_mask_metric": "product", "product_mask_low": 0.5, "product_mask_high": 2.0},
    "token_mask": {"token_mask_is_threshold_low": 0.6, "token_mask_is_threshold_high": 1.8},
    "outlier_mask": {"outlier_token_is_threshold_low": 0.3, "outlier_token_is_threshold_high": 3.0},
    "all": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 3.0, "sequence_mask_metric": "geometric",
            "geo_mask_low": 0.6, "geo_mask_high": 1.6, "token_mask_is_threshold_low": 0.3,
            "token_mask_is_threshold_high": 4.0, "outlier_token_is_threshold_high": 8.0},
}  # fmt: skip


def _config(**block: Any) -> Any:
    skyrl_ppo_utils()  # registers skyrl.backends on Python < 3.12
    from skyrl.train.config.config import AlgorithmConfig

    cfg = dataclasses.replace(AlgorithmConfig(), loss_reduction="token_mean", policy_loss_type="regular")
    return dataclasses.replace(cfg, off_policy_correction=dataclasses.replace(cfg.off_policy_correction, **block))


@pytest.mark.parametrize("name", list(BLOCKS))
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_skyrl_off_policy_correction_block(case: Case, name: str) -> None:
    ppo = skyrl_ppo_utils()
    from steadyrl.integrations import skyrl as ssky

    cfg = _config(**BLOCKS[name])
    theta = leaf(case.theta)
    loss, _ = ppo.ppo_policy_loss(theta, case.prox, case.adv_tok, cfg, loss_mask=case.mask.to(case.theta.dtype),
                                  rollout_logprobs=case.behav)  # fmt: skip
    logp = leaf(case.ours(case.theta))
    mine, _ = ssky.PolicyLoss("ppo")(logp, case.ours(case.prox), case.ours(case.adv_tok), config=cfg,
                                     loss_mask=case.mask, rollout_logprobs=case.ours(case.behav))  # fmt: skip
    assert_close(mine, loss, rtol=1e-6, atol=1e-8)  # SkyRL exponentiates in float32 (safe_exp_delta)
    assert_close(grad(mine, logp), torch.where(case.mask, grad(loss, theta), 0.0), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.5, 1.0)])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_skyrl_rollout_is(case: Case, low: float, high: float) -> None:
    ppo = skyrl_ppo_utils()
    cfg = dataclasses.replace(_config(), eps_clip_low=low, eps_clip_high=high, policy_loss_type="rollout_is")
    theta = leaf(case.theta)
    loss, _ = ppo.rollout_is_policy_loss(
        theta, case.prox, case.adv_tok, cfg, loss_mask=case.mask.to(case.theta.dtype), rollout_logprobs=case.behav
    )
    logp = leaf(case.ours(case.theta))
    b = batch(case, logp, case.adv_tok) | {"behav_logp": case.ours(case.behav)}
    overrides = {"advantage.type": "given", "agg": "token-sum", "token_mis.lower": 1.0 - low,
                 "token_mis.upper": 1.0 + high}  # fmt: skip
    out = compute_loss("rollout_is", b, overrides=overrides)
    assert_close(out.loss, loss, rtol=1e-6, atol=1e-8)
    assert_close(grad(out.loss, logp), torch.where(case.mask, grad(loss, theta), 0.0), rtol=1e-5, atol=1e-8)
