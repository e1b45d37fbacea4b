"""GSPO (``objective.type=gspo``) against the frameworks' own losses, and exactly where their two forms differ.

Two forms ship. The sequence form (s_i with its gradient through the mean log-ratio, clamped to ±20 here, unclamped
in the frameworks): TRL 1.16.0 ``importance_sampling_level="sequence"``, OpenRLHF 0.11.2 ``policy_loss_type="gspo"``,
AReaL 1.0.4 ``importance_sampling_level="sequence"`` (which first averages the token advantages per sequence). The
GSPO-token form sg[s_i]·π_θ/sg[π_θ] with log s capped at +10: verl 0.9.1 ``gspo`` and SkyRL 0.3.0 ``GSPO``
(``objective.form='token'``, ``objective.log_ratio_cap=10``). Each comparison: same loss, same gradient w.r.t.
log π_θ, same clip fraction, on hypothesis batches with heavy-tailed token advantages, log-ratios up to ±20, garbage
at padding and all-masked rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss, resolve_method
from steadyrl.core.masking import masked_mean
from steadyrl.core.objectives.ppo import VERL_GSPO_LOG_RATIO_CAP, gspo_loss
from tests.parity._parity import Case, assert_close, batch, cases, grad, leaf, make_case

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations inside TRL's config

CLIPS = st.sampled_from([(3e-4, 4e-4), (0.2, 0.27), (0.05, 0.1)])
TOKEN_FORM = {"objective.form": "token", "objective.log_ratio_cap": VERL_GSPO_LOG_RATIO_CAP}


def ours(case: Case, overrides: dict[str, Any], adv: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    logp = leaf(case.ours(case.theta))
    spec = resolve_method("gspo", {"advantage.type": "given", **overrides})
    out = compute_loss(spec, batch(case, logp, case.adv_tok if adv is None else adv))
    return out, grad(out.loss, logp)


def clips(clip: tuple[float, float]) -> dict[str, float]:
    return {"objective.clip_low": clip[0], "objective.clip_high": clip[1]}


def check(out: Any, g: torch.Tensor, loss: torch.Tensor, g_theirs: torch.Tensor, rtol: float = 1e-9) -> None:
    assert_close(out.loss, loss, rtol=rtol, atol=1e-9)
    assert_close(g, g_theirs, rtol=rtol, atol=rtol * max(1.0, float(g_theirs.abs().max())))


# ------------------------------------------------------------------------------------------------------- verl
def verl_config(clip: tuple[float, float], agg: str, mask: torch.Tensor, trainer: bool) -> Any:
    pytest.importorskip("verl", reason="verl==0.9.1")
    from verl.workers.config import ActorConfig, PolicyLossConfig

    cfg = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="gspo"), loss_agg_mode=agg, clip_ratio_low=clip[0],
        clip_ratio_high=clip[1],
    )  # fmt: skip
    if trainer:
        cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    return cfg


@settings(max_examples=40, deadline=None)
@given(case=cases(), clip=CLIPS, agg=st.sampled_from(["seq-mean-token-mean", "token-mean"]), trainer=st.booleans())
def test_verl_gspo(case: Case, clip: tuple[float, float], agg: str, trainer: bool) -> None:
    """verl's ``gspo`` = ``form='token'``, ``log_ratio_cap=10`` (token-level advantages included); its trainer's
    ``global_batch_size`` = B counts empty rows (``empty_rows='count'``)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_gspo

    cfg = verl_config(clip, agg, case.mask, trainer)
    logp = leaf(case.theta)
    loss, metrics = compute_policy_loss_gspo(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=case.mask, loss_agg_mode=agg,
        config=cfg,
    )  # fmt: skip
    rows = "count" if trainer and agg != "token-mean" else "skip"
    out, g = ours(case, {**TOKEN_FORM, **clips(clip), "agg": agg, "objective.empty_rows": rows})
    if not case.mask.any():
        assert float(out.loss.detach()) == 0.0 and (math.isnan(float(loss.detach())) or float(loss.detach()) == 0.0)
        return
    check(out, g, loss, grad(loss, logp), rtol=1e-7)  # verl adds 1e-8 to the row lengths
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)


@settings(max_examples=20, deadline=None)
@given(case=cases(), clip=CLIPS)
def test_verl_gspo_rollout_weights(case: Case, clip: tuple[float, float]) -> None:
    """verl's ``rollout_is_weights`` multiply each token's term: the token form with token weights (``core`` level)."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_gspo

    g = torch.Generator().manual_seed(1)
    w = torch.exp(0.5 * torch.randn(case.mask.shape, dtype=case.theta.dtype, generator=g))
    cfg = verl_config(clip, "seq-mean-token-mean", case.mask, trainer=False)
    logp = leaf(case.theta)
    loss, _ = compute_policy_loss_gspo(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=case.mask,
        loss_agg_mode="seq-mean-token-mean", config=cfg, rollout_is_weights=w,
    )  # fmt: skip
    mine = leaf(case.ours(case.theta))
    out = gspo_loss(
        logp=mine, prox_logp=case.ours(case.prox), advantages=case.ours(case.adv_tok), mask=case.mask,
        weights=case.ours(w), clip_low=clip[0], clip_high=clip[1], form="token", log_ratio_cap=10.0,
    )  # fmt: skip
    if case.mask.any():
        check(out, grad(out.loss, mine), loss, grad(loss, logp), rtol=1e-7)


# ------------------------------------------------------------------------------------------------------ SkyRL
@settings(max_examples=30, deadline=None)
@given(case=cases(), clip=CLIPS, reduction=st.sampled_from(["sequence_mean", "token_mean"]))
def test_skyrl_gspo(case: Case, clip: tuple[float, float], reduction: str) -> None:
    """SkyRL's ``GSPO`` (GSPO-token, cap 10, its native dtype) after its advantage pre-scaling."""
    pytest.importorskip("skyrl", reason="skyrl==0.3.0")
    from skyrl.train.config import AlgorithmConfig

    from tests.parity._parity import skyrl_ppo_utils

    ppo = skyrl_ppo_utils()
    B, T = case.mask.shape
    m = case.mask.to(case.theta.dtype)
    cfg = dataclasses.replace(AlgorithmConfig(), policy_loss_type="gspo", eps_clip_low=clip[0], eps_clip_high=clip[1],
                              loss_reduction=reduction, max_seq_len=T)  # fmt: skip
    scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=case.adv_tok * m, loss_mask=m, loss_reduction=reduction, micro_batch_size=B, max_seq_len=T
    )
    logp = leaf(case.theta)
    loss, metrics = ppo.PolicyLossRegistry.get("gspo")(logp, case.prox, scaled, config=cfg, loss_mask=m,
                                                       rollout_logprobs=None)  # fmt: skip
    agg, rows = ("seq-mean-token-mean", "count") if reduction == "sequence_mean" else ("token-mean", "skip")
    out, g = ours(case, {**TOKEN_FORM, **clips(clip), "agg": agg, "objective.empty_rows": rows})
    check(out, g, loss, grad(loss, logp))
    assert metrics["clip_ratio"] == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)


# --------------------------------------------------------------------------------------------------------- TRL
@settings(max_examples=30, deadline=None)
@given(case=cases(), clip=CLIPS, loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo"]))
def test_trl_sequence_level(case: Case, clip: tuple[float, float], loss_type: str) -> None:
    """TRL's ``importance_sampling_level="sequence"``: the sequence form (token advantages included); its reduction
    as in ``test_ppo`` (grpo counts every row). TRL does not clamp log s: equal for |log s| ≤ 20."""
    pytest.importorskip("trl", reason="trl==1.16.0")
    from tests.parity._parity import trl_loss

    T = case.mask.shape[1]
    logp = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_tok, "old_per_token_logps": case.prox}
    loss, _ = trl_loss(logp, inputs, loss_type=loss_type, importance_sampling_level="sequence", epsilon=clip[0],
                       epsilon_high=clip[1], max_completion_length=T, beta=0.0)  # fmt: skip
    agg, rows = {"grpo": ("seq-mean-token-mean", "count"), "bnpo": ("token-mean", "skip"),
                 "dr_grpo": ("seq-mean-token-sum-norm", "skip")}[loss_type]  # fmt: skip
    out, g = ours(case, {**clips(clip), "agg": agg, "objective.empty_rows": rows})
    check(out, g, loss, grad(loss, logp))


# ---------------------------------------------------------------------------------------------------- OpenRLHF
@pytest.mark.parametrize("seed", range(20))
def test_openrlhf_gspo(seed: int) -> None:
    """OpenRLHF's ``gspo`` (sequence form, per-sample mean over the non-empty rows, or over B given
    ``global_batch_size``), without its optional dual clip (steadyrl's GSPO has none)."""
    pytest.importorskip("openrlhf", reason="openrlhf==0.11.2")
    pytest.importorskip("deepspeed", reason="openrlhf/models/loss.py imports deepspeed")
    from tests.parity._parity import openrlhf_module

    loss_mod = openrlhf_module("openrlhf.models.loss")
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(0 if seed % 3 else 1, T + 1, (1 + seed % 5,), generator=g).tolist()
    case = make_case(seed, lengths, T, log_scale=[1e-3, 0.1, 1.0, 5.0, 20.0][seed % 5])
    clip = [(3e-4, 4e-4), (0.2, 0.27)][seed % 2]
    m = case.mask.to(case.theta.dtype)
    fn = loss_mod.PolicyLoss(clip_eps_low=clip[0], clip_eps_high=clip[1], policy_loss_type="gspo")
    totals = {"global_batch_size": float(m.shape[0])} if seed % 2 else {}
    logp = leaf(case.theta)
    loss, clip_ratio, *_ = fn(logp, case.prox, case.adv_tok, action_mask=m, **totals)
    out, gr = ours(case, {**clips(clip), "objective.empty_rows": "count" if totals else "skip"})
    if not case.mask.any():
        assert float(out.loss.detach()) == 0.0  # OpenRLHF: 0/0 without global_batch_size
        return
    check(out, gr, loss, grad(loss, logp), rtol=1e-7)  # OpenRLHF adds 1e-8 to the row lengths
    assert float(clip_ratio) == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)


# ------------------------------------------------------------------------------------------------------- AReaL
@settings(max_examples=30, deadline=None)
@given(case=cases(), clip=CLIPS)
def test_areal_sequence_level(case: Case, clip: tuple[float, float]) -> None:
    """AReaL averages the token advantages per sequence, then the sequence form with a token mean: steadyrl on
    ``given`` [B] advantages equal to those row means."""
    pytest.importorskip("areal", reason="areal==1.0.4")
    from areal.utils.functional.functional import ppo_actor_loss_fn

    logp = leaf(case.theta)
    loss, stat = ppo_actor_loss_fn(
        logprobs=logp, proximal_logprobs=case.prox, old_logprobs=case.prox, advantages=case.adv_tok,
        eps_clip=clip[0], eps_clip_higher=clip[1], loss_mask=case.mask, importance_sampling_level="sequence",
    )  # fmt: skip
    row_adv = masked_mean(case.adv_tok, case.mask, dim=-1)
    out, g = ours(case, {**clips(clip), "agg": "token-mean"}, adv=row_adv)
    check(out, g, loss, grad(loss, logp))
    frac = int(stat["clip_mask"].sum()) / max(int(case.mask.sum()), 1)
    assert float(out.metrics["loss/clip_frac"]) == pytest.approx(frac, abs=1e-7)


# ---------------------------------------------------------------------------------- where the two forms differ
@settings(max_examples=30, deadline=None)
@given(case=cases(), clip=CLIPS)
def test_forms_agree_on_sequence_advantages_and_differ_on_token_ones(case: Case, clip: tuple[float, float]) -> None:
    """Same loss always (the value of s_{i,t} is s_i); same gradient when A is constant over each sequence (GRPO's
    broadcast); with token-level A the token form weighs each token by its own A_t, the sequence form by the row's
    mean, so the gradients differ."""
    seq_tok = case.seq_tok()
    seq, g_seq = ours(case, clips(clip), adv=seq_tok)
    tok, g_tok = ours(case, {**clips(clip), "objective.form": "token"}, adv=seq_tok)
    assert_close(tok.loss, seq.loss, rtol=1e-12, atol=1e-12)
    assert_close(g_tok, g_seq, rtol=1e-9, atol=1e-12 * max(1.0, float(g_seq.abs().max())))
    seq_a, g_seq_a = ours(case, clips(clip))
    tok_a, g_tok_a = ours(case, {**clips(clip), "objective.form": "token"})
    assert_close(tok_a.loss, seq_a.loss, rtol=1e-12, atol=1e-12)
    # the row sums of the gradient agree (Σ_t A_t s_i/L_i either way, where unclipped); the tokens do not
    assert_close(g_tok_a.sum(-1), g_seq_a.sum(-1), rtol=1e-9, atol=1e-9 * max(1.0, float(g_seq_a.abs().max())))


def test_log_ratio_cap_differs_only_above_ten() -> None:
    """The ±20 clamp and verl's +10 cap give the same loss and gradient while log s ≤ 10; above it verl's loss
    saturates at e^10 (zero gradient) and steadyrl's default keeps growing up to e^20."""
    case = make_case(3, [4, 4], 4, log_scale=1.0)
    shift = torch.tensor([[0.0], [12.0]], dtype=case.theta.dtype)  # row 1: log s ≈ 12
    case = case._replace(theta=case.theta + shift, adv_tok=-case.adv_tok.abs())  # A < 0: the unclipped branch
    wide = {"objective.clip_low": 0.2, "objective.clip_high": 0.2}
    default, g_default = ours(case, wide)
    capped, g_capped = ours(case, {**wide, "objective.log_ratio_cap": 10.0})
    assert_close(g_capped[0], g_default[0], rtol=1e-12, atol=1e-12)
    assert torch.equal(g_capped[1], torch.zeros_like(g_capped[1])) and bool((g_default[1] != 0).all())
    assert float(default.loss.detach()) > float(capped.loss.detach())
