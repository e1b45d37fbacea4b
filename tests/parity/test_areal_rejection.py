"""AReaL 1.0.4's decoupled PPO loss with ``rejection_sampling`` (``areal/utils/functional/functional.py``
``ppo_actor_loss_fn`` → ``apply_rejection_sampling``; ``RejectionSamplingConfig`` in ``areal/api/cli_args.py``) against
steadyrl's corrections.

AReaL filters on π_prox/μ with ``metric`` ratio | kl_k1 | kl_k2 | kl_k3 at ``level`` token | sequence (``agg`` sum |
mean | max), ``action`` mask | clamp, and divides the loss by the token count taken *before* the rejection
(``loss_mask_count``): ``denominator="input"``. The specs that reproduce it:

=================================  ================================================================================
token, mask, ratio (the default)   ``decoupled_ppo`` = ``token_mis(lower, upper, weight=ratio)``
token, mask, kl_k*                 ``rejection(metric=k*, level=token, convention=areal, weight=token)``
sequence, mask, ratio, agg         ``rejection(metric=ratio, level=sequence, seq_agg=agg, weight=geometric)``
sequence, mask, kl_k*, agg         ``rejection(metric=k*, level=sequence, seq_agg=agg, convention=areal, weight=token)``
token, clamp (ratio)               ``token_tis(cap=upper, floor=lower)``
sequence, clamp, ratio, mean       ``seq_tis(ratio=geometric, cap=upper, floor=lower)``
``importance_sampling_level``      ``objective.type=gspo`` (its s_i over the kept tokens, ``agg=token-mean``)
 = sequence (GSPO)
=================================  ================================================================================

Not expressible: ``action=clamp`` at sequence level with ``agg`` sum or max clamps the geometric-mean weight of the
sequences whose exp(S_i) or max_t ρ_t leaves the bounds (the weight and the tested quantity differ). KPop
(bidirectional binary KL, ``rejection(metric=binary_kl)``) is not in AReaL 1.0.4 (AReaL PR #1405 came after), so it has
no parity test here.

AReaL computes ℓ and its metrics in float32 (``proximal_logprobs.float() − old_logprobs.float()``): weights and loss
agree to float32 precision, |ℓ|·2⁻²⁴ ≲ 1.2e-6 relative at |ℓ| ≤ 20 (tolerance 3e-6). Hypothesis batches with
heavy-tailed log-ratios, finite garbage at padding for AReaL and NaN for steadyrl, all-masked rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss, resolve_method
from steadyrl.methods.spec import MethodSpec
from tests.parity._parity import Case, assert_close, batch, cases, grad, heavy, leaf

pytest.importorskip("areal", reason="areal==1.0.4 (requirements/integrations)")

from areal.api.cli_args import RejectionSamplingConfig
from areal.utils.functional.functional import ppo_actor_loss_fn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # AReaL warns that agg is unused at token level

RTOL = 3e-6  # AReaL's float32 log-ratio, exp and metrics
KL_METRICS = {"kl_k1": "k1", "kl_k2": "k2", "kl_k3": "k3"}
TOKEN_BOUNDS = {"ratio": [(None, 5.0), (0.5, 2.0)], "kl_k1": [(-0.3, 0.3), (None, 0.1)],
                "kl_k2": [(None, 0.1), (0.01, 0.5)], "kl_k3": [(None, 0.1), (None, 1.0)]}  # fmt: skip
SEQ_BOUNDS = {"ratio": {"sum": (0.2, 5.0), "mean": (0.8, 1.25), "max": (None, 2.0)},
              "kl_k1": {"sum": (-1.0, 1.0), "mean": (-0.1, 0.1), "max": (None, 0.5)},
              "kl_k2": {"sum": (None, 1.0), "mean": (None, 0.1), "max": (None, 0.5)},
              "kl_k3": {"sum": (None, 1.0), "mean": (None, 0.1), "max": (None, 0.5)}}  # fmt: skip


@st.composite
def stale(draw: Any) -> Case:
    """A batch whose behavior log-ratio ℓ = log π_prox − log μ is heavy-tailed, |ℓ| ≤ 20."""
    case = draw(cases())
    scale = draw(st.sampled_from([0.05, 0.3, 1.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ell = (scale * heavy(g, *case.mask.shape)).clamp(-20.0, 20.0)
    return case._replace(behav=torch.where(case.mask, case.prox - ell, case.behav))


def areal(case: Case, config: RejectionSamplingConfig | None, clip: tuple[float, float], *,
          level: str = "token", adv: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    logp = leaf(case.theta)
    loss, stat = ppo_actor_loss_fn(
        logprobs=logp, proximal_logprobs=case.prox, old_logprobs=case.behav,
        advantages=case.adv_tok if adv is None else adv, eps_clip=clip[0], eps_clip_higher=clip[1],
        loss_mask=case.mask, rejection_sampling=config, importance_sampling_level=level,
    )  # fmt: skip
    return loss, grad(loss, logp), stat


def spec(corrections: list[dict[str, Any]], clip: tuple[float, float], objective: str = "ppo_clip") -> MethodSpec:
    return MethodSpec.model_validate({
        "name": "areal", "advantage": {"type": "given"}, "corrections": corrections, "agg": "token-mean",
        "objective": {"type": objective, "clip_low": clip[0], "clip_high": clip[1]}, "denominator": "input",
    })  # fmt: skip


def ours(case: Case, method: MethodSpec, adv: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    logp = leaf(case.ours(case.theta))
    a = case.adv_tok if adv is None else adv
    out = compute_loss(method, batch(case, logp, a, behav_logp=case.ours(case.behav)), return_details=True)
    return out, grad(out.loss, logp)


def check(out: Any, g: torch.Tensor, loss: torch.Tensor, g_theirs: torch.Tensor, stat: dict[str, Any],
          name: str, mask_mode: bool = True) -> None:  # fmt: skip
    assert_close(out.loss, loss, rtol=RTOL, atol=1e-9)
    assert_close(g, g_theirs, rtol=RTOL, atol=1e-9)
    assert_close(out.weights, stat["behave_imp_weight"], rtol=RTOL, atol=1e-12)  # 0 off the kept mask, both
    if mask_mode:
        assert torch.equal(out.mask, stat["behave_mask"])
        assert stat["filtered_fraction"] == pytest.approx(float(out.metrics[f"{name}/masked_frac"]), abs=1e-12)
    else:
        assert stat["filtered_fraction"] == pytest.approx(float(out.metrics[f"{name}/truncated_frac"]), abs=1e-12)


CLIPS = st.sampled_from([(0.2, 0.2), (0.2, 0.28)])


@settings(max_examples=25, deadline=None)
@given(case=stale(), clip=CLIPS)
def test_decoupled_ppo_preset_is_the_default_rejection(case: Case, clip: tuple[float, float]) -> None:
    """AReaL's default ``RejectionSamplingConfig()`` (token, mask, ratio ≤ 5) is the ``decoupled_ppo`` preset with
    the input denominator."""
    loss, g_theirs, stat = areal(case, RejectionSamplingConfig(), clip)
    overrides = {"advantage.type": "given", "denominator": "input", "objective.clip_low": clip[0],
                 "objective.clip_high": clip[1]}  # fmt: skip
    method = resolve_method("decoupled_ppo", overrides)
    out, g = ours(case, method)
    check(out, g, loss, g_theirs, stat, "token_mis")


def _token_mask() -> st.SearchStrategy[tuple[str, tuple[float | None, float]]]:
    return st.sampled_from([(m, b) for m, bs in TOKEN_BOUNDS.items() for b in bs])


@settings(max_examples=40, deadline=None)
@given(case=stale(), metric_bounds=_token_mask(), clip=CLIPS)
def test_token_mask(case: Case, metric_bounds, clip: tuple[float, float]) -> None:
    metric, (lo, hi) = metric_bounds
    cfg = RejectionSamplingConfig(level="token", action="mask", metric=metric, lower=lo, upper=hi)
    loss, g_theirs, stat = areal(case, cfg, clip)
    if metric == "ratio":
        corr = {"type": "token_mis", "lower": lo, "upper": hi, "weight": "ratio"}
        name = "token_mis"
    else:
        corr = {"type": "rejection", "metric": KL_METRICS[metric], "level": "token", "convention": "areal",
                "weight": "token", "lower": lo, "upper": hi}  # fmt: skip
        name = "rejection"
    out, g = ours(case, spec([corr], clip))
    check(out, g, loss, g_theirs, stat, name)


def _seq_mask() -> st.SearchStrategy[tuple[str, str, tuple[float | None, float]]]:
    return st.sampled_from([(m, a, b) for m, aggs in SEQ_BOUNDS.items() for a, b in aggs.items()])


@settings(max_examples=40, deadline=None)
@given(case=stale(), setting=_seq_mask(), clip=CLIPS)
def test_sequence_mask(case: Case, setting, clip: tuple[float, float]) -> None:
    """Sequence level: the ratio metric aggregates log ρ (exp(S), exp(S̄), exp(max ℓ)) and carries the geometric
    mean exp(S̄); the KL metrics aggregate the estimator and carry the token ratio."""
    metric, agg, (lo, hi) = setting
    cfg = RejectionSamplingConfig(level="sequence", action="mask", metric=metric, agg=agg, lower=lo, upper=hi)
    loss, g_theirs, stat = areal(case, cfg, clip)
    corr = {"type": "rejection", "level": "sequence", "seq_agg": agg, "lower": lo, "upper": hi}
    if metric == "ratio":
        corr |= {"metric": "ratio", "weight": "geometric"}
    else:
        corr |= {"metric": KL_METRICS[metric], "convention": "areal", "weight": "token"}
    out, g = ours(case, spec([corr], clip))
    check(out, g, loss, g_theirs, stat, "rejection")


@settings(max_examples=30, deadline=None)
@given(case=stale(), level=st.sampled_from(["token", "sequence"]),
       bounds=st.sampled_from([(None, 5.0), (0.5, 2.0), (0.9, 1.1)]), clip=CLIPS)  # fmt: skip
def test_clamp(case: Case, level: str, bounds: tuple[float | None, float], clip: tuple[float, float]) -> None:
    """``action=clamp`` truncates instead of masking: token TIS with a floor, or the geometric-mean sequence TIS
    (``agg=mean``)."""
    lo, hi = bounds
    cfg = RejectionSamplingConfig(level=level, action="clamp", metric="ratio", agg="mean", lower=lo, upper=hi)
    loss, g_theirs, stat = areal(case, cfg, clip)
    if level == "token":
        corr, name = {"type": "token_tis", "cap": hi, "floor": lo}, "token_tis"
    else:
        corr, name = {"type": "seq_tis", "ratio": "geometric", "cap": hi, "floor": lo}, "seq_tis"
    out, g = ours(case, spec([corr], clip))
    check(out, g, loss, g_theirs, stat, name, mask_mode=False)


@settings(max_examples=30, deadline=None)
@given(case=stale(), rs=st.sampled_from(["token", "sequence"]), clip=st.sampled_from([(3e-4, 4e-4), (0.05, 0.1)]))
def test_gspo_with_rejection(case: Case, rs: str, clip: tuple[float, float]) -> None:
    """AReaL's GSPO (``importance_sampling_level="sequence"``) after a rejection: s_i = exp(mean of log r over the
    kept tokens), the loss divided by the pre-rejection token count. Sequence advantages (AReaL averages A over the
    kept tokens of each sequence)."""
    adv = case.seq_tok()
    if rs == "token":
        cfg = RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=2.0, lower=0.5)
        corr = {"type": "token_mis", "lower": 0.5, "upper": 2.0, "weight": "ratio"}
        name = "token_mis"
    else:
        cfg = RejectionSamplingConfig(level="sequence", action="mask", metric="kl_k3", agg="mean", upper=0.1)
        corr = {"type": "rejection", "metric": "k3", "level": "sequence", "seq_agg": "mean", "convention": "areal",
                "weight": "token", "upper": 0.1}  # fmt: skip
        name = "rejection"
    loss, g_theirs, stat = areal(case, cfg, clip, level="sequence", adv=adv)
    out, g = ours(case, spec([corr], clip, objective="gspo"), adv=case.adv_seq)
    check(out, g, loss, g_theirs, stat, name)


def test_the_comparison_sees_rejection_and_the_input_denominator() -> None:
    """Guard: on this batch the default rejection drops tokens, and steadyrl's default (kept-token) denominator gives
    a different loss than AReaL's."""
    from tests.parity._parity import make_case

    case = make_case(2, [6, 5, 0, 6], 6, log_scale=0.3)
    g = torch.Generator().manual_seed(3)
    case = case._replace(behav=torch.where(case.mask, case.prox - 2.0 * torch.randn(4, 6, generator=g,
                                                                                      dtype=torch.float64), 0.0))
    loss, _, stat = areal(case, RejectionSamplingConfig(), (0.2, 0.2))
    assert 0.0 < stat["filtered_fraction"] < 1.0
    method = resolve_method("decoupled_ppo", {"advantage.type": "given", "denominator": "input"})
    out, _ = ours(case, method)
    assert_close(out.loss, loss, rtol=RTOL)
    kept, _ = ours(case, method.model_copy(update={"denominator": "kept"}))
    assert abs(float(kept.loss.detach()) - float(loss.detach())) > 1e-6
