"""Clip-Cov / KL-Cov parity with every installed framework that ships them: verl 0.9.1 (``loss_mode="clip_cov"`` /
``"kl_cov"``) and SkyRL 0.3.0 (``PolicyLossType.CLIP_COV`` / ``KL_COV``).

Each test calls the framework's own function and ``compute_loss("clip_cov" | "kl_cov")`` (``advantage.type=given``,
the framework's token advantages) on hypothesis batches (heavy-tailed advantages, log-ratios up to ±20, garbage off
the mask, empty rows) and compares the loss, its gradient w.r.t. log π_θ and the selected fraction. The mapping:

* verl: ``clip_ratio_low``/``clip_ratio_high`` = ``clip_low``/``clip_high``, ``policy_loss.clip_cov_ratio`` /
  ``clip_cov_lb`` / ``clip_cov_ub`` = ``frac`` / ``cov_lb`` / ``cov_ub``; ``policy_loss.kl_cov_ratio`` /
  ``ppo_kl_coef`` = ``frac`` / ``coef``; ``loss_agg_mode`` = ``agg``. ``actor/pg_clipfrac`` (Clip-Cov) =
  ``cov/selected_frac``, ``actor/ppo_kl`` (KL-Cov) = ``kl_cov/abs_log_ratio_mean``.
* SkyRL: ``clip_cov.clip_ratio`` / ``clip_cov_lb`` / ``clip_cov_ub``, ``eps_clip_low``/``eps_clip_high``;
  ``kl_cov.kl_cov_frac`` / ``ppo_kl_coef``; the loss is the token sum (``agg=seq-mean-token-sum-norm``,
  ``norm_len=1``, times B) of the advantages it is given (SkyRL's trainer pre-scales them; the covariance then sees
  the scaled values, so its absolute bounds ω mean something else there).

Clip-Cov's random draw: both frameworks draw ``torch.randperm`` over their row-major candidate list. The
deterministic part (covariance, candidates, count, zeroed tokens, denominators) is tested exactly with ``frac = 1``
(every candidate is drawn); the draw itself by steering: ``torch.randperm`` is replaced, for the framework's call
only, by a permutation that puts steadyrl's drawn tokens first (steadyrl's draw from the spec's seed, recomputed with
``cov_penalty.clip_cov_selection``), so the framework zeroes the same tokens; the uniformity of steadyrl's draw is
tested in tests/core/objectives/test_cov_penalty.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss
from steadyrl.core.masking import safe_exp
from steadyrl.core.objectives import cov_penalty, ppo
from tests.parity._parity import Case, assert_close, batch, cases, grad, leaf, make_case, skyrl_ppo_utils

EXAMPLES = 15
SEED = 7


def ours(name: str, case: Case, **overrides: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logp = leaf(case.ours(case.theta))
    out = compute_loss(name, batch(case, logp, case.adv_tok), overrides={"advantage.type": "given", **overrides})
    return out.loss, grad(out.loss, logp), out.metrics


def our_draw(case: Case, el: float, eh: float, frac: float, lb: float, ub: float) -> cov_penalty.CovSelection:
    """The tokens ``compute_loss("clip_cov", objective.seed=SEED)`` draws on ``case`` (learner version unknown)."""
    x = ppo.prepare_token_inputs(logp=case.ours(case.theta), prox_logp=case.ours(case.prox),
                                 advantages=case.ours(case.adv_tok), mask=case.mask)  # fmt: skip
    r = safe_exp(x.log_ratio)
    clipped = ppo.clipped_surrogate(ratio=r, advantages=x.advantages, lower=torch.tensor(1.0 - el, dtype=r.dtype),
                                    upper=torch.tensor(1.0 + eh, dtype=r.dtype)).clipped  # fmt: skip
    return cov_penalty.clip_cov_selection(
        logp=case.ours(case.theta), advantages=x.advantages, mask=x.mask, ppo_clipped=clipped,
        frac=frac, cov_lb=lb, cov_ub=ub, generator=cov_penalty.selection_generator(SEED, None, "cpu"),
    )  # fmt: skip


def steer_randperm(monkeypatch: pytest.MonkeyPatch, sel: cov_penalty.CovSelection) -> None:
    """Make the framework's ``torch.randperm(n)`` put steadyrl's drawn candidates first (row-major candidate order)."""
    drawn = sel.selected[sel.candidates]  # [n_candidates] bool, in the order of torch.nonzero(candidates)
    order = torch.cat([drawn.nonzero().flatten(), (~drawn).nonzero().flatten()])

    def fake(n: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert n == order.numel(), (n, order.numel())  # the same candidates on both sides
        return order.clone()

    monkeypatch.setattr(torch, "randperm", fake)


COV_WINDOWS = [(1.0, 5.0), (0.05, 2.0), (-1.0, 50.0)]  # the paper's ω, and windows wide enough to hold candidates
FRACS = [1.0, 0.2, 2e-4]  # 1: every candidate; 0.2 and 2e-4 (the paper's ρ, one token): a steered draw


# -------------------------------------------------------------------------------------------------------- verl
def verl_config(loss_mode: str, agg: str, **kw: Any) -> Any:
    from verl.workers.config import ActorConfig, PolicyLossConfig

    policy = {k: kw.pop(k) for k in list(kw) if k.startswith(("clip_cov", "kl_cov", "ppo_kl"))}
    return ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy), loss_agg_mode=agg, **kw,
    )  # fmt: skip


def check_verl_clip_cov(case: Case, agg: str, el: float, eh: float, lb: float, ub: float, frac: float) -> int:
    """verl's Clip-Cov, its draw steered to steadyrl's, against ``compute_loss``; returns how many tokens were drawn."""
    from verl.trainer.ppo import core_algos

    config = verl_config("clip_cov", agg, clip_ratio_low=el, clip_ratio_high=eh, clip_cov_ratio=frac,
                         clip_cov_lb=lb, clip_cov_ub=ub)  # fmt: skip
    theta = leaf(case.theta)
    sel = our_draw(case, el, eh, frac, lb, ub)
    with pytest.MonkeyPatch.context() as mp:
        steer_randperm(mp, sel)
        loss, metrics = core_algos.get_policy_loss_fn("clip_cov")(
            old_log_prob=case.prox, log_prob=theta, advantages=case.adv_tok, response_mask=case.mask,
            loss_agg_mode=agg, config=config, rollout_is_weights=None,
        )  # fmt: skip
    overrides = {"agg": agg, "objective.clip_low": el, "objective.clip_high": eh, "objective.frac": frac,
                 "objective.cov_lb": lb, "objective.cov_ub": ub, "objective.seed": SEED}  # fmt: skip
    ref, g, m = ours("clip_cov", case, **overrides)
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)
    assert_close(m["cov/selected_frac"], metrics["actor/pg_clipfrac"], rtol=0, atol=1e-6)
    return int(sel.selected.sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize(("el", "eh"), [(1.0, 1.0), (0.2, 0.28)])  # the authors' Clip-Cov scripts; DAPO's clip
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), window=st.sampled_from(COV_WINDOWS), frac=st.sampled_from(FRACS))
def test_verl_clip_cov(case: Case, agg: str, el: float, eh: float, window: tuple[float, float], frac: float) -> None:
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    assume(bool(case.mask.any()))  # verl's means of nothing are NaN; steadyrl's exact 0 is tested elsewhere
    check_verl_clip_cov(case, agg, el, eh, *window, frac)


def test_verl_clip_cov_on_a_case_where_the_draw_is_a_real_subset() -> None:
    """Not vacuous: on a fixed case the steered draw zeroes some candidates and not others, and verl agrees."""
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    case = make_case(3, [7, 7, 5, 7, 6, 7], 7, 1.0)
    sel = our_draw(case, 0.2, 0.28, 0.2, -1.0, 50.0)
    assert 0 < int(sel.selected.sum()) < int(sel.candidates.sum())
    assert check_verl_clip_cov(case, "token-mean", 0.2, 0.28, -1.0, 50.0, 0.2) == int(sel.selected.sum())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), frac=st.sampled_from([2e-3, 0.2, 1.0]), coef=st.sampled_from([1.0, 0.1]))
def test_verl_kl_cov(case: Case, agg: str, frac: float, coef: float) -> None:
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    from verl.trainer.ppo import core_algos

    assume(bool(case.mask.any()))
    config = verl_config("kl_cov", agg, kl_cov_ratio=frac, ppo_kl_coef=coef)
    theta = leaf(case.theta)
    loss, metrics = core_algos.get_policy_loss_fn("kl_cov")(
        old_log_prob=case.prox, log_prob=theta, advantages=case.adv_tok, response_mask=case.mask, loss_agg_mode=agg,
        config=config, rollout_is_weights=None,
    )  # fmt: skip
    ref, g, m = ours("kl_cov", case, agg=agg, **{"objective.frac": frac, "objective.coef": coef})
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)
    assert_close(m["kl_cov/abs_log_ratio_mean"], metrics["actor/ppo_kl"], rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------------------- SkyRL
def skyrl_config(**fields: Any) -> Any:
    from skyrl.train.config.config import AlgorithmConfig

    return dataclasses.replace(AlgorithmConfig(), **fields)


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), window=st.sampled_from(COV_WINDOWS), frac=st.sampled_from(FRACS))
def test_skyrl_clip_cov(case: Case, window: tuple[float, float], frac: float) -> None:
    pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")
    ppo_utils = skyrl_ppo_utils()
    from skyrl.train.config.config import ClipCovConfig

    lb, ub = window
    el, eh = 0.2, 0.2  # SkyRL's eps_clip defaults
    cfg = skyrl_config(policy_loss_type="clip_cov", eps_clip_low=el, eps_clip_high=eh,
                       clip_cov=ClipCovConfig(clip_ratio=frac, clip_cov_lb=lb, clip_cov_ub=ub))  # fmt: skip
    theta = leaf(case.theta)
    with pytest.MonkeyPatch.context() as mp:
        steer_randperm(mp, our_draw(case, el, eh, frac, lb, ub))
        loss, metrics = ppo_utils.PolicyLossRegistry.get("clip_cov")(
            theta, case.prox, case.adv_tok, config=cfg, loss_mask=case.mask.to(torch.float64), rollout_logprobs=None
        )
    overrides = {"agg": "seq-mean-token-sum-norm", "norm_len": 1, "objective.clip_low": el,
                 "objective.clip_high": eh, "objective.frac": frac, "objective.cov_lb": lb, "objective.cov_ub": ub,
                 "objective.seed": SEED}  # fmt: skip
    ref, g, m = ours("clip_cov", case, **overrides)
    B = case.mask.shape[0]
    assert_close(ref * B, loss, rtol=1e-6, atol=1e-9)
    assert_close(g * B, grad(loss, theta), rtol=1e-6, atol=1e-9)
    assert abs(float(m["cov/selected_frac"]) - metrics["clip_ratio"]) < 1e-6


@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases(), frac=st.sampled_from([2e-3, 0.2, 1.0]), coef=st.sampled_from([1.0, 0.1]))
def test_skyrl_kl_cov(case: Case, frac: float, coef: float) -> None:
    pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")
    ppo_utils = skyrl_ppo_utils()
    from skyrl.train.config.config import KLCovConfig

    cfg = skyrl_config(policy_loss_type="kl_cov", kl_cov=KLCovConfig(kl_cov_frac=frac, ppo_kl_coef=coef))
    theta = leaf(case.theta)
    loss, _ = ppo_utils.PolicyLossRegistry.get("kl_cov")(
        theta, case.prox, case.adv_tok, config=cfg, loss_mask=case.mask.to(torch.float64), rollout_logprobs=None
    )
    overrides = {"agg": "seq-mean-token-sum-norm", "norm_len": 1, "objective.frac": frac, "objective.coef": coef}
    ref, g, _ = ours("kl_cov", case, **overrides)
    B = case.mask.shape[0]
    assert_close(ref * B, loss, rtol=1e-6, atol=1e-9)
    assert_close(g * B, grad(loss, theta), rtol=1e-6, atol=1e-9)
