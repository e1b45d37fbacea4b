"""Reference-KL estimators (``core.kl.reference_kl``: k1, k2, k3, abs, low_var_kl; ``value_clamp``,
``straight_through``) and the KL terms built on them (``kl.type=in_loss`` / ``in_reward``) against the frameworks.

Per token: verl 0.9.1 ``kl_penalty`` (every name, ``+`` straight-through kinds included), SkyRL 0.3.0 and OpenRLHF
0.11.2 ``compute_approx_kl``, AReaL 1.0.4 ``KLEstimator`` (values and gradients w.r.t. log π_θ). As loss terms:
TRL 1.16.0's ``per_token_kl`` inside ``_compute_loss`` (``beta > 0``, with and without ``use_bias_correction_kl``),
verl's ``agg_loss`` of ``kl_penalty`` (as its ``ppo_loss`` adds it), OpenRLHF's token-mean KL loss, SkyRL's row-mean
KL loss, verl's ``compute_rewards`` (k1 in the reward). Heavy-tailed log π_θ − log π_ref, garbage at padding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss, resolve_method
from steadyrl.core.kl import ESTIMATOR_VALUE_CLAMP, kl_in_reward, reference_kl
from tests.parity._parity import DT, Case, assert_close, batch, cases, grad, leaf

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations inside TRL


def weights(case: Case) -> torch.Tensor:
    """Random per-token coefficients: Σ c_t k_t tests every token's value and gradient at once."""
    return torch.rand(case.mask.shape, dtype=DT, generator=torch.Generator().manual_seed(5)) + 0.5


def ours(case: Case, kind: str, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token k [B,T], Σ c·k, its gradient w.r.t. log π_θ) of steadyrl, NaN/inf garbage off the mask."""
    logp = leaf(case.ours(case.theta))
    k = reference_kl(logp=logp, ref_logp=case.ours(case.ref), mask=case.mask, kind=kind, **kw).kl
    total = (k * weights(case)).sum()
    return k, total, grad(total, logp)


def check(case: Case, mine: tuple[torch.Tensor, ...], k: torch.Tensor, logp: torch.Tensor, rtol: float) -> None:
    m = case.mask
    total = (torch.where(m, k, 0.0) * weights(case)).sum()
    g = grad(total, logp)
    assert_close(mine[0][m], k[m], rtol=rtol, atol=rtol)
    assert torch.equal(mine[0][~m], torch.zeros_like(mine[0][~m]))
    assert_close(mine[1], total, rtol=rtol, atol=rtol)
    assert_close(mine[2], g, rtol=rtol, atol=rtol * max(1.0, float(g.abs().max())))


def within(case: Case, bound: float = 20.0) -> Case:
    """log π_ref − log π_θ within ±bound (where TRL's and AReaL's unguarded exp equal our ±20-clamped one)."""
    return case._replace(ref=case.theta + (case.ref - case.theta).clamp(-bound, bound))


# ------------------------------------------------------------------------------------------------------- verl
VERL = {"kl": ("k1", False), "k1": ("k1", False), "abs": ("abs", False), "mse": ("k2", False), "k2": ("k2", False),
        "low_var_kl": ("low_var_kl", False), "k3": ("low_var_kl", False), "k1+": ("k1", True),
        "abs+": ("abs", True), "k2+": ("k2", True), "low_var_kl+": ("low_var_kl", True),
        "k3+": ("low_var_kl", True)}  # fmt: skip


@settings(max_examples=50, deadline=None)
@given(case=cases(), name=st.sampled_from(sorted(VERL)))
def test_verl_kl_penalty(case: Case, name: str) -> None:
    """Every verl name: its ``k3`` is our ``low_var_kl`` (both clamped to ±10); a ``+`` suffix is
    ``straight_through=True`` (the value of the kind, the gradient of k2)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1")
    kind, st_ = VERL[name]
    logp = leaf(case.theta)
    k = core_algos.kl_penalty(logp, case.ref, kl_penalty=name)
    check(case, ours(case, kind, straight_through=st_), k, logp, rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(case=cases(empty=False), kind=st.sampled_from(["k1", "low_var_kl", "k2"]),
       agg=st.sampled_from(["token-mean", "seq-mean-token-mean"]), beta=st.sampled_from([1e-3, 0.5]))  # fmt: skip
def test_verl_kl_loss_term(case: Case, kind: str, agg: str, beta: float) -> None:
    """verl's ``ppo_loss``: pg loss + ``kl_loss_coef`` · ``agg_loss(kl_penalty(...), loss_agg_mode)`` = steadyrl's
    ``kl.type=in_loss`` on the same objective (verl's vanilla loss is PPO-clip with dual clip c = 3)."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1")
    from verl.workers.config import ActorConfig, PolicyLossConfig

    cfg = ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
                      policy_loss=PolicyLossConfig(loss_mode="vanilla"), loss_agg_mode=agg)  # fmt: skip
    logp = leaf(case.theta)
    pg, _ = core_algos.compute_policy_loss_vanilla(
        old_log_prob=case.prox, log_prob=logp, advantages=case.adv_tok, response_mask=case.mask, loss_agg_mode=agg,
        config=cfg,
    )  # fmt: skip
    kl_loss = core_algos.agg_loss(core_algos.kl_penalty(logp, case.ref, kind), case.mask, agg)
    theirs = pg + beta * kl_loss
    mine = leaf(case.ours(case.theta))
    spec = resolve_method("kl_in_loss", {"advantage.type": "given", "agg": agg, "objective.dual_clip": 3.0,
                                         "kl.kind": kind, "kl.beta": beta})  # fmt: skip
    out = compute_loss(spec, batch(case, mine, case.adv_tok, ref_logp=case.ours(case.ref)))
    assert_close(out.loss, theirs, rtol=1e-7, atol=1e-9)
    assert_close(out.metrics["loss/kl"], kl_loss, rtol=1e-7, atol=1e-9)
    g = grad(theirs, logp)
    assert_close(grad(out.loss, mine), g, rtol=1e-7, atol=1e-7 * max(1.0, float(g.abs().max())))


@settings(max_examples=20, deadline=None)
@given(case=cases(), beta=st.sampled_from([1e-3, 0.1]))
def test_verl_kl_in_reward(case: Case, beta: float) -> None:
    """verl's ``compute_rewards`` (k1 of the rollout policy against π_ref, subtracted per token) = ``kl_in_reward``."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1")
    scores = torch.where(case.mask, case.adv_tok, 0.0)
    theirs = core_algos.compute_rewards(scores, case.theta, case.ref, beta)
    out = kl_in_reward(logp=case.ours(case.theta), ref_logp=case.ours(case.ref), mask=case.mask,
                       token_rewards=case.ours(scores), beta=beta, kind="k1")  # fmt: skip
    assert_close(out.token_rewards[case.mask], theirs[case.mask], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------------ SkyRL
SKYRL = {"k1": "k1", "abs": "abs", "k2": "k2", "k3": "low_var_kl"}


@settings(max_examples=30, deadline=None)
@given(case=cases(), name=st.sampled_from(sorted(SKYRL)))
def test_skyrl_compute_approx_kl(case: Case, name: str) -> None:
    """SkyRL's estimators (its k3 clamps x to ±20 and the value to ±10: our ``low_var_kl``), masked like ours."""
    pytest.importorskip("skyrl", reason="skyrl==0.3.0")
    from tests.parity._parity import skyrl_ppo_utils

    ppo = skyrl_ppo_utils()
    logp = leaf(case.theta)
    k = ppo.compute_approx_kl(logp, case.ref, loss_mask=case.mask.to(DT), kl_estimator_type=name)
    check(case, ours(case, SKYRL[name]), k, logp, rtol=1e-12)


@settings(max_examples=20, deadline=None)
@given(case=cases(), beta=st.sampled_from([1e-3, 0.5]))
def test_skyrl_kl_loss_term(case: Case, beta: float) -> None:
    """SkyRL's worker: ``masked_mean(kl, loss_mask, dim=-1).mean()`` whatever the policy's reduction — a row mean
    over all B rows: ``kl.agg='seq-mean-token-mean'``, ``kl.empty_rows='count'``."""
    pytest.importorskip("skyrl", reason="skyrl==0.3.0")
    from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean

    from tests.parity._parity import skyrl_ppo_utils

    ppo = skyrl_ppo_utils()
    m = case.mask.to(DT)
    logp = leaf(case.theta)
    kl = ppo.compute_approx_kl(logp, case.ref, loss_mask=m, kl_estimator_type="k3")
    theirs = masked_mean(kl, m, dim=-1).mean()
    spec = resolve_method("kl_in_loss", {"advantage.type": "given", "kl.beta": beta, "kl.agg": "seq-mean-token-mean",
                                         "kl.empty_rows": "count"})  # fmt: skip
    out = compute_loss(spec, batch(case, leaf(case.ours(case.theta)), case.adv_tok, ref_logp=case.ours(case.ref)))
    assert_close(out.metrics["loss/kl"], theirs, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------- OpenRLHF
@pytest.fixture(scope="module")
def openrlhf_utils() -> Any:
    pytest.importorskip("openrlhf", reason="openrlhf==0.11.2")
    pytest.importorskip("deepspeed", reason="openrlhf/models/utils.py imports deepspeed")
    from tests.parity._parity import openrlhf_module

    return openrlhf_module("openrlhf.models.utils"), openrlhf_module("openrlhf.models.loss")


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", range(6))
def test_openrlhf_compute_approx_kl(openrlhf_utils: Any, name: str, seed: int) -> None:
    """OpenRLHF clamps every estimator's value to ±10 (``value_clamp=10``; its k3 is then our ``low_var_kl``); it
    computes in float32. Its ``unbiased_gradient`` (an importance-weighted k2 gradient) has no steadyrl option."""
    from tests.parity._parity import make_case

    utils, _ = openrlhf_utils
    case = make_case(seed, [5, 3, 0, 1, 4][: 2 + seed % 4], 5, log_scale=1.0)
    logp = leaf(case.theta)
    k = utils.compute_approx_kl(logp, case.ref, kl_estimator=name).to(DT)
    check(case, ours(case, name, value_clamp=ESTIMATOR_VALUE_CLAMP), k, logp, rtol=2e-6)
    if name == "k3":
        logp = leaf(case.theta)
        k = utils.compute_approx_kl(logp, case.ref, kl_estimator=name).to(DT)
        check(case, ours(case, "low_var_kl"), k, logp, rtol=2e-6)


@pytest.mark.parametrize("seed", range(6))
def test_openrlhf_kl_loss_is_a_token_mean(openrlhf_utils: Any, seed: int) -> None:
    """OpenRLHF's actor adds ``aggregate_loss(kl, action_mask)`` (token level) whatever the policy's reduction: with
    GSPO's sequence mean, ``kl.agg='token-mean'`` reproduces it."""
    from tests.parity._parity import make_case

    utils, loss_mod = openrlhf_utils
    case = make_case(seed, [5, 3, 2, 1, 4][: 2 + seed % 4], 5, log_scale=1.0)
    theirs = loss_mod.aggregate_loss(utils.compute_approx_kl(case.theta, case.ref, kl_estimator="k3"),
                                     case.mask.to(DT)).to(DT)  # fmt: skip
    spec = resolve_method("gspo", {"advantage.type": "given", "kl": {"type": "in_loss", "kind": "low_var_kl",
                                   "agg": "token-mean"}})  # fmt: skip
    out = compute_loss(spec, batch(case, leaf(case.ours(case.theta)), case.adv_tok, ref_logp=case.ours(case.ref)))
    assert_close(out.metrics["loss/kl"], theirs, rtol=2e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------- AReaL
@settings(max_examples=30, deadline=None)
@given(case=cases(), name=st.sampled_from(["k1", "k2", "k3"]), clamp=st.booleans())
def test_areal_kl_estimator(case: Case, name: str, clamp: bool) -> None:
    """AReaL's ``KLEstimator`` (float32): ``apply_clamp=True`` is ``value_clamp=10``; unclamped, its k3 has no exp
    guard (equal to ours for |log π_ref − log π_θ| ≤ 20)."""
    pytest.importorskip("areal", reason="areal==1.0.4")
    from areal.utils.data import KLEstimator

    case = within(case)
    logp = leaf(case.theta)
    k = KLEstimator(name, apply_clamp=clamp)(logp, case.ref).to(DT)
    kw = {"value_clamp": ESTIMATOR_VALUE_CLAMP} if clamp else {}
    check(case, ours(case, name, **kw), k, logp, rtol=2e-6)


# --------------------------------------------------------------------------------------------------------- TRL
@settings(max_examples=30, deadline=None)
@given(case=cases(), loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo"]), beta=st.sampled_from([0.04, 1.0]),
       corrected=st.booleans(), level=st.sampled_from(["token", "sequence"]))  # fmt: skip
def test_trl_per_token_kl(case: Case, loss_type: str, beta: float, corrected: bool, level: str) -> None:
    """TRL adds β·k3 per token before its reduction (so the KL term is reduced like the policy term, empty rows
    included); ``use_bias_correction_kl`` multiplies k3 by its ratio ``coef_1`` (``kl.bias_correction``: per token, or
    the sequence ratio under ``importance_sampling_level="sequence"``, where the objective is GSPO)."""
    pytest.importorskip("trl", reason="trl==1.16.0")
    from tests.parity._parity import trl_loss

    case = within(case)
    T = case.mask.shape[1]
    logp = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_tok, "old_per_token_logps": case.prox,
              "ref_per_token_logps": case.ref}  # fmt: skip
    loss, _ = trl_loss(logp, inputs, loss_type=loss_type, beta=beta, use_bias_correction_kl=corrected,
                       importance_sampling_level=level, max_completion_length=T)  # fmt: skip
    agg, rows = {"grpo": ("seq-mean-token-mean", "count"), "bnpo": ("token-mean", "skip"),
                 "dr_grpo": ("seq-mean-token-sum-norm", "skip")}[loss_type]  # fmt: skip
    method = "gspo" if level == "sequence" else "ppo"
    spec = resolve_method(method, {
        "advantage.type": "given", "agg": agg, "objective.empty_rows": rows, "objective.clip_low": 0.2,
        "objective.clip_high": 0.2,
        "kl": {"type": "in_loss", "kind": "k3", "beta": beta, "bias_correction": level if corrected else "none"},
    })  # fmt: skip
    mine = leaf(case.ours(case.theta))
    out = compute_loss(spec, batch(case, mine, case.adv_tok, ref_logp=case.ours(case.ref)))
    assert_close(out.loss, loss, rtol=1e-9, atol=1e-9)
    g = grad(loss, logp)
    assert_close(grad(out.loss, mine), g, rtol=1e-9, atol=1e-9 * max(1.0, float(g.abs().max())))
