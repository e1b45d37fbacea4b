"""PPO-clip (``objective.type=ppo_clip``: clip-higher, dual clip) against the frameworks' own loss functions.

verl 0.9.1 ``compute_policy_loss_vanilla`` (its dual clip ``clip_ratio_c`` is always on), SkyRL 0.3.0 ``REGULAR`` /
``DUAL_CLIP`` (after its own advantage pre-scaling for the ``loss_reduction``), OpenRLHF 0.11.2 ``PolicyLoss``
(``policy_loss_type="ppo"``), AReaL 1.0.4 ``ppo_actor_loss_fn`` (no rejection) and TRL 1.16.0
``GRPOTrainer._compute_loss`` (``loss_type`` grpo / bnpo / dr_grpo / dapo, and its ``delta``), each on hypothesis
batches with heavy-tailed token advantages, log-ratios up to ±20, garbage at padding and all-masked rows: same loss,
same gradient w.r.t. log π_θ, same clip fractions. The ``agg`` / ``empty_rows`` / ``norm_len`` that reproduce each
framework's reduction are part of what is checked.
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
from steadyrl.core.objectives.ppo import ppo_clip_loss
from tests.parity._parity import Case, assert_close, batch, cases, grad, leaf, make_case

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations inside TRL's config

CLIPS = st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])


def ours(case: Case, overrides: dict[str, Any], adv: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """``compute_loss`` of PPO-clip on given advantages (token-level by default) and its gradient."""
    logp = leaf(case.ours(case.theta))
    spec = resolve_method("ppo", {"advantage.type": "given", **overrides})
    out = compute_loss(spec, batch(case, logp, case.adv_tok if adv is None else adv))
    return out, grad(out.loss, logp)


def clip_overrides(clip: tuple[float, float], dual: float | None = None) -> dict[str, Any]:
    return {"objective.clip_low": clip[0], "objective.clip_high": clip[1], "objective.dual_clip": dual}


def check(out: Any, g: torch.Tensor, loss: torch.Tensor, g_theirs: torch.Tensor, rtol: float, atol: float) -> None:
    assert_close(out.loss, loss, rtol=rtol, atol=atol)
    assert_close(g, g_theirs, rtol=rtol, atol=rtol * max(1.0, float(g_theirs.abs().max())))


def loss_scale(case: Case) -> float:
    """Σ |A|·r over the trained tokens: a bound on every term of any reduction (for float32 frameworks' atol)."""
    r = torch.exp((case.theta - case.prox).clamp(-20, 20))
    return max(1.0, float((case.adv_tok.abs() * r)[case.mask].sum()))


# ------------------------------------------------------------------------------------------------------- verl
def _verl() -> Any:
    return pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1 (requirements/integrations)")


def verl_config(agg: str, clip: tuple[float, float], c: float, trainer: bool, mask: torch.Tensor, **kw: Any) -> Any:
    _verl()
    from verl.workers.config import ActorConfig, PolicyLossConfig

    cfg = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"), loss_agg_mode=agg, clip_ratio_low=clip[0],
        clip_ratio_high=clip[1], clip_ratio_c=c, **kw,
    )  # fmt: skip
    if trainer:  # what verl's ppo_loss sets for one process: the mini-batch's token count and size, the norm length
        cfg.global_batch_info.update(
            dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0],
            loss_scale_factor=cfg.loss_scale_factor,
        )  # fmt: skip
    return cfg


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@settings(max_examples=30, deadline=None)
@given(case=cases(), agg=st.sampled_from(AGGS), clip=CLIPS, dual=st.sampled_from([3.0, 1.5, None]),
       trainer=st.booleans())  # fmt: skip
def test_verl_vanilla(case: Case, agg: str, clip: tuple[float, float], dual: float | None, trainer: bool) -> None:
    """verl's vanilla loss is ``ppo_clip`` with ``dual_clip = clip_ratio_c`` (off: a c no ratio reaches).

    Reduction: bare ``agg_loss`` (``global_batch_info`` empty) skips empty rows; the trainer's values
    (``global_batch_size`` = B) count them: ``objective.empty_rows='count'``. ``seq-mean-token-sum-norm`` is ours with
    ``norm_len = loss_scale_factor`` when verl gets the trainer's values; bare, verl divides by |N| · T instead.
    """
    B, T = case.mask.shape
    norm_len = T + 3 if trainer else None  # bare agg_loss normalizes by the padded length T
    c = 1e12 if dual is None else dual  # verl always applies its dual clip; 1e12 > e^20 ≥ any ratio here: off
    cfg = verl_config(agg, clip, c, trainer, case.mask, loss_scale_factor=T + 3)
    logp = leaf(case.theta)
    loss, metrics = _verl().compute_policy_loss_vanilla(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=case.mask, loss_agg_mode=agg,
        config=cfg,
    )  # fmt: skip
    rows = "count" if trainer and agg in ("seq-mean-token-mean", "seq-mean-token-sum") else "skip"
    out, g = ours(case, {"agg": agg, "norm_len": norm_len, "objective.empty_rows": rows, **clip_overrides(clip, dual)})
    if not case.mask.any():  # verl divides 0 by 0 (token-mean) where steadyrl returns an exact 0
        assert float(out.loss.detach()) == 0.0 and (math.isnan(float(loss.detach())) or float(loss.detach()) == 0.0)
        return
    n_rows = int(case.mask.any(-1).sum())
    share = B / n_rows if agg == "seq-mean-token-sum-norm" and not trainer else 1.0  # bare verl: |N|·norm_len
    check(out, g, loss / share, grad(loss, logp) / share, rtol=1e-7, atol=1e-9)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)
    if dual is not None:
        assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(float(out.metrics["loss/dual_clip_frac"]), abs=1e-7)


@settings(max_examples=20, deadline=None)
@given(case=cases(), clip=CLIPS)
def test_verl_vanilla_rollout_weights_are_correction_weights(case: Case, clip: tuple[float, float]) -> None:
    """verl's ``rollout_is_weights`` multiply the per-token loss as a correction's weights do (``core`` level)."""
    g = torch.Generator().manual_seed(0)
    w = torch.exp(0.3 * torch.randn(case.mask.shape, dtype=case.theta.dtype, generator=g))
    cfg = verl_config("token-mean", clip, 3.0, True, case.mask)
    logp = leaf(case.theta)
    loss, _ = _verl().compute_policy_loss_vanilla(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=case.mask,
        loss_agg_mode="token-mean", config=cfg, rollout_is_weights=w,
    )  # fmt: skip
    mine = leaf(case.ours(case.theta))
    out = ppo_clip_loss(
        logp=mine, prox_logp=case.ours(case.prox), advantages=case.ours(case.adv_tok), mask=case.mask,
        weights=case.ours(w), clip_low=clip[0], clip_high=clip[1], dual_clip=3.0,
    )  # fmt: skip
    if not case.mask.any():
        return
    check(out, grad(out.loss, mine), loss, grad(loss, logp), rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------------ SkyRL
def _skyrl() -> Any:
    pytest.importorskip("skyrl", reason="skyrl==0.3.0 (requirements/integrations/skyrl.txt)")
    from tests.parity._parity import skyrl_ppo_utils

    return skyrl_ppo_utils()


SKYRL_AGG = {"token_mean": ("token-mean", "skip"), "sequence_mean": ("seq-mean-token-mean", "count"),
             "seq_mean_token_sum_norm": ("seq-mean-token-sum-norm", "skip")}  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(case=cases(), reduction=st.sampled_from(sorted(SKYRL_AGG)), clip=CLIPS, dual=st.sampled_from([None, 3.0]))
def test_skyrl_regular_and_dual_clip(case: Case, reduction: str, clip: tuple[float, float], dual: float | None) -> None:
    """SkyRL's loss: its advantages pre-scaled by ``apply_loss_reduction_to_advantages_minibatch`` (one micro-batch),
    then ``ppo_policy_loss`` summed. ``sequence_mean`` divides by the batch size: ``empty_rows='count'``;
    ``seq_mean_token_sum_norm``: ``norm_len = max_seq_len``. SkyRL exponentiates in float32 (``safe_exp_delta``)."""
    ppo = _skyrl()
    from skyrl.train.config import AlgorithmConfig

    B, T = case.mask.shape
    m = case.mask.to(case.theta.dtype)
    cfg = dataclasses.replace(
        AlgorithmConfig(), policy_loss_type="regular" if dual is None else "dual_clip", eps_clip_low=clip[0],
        eps_clip_high=clip[1], clip_ratio_c=3.0 if dual is None else dual, loss_reduction=reduction, max_seq_len=T + 2,
    )  # fmt: skip
    scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=case.adv_tok * m, loss_mask=m, loss_reduction=reduction, micro_batch_size=B, max_seq_len=T + 2
    )
    logp = leaf(case.theta)
    loss, metrics = ppo.PolicyLossRegistry.get(cfg.policy_loss_type)(
        logp, case.prox, scaled, config=cfg, loss_mask=m, rollout_logprobs=None
    )
    agg, rows = SKYRL_AGG[reduction]
    out, g = ours(case, {"agg": agg, "norm_len": T + 2, "objective.empty_rows": rows, **clip_overrides(clip, dual)})
    check(out, g, loss, grad(loss, logp), rtol=1e-6, atol=1e-6 * loss_scale(case))
    assert metrics["clip_ratio"] == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)


# ---------------------------------------------------------------------------------------------------- OpenRLHF
@pytest.fixture(scope="module")
def openrlhf_loss() -> Any:
    pytest.importorskip("openrlhf", reason="openrlhf==0.11.2 (requirements/integrations/openrlhf.txt)")
    pytest.importorskip("deepspeed", reason="openrlhf/models/loss.py imports deepspeed")
    from tests.parity._parity import openrlhf_module

    return openrlhf_module("openrlhf.models.loss")


@pytest.mark.parametrize("seed", range(25))
def test_openrlhf_policy_loss(openrlhf_loss: Any, seed: int) -> None:
    """``PolicyLoss(policy_loss_type="ppo")``: token-level → ``token-mean``; ``token_level_loss=False`` →
    ``seq-mean-token-mean`` (skipping empty rows, or counting them when given ``global_batch_size = B``)."""
    g = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(0, T + 1, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    case = make_case(seed, lengths, T, log_scale=[1e-3, 0.1, 1.0, 5.0, 20.0][seed % 5])
    clip, dual = [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)][seed % 3], [None, 3.0][seed % 2]
    token_level, given_size = seed % 4 < 2, seed % 2 == 0
    fn = openrlhf_loss.PolicyLoss(clip_eps_low=clip[0], clip_eps_high=clip[1], dual_clip=dual,
                                  token_level_loss=token_level, policy_loss_type="ppo")  # fmt: skip
    m = case.mask.to(case.theta.dtype)
    norm = {"batch_num_tokens": float(m.sum())} if token_level else {"global_batch_size": float(m.shape[0])}
    logp = leaf(case.theta)
    loss, clip_ratio, *_ = fn(logp, case.prox, case.adv_tok, action_mask=m, **(norm if given_size else {}))
    agg = "token-mean" if token_level else "seq-mean-token-mean"
    rows = "count" if not token_level and given_size else "skip"
    out, gr = ours(case, {"agg": agg, "objective.empty_rows": rows, **clip_overrides(clip, dual)})
    if not case.mask.any():  # OpenRLHF's masked mean divides 0 by 0
        assert float(out.loss.detach()) == 0.0
        return
    check(out, gr, loss, grad(loss, logp), rtol=1e-7, atol=1e-9)
    assert float(clip_ratio) == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)


# ------------------------------------------------------------------------------------------------------- AReaL
@settings(max_examples=30, deadline=None)
@given(case=cases(), clip=CLIPS, dual=st.sampled_from([None, 3.0]))
def test_areal_ppo_actor_loss(case: Case, clip: tuple[float, float], dual: float | None) -> None:
    """``ppo_actor_loss_fn`` without rejection: a token mean over the loss mask; its c_clip is the dual clip."""
    pytest.importorskip("areal", reason="areal==1.0.4 (requirements/integrations)")
    from areal.utils.functional.functional import ppo_actor_loss_fn

    logp = leaf(case.theta)
    loss, stat = ppo_actor_loss_fn(
        logprobs=logp, proximal_logprobs=case.prox, old_logprobs=case.prox, advantages=case.adv_tok,
        eps_clip=clip[0], eps_clip_higher=clip[1], c_clip=dual, loss_mask=case.mask,
    )  # fmt: skip
    out, g = ours(case, {"agg": "token-mean", **clip_overrides(clip, dual)})
    check(out, g, loss, grad(loss, logp), rtol=1e-9, atol=1e-9)
    n = max(int(case.mask.sum()), 1)
    assert float(out.metrics["loss/clip_frac"]) == pytest.approx(int(stat["clip_mask"].sum()) / n, abs=1e-7)
    if dual is not None:
        assert float(out.metrics["loss/dual_clip_frac"]) == pytest.approx(int(stat["dual_clip_mask"].sum()) / n)


# --------------------------------------------------------------------------------------------------------- TRL
TRL_AGG = {"grpo": ("seq-mean-token-mean", "count"), "bnpo": ("token-mean", "skip"),
           "dr_grpo": ("seq-mean-token-sum-norm", "skip"), "dapo": ("token-mean", "skip")}  # fmt: skip


@pytest.fixture(scope="module")
def trl_available() -> None:
    pytest.importorskip("trl", reason="trl==1.16.0 (requirements.lock)")


@settings(max_examples=30, deadline=None)
@given(case=cases(), loss_type=st.sampled_from(sorted(TRL_AGG)), clip=CLIPS,
       delta=st.sampled_from([None, 2.0, 5.0]))  # fmt: skip
def test_trl_loss_types(
    trl_available: None, case: Case, loss_type: str, clip: tuple[float, float], delta: float | None
) -> None:
    """TRL's GRPO losses on token advantages: grpo = ``seq-mean-token-mean`` over all B rows (``empty_rows='count'``),
    bnpo / dapo (one micro-batch) = ``token-mean``, dr_grpo = ``seq-mean-token-sum-norm`` with
    ``norm_len = max_completion_length``. TRL's ``delta`` (an upper bound on the unclipped ratio, INTELLECT-2) is
    ``dual_clip = delta`` (delta ≥ 1 + ε_high). TRL does not clamp the log-ratio: equal within ±20."""
    from tests.parity._parity import trl_loss

    T = case.mask.shape[1]
    logp = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_tok, "old_per_token_logps": case.prox,
              "num_items_in_batch": case.mask.sum()}  # fmt: skip
    loss, logged = trl_loss(logp, inputs, loss_type=loss_type, epsilon=clip[0], epsilon_high=clip[1], delta=delta,
                            max_completion_length=T + 4, beta=0.0)  # fmt: skip
    agg, rows = TRL_AGG[loss_type]
    out, g = ours(case, {"agg": agg, "norm_len": T + 4, "objective.empty_rows": rows, **clip_overrides(clip, delta)})
    check(out, g, loss, grad(loss, logp), rtol=1e-9, atol=1e-9)
    if delta is None and T > 1:  # TRL's metric helper reads a [B, 1] tensor as per-sequence and ignores the mask
        assert logged["clip_ratio/region_mean"][-1] == pytest.approx(float(out.metrics["loss/clip_frac"]), abs=1e-7)


def test_trl_sequence_advantages_broadcast(trl_available: None) -> None:
    """TRL's [B] advantages (its own shape) against ``given`` sequence advantages, on a batch with an empty row."""
    from tests.parity._parity import trl_loss

    case = make_case(7, [5, 0, 3, 1], 5, log_scale=1.0)
    logp = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_seq, "old_per_token_logps": case.prox}
    loss, _ = trl_loss(logp, inputs, loss_type="grpo", epsilon=0.2, epsilon_high=0.28, beta=0.0)
    out, g = ours(case, {"agg": "seq-mean-token-mean", "objective.empty_rows": "count",
                         **clip_overrides((0.2, 0.28))}, adv=case.adv_seq)  # fmt: skip
    check(out, g, loss, grad(loss, logp), rtol=1e-9, atol=1e-9)
    skipped, _ = ours(case, {"agg": "seq-mean-token-mean", **clip_overrides((0.2, 0.28))}, adv=case.adv_seq)
    # the default divides by the 3 non-empty rows
    assert float(skipped.loss.detach()) == pytest.approx(float(loss.detach()) * 4 / 3, rel=1e-9)
