"""verl 0.9.1 rollout correction (``verl/trainer/ppo/rollout_corr_helper.py``) against steadyrl's corrections.

verl's own functions run on the batch: ``compute_rollout_correction_weights`` (``rollout_is`` token / sequence, TIS
threshold or IcePop ``"lower_upper"``, ``rollout_is_batch_normalize``, and its ``rollout_is_eff_sample_size``),
``compute_rollout_rejection_mask`` (every ``rollout_rs`` option: ``token_k{1,2,3}``, ``seq_{sum,mean}_k{1,2,3}``,
``seq_max_k{2,3}``, comma lists, Geo-RS = ``seq_mean_k1`` with ``"0.999_1.001"``), the decoupled pipeline
``compute_rollout_correction_and_rejection_mask`` + ``compute_policy_loss_vanilla``, and the bypass mode
``compute_policy_loss_bypass_mode`` (PPO-clip and REINFORCE). The specs that reproduce them:

=============================  =================================================================================
``rollout_is=token``, C        ``token_tis(cap=C)`` (``renormalize=token`` for ``rollout_is_batch_normalize``)
``rollout_is=sequence``, C     ``seq_tis(cap=C)`` (``renormalize=sequence``)
IcePop ``"a_b"`` (token/seq)   ``token_mis`` / ``seq_mis(lower=a, upper=b, weight=ratio, rejected=zero)`` (verl
                               zeroes the weight and keeps the token in its response mask, RS then removes tokens)
``token_k1`` ``"a_b"``         ``rejection(metric=k1, level=token, ratio_bounds=True, lower=a, upper=b)``
``seq_{agg}_k{n}`` u           ``rejection(metric=k{n}, level=sequence, seq_agg=agg, upper=u)``
comma list                     one ``rejection`` per option, the sequence-level ones first
ESS metric                     ``weights_ess=True`` → ``is/ess_ratio_weights``
bypass mode                    ``policy=bypass, bypass_ratio=current``; REINFORCE is ``reinforce(surrogate=log_prob)``,
                               PPO-clip is ``ppo_clip(dual_clip=3)`` with the rejections only (verl computes, and does
                               not apply, its IS weights there)
=============================  =================================================================================

Float64, hypothesis batches (heavy-tailed log-ratios up to ±20, garbage at padding, all-masked rows; verl's metrics
refuse a batch without any valid token, so those are left out): same weights, masks, loss, gradient and metrics to
1e-9. verl 0.9.1 has no token veto (``rollout_token_veto_threshold`` is gone from its config), so ``token_veto`` has no
verl counterpart here.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss, resolve_method
from steadyrl.methods.spec import MethodSpec
from tests.parity._parity import Case, assert_close, batch, cases, grad, heavy, leaf

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1 (requirements/integrations)")

from verl.trainer.config.algorithm import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import rollout_corr_helper as rc  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

#: verl rollout_rs option → (its threshold, the steadyrl rejection spec)
RS_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "token_k1": ("0.5_2.0", {"metric": "k1", "level": "token", "ratio_bounds": True, "lower": 0.5, "upper": 2.0}),
    "token_k2": ("0.3", {"metric": "k2", "level": "token", "upper": 0.3}),
    "token_k3": ("0.3", {"metric": "k3", "level": "token", "upper": 0.3}),
    "seq_sum_k1": ("0.2_5.0", {"metric": "k1", "seq_agg": "sum", "ratio_bounds": True, "lower": 0.2, "upper": 5.0}),
    "seq_sum_k2": ("1.0", {"metric": "k2", "seq_agg": "sum", "upper": 1.0}),
    "seq_sum_k3": ("1.0", {"metric": "k3", "seq_agg": "sum", "upper": 1.0}),
    "seq_mean_k1": ("0.999_1.001", {"metric": "k1", "seq_agg": "mean", "ratio_bounds": True, "lower": 0.999,
                                    "upper": 1.001}),  # Geo-RS (decoupled_geo_rs)
    "seq_mean_k2": ("0.2", {"metric": "k2", "seq_agg": "mean", "upper": 0.2}),
    "seq_mean_k3": ("0.2", {"metric": "k3", "seq_agg": "mean", "upper": 0.2}),
    "seq_max_k2": ("0.5", {"metric": "k2", "seq_agg": "max", "upper": 0.5}),
    "seq_max_k3": ("0.5", {"metric": "k3", "seq_agg": "max", "upper": 0.5}),
}  # fmt: skip


@st.composite
def stale(draw: Any, empty: bool = True) -> Case:
    """A batch with at least one trained token and a heavy-tailed behavior log-ratio ℓ = log π_prox − log μ,
    |ℓ| ≤ 20 (scale 1e-4 lets Geo-RS's ±0.1 % band keep some sequences)."""
    case = draw(cases(empty=empty))
    assume(bool(case.mask.any()))
    scale = draw(st.sampled_from([1e-4, 0.05, 0.3, 1.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ell = (scale * heavy(g, *case.mask.shape)).clamp(-20.0, 20.0)
    return case._replace(behav=torch.where(case.mask, case.prox - ell, case.behav))


def actor_config(loss_mode: str, agg: str, rollout: RolloutCorrectionConfig | None = None) -> ActorConfig:
    policy = PolicyLossConfig(loss_mode=loss_mode)
    if rollout is not None:
        policy = PolicyLossConfig(loss_mode=loss_mode, rollout_correction=rollout)
    return ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
                       policy_loss=policy, loss_agg_mode=agg)  # fmt: skip


def is_correction(level: str, threshold: str | float, normalize: bool = False) -> dict[str, Any]:
    """The steadyrl correction for verl's ``rollout_is`` (TIS for one threshold, IcePop for ``"lower_upper"``)."""
    if isinstance(threshold, str) and "_" in threshold:
        lo, hi = map(float, threshold.split("_"))
        kind = "token_mis" if level == "token" else "seq_mis"
        return {"type": kind, "lower": lo, "upper": hi, "weight": "ratio", "rejected": "zero"}
    out: dict[str, Any] = {"type": "token_tis" if level == "token" else "seq_tis", "cap": float(threshold)}
    if normalize:
        out["renormalize"] = level
    return out


def rs_corrections(options: list[str]) -> list[dict[str, Any]]:
    """One ``rejection`` per verl option, the sequence-level ones first (they aggregate over the input mask)."""
    ordered = sorted(options, key=lambda o: o.startswith("token"))
    return [{"type": "rejection", "level": "sequence", **RS_OPTIONS[o][1]} for o in ordered]


def method(corrections: list[dict[str, Any]], agg: str, **fields: Any) -> MethodSpec:
    fields.setdefault("objective", {"type": "ppo_clip", "dual_clip": 3.0})  # verl's clip_ratio_c, always on
    return MethodSpec.model_validate({"name": "verl", "advantage": {"type": "given"}, "corrections": corrections,
                                      "agg": agg, "weights_ess": True, **fields})  # fmt: skip


def ours(case: Case, spec: MethodSpec) -> tuple[Any, torch.Tensor]:
    logp = leaf(case.ours(case.theta))
    out = compute_loss(spec, batch(case, logp, case.adv_tok, behav_logp=case.ours(case.behav)), return_details=True)
    return out, grad(out.loss, logp)


EPS = 1e-8  # verl's masked_mean divides by count + 1e-8; its ESS by mean + 1e-8; seq-mean-token-mean by L_i + 1e-8
#: verl's 1e-8 in the per-sequence token counts of seq-mean-token-mean: a relative difference ≤ 1e-8
LOSS_RTOL = 2e-8


def verl_ess(ess_ratio: float, weights: torch.Tensor, mask: torch.Tensor, cap: float) -> float:
    """steadyrl's ESS ratio (Σw)²/(N·Σw²) as verl reports it: 1 / masked_mean((w̃/(m̃ + ε))²), w̃ = clamp(w, 0, C),
    m̃ = Σw̃/(N + ε), every masked_mean dividing by N + ε: ours · ((N + ε)/N) · ((m̃ + ε)/m)², m = Σw̃/N."""
    w = weights.clamp(0.0, cap)[mask]
    n, total = w.numel(), float(w.sum())
    m, m_verl = total / n, total / (n + EPS)
    return ess_ratio * ((n + EPS) / n) * ((m_verl + EPS) / m) ** 2


def ess_cap(threshold: str | float) -> float:
    return float(str(threshold).split("_")[-1])


# ------------------------------------------------------------------------------------------- IS weights and ESS
IS_SETTINGS = st.sampled_from([("token", 2.0, False), ("token", 5.0, True), ("token", "0.5_2.0", False),
                               ("sequence", 2.0, False), ("sequence", 8.0, True), ("sequence", "0.2_5.0", False)])


@settings(max_examples=25, deadline=None)
@given(case=stale(), setting=IS_SETTINGS, agg=st.sampled_from(AGGS))
def test_is_weights_ess_and_loss(case: Case, setting: tuple[str, Any, bool], agg: str) -> None:
    level, threshold, normalize = setting
    mask = case.mask.double()
    icepop = isinstance(threshold, str)
    spec = method([is_correction(level, threshold, normalize)], agg)
    try:
        w, metrics = rc.compute_rollout_correction_weights(
            log_ratio=case.prox - case.behav, response_mask=mask, rollout_is=level, rollout_is_threshold=threshold,
            rollout_is_batch_normalize=normalize,
        )  # fmt: skip
    except ZeroDivisionError:  # verl's ESS divides by zero when IcePop zeroes every weight; steadyrl reports 0
        out, _ = ours(case, spec)
        assert icepop and not out.weights.any() and float(out.metrics["is/ess_ratio_weights"]) == 0.0
        return
    logp = leaf(case.theta)
    loss, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=mask, loss_agg_mode=agg,
        config=actor_config("vanilla", agg), rollout_is_weights=w,
    )  # fmt: skip
    out, g = ours(case, spec)
    assert torch.equal(out.mask, case.mask)  # IcePop zeroes weights, the response mask stays
    # 0 at padding (verl multiplies by the mask) and at IcePop's rejected tokens; verl's normalizing mean has the 1e-8
    assert_close(out.weights, w, rtol=LOSS_RTOL if normalize else 1e-9)
    assert_close(out.loss, loss, rtol=LOSS_RTOL)
    assert_close(g, grad(loss, logp), rtol=LOSS_RTOL)
    # verl's ESS is taken before the batch normalization; the ESS is scale invariant and its clamp at C a no-op
    w_raw = w if not normalize else w * metrics["rollout_is_batch_norm_factor"]
    expect = verl_ess(float(out.metrics["is/ess_ratio_weights"]), w_raw, case.mask, ess_cap(threshold))
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(expect, rel=1e-9)
    if not icepop and not normalize:
        name = "token_tis" if level == "token" else "seq_tis"
        n = int(case.mask.sum())  # verl's masked_mean divides by N + 1e-8
        expect = float(out.metrics[f"{name}/weight_mean"]) * n / (n + EPS)
        assert metrics["rollout_is_mean"] == pytest.approx(expect, rel=1e-12)


# ---------------------------------------------------------------------------------------------- rejection (RS)
OPTION_LISTS = st.one_of(
    st.sampled_from(sorted(RS_OPTIONS)).map(lambda o: [o]),
    st.lists(st.sampled_from(sorted(RS_OPTIONS)), min_size=2, max_size=3, unique=True),
)


@settings(max_examples=30, deadline=None)
@given(case=stale(), options=OPTION_LISTS)
def test_rollout_rs_options(case: Case, options: list[str]) -> None:
    mask = case.mask.double()
    threshold = ",".join(RS_OPTIONS[o][0] for o in options)
    kept, metrics = rc.compute_rollout_rejection_mask(
        log_ratio=case.prox - case.behav, response_mask=mask, rollout_rs=",".join(options),
        rollout_rs_threshold=threshold,
    )  # fmt: skip
    out, _ = ours(case, method(rs_corrections(options), "token-mean"))
    assert torch.equal(out.mask, kept.bool())
    n = int(case.mask.sum())  # verl's masked_mean divides by N + 1e-8
    frac = metrics["rollout_rs_masked_fraction"] * (n + EPS) / n
    assert frac == pytest.approx(1.0 - int(out.mask.sum()) / n, abs=1e-12)
    if len(options) == 1:
        assert frac == pytest.approx(float(out.metrics["rejection/masked_frac"]), abs=1e-12)


def test_rs_options_cover_verl() -> None:
    """Every option verl 0.9.1 supports has a spec here (a new verl option fails this test)."""
    assert set(RS_OPTIONS) == rc.SUPPORTED_ROLLOUT_RS_OPTIONS


def test_geo_rs_preset_config() -> None:
    """verl's ``decoupled_geo_rs()`` is the ``seq_mean_k1`` rejection with ratio bounds [0.999, 1.001]."""
    cfg = RolloutCorrectionConfig.decoupled_geo_rs()
    assert (cfg.rollout_is, cfg.rollout_rs, cfg.rollout_rs_threshold) == (None, "seq_mean_k1", "0.999_1.001")
    assert RS_OPTIONS["seq_mean_k1"][0] == cfg.rollout_rs_threshold


# ------------------------------------------------------------------------------------- the decoupled pipeline
@settings(max_examples=25, deadline=None)
@given(case=stale(), level=st.sampled_from(["token", "sequence"]), options=OPTION_LISTS, agg=st.sampled_from(AGGS))
def test_decoupled_pipeline(case: Case, level: str, options: list[str], agg: str) -> None:
    """``compute_rollout_correction_and_rejection_mask`` (TIS weights, RS mask) then verl's vanilla loss."""
    mask = case.mask.double()
    proto, kept, metrics = rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=case.prox, rollout_log_prob=case.behav, response_mask=mask, rollout_is=level,
        rollout_is_threshold=2.0, rollout_rs=",".join(options),
        rollout_rs_threshold=",".join(RS_OPTIONS[o][0] for o in options),
    )  # fmt: skip
    w = proto.batch["rollout_is_weights"]
    logp = leaf(case.theta)
    loss, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=kept, loss_agg_mode=agg,
        config=actor_config("vanilla", agg), rollout_is_weights=w,
    )  # fmt: skip
    spec = method([is_correction(level, 2.0), *rs_corrections(options)], agg)  # the IS weight on the input mask first
    out, g = ours(case, spec)
    assert torch.equal(out.mask, kept.bool())
    assert_close(out.weights, torch.where(out.mask, w, 0.0))
    if not out.mask.any():  # verl's token-mean is 0/0 there; steadyrl returns an exact 0 with zero gradients
        assert float(out.loss.detach()) == 0.0 and not g.any()
        return
    assert_close(out.loss, loss, rtol=LOSS_RTOL)
    assert_close(g, grad(loss, logp), rtol=LOSS_RTOL)
    expect = verl_ess(float(out.metrics["is/ess_ratio_weights"]), w, case.mask, 2.0)
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(expect, rel=1e-9)


# ------------------------------------------------------------------------------------------------ bypass mode
BYPASS_IS = st.sampled_from([None, ("token", 2.0), ("sequence", 2.0), ("token", "0.5_5.0")])
BYPASS_RS = st.sampled_from([None, ["seq_mean_k3"], ["token_k1"], ["seq_mean_k1", "token_k2"]])


@settings(max_examples=30, deadline=None)
@given(case=stale(), loss_type=st.sampled_from(["reinforce", "ppo_clip"]), is_=BYPASS_IS, rs=BYPASS_RS,
       agg=st.sampled_from(AGGS))  # fmt: skip
def test_bypass_mode(case: Case, loss_type: str, is_, rs, agg: str) -> None:
    """verl's bypass mode: π_old := μ; IS and RS from the current log-probs (detached) against μ; REINFORCE's loss is
    −A·w·log π_θ in value. steadyrl: ``policy=bypass, bypass_ratio=current``."""
    rollout = RolloutCorrectionConfig(
        rollout_is=None if is_ is None else is_[0], rollout_is_threshold=2.0 if is_ is None else is_[1],
        rollout_rs=None if rs is None else ",".join(rs),
        rollout_rs_threshold=None if rs is None else ",".join(RS_OPTIONS[o][0] for o in rs),
        bypass_mode=True, loss_type=loss_type,
    )  # fmt: skip
    mask = case.mask.double()
    logp = leaf(case.theta)
    try:
        loss, metrics = core_algos.compute_policy_loss_bypass_mode(
            old_log_prob=case.behav, log_prob=logp, advantages=case.adv_tok, response_mask=mask, loss_agg_mode=agg,
            config=actor_config("bypass_mode", agg, rollout),
        )  # fmt: skip
    except ZeroDivisionError:  # verl's ESS when IcePop zeroes every weight (steadyrl: ESS 0, an exact-zero loss)
        assume(False)
    corrections = [] if rs is None else rs_corrections(rs)
    applies_is = loss_type == "reinforce" and is_ is not None  # PPO-clip in bypass mode does not apply its weights
    if applies_is:
        corrections = [is_correction(*is_), *corrections]
    objective = {"type": "reinforce", "surrogate": "log_prob"} if loss_type == "reinforce" else None
    fields: dict[str, Any] = {"policy": "bypass", "bypass_ratio": "current"}
    if objective is not None:
        fields["objective"] = objective
    out, g = ours(case, method(corrections, agg, **fields))
    if not out.mask.any():
        assert float(out.loss.detach()) == 0.0 and not g.any()
        return
    assert_close(out.loss, loss, rtol=LOSS_RTOL)
    assert_close(g, grad(loss, logp), rtol=LOSS_RTOL)
    if applies_is and rs is None:  # (with RS, the rejected tokens' weights, which verl's ESS counts, are not returned)
        expect = verl_ess(float(out.metrics["is/ess_ratio_weights"]), out.weights, case.mask, ess_cap(is_[1]))
        assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(expect, rel=1e-9)


PG_IS = RolloutCorrectionConfig.bypass_pg_is()


@settings(max_examples=20, deadline=None)
@given(case=stale())
def test_bypass_pg_is_preset(case: Case) -> None:
    """The ``bypass_pg_is`` preset is verl's ``RolloutCorrectionConfig.bypass_pg_is()`` (token-mean, verl's default
    ``loss_agg_mode``)."""
    mask = case.mask.double()
    logp = leaf(case.theta)
    loss, _ = core_algos.compute_policy_loss_bypass_mode(
        old_log_prob=case.behav, log_prob=logp, advantages=case.adv_tok, response_mask=mask,
        loss_agg_mode="token-mean", config=actor_config("bypass_mode", "token-mean", PG_IS),
    )  # fmt: skip
    out, g = ours(case, resolve_method("bypass_pg_is", {"advantage.type": "given"}))
    assert_close(out.loss, loss)
    assert_close(g, grad(loss, logp))


def test_bypass_ratio_one_makes_the_corrections_no_ops() -> None:
    """Guard: with the default ``bypass_ratio='one'`` (π_prox := μ) the sequence weight is 1 and the loss differs from
    verl's bypass REINFORCE on a stale batch; ``current`` reproduces it."""
    from tests.parity._parity import make_case

    case = make_case(11, [5, 3, 6, 2], 6, log_scale=0.5)
    g = torch.Generator().manual_seed(1)
    case = case._replace(behav=torch.where(case.mask, case.theta - 0.4 * torch.randn(4, 6, generator=g,
                                                                                       dtype=torch.float64), 0.0))
    logp = leaf(case.theta)
    loss, _ = core_algos.compute_policy_loss_bypass_mode(
        old_log_prob=case.behav, log_prob=logp, advantages=case.adv_tok, response_mask=case.mask.double(),
        loss_agg_mode="token-mean", config=actor_config("bypass_mode", "token-mean", PG_IS),
    )  # fmt: skip
    spec = resolve_method("bypass_pg_is", {"advantage.type": "given"})
    out, _ = ours(case, spec)
    assert_close(out.loss, loss)
    one, _ = ours(case, spec.model_copy(update={"bypass_ratio": "one"}))
    assert torch.equal(one.weights, case.mask.double()) and abs(float(one.loss.detach()) - float(loss.detach())) > 1e-6
    assert not math.isclose(float(out.metrics["seq_tis/weight_mean"]), 1.0)
