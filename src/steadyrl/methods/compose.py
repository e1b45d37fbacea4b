"""``compute_loss``: run the loss-level part of any method on a batch, calling ``steadyrl.core`` step by step.

The pipeline, in the order it runs (ALGORITHMS.md, "Two policies or three"):

1. **Policies.** ``behav_logp`` = log μ; ``prox_logp`` = log π_prox, the recomputed proximal policy, or ``logp``
   detached when not given (one update per batch: VCPO's setting); in ``policy="bypass"`` π_prox := μ (verl).
   ℓ = log π_prox − log μ is the behavior-correction log-ratio, detached.
2. **Rewards.** Outcome rewards [B] (or token rewards [B,T]); ``kl.type="in_reward"`` subtracts β·k_t per token.
3. **Advantages.** GRPO / Dr.GRPO (optionally on length-corrected rewards R_i/L_i, TIC-GRPO), OPOB, OTB, COPC TD,
   VACO (GRPO re-aligned with a one-step V-trace target on ℓ), or given; sequence advantages are broadcast to tokens.
4. **Corrections**, in the method's order: each returns detached token weights and a mask; weights multiply, masks
   intersect. Their ``is/...`` metrics are renamed ``<correction>/...`` so they never shadow the diagnostics.
5. **Objective** on the surviving tokens, aggregated with the method's ``agg`` mode. GMC-GRPO computes its own
   sequence weights and OAPL has no importance ratio: with them, corrections act through their masks only (their
   weights are not applied). TIC-GRPO takes one weight per sequence (the masked mean of the correction weights)
   on top of its own trajectory ratio to μ.
6. **KL in the loss** (optional), then the **diagnostics** every run logs (ESS, weights, mismatch KL, lag) measured
   on π_prox (or π_θ detached) against μ, and the inputs of the method's controllers (``vcpo/ess_ratio``).

Everything stays on the device; no host syncs. A batch with no trainable token gives an exact-zero loss with zero
gradients and ``loss/all_masked = 1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from torch import Tensor

from steadyrl.core import kl as core_kl
from steadyrl.core import rejection, weights
from steadyrl.core.advantages import grpo, opob, otb, vaco, vtrace
from steadyrl.core.diagnostics import staleness_diagnostics
from steadyrl.core.ess import sequence_ess
from steadyrl.core.masking import (
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
from steadyrl.core.objectives import filters, gmc_grpo, m2po, oapl, pnpo, ppo, tic_grpo
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
            beta=method.kl.beta, kind=method.kl.kind,
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


def _advantages(
    method: S.MethodSpec, b: LossBatch, *, logp: Tensor, prox: Tensor, behav: Tensor, ell: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor | None, Metrics]:
    """(token advantages [B,T], sequence advantages [B] or None, metrics)."""
    adv = method.advantage
    rw = _rewards(method, b, logp, mask, tokens=isinstance(adv, (S.CopcAdvantage, S.OtbAdvantage)))
    seq_r, tok_r = rw.seq, rw.token
    if isinstance(adv, S.GivenAdvantage):
        a = b.advantages
        assert a is not None
        a = a.detach()
        if a.dim() == 1:
            return grpo.token_advantages(advantages=a, mask=mask), a, {}
        return where_masked(a, mask), None, {}
    if isinstance(adv, S.CopcAdvantage):
        out = _copc(adv, b, token_rewards=tok_r, logp=logp, behav=behav, mask=mask)
        return out.advantages, None, {**rw.metrics, **out.metrics}
    assert seq_r is not None and b.group_ids is not None
    if isinstance(adv, S.GrpoAdvantage):
        r = grpo.length_corrected_rewards(rewards=seq_r, mask=mask) if adv.length_corrected else seq_r
        out_g = grpo.grpo_advantages(
            rewards=r, group_ids=b.group_ids, scale=adv.scale, eps=adv.eps, unbiased=adv.unbiased
        )
        metrics = {**rw.metrics, **out_g.metrics}
        return grpo.token_advantages(advantages=out_g.advantages, mask=mask), out_g.advantages, metrics
    if isinstance(adv, S.OpobAdvantage):
        assert b.grad_sq_norms is not None
        out_o = opob.opob_advantages(
            rewards=seq_r, group_ids=b.group_ids, log_weights=seq_log_ratio(ell, mask),
            grad_sq_norms=b.grad_sq_norms.detach(), weighting=adv.weighting, scope=adv.scope,
            aggregation=adv.aggregation, length_normalize=adv.length_normalize, lengths=lengths(mask),
            clip=adv.clip, tis_cap=adv.tis_cap,
        )  # fmt: skip
        metrics = {**rw.metrics, **out_o.metrics}
        return grpo.token_advantages(advantages=out_o.advantages, mask=mask), out_o.advantages, metrics
    if isinstance(adv, S.VacoAdvantage):
        out_v = vaco.vaco_advantages(
            rewards=seq_r, group_ids=b.group_ids, log_ratio=ell, mask=mask, rho_bar=adv.rho_bar, ratio=adv.ratio,
            scale=adv.scale, eps=adv.eps, unbiased=adv.unbiased,
        )  # fmt: skip
        metrics = {**rw.metrics, **out_v.metrics}
        return grpo.token_advantages(advantages=out_v.advantages, mask=mask), out_v.advantages, metrics
    assert isinstance(adv, S.OtbAdvantage) and b.sum_p2 is not None
    out_t = otb.otb_advantages(
        returns=_return_to_go(tok_r, mask), token_logp=prox, sum_p2=b.sum_p2.detach(),
        mask=mask, group_ids=b.group_ids, token_weights=safe_exp(ell) if adv.importance_weighted else None,
    )  # fmt: skip
    return out_t.advantages, None, {**rw.metrics, **out_t.metrics}


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


def _correct(
    c: Any, *, b: LossBatch, logp: Tensor, prox: Tensor, measured: Tensor, behav: Tensor, ell: Tensor,
    adv_tok: Tensor, adv_seq: Tensor | None, mask: Tensor,
) -> Corrected:  # fmt: skip
    """Apply one correction (spec ``c``) to the current mask."""
    if isinstance(c, S.TokenTIS):
        return weights.token_tis(log_ratio=ell, mask=mask, cap=c.cap, floor=c.floor, renormalize=c.renormalize)
    if isinstance(c, S.SeqTIS):
        return weights.seq_tis(log_ratio=ell, mask=mask, cap=c.cap)
    mis = {"token_mis": weights.token_mis, "seq_mis": weights.seq_mis, "geo_mis": weights.geo_mis}
    if c.type in mis or isinstance(c, S.IcePop):
        fn = weights.icepop if isinstance(c, S.IcePop) else mis[c.type]
        return fn(log_ratio=ell, mask=mask, lower=c.lower, upper=c.upper, weight=c.weight)
    if isinstance(c, S.TokenVeto):
        return weights.token_veto(log_ratio=ell, mask=mask, threshold=c.threshold)
    if isinstance(c, S.Rejection):
        return rejection.divergence_rejection(
            log_ratio=ell, mask=mask, metric=c.metric, level=c.level, seq_agg=c.seq_agg, lower=c.lower, upper=c.upper
        )
    if isinstance(c, S.OPSM):
        a = adv_seq if adv_seq is not None else masked_mean(adv_tok, mask, dim=-1)
        return rejection.opsm(logp=logp, behav_logp=behav, advantages=a, mask=mask, delta=c.delta)
    if isinstance(c, S.PrefixRatio):
        return weights.prefix_ratio(log_ratio=ell, mask=mask, cap=c.cap)
    if isinstance(c, S.M2POMask):
        return m2po.m2po_mask(
            log_ratio=behav - measured, mask=mask, tau=c.tau, harmful_only=c.harmful_only, advantages=adv_tok
        )  # δ = log μ − log π_prox (measured, also under bypass)
    if isinstance(c, S.VacoFilter):
        return filters.vaco_filter(
            logp=logp, behav_logp=behav, advantages=adv_tok, mask=mask, group_ids=b.group_ids, delta=c.delta,
            rule=c.rule,
        )  # fmt: skip
    if isinstance(c, S.CopcMask):
        return filters.copc_actor_mask(logp=logp, behav_logp=behav, mask=mask, c_low=c.c_low, c_high=c.c_high)
    assert isinstance(c, S.ESTRMask) and b.behav_entropy is not None
    kw = {} if c.tau is None else {"tau": c.tau}
    return filters.estr_mask(logp=logp, behav_logp=behav, behav_entropy=b.behav_entropy, mask=mask, eps=c.eps, **kw)


def _objective(
    method: S.MethodSpec, *, b: LossBatch, logp: Tensor, prox: Tensor, measured: Tensor, behav: Tensor,
    adv_tok: Tensor, adv_seq: Tensor | None, mask: Tensor, w: Tensor | None, seq_rewards: Tensor | None,
) -> LossOutput:  # fmt: skip
    obj = method.objective
    norm_len = None if method.norm_len is None else float(method.norm_len)  # core annotates a float
    common = {"logp": logp, "prox_logp": prox, "mask": mask, "agg": method.agg, "norm_len": norm_len}
    if isinstance(obj, S.PPOClip):
        return ppo.ppo_clip_loss(
            **common, advantages=adv_tok, weights=w, clip_low=obj.clip_low, clip_high=obj.clip_high,
            dual_clip=obj.dual_clip,
        )  # fmt: skip
    if isinstance(obj, S.Reinforce):
        return ppo.reinforce_loss(**common, advantages=adv_tok, weights=w)
    if isinstance(obj, S.GSPO):
        return ppo.gspo_loss(**common, advantages=adv_tok, weights=w, clip_low=obj.clip_low, clip_high=obj.clip_high)
    if isinstance(obj, S.M2POClip):
        rng = m2po.m2po_clip_range(
            log_ratio=behav - measured, mask=mask, advantages=adv_tok, tau=obj.tau,
            floor_low=obj.floor_low, floor_high=obj.floor_high,
        )  # fmt: skip
        out = ppo.ppo_clip_loss(**common, advantages=adv_tok, weights=w, clip_low=rng.clip_low, clip_high=rng.clip_high)
        return LossOutput(out.loss, {**out.metrics, **rng.metrics})
    if isinstance(obj, S.PNPO):
        return pnpo.pnpo_loss(
            logp=logp, behav_logp=behav, advantages=adv_tok, mask=mask, weights=w, delta=obj.delta, agg=method.agg,
            norm_len=norm_len,
        )  # fmt: skip
    a_seq = adv_seq if adv_seq is not None else masked_mean(adv_tok, mask, dim=-1)
    if isinstance(obj, S.TICGRPO):
        # Sequence weight of the corrections: their masked mean (exact for sequence-level corrections).
        w_seq = None if w is None else masked_mean(w, mask, dim=-1)
        return tic_grpo.tic_grpo_loss(
            logp=logp, behav_logp=behav if obj.ratio_to == "behavior" else prox, advantages=a_seq, mask=mask,
            weights=w_seq, clip_eps=obj.eps, upper_only=obj.upper_only,
        )  # fmt: skip
    if isinstance(obj, S.GMCGRPO):
        assert b.group_ids is not None
        return gmc_grpo.gmc_grpo_loss(
            logp=logp, prox_logp=prox, behav_logp=behav, advantages=a_seq, mask=mask, group_ids=b.group_ids,
            eps=obj.eps, cap=obj.cap, agg=method.agg, norm_len=norm_len,
        )  # fmt: skip
    assert isinstance(obj, S.OAPL) and seq_rewards is not None and b.group_ids is not None
    return oapl.oapl_loss(
        logp=logp, behav_logp=behav, rewards=seq_rewards, group_ids=b.group_ids, mask=mask,
        beta1=obj.beta1, beta2=obj.beta2,
    )  # fmt: skip


def _rename_is(metrics: Metrics, prefix: str) -> Metrics:
    """Correction metrics under ``is/`` move to ``<prefix>/`` (the ``is/`` namespace belongs to the diagnostics)."""
    return {(f"{prefix}/{k[3:]}" if k.startswith("is/") else k): v for k, v in metrics.items()}


def compute_loss(
    method: str | S.MethodSpec,
    batch: LossBatch | Mapping[str, Any],
    *,
    overrides: Mapping[str, Any] | None = None,
) -> LossOutput:
    """The loss-level part of ``method`` on ``batch``: ``(loss, metrics)``.

    ``method``: a preset name, a composition (``"seq_tis+gac"``) or a resolved ``MethodSpec``; ``overrides`` as in
    :func:`steadyrl.methods.resolve_method`. ``batch``: a mapping or :class:`LossBatch` with ``logp`` [B,T]
    (with gradient), ``behav_logp`` [B,T], ``mask`` [B,T] and what the method needs (``rewards`` and ``group_ids``
    for group advantages, ``grad_sq_norms`` for OPOB, ...): a missing tensor is a ``ValueError`` naming it.
    Step-level controllers (ESS step size, GAC) are not applied here; see :mod:`steadyrl.control`.
    """
    spec = resolve_method(method, overrides) if isinstance(method, str) or overrides else method
    assert isinstance(spec, S.MethodSpec)
    b = LossBatch.from_any(batch)
    b.require(required_inputs(spec), spec.name)
    mask0 = as_bool_mask(b.mask)
    logp = b.logp
    behav = b.behav_logp.detach()
    measured = b.prox_logp.detach() if b.prox_logp is not None else logp.detach()
    prox = behav if spec.policy == "bypass" else measured
    ell = where_masked(prox - behav, mask0)  # ℓ = log π_prox − log μ (detached)

    adv_tok, adv_seq, metrics = _advantages(spec, b, logp=logp, prox=prox, behav=behav, ell=ell, mask=mask0)
    metrics = dict(metrics)
    w: Tensor | None = None  # the product of the correction weights; None while it is all ones
    mask = mask0
    for c in spec.corrections:
        res = _correct(
            c, b=b, logp=logp, prox=prox, measured=measured, behav=behav, ell=ell, adv_tok=adv_tok,
            adv_seq=adv_seq, mask=mask,
        )  # fmt: skip
        if not res.unit_weights:  # a pure mask's weight is 1 on every token it keeps: no product needed
            w = res.weights if w is None else w * res.weights
        mask = res.mask
        metrics.update(_rename_is(res.metrics, c.type))
    seq_rewards = _rewards(spec, b, logp, mask0).seq if spec.objective.type == "oapl" else None
    out = _objective(
        spec, b=b, logp=logp, prox=prox, measured=measured, behav=behav, adv_tok=adv_tok, adv_seq=adv_seq,
        mask=mask, w=w, seq_rewards=seq_rewards,
    )  # fmt: skip
    loss = out.loss
    metrics.update(out.metrics)
    if isinstance(spec.kl, S.KLInLoss):
        assert b.ref_logp is not None
        ref = core_kl.reference_kl(logp=logp, ref_logp=b.ref_logp, mask=mask, kind=spec.kl.kind)
        kl_term = aggregate(ref.kl, mask, spec.agg, norm_len=None if spec.norm_len is None else float(spec.norm_len))
        loss = loss + spec.kl.beta * kl_term
        metrics.update(ref.metrics)
        metrics["loss/kl"] = kl_term.detach()

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
    return LossOutput(loss, {k: v.detach() for k, v in metrics.items()})
