"""DPPO parity with every installed framework that ships it: verl 0.9.1 (``loss_mode="dppo_tv"`` / ``"dppo_kl"``) and
SkyRL 0.3.0 (``PolicyLossType.DPPO``, ``dppo.dppo_type="binary_tv"`` / ``"binary_kl"``).

Each test calls the framework's own function and ``compute_loss("dppo_tv" | "dppo_kl")`` (``advantage.type=given``,
the framework's token advantages) on hypothesis batches (heavy-tailed advantages, log-ratios up to ±20, garbage off
the mask, empty rows) and compares the loss, its gradient w.r.t. log π_θ and the masked fraction. DPPO works on
probabilities, so the log-probabilities here are valid ones (log σ(z) ≤ 0, z of scale up to 20). The mapping:

* verl: ``clip_ratio_low``/``clip_ratio_high`` = ``delta_low``/``delta_high``, ``clip_ratio_c`` = ``trunc`` (verl
  reads it from the actor config, default 3), ``surrogate=log_prob`` (verl's −A·sg(min(r, C))·log π_θ),
  ``loss_agg_mode`` = ``agg``. verl's anchor is its ``old_log_prob``: μ in bypass mode (the presets,
  ``policy=bypass``), the recomputed π_prox otherwise (``policy=decoupled``). ``actor/pg_clipfrac`` = ``loss/clip_frac``
  and ``actor/pg_clipfrac_lower`` = ``dppo/trunc_frac`` (A ≠ 0 on every trained token here: verl counts A = 0 tokens
  whose probability fell as masked, steadyrl never masks a token without a direction).
* SkyRL: ``dppo.delta_low``/``delta_high`` = ``delta_low``/``delta_high``, ``surrogate=ratio``, no truncation; its
  anchor is ``rollout_logprobs`` (μ); its loss is the token sum (``agg=seq-mean-token-sum-norm``, ``norm_len=1``, times
  B); it exponentiates in float32 (``safe_exp_delta``), hence 1e-5. ``clip_ratio`` = ``loss/clip_frac``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.nn.functional import logsigmoid

from steadyrl import compute_loss
from tests.parity._parity import Case, assert_close, cases, grad, leaf, make_case, skyrl_ppo_utils

EXAMPLES = 15
DIVERGENCE = {"dppo_tv": "binary_tv", "dppo_kl": "binary_kl"}


def with_probabilities(case: Case, seed: int, scale: float) -> Case:
    """``case`` with valid log-probabilities on the mask: log σ(z), z ~ scale·N(0, 1) for the anchor (μ and π_prox)
    and z + scale·N(0, 1) for π_θ (log-ratios clamped to ±20); the finite garbage off the mask is kept."""
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(case.mask.shape, generator=g, dtype=torch.float64)
    anchor = logsigmoid(z)
    theta = logsigmoid(z + scale * torch.randn(z.shape, generator=g, dtype=torch.float64)).clamp(anchor - 20.0)
    keep = lambda x, old: torch.where(case.mask, x, old)  # noqa: E731
    return case._replace(theta=keep(theta, case.theta), behav=keep(anchor, case.behav), prox=keep(anchor, case.prox))


@st.composite
def prob_cases(draw: Any) -> Case:
    """``cases()`` (empty rows, heavy-tailed advantages) with valid log-probabilities of scale 0.1 … 20."""
    scale = draw(st.sampled_from([0.1, 1.0, 3.0, 20.0]))
    return with_probabilities(draw(cases()), draw(st.integers(0, 2**31 - 1)), scale)


def ours(name: str, case: Case, **overrides: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``compute_loss`` with NaN/inf garbage off the mask; the anchor is μ (bypass) unless ``policy`` says otherwise."""
    logp = leaf(case.ours(case.theta))
    batch = {"logp": logp, "behav_logp": case.ours(case.behav), "prox_logp": case.ours(case.prox),
             "mask": case.mask, "advantages": case.ours(case.adv_tok)}  # fmt: skip
    out = compute_loss(name, batch, overrides={"advantage.type": "given", **overrides})
    return out.loss, grad(out.loss, logp), out.metrics


# -------------------------------------------------------------------------------------------------------- verl
def check_verl(case: Case, name: str, agg: str, low: float, high: float, trunc: float, policy: str) -> float:
    """verl's loss, gradient and metrics against ours on ``case``; returns verl's masked fraction."""
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=name), loss_agg_mode=agg, clip_ratio_low=low, clip_ratio_high=high,
        clip_ratio_c=trunc,
    )  # fmt: skip
    theta = leaf(case.theta)
    anchor = case.behav if policy == "bypass" else case.prox  # verl's old_log_prob in either mode
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=anchor, log_prob=theta, advantages=case.adv_tok, response_mask=case.mask, loss_agg_mode=agg,
        config=config, rollout_is_weights=None,
    )  # fmt: skip
    overrides = {"agg": agg, "policy": policy, "objective.delta_low": low, "objective.delta_high": high,
                 "objective.trunc": trunc, "objective.surrogate": "log_prob"}  # fmt: skip
    if policy == "decoupled":  # μ must not matter then: give it something else
        case = case._replace(behav=case.behav - 1.0)
    ref, g, m = ours(name, case, **overrides)
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)
    assert_close(m["loss/clip_frac"], metrics["actor/pg_clipfrac"], rtol=0, atol=1e-6)
    assert_close(m["dppo/trunc_frac"], metrics["actor/pg_clipfrac_lower"], rtol=0, atol=1e-6)
    return metrics["actor/pg_clipfrac"]


@pytest.mark.parametrize("name", list(DIVERGENCE))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(
    ("low", "high", "trunc", "policy"), [(None, None, 3.0, "bypass"), (0.1, 0.3, 20.0, "decoupled")]
)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=prob_cases())
def test_verl(
    case: Case, name: str, agg: str, low: float | None, high: float | None, trunc: float, policy: str
) -> None:
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    assume(bool(case.mask.any()))  # verl's means of nothing are NaN; steadyrl's exact 0 is tested elsewhere
    delta = 0.15 if name == "dppo_tv" else 0.05  # the presets' δ, unless the case sets both sides
    check_verl(case, name, agg, delta if low is None else low, delta if high is None else high, trunc, policy)


@pytest.mark.parametrize("name", list(DIVERGENCE))
def test_verl_on_a_case_with_tokens_on_both_sides_of_the_trust_region(name: str) -> None:
    """Not vacuous: on a fixed case verl drops some tokens and keeps others, and steadyrl agrees."""
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    case = with_probabilities(make_case(0, [7, 5, 0, 7, 3, 6], 7, 1.0), seed=1, scale=2.0)
    frac = check_verl(case, name, "token-mean", 0.05, 0.05, 3.0, "bypass")
    assert 0.1 < frac < 0.9


# ------------------------------------------------------------------------------------------------------- SkyRL
@pytest.mark.parametrize("name", list(DIVERGENCE))
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.2), (0.05, 0.3)])  # SkyRL's default 0.2, and asymmetric
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=prob_cases())
def test_skyrl(case: Case, name: str, low: float, high: float) -> None:
    pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")
    ppo = skyrl_ppo_utils()
    from skyrl.train.config.config import AlgorithmConfig, DPPOConfig

    cfg = dataclasses.replace(
        AlgorithmConfig(), policy_loss_type="dppo",
        dppo=DPPOConfig(dppo_type=DIVERGENCE[name], delta_low=low, delta_high=high),
    )  # fmt: skip
    theta = leaf(case.theta)
    loss, metrics = ppo.PolicyLossRegistry.get("dppo")(
        theta, case.prox, case.adv_tok, config=cfg, loss_mask=case.mask.to(torch.float64),
        rollout_logprobs=case.behav,
    )  # fmt: skip
    overrides = {"agg": "seq-mean-token-sum-norm", "norm_len": 1, "objective.delta_low": low,
                 "objective.delta_high": high, "objective.surrogate": "ratio", "objective.trunc": None}  # fmt: skip
    ref, g, m = ours(name, case, **overrides)
    B = case.mask.shape[0]
    assert_close(ref * B, loss, rtol=1e-5, atol=1e-7)
    assert_close(g * B, grad(loss, theta), rtol=1e-5, atol=1e-7)
    assert abs(float(m["loss/clip_frac"]) - metrics["clip_ratio"]) < 1e-6
