"""``compute_loss``: run the loss-level part of any method on a batch, calling ``steadyrl.core`` step by step.

The pipeline, in the order it runs (docs/algorithms.md, "Two policies or three"):

1. **Policies.** ``behav_logp`` = log μ; ``prox_logp`` = log π_prox, the recomputed proximal policy, or ``logp``
   detached when not given (one update per batch: VCPO's setting); in ``policy="bypass"`` π_prox := μ (verl).
   ℓ = log π_prox − log μ is the behavior-correction log-ratio, detached (under bypass ℓ ≡ 0, unless
   ``bypass_ratio="current"`` hands the corrections log π_θ − log μ, detached, as verl's bypass mode does).
2. **Rewards.** Outcome rewards [B] (or token rewards [B,T]); ``kl.type="in_reward"`` subtracts β·k_t per token.
3. **Advantages.** GRPO / Dr.GRPO (optionally on length-corrected rewards R_i/L_i, TIC-GRPO), OPOB, OTB, COPC TD,
   VACO (GRPO re-aligned with a one-step V-trace target on ℓ), or given; sequence advantages are broadcast to tokens.
4. **Corrections**, in the method's order: each returns detached token weights and a mask; weights multiply, masks
   intersect. Their ``is/...`` metrics are renamed ``<correction>/...`` so they never shadow the diagnostics.
5. **Objective** on the surviving tokens, aggregated with the method's ``agg`` mode (``denominator="input"``: the
   counts from the input mask, rejected tokens included). GMC-GRPO computes its own
   sequence weights and OAPL has no importance ratio: with them, corrections act through their masks only (their
   weights are not applied). TIC-GRPO takes one weight per sequence (the masked mean of the correction weights)
   on top of its own trajectory ratio to μ.
6. **KL in the loss** (optional), the **entropy bonus** −c·agg(H) (optional: ``entropy.coef`` ≠ 0 or the
   ``adaptive_entropy`` controller; H is the batch's ``entropy``, c the batch's ``entropy_coef`` when given, else
   ``entropy.coef``), then the **diagnostics** every run logs (ESS, weights, mismatch KL, lag) measured on π_prox (or
   π_θ detached) against μ, and the inputs of the method's controllers (``vcpo/ess_ratio``,
   ``entropy/token_sum``).

Each step dispatches through a table keyed by the spec class (``ADVANTAGES``, ``CORRECTIONS``, ``OBJECTIVES``): a new
method is a core function, a spec class and one table entry; ``tests/methods/test_dispatch.py`` checks that every
member of the spec unions has its entry. Everything stays on the device; no host syncs, except the one read of the
input checks that ``validate=True`` (the default of a direct call) adds. A batch with no trainable token gives an
exact-zero loss with zero gradients and ``loss/all_masked = 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor

from steadyrl.core import importance_weights as weights
from steadyrl.core import kl as core_kl
from steadyrl.core import prob_diff, proximal, rejection, segments
from steadyrl.core.advantages import brace, grpo, opob, otb, reinforce_pp, rloo, vaco, vtrace
from steadyrl.core.diagnostics import staleness_diagnostics
from steadyrl.core.entropy import entropy_bonus
from steadyrl.core.ess import sequence_ess, weights_ess
from steadyrl.core.masking import (
    AggMode,
    EmptyRows,
    aggregate,
    all_masked_flag,
    as_bool_mask,
    broadcast_seq,
    lengths,
    masked_mean,
    safe_exp,
    seq_log_ratio,
    where_masked,
)
from steadyrl.core.objectives import (
    bapo,
    cispo,
    cov_penalty,
    dppo,
    dro,
    filters,
    gmc_grpo,
    gmpo,
    ipo,
    m2po,
    oapl,
    pnpo,
    ppo,
    sapo,
    score_centering,
    tic_grpo,
    topr,
    vespo,
)
from steadyrl.core.types import Corrected, LossOutput, Metrics
from steadyrl.methods import spec as S
from steadyrl.methods.batch import LossBatch
from steadyrl.methods.resolve import required_inputs, resolve_method


class _Rewards(NamedTuple):
    seq: Tensor | None  # [B] return of each response
    token: Tensor | None  # [B,T] reward at each token (outcome reward on the last trained token), when asked for
    metrics: Metrics


def _rewards(method: S.MethodSpec, b: LossBatch, logp: Tensor, mask: Tensor, *, tokens: bool = False) -> _Rewards:
    """Sequence and token rewards after an optional KL-in-reward penalty.

    Outcome rewards are placed on the last token only when ``tokens`` asks for them (token rewards are otherwise
    None, unless the batch or the KL penalty makes them anyway).
    """
    if b.rewards is None:
        return _Rewards(None, None, {})
    token_in = b.rewards if b.rewards.dim() == 2 else None
    seq_in = b.rewards if b.rewards.dim() == 1 else None
    if isinstance(method.kl, S.KLInReward):
        assert b.ref_logp is not None
        out = core_kl.kl_in_reward(
            logp=logp, ref_logp=b.ref_logp, mask=mask, rewards=seq_in, token_rewards=token_in,
            beta=method.kl.beta, kind=method.kl.kind, value_clamp=method.kl.value_clamp,
        )  # fmt: skip
        return _Rewards(out.returns, out.token_rewards, out.metrics)
    if token_in is not None:
        return _Rewards(where_masked(token_in, mask).sum(-1), token_in, {})
    if not tokens:
        return _Rewards(seq_in, None, {})
    last = core_kl.last_token_mask(mask)  # outcome reward on the last trained token
    return _Rewards(seq_in, where_masked(broadcast_seq(seq_in, logp), last), {})


def _return_to_go(token_rewards: Tensor, mask: Tensor) -> Tensor:
    """G_t = Σ_{k≥t} m_k r_k (undiscounted), 0 outside the mask."""
    r = where_masked(token_rewards, mask)
    return where_masked(r.flip(-1).cumsum(-1).flip(-1), mask)


class AdvantageInputs(NamedTuple):
    """What an advantage estimator of ``compute_loss`` reads: the batch, the policies and the rewards."""

    b: LossBatch
    prox: Tensor  # log π_prox used by the objective (μ under bypass)
    ell: Tensor  # ℓ = log π_prox − log μ
    logp: Tensor
    behav: Tensor
    mask: Tensor
    rewards: _Rewards


Advantages = tuple[Tensor, Tensor | None, Metrics]  # (token advantages [B,T], sequence advantages [B] or None, metrics)


def _from_seq(a: Tensor, x: AdvantageInputs, metrics: Metrics) -> Advantages:
    """Sequence advantages [B], broadcast to the tokens, with the reward metrics."""
    return grpo.token_advantages(advantages=a, mask=x.mask), a, {**x.rewards.metrics, **metrics}


def _given(adv: S.GivenAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.b.advantages is not None
    a = x.b.advantages.detach()
    if a.dim() == 1:
        return grpo.token_advantages(advantages=a, mask=x.mask), a, {}
    return where_masked(a, x.mask), None, {}


def _grpo(adv: S.GrpoAdvantage, x: AdvantageInputs) -> Advantages:
    seq_r = x.rewards.seq
    assert seq_r is not None and x.b.group_ids is not None
    r = grpo.length_corrected_rewards(rewards=seq_r, mask=x.mask) if adv.length_corrected else seq_r
    out = grpo.grpo_advantages(
        rewards=r, group_ids=x.b.group_ids, scale=adv.scale, eps=adv.eps, unbiased=adv.unbiased,
        batch_std=adv.batch_std, singleton=adv.singleton,
    )  # fmt: skip
    return _from_seq(out.advantages, x, out.metrics)


def _opob(adv: S.OpobAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.rewards.seq is not None and x.b.group_ids is not None and x.b.grad_sq_norms is not None
    out = opob.opob_advantages(
        rewards=x.rewards.seq, group_ids=x.b.group_ids, log_weights=seq_log_ratio(x.ell, x.mask),
        grad_sq_norms=x.b.grad_sq_norms.detach(), weighting=adv.weighting, scope=adv.scope,
        aggregation=adv.aggregation, length_normalize=adv.length_normalize, lengths=lengths(x.mask),
        clip=adv.clip, tis_cap=adv.tis_cap,
    )  # fmt: skip
    return _from_seq(out.advantages, x, out.metrics)


def _vaco(adv: S.VacoAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.rewards.seq is not None and x.b.group_ids is not None
    out = vaco.vaco_advantages(
        rewards=x.rewards.seq, group_ids=x.b.group_ids, log_ratio=x.ell, mask=x.mask, rho_bar=adv.rho_bar,
        ratio=adv.ratio, scale=adv.scale, eps=adv.eps, unbiased=adv.unbiased,
    )  # fmt: skip
    return _from_seq(out.advantages, x, out.metrics)


def _otb(adv: S.OtbAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.rewards.token is not None and x.b.group_ids is not None and x.b.sum_p2 is not None
    out = otb.otb_advantages(
        returns=_return_to_go(x.rewards.token, x.mask), token_logp=x.prox, sum_p2=x.b.sum_p2.detach(),
        mask=x.mask, group_ids=x.b.group_ids, token_weights=safe_exp(x.ell) if adv.importance_weighted else None,
        eps=adv.eps, alignment=adv.alignment, zero_lone_baseline=adv.zero_lone_baseline,
    )  # fmt: skip
    return out.advantages, None, {**x.rewards.metrics, **out.metrics}


def _copc_adv(adv: S.CopcAdvantage, x: AdvantageInputs) -> Advantages:
    out = _copc(adv, x.b, token_rewards=x.rewards.token, logp=x.logp, behav=x.behav, mask=x.mask)
    return out.advantages, None, {**x.rewards.metrics, **out.metrics}


def _rloo(adv: S.RlooAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.rewards.seq is not None and x.b.group_ids is not None
    out = rloo.rloo_advantages(rewards=x.rewards.seq, group_ids=x.b.group_ids, singleton=adv.singleton)
    return _from_seq(out.advantages, x, out.metrics)


def _reinforce_pp(adv: S.ReinforcePPAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.rewards.token is not None
    out = reinforce_pp.reinforce_pp_advantages(token_rewards=x.rewards.token, mask=x.mask, gamma=adv.gamma)
    return out.advantages, None, {**x.rewards.metrics, **out.metrics}


def _reinforce_pp_baseline(adv: S.ReinforcePPBaselineAdvantage, x: AdvantageInputs) -> Advantages:
    assert x.rewards.seq is not None and x.b.group_ids is not None
    out = reinforce_pp.reinforce_pp_baseline_advantages(rewards=x.rewards.seq, group_ids=x.b.group_ids, mask=x.mask)
    return out.advantages, None, {**x.rewards.metrics, **out.metrics}


def _brace_adv(adv: S.BraceAdvantage, x: AdvantageInputs) -> Advantages:
    out = _brace(adv, x.b, rewards=x.rewards, ell=x.ell, mask=x.mask)
    return out.advantages, None, {**x.rewards.metrics, **out.metrics}


#: One estimator per advantage spec (``tests/methods/test_dispatch.py`` checks the table covers the union).
ADVANTAGES: dict[type, Callable[[Any, AdvantageInputs], Advantages]] = {
    S.GivenAdvantage: _given,
    S.GrpoAdvantage: _grpo,
    S.OpobAdvantage: _opob,
    S.VacoAdvantage: _vaco,
    S.OtbAdvantage: _otb,
    S.CopcAdvantage: _copc_adv,
    S.RlooAdvantage: _rloo,
    S.ReinforcePPAdvantage: _reinforce_pp,
    S.ReinforcePPBaselineAdvantage: _reinforce_pp_baseline,
    S.BraceAdvantage: _brace_adv,
}
#: Estimators that need outcome rewards placed on the last token (token rewards).
_TOKEN_REWARDS = (S.CopcAdvantage, S.OtbAdvantage, S.ReinforcePPAdvantage, S.BraceAdvantage)


def _advantages(
    method: S.MethodSpec, b: LossBatch, *, logp: Tensor, prox: Tensor, behav: Tensor, ell: Tensor, mask: Tensor
) -> Advantages:
    """(token advantages [B,T], sequence advantages [B] or None, metrics) of the method's estimator."""
    adv = method.advantage
    rw = _rewards(method, b, logp, mask, tokens=isinstance(adv, _TOKEN_REWARDS))
    return ADVANTAGES[type(adv)](adv, AdvantageInputs(b, prox, ell, logp, behav, mask, rw))


def _copc(
    adv: S.CopcAdvantage, b: LossBatch, *, token_rewards: Tensor | None, logp: Tensor, behav: Tensor, mask: Tensor
) -> vtrace.CopcAdvantages:
    """COPC advantages and value targets from the batch's ``values`` and log ρ = log π_θ (detached) − log μ."""
    assert b.values is not None and token_rewards is not None
    return vtrace.copc_advantages(
        rewards=token_rewards, values=b.values.detach(), log_rhos=logp.detach() - behav, mask=mask,
        gamma=adv.gamma, lam=adv.lam, rho_min=adv.rho_min, rho_max=adv.rho_max,
    )  # fmt: skip


def copc_value_targets(method: str | S.MethodSpec, batch: LossBatch | Mapping[str, Any]) -> Tensor:
    """COPC's value targets V(s_t) + Â_t [B,T] for a critic (arXiv 2610.09597) [reconstructed], detached, 0 off-mask.

    The same computation :func:`compute_loss` runs for the advantages of ``advantage.type=copc`` (token rewards with
    the outcome reward on the last trained token, after any KL-in-reward penalty; the batch's ``values``; log ρ of
    π_θ against μ), returning ``copc_advantages(...).returns`` instead of the advantages. ``method``: a preset name,
    composition or resolved spec whose advantage is ``copc``; ``batch`` as for :func:`compute_loss`.
    """
    spec = resolve_method(method) if isinstance(method, str) else method
    adv = spec.advantage
    if not isinstance(adv, S.CopcAdvantage):
        raise ValueError(f"method {spec.name!r} has advantage.type={adv.type!r}; value targets need 'copc'")
    b = LossBatch.from_any(batch)
    b.require(required_inputs(spec), spec.name)
    mask = as_bool_mask(b.mask)
    rw = _rewards(spec, b, b.logp, mask, tokens=True)
    return _copc(adv, b, token_rewards=rw.token, logp=b.logp, behav=b.behav_logp.detach(), mask=mask).returns


def _brace(
    adv: S.BraceAdvantage, b: LossBatch, *, rewards: _Rewards, ell: Tensor, mask: Tensor
) -> brace.BraceOutput:
    """BRACE from the batch's ``values`` and log w = ℓ = log π_prox − log μ (arXiv 2609.09783).

    The outcome reward is BRACE's terminal R and the in-response rewards r_t are what else the token rewards carry
    (a KL-in-reward penalty; 0 otherwise); token rewards given by the batch are all in-response (R = 0).
    """
    assert b.values is not None and rewards.token is not None and b.rewards is not None
    if b.rewards.dim() == 1:
        R = b.rewards.detach()
        r = rewards.token - where_masked(broadcast_seq(R, rewards.token), core_kl.last_token_mask(mask))
    else:
        R, r = torch.zeros_like(b.rewards[:, 0]), rewards.token
    return brace.brace_advantages(
        rewards=r, returns=R, values=b.values.detach(), log_ratio=ell, mask=mask, k=adv.k, rho_bar=adv.rho_bar,
        c_bar=adv.c_bar, gamma=adv.gamma, lam=adv.lam, whiten=adv.whiten,
    )  # fmt: skip


def brace_value_targets(method: str | S.MethodSpec, batch: LossBatch | Mapping[str, Any]) -> Tensor:
    """BRACE's critic targets V_targ(s) [B,T] (arXiv 2609.09783, §3), detached, 0 off-mask.

    The same computation :func:`compute_loss` runs for ``advantage.type=brace`` (the batch's ``values``; w from
    π_prox, or π_θ detached when π_prox is not recomputed, against μ), returning the targets instead of the
    advantages.
    """
    spec = resolve_method(method) if isinstance(method, str) else method
    adv = spec.advantage
    if not isinstance(adv, S.BraceAdvantage):
        raise ValueError(f"method {spec.name!r} has advantage.type={adv.type!r}; BRACE targets need 'brace'")
    b = LossBatch.from_any(batch)
    b.require(required_inputs(spec), spec.name)
    mask = as_bool_mask(b.mask)
    prox = b.prox_logp.detach() if b.prox_logp is not None else b.logp.detach()
    behav = b.behav_logp.detach()
    ell = where_masked((behav if spec.policy == "bypass" else prox) - behav, mask)
    rw = _rewards(spec, b, b.logp, mask, tokens=True)
    return _brace(adv, b, rewards=rw, ell=ell, mask=mask).targets


class Step(NamedTuple):
    """What a correction or an objective of ``compute_loss`` may read (the dispatch tables' one argument besides the
    spec). All log-probs are [B,T]; only ``logp`` carries the gradient."""

    method: S.MethodSpec
    b: LossBatch
    logp: Tensor  # log π_θ (with gradient)
    prox: Tensor  # log π_prox used by the objective: measured, or μ under policy=bypass
    measured: Tensor  # log π_prox as recomputed (or π_θ detached), also under bypass
    behav: Tensor  # log μ
    ell: Tensor  # ℓ = log π_prox − log μ, 0 off the input mask
    adv_tok: Tensor  # [B,T] token advantages
    adv_seq: Tensor | None  # [B] sequence advantages when the estimator gives them
    mask: Tensor  # the current mask (after the corrections applied so far)
    w: Tensor | None = None  # product of the correction weights (objectives only); None while all ones
    seq_rewards: Tensor | None = None  # [B] returns (OAPL only)
    mask_in: Tensor | None = None  # the input mask, before any correction (denominator='input' counts on it)

    @property
    def norm_len(self) -> float | None:
        return None if self.method.norm_len is None else float(self.method.norm_len)  # core annotates a float

    @property
    def seq_adv(self) -> Tensor:
        """[B] sequence advantages: the estimator's, or the masked mean of the token advantages."""
        return self.adv_seq if self.adv_seq is not None else masked_mean(self.adv_tok, self.mask, dim=-1)

    @property
    def token_loss_args(self) -> dict[str, Any]:
        """The keyword arguments every token-level objective of ``core.objectives`` shares."""
        args = {"logp": self.logp, "prox_logp": self.prox, "mask": self.mask, "agg": self.method.agg,
                "norm_len": self.norm_len}  # fmt: skip
        if self.method.denominator == "input":  # rejected tokens stay in the denominators (spec.MethodSpec)
            args["count_mask"] = self.mask_in
        return args


# ------------------------------------------------------------------------------------------------- corrections
# One entry per correction spec: (spec, step) → Corrected. ``tests/methods/test_dispatch.py`` checks that every
# member of ``spec.CorrectionSpec`` has one.
def _mis(fn: Callable[..., Corrected]) -> Callable[[Any, Step], Corrected]:
    def run(c: Any, x: Step) -> Corrected:
        res = fn(log_ratio=x.ell, mask=x.mask, lower=c.lower, upper=c.upper, weight=c.weight)
        if c.rejected == "drop":
            return res
        # rejected="zero": the rejected tokens keep their place in the mask (and the denominators) with weight 0
        return Corrected(where_masked(res.weights, res.mask), x.mask, res.metrics, unit_weights=False)

    return run


def _m2po_mask(c: S.M2POMask, x: Step) -> Corrected:
    return m2po.m2po_mask(  # δ = log μ − log π_prox (measured, also under bypass)
        log_ratio=x.behav - x.measured, mask=x.mask, tau=c.tau, harmful_only=c.harmful_only, advantages=x.adv_tok,
        budget_over=c.budget_over,
    )


def _estr(c: S.ESTRMask, x: Step) -> Corrected:
    assert x.b.behav_entropy is not None
    kw = {} if c.tau is None else {"tau": c.tau}
    return filters.estr_mask(
        logp=x.logp, behav_logp=x.behav, behav_entropy=x.b.behav_entropy, mask=x.mask, eps=c.eps, **kw
    )


CORRECTIONS: dict[type, Callable[[Any, Step], Corrected]] = {
    S.TokenTIS: lambda c, x: weights.token_tis(
        log_ratio=x.ell, mask=x.mask, cap=c.cap, floor=c.floor, renormalize=c.renormalize
    ),
    S.SeqTIS: lambda c, x: weights.seq_tis(
        log_ratio=x.ell, mask=x.mask, cap=c.cap, floor=c.floor, ratio=c.ratio, renormalize=c.renormalize
    ),
    S.TokenMIS: _mis(weights.token_mis),
    S.SeqMIS: _mis(weights.seq_mis),
    S.GeoMIS: _mis(weights.geo_mis),
    S.IcePop: _mis(weights.icepop),
    S.TokenVeto: lambda c, x: weights.token_veto(log_ratio=x.ell, mask=x.mask, threshold=c.threshold, weight=c.weight),
    S.Rejection: lambda c, x: rejection.divergence_rejection(
        log_ratio=x.ell, mask=x.mask, metric=c.metric, level=c.level, seq_agg=c.seq_agg, lower=c.lower, upper=c.upper,
        ratio_bounds=c.ratio_bounds, convention=c.convention, weight=c.weight, behav_logp=x.behav,
    ),
    S.OPSM: lambda c, x: rejection.opsm(
        logp=x.logp, behav_logp=x.behav, advantages=x.seq_adv, mask=x.mask, delta=c.delta
    ),
    S.PrefixRatio: lambda c, x: weights.prefix_ratio(log_ratio=x.ell, mask=x.mask, cap=c.cap),
    S.M2POMask: _m2po_mask,
    S.VacoFilter: lambda c, x: filters.vaco_filter(
        logp=x.logp, behav_logp=x.behav, advantages=x.adv_tok, mask=x.mask, group_ids=x.b.group_ids, delta=c.delta,
        rule=c.rule,
    ),
    S.CopcMask: lambda c, x: filters.copc_actor_mask(
        logp=x.logp, behav_logp=x.behav, mask=x.mask, c_low=c.c_low, c_high=c.c_high
    ),
    S.ESTRMask: _estr,
    S.SeqLogprobError: lambda c, x: rejection.seq_logprob_error_mask(
        log_ratio=x.ell, mask=x.mask, threshold=c.threshold
    ),
    S.SegmentTIS: lambda c, x: segments.segment_tis(log_ratio=x.ell, mask=x.mask, cap=c.cap),
    S.ProbDiffFilter: lambda c, x: prob_diff.prob_diff_filter(  # π_prox: the one ℓ measures (π_θ under bypass=current)
        prox_logp=x.behav + x.ell, behav_logp=x.behav, mask=x.mask, level=c.level, lower=c.lower, upper=c.upper
    ),
}


# -------------------------------------------------------------------------------------------------- objectives
# One entry per objective spec: (spec, step) → LossOutput, on the mask the corrections left and their weight w.
def _m2po_clip(obj: S.M2POClip, x: Step) -> LossOutput:
    rng = m2po.m2po_clip_range(
        log_ratio=x.behav - x.measured, mask=x.mask, advantages=x.adv_tok, tau=obj.tau,
        floor_low=obj.floor_low, floor_high=obj.floor_high,
    )  # fmt: skip
    out = ppo.ppo_clip_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, clip_low=rng.clip_low, clip_high=rng.clip_high
    )
    return LossOutput(out.loss, {**out.metrics, **rng.metrics})


def _tic_grpo(obj: S.TICGRPO, x: Step) -> LossOutput:
    # Sequence weight of the corrections: their masked mean (exact for sequence-level corrections).
    w_seq = None if x.w is None else masked_mean(x.w, x.mask, dim=-1)
    return tic_grpo.tic_grpo_loss(
        logp=x.logp, behav_logp=x.behav if obj.ratio_to == "behavior" else x.prox, advantages=x.seq_adv,
        mask=x.mask, weights=w_seq, clip_eps=obj.eps, upper_only=obj.upper_only,
    )  # fmt: skip


def _oapl(obj: S.OAPL, x: Step) -> LossOutput:
    assert x.seq_rewards is not None and x.b.group_ids is not None
    return oapl.oapl_loss(
        logp=x.logp, behav_logp=x.behav, rewards=x.seq_rewards, group_ids=x.b.group_ids, mask=x.mask,
        beta1=obj.beta1, beta2=obj.beta2,
    )  # fmt: skip



def _dppo(obj: S.DPPOTV | S.DPPOKL, x: Step) -> LossOutput:
    return dppo.dppo_loss(  # the anchor is π_prox: μ under policy=bypass (the dppo presets)
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, divergence=obj.DIVERGENCE, delta_low=obj.delta_low,
        delta_high=obj.delta_high, trunc=obj.trunc, surrogate=obj.surrogate, sq_log_ratio_coef=obj.sq_log_ratio_coef,
    )


def _score_centering(obj: S.ScoreCentering, x: Step) -> LossOutput:
    assert x.b.centering is not None
    return score_centering.score_centering_loss(
        logp=x.logp, behav_logp=x.behav, centering=x.b.centering, advantages=x.adv_tok, mask=x.mask,
        weight=obj.weight, agg=x.method.agg, norm_len=x.norm_len, weights=x.w,
    )  # fmt: skip


OBJECTIVES: dict[type, Callable[[Any, Step], LossOutput]] = {
    S.PPOClip: lambda obj, x: ppo.ppo_clip_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, clip_low=obj.clip_low, clip_high=obj.clip_high,
        dual_clip=obj.dual_clip, empty_rows=obj.empty_rows,
    ),
    S.Reinforce: lambda obj, x: ppo.reinforce_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, surrogate=obj.surrogate
    ),
    S.GSPO: lambda obj, x: ppo.gspo_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, clip_low=obj.clip_low, clip_high=obj.clip_high,
        form=obj.form, log_ratio_cap=obj.log_ratio_cap, empty_rows=obj.empty_rows,
    ),
    S.M2POClip: _m2po_clip,
    S.PNPO: lambda obj, x: pnpo.pnpo_loss(
        logp=x.logp, behav_logp=x.behav, advantages=x.adv_tok, mask=x.mask, weights=x.w, delta=obj.delta,
        agg=x.method.agg, norm_len=x.norm_len,
    ),
    S.TICGRPO: _tic_grpo,
    S.GMCGRPO: lambda obj, x: gmc_grpo.gmc_grpo_loss(
        logp=x.logp, prox_logp=x.prox, behav_logp=x.behav, advantages=x.seq_adv, mask=x.mask,
        group_ids=x.b.group_ids, eps=obj.eps, cap=obj.cap, agg=x.method.agg, norm_len=x.norm_len,
    ),
    S.OAPL: _oapl,
    S.VESPO: lambda obj, x: vespo.vespo_loss(
        logp=x.logp, ratio_logp=x.behav if obj.ratio_to == "behavior" else x.prox, advantages=x.seq_adv,
        mask=x.mask, weights=x.w, k_pos=obj.k_pos, lambda_pos=obj.lambda_pos, k_neg=obj.k_neg,
        lambda_neg=obj.lambda_neg, agg=x.method.agg, norm_len=x.norm_len,
    ),
    S.CISPO: lambda obj, x: cispo.cispo_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, clip_low=obj.clip_low, clip_high=obj.clip_high
    ),
    S.SAPO: lambda obj, x: sapo.sapo_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, tau_pos=obj.tau_pos, tau_neg=obj.tau_neg,
        empty_rows=obj.empty_rows,
    ),
    S.GMPO: lambda obj, x: gmpo.gmpo_loss(
        **x.token_loss_args, advantages=x.seq_adv, weights=x.w, clip_low=obj.clip_low, clip_high=obj.clip_high,
        empty_rows=obj.empty_rows,
    ),
    S.TOPR: lambda obj, x: topr.topr_loss(
        logp=x.logp, behav_logp=x.behav, advantages=x.seq_adv, mask=x.mask, weights=x.w, agg=x.method.agg,
        norm_len=x.norm_len, value=obj.value,
    ),
    S.ScoreCentering: _score_centering,
    S.DPPOTV: _dppo,
    S.DPPOKL: _dppo,
    S.ClipCov: lambda obj, x: cov_penalty.clip_cov_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, clip_low=obj.clip_low, clip_high=obj.clip_high,
        frac=obj.frac, cov_lb=obj.cov_lb, cov_ub=obj.cov_ub,
        generator=cov_penalty.selection_generator(obj.seed, x.b.learner_version, x.logp.device),
    ),
    S.IPO: lambda obj, x: ipo.ipo_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, epsilon=obj.epsilon, kl_coef=obj.kl_coef
    ),
    S.DRO: lambda obj, x: dro.dro_loss(**x.token_loss_args, advantages=x.adv_tok, weights=x.w, beta=obj.beta),
    S.KLCov: lambda obj, x: cov_penalty.kl_cov_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, frac=obj.frac, coef=obj.coef
    ),
    S.BAPO: lambda obj, x: bapo.bapo_loss(
        **x.token_loss_args, advantages=x.adv_tok, weights=x.w, target=obj.target, balance=obj.balance,
        dual_clip=obj.dual_clip, path=bapo.search_path(
            low_start=obj.low_start, low_max=obj.low_max, low_step=obj.low_step, high_start=obj.high_start,
            high_max=obj.high_max, high_step=obj.high_step, order=obj.order,
        ),
    ),
}


def _kl_reduction(spec: S.MethodSpec) -> tuple[AggMode, EmptyRows]:
    """(agg, empty_rows) of the KL-in-loss term: its own when ``kl.agg`` is set, else the objective's reduction."""
    assert isinstance(spec.kl, S.KLInLoss)
    if spec.kl.agg is not None:
        return spec.kl.agg, spec.kl.empty_rows
    return spec.agg, getattr(spec.objective, "empty_rows", "skip")  # objectives without the option skip empty rows


def _entropy_reduction(spec: S.MethodSpec) -> tuple[AggMode, EmptyRows]:
    """(agg, empty_rows) of the entropy bonus: its own when ``entropy.agg`` is set, else the objective's reduction
    (verl aggregates the entropy with the actor's ``loss_agg_mode``)."""
    if spec.entropy.agg is not None:
        return spec.entropy.agg, spec.entropy.empty_rows
    return spec.agg, getattr(spec.objective, "empty_rows", "skip")


def _entropy_term(spec: S.MethodSpec, b: LossBatch, *, mask: Tensor, mask_in: Tensor) -> LossOutput:
    """−c·agg(m H) on the kept tokens (``entropy.mask='kept'``) or on the input mask (``'input'``), its counts on the
    input mask too under ``denominator='input'`` (as the objective's)."""
    assert b.entropy is not None
    agg, rows = _entropy_reduction(spec)
    on = mask_in if spec.entropy.mask == "input" else mask
    coef = spec.entropy.coef if b.entropy_coef is None else b.entropy_coef
    norm_len = None if spec.norm_len is None else float(spec.norm_len)
    return entropy_bonus(
        entropy=b.entropy, mask=on, coef=coef, agg=agg, norm_len=norm_len, empty_rows=rows,
        count_mask=mask_in if spec.denominator == "input" else None,
    )  # fmt: skip


def _rename_is(metrics: Metrics, prefix: str) -> Metrics:
    """Correction metrics under ``is/`` move to ``<prefix>/`` (the ``is/`` namespace belongs to the diagnostics)."""
    return {(f"{prefix}/{k[3:]}" if k.startswith("is/") else k): v for k, v in metrics.items()}


class LossDetails(NamedTuple):
    """``compute_loss(..., return_details=True)``: the loss and metrics, and what the objective was handed.

    ``weights`` [B,T]: the product of the corrections' detached weights (1 on kept tokens of pure masks, 1 when the
    method has no weighting correction; 0 off ``mask``); ``mask`` [B,T] bool: the tokens the objective trained on
    (the input mask minus every rejection); ``advantages`` [B,T]: the token advantages after the estimator (0 off the
    input mask). All detached; ``pad_weight="one"`` reports 1 outside the input mask (TRL's convention). An
    objective's own internal weights (CISPO's clipped ratio, GMC-GRPO's capped sequence weights, ...) are the
    objective's and appear in its metrics, not here.
    """

    loss: Tensor
    metrics: Metrics
    weights: Tensor
    mask: Tensor
    advantages: Tensor


@overload
def compute_loss(
    method: str | S.MethodSpec, batch: LossBatch | Mapping[str, Any], *,
    overrides: Mapping[str, Any] | None = None, validate: bool = True, return_details: Literal[False] = False,
) -> LossOutput: ...  # fmt: skip


@overload
def compute_loss(
    method: str | S.MethodSpec, batch: LossBatch | Mapping[str, Any], *,
    overrides: Mapping[str, Any] | None = None, validate: bool = True, return_details: Literal[True],
) -> LossDetails: ...  # fmt: skip


def compute_loss(
    method: str | S.MethodSpec,
    batch: LossBatch | Mapping[str, Any],
    *,
    overrides: Mapping[str, Any] | None = None,
    validate: bool = True,
    return_details: bool = False,
) -> LossOutput | LossDetails:
    """The loss-level part of ``method`` on ``batch``: ``(loss, metrics)``.

    ``method``: a preset name, a composition (``"seq_tis+gac"``) or a resolved ``MethodSpec``; ``overrides`` as in
    :func:`steadyrl.methods.resolve_method`. ``batch``: a mapping or :class:`LossBatch` with ``logp`` [B,T]
    (with gradient), ``behav_logp`` [B,T], ``mask`` [B,T] and what the method needs (``rewards`` and ``group_ids``
    for group advantages, ``grad_sq_norms`` for OPOB, ...): a missing tensor is a ``ValueError`` naming it.
    Step-level controllers (ESS step size, GAC) are not applied here; see :mod:`steadyrl.control`. An entropy bonus
    (``entropy.coef`` ≠ 0 or the ``adaptive_entropy`` controller) reads ``entropy`` [B,T] (with gradient) and the
    coefficient ``entropy_coef`` when the batch carries it (the controller's ``loss_inputs``), else ``entropy.coef``.
    ``validate=True`` (the default) also checks the values: NaN or ±inf in any float input (``[B, T]`` ones where
    ``mask`` is true) and log-probs above ``LOGP_TOLERANCE`` are a ``ValueError`` naming the key; it reads one flag
    vector back to the host, so a trainer that already trusts its tensors passes ``validate=False`` (steadyrl's
    learner and adapters do). An empty batch (B = 0 or T = 0) is a ``ValueError`` either way.
    ``return_details=True`` returns a :class:`LossDetails` instead, with the per-token weights, mask and advantages
    the objective was handed, so a caller can check them against its own framework's.
    """
    spec = resolve_method(method, overrides) if isinstance(method, str) or overrides else method
    assert isinstance(spec, S.MethodSpec)
    b = LossBatch.from_any(batch)
    needs = required_inputs(spec)
    b.require(needs, spec.name)
    b.check_not_empty()
    if validate:
        b.check_values()
    mask0 = as_bool_mask(b.mask)
    logp = b.logp
    behav = b.behav_logp.detach()
    measured = b.prox_logp.detach() if b.prox_logp is not None else logp.detach()
    approx_metrics: Metrics = {}
    if spec.prox_approx == "loglinear":  # A-3PO: π_prox interpolated between μ and π_θ by token version
        assert b.versions is not None and b.learner_version is not None
        approx = proximal.loglinear_prox_logp(
            logp=logp, behav_logp=b.behav_logp, versions=b.versions, learner_version=b.learner_version, mask=mask0
        )
        measured, approx_metrics = approx.prox_logp, approx.metrics
    prox = behav if spec.policy == "bypass" else measured
    ell = where_masked(prox - behav, mask0)  # ℓ = log π_prox − log μ (detached)

    adv_tok, adv_seq, metrics = _advantages(spec, b, logp=logp, prox=prox, behav=behav, ell=ell, mask=mask0)
    metrics = {**metrics, **approx_metrics}
    # Under bypass π_prox := μ, so ℓ = 0; bypass_ratio='current' lets the corrections read π_θ (detached)/μ (verl).
    ell_corr = where_masked(logp.detach() - behav, mask0) if spec.bypass_ratio == "current" else ell
    step = Step(spec, b, logp, prox, measured, behav, ell_corr, adv_tok, adv_seq, mask0, mask_in=mask0)
    w: Tensor | None = None  # the product of the correction weights; None while it is all ones
    for c in spec.corrections:
        res = CORRECTIONS[type(c)](c, step)
        if not res.unit_weights:  # a pure mask's weight is 1 on every token it keeps: no product needed
            w = res.weights if w is None else w * res.weights
        step = step._replace(mask=res.mask)
        metrics.update(_rename_is(res.metrics, c.type))
    mask = step.mask
    if spec.weights_ess:  # verl's rollout_is_eff_sample_size: the corrections' weights, every input token a sample
        w_all = torch.ones_like(logp.detach()) if w is None else w
        metrics["is/ess_ratio_weights"] = weights_ess(weights=w_all, mask=mask0).ess_ratio
    seq_rewards = _rewards(spec, b, logp, mask0).seq if spec.objective.type == "oapl" else None
    out = OBJECTIVES[type(spec.objective)](spec.objective, step._replace(w=w, seq_rewards=seq_rewards))
    loss = out.loss
    metrics.update(out.metrics)
    if isinstance(spec.kl, S.KLInLoss):
        assert b.ref_logp is not None
        ref = core_kl.reference_kl(
            logp=logp, ref_logp=b.ref_logp, mask=mask, kind=spec.kl.kind, value_clamp=spec.kl.value_clamp,
            straight_through=spec.kl.straight_through,
        )  # fmt: skip
        if spec.kl.bias_correction != "none":  # k·π_θ/π_prox, the ratio with gradient (TRL use_bias_correction_kl)
            ref = core_kl.importance_weighted_kl(
                kl=ref.kl, logp=logp, prox_logp=prox, mask=mask, level=spec.kl.bias_correction
            )
        kl_agg, kl_rows = _kl_reduction(spec)
        kl_term = aggregate(
            ref.kl, mask, kl_agg, norm_len=None if spec.norm_len is None else float(spec.norm_len), empty_rows=kl_rows
        )
        loss = loss + spec.kl.beta * kl_term
        metrics.update(ref.metrics)
        metrics["loss/kl"] = kl_term.detach()
    if "entropy" in needs:  # entropy.coef ≠ 0, or the adaptive_entropy controller
        bonus = _entropy_term(spec, b, mask=mask, mask_in=mask0)
        loss = loss + bonus.loss
        metrics.update({k: v for k, v in bonus.metrics.items() if k != "loss/all_masked"})

    metrics.update(
        staleness_diagnostics(
            logp=measured, behav_logp=behav, mask=mask0, versions=b.versions, learner_version=b.learner_version
        )
    )
    for ctrl in spec.controllers:
        if isinstance(ctrl, S.EssStepSize):
            S_seq = seq_log_ratio(where_masked(measured - behav, mask0), mask0)
            ess = sequence_ess(log_weights=S_seq, valid=mask0.any(dim=-1), cap=ctrl.clip)
            metrics["vcpo/ess_ratio"] = ess.ess_ratio.detach()
    n0 = mask0.sum().clamp(min=1)
    metrics["loss/masked_frac"] = (1 - mask.sum() / n0).to(logp.dtype).detach()
    metrics["loss/all_masked"] = all_masked_flag(mask)
    metrics["loss/total"] = loss.detach()
    metrics = {k: v.detach() for k, v in metrics.items()}
    if not return_details:
        return LossOutput(loss, metrics)
    w_out = where_masked(torch.ones_like(logp.detach()) if w is None else w.detach(), mask)
    if spec.pad_weight == "one":  # TRL reports its token ratio exp(0) = 1 at padding
        w_out = torch.where(mask0, w_out, 1.0)
    return LossDetails(loss, metrics, w_out, mask, adv_tok.detach())
