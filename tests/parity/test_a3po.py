"""A-3PO parity with AReaL 1.0.4, the authors' implementation (``prox_logp_method=loglinear``).

(1) AReaL's ``compute_prox_logp_approximations`` and steadyrl's ``loglinear_prox_logp`` give the same π_prox;
(2) AReaL's whole actor loss (``grpo_loss_fn`` with the decoupled loss, the log-linear π_prox and its token
rejection ``ratio ≤ 5``) equals ``compute_loss("a3po")`` on AReaL's advantages, in value and gradient. AReaL's stats
tracker takes float32 tensors only, so (2) runs in float32 (tolerance 1e-6 relative).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("areal", reason="the AReaL parity tests need areal==1.0.4 (requirements/integrations)")

from areal.api.cli_args import RejectionSamplingConfig
from areal.trainer.ppo.actor import compute_prox_logp_approximations, grpo_loss_fn

from steadyrl import compute_loss
from steadyrl.core.proximal import loglinear_prox_logp


def batch(seed: int, B: int, T: int, dtype: torch.dtype, scale: float = 0.3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 2
    behav = logp + scale * torch.randn(B, T, generator=g, dtype=dtype)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    return {
        "logp": logp, "behav": behav, "mask": mask, "adv": torch.randn(B, T, generator=g, dtype=dtype),
        "versions": torch.randint(0, 8, (B, T), generator=g),
    }  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), v=st.integers(0, 9), B=st.integers(1, 5), T=st.integers(1, 7))
def test_proximal_approximation_matches_areal(seed: int, v: int, B: int, T: int) -> None:
    x = batch(seed, B, T, torch.float64, scale=3.0)
    theirs = compute_prox_logp_approximations(
        old_logp=x["behav"], logprobs=x["logp"], versions=x["versions"], current_version=v, method="loglinear"
    )["loglinear"]
    ours = loglinear_prox_logp(
        logp=x["logp"], behav_logp=x["behav"], versions=x["versions"], learner_version=v, mask=x["mask"]
    ).prox_logp
    # AReaL computes α in float32 (versions.float()); the rest in float64
    torch.testing.assert_close(ours[x["mask"]], theirs[x["mask"]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [0.3, 3.0])  # 3.0: heavy tails, some tokens past the ratio 5 are rejected
@pytest.mark.parametrize("seed", range(4))
def test_actor_loss_matches_areal(seed: int, scale: float) -> None:
    """AReaL divides by the token count before its rejection: ``denominator=input`` (a no-op when nothing is
    rejected, as at scale 0.3)."""
    x = batch(seed, 6, 9, torch.float32, scale=scale)
    v = 7
    logp_a = x["logp"].clone().requires_grad_(True)
    rs = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=5.0)
    data = {"logprobs": x["behav"], "advantages": x["adv"], "loss_mask": x["mask"], "versions": x["versions"]}
    theirs = grpo_loss_fn(
        logp_a, torch.zeros_like(logp_a), data, eps_clip=0.2, eps_clip_higher=None, c_clip=None,
        rejection_sampling=rs, current_version=v, prox_logp_method="loglinear", use_decoupled_loss=True,
    )  # fmt: skip
    theirs.backward()
    logp_s = x["logp"].clone().requires_grad_(True)
    ours = compute_loss(
        "a3po",
        {"logp": logp_s, "behav_logp": x["behav"], "mask": x["mask"], "advantages": x["adv"],
         "versions": x["versions"], "learner_version": v},
        overrides={"advantage.type": "given", "agg": "token-mean", "denominator": "input"},
    )  # fmt: skip
    ours.loss.backward()
    if scale > 1:
        assert float(ours.metrics["loss/masked_frac"]) > 0  # the rejection acted
    torch.testing.assert_close(ours.loss, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(logp_s.grad, logp_a.grad, rtol=1e-6, atol=1e-7)
