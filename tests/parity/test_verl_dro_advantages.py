"""verl 0.9.1's DRO loss, ``token-sum`` aggregation and the RLOO / REINFORCE++ advantage estimators against
steadyrl's ``dro`` objective, ``agg="token-sum"`` and the ``rloo`` / ``reinforce_pp`` / ``reinforce_pp_baseline``
advantages, called through ``compute_loss`` on the same float64 batches.

* ``compute_policy_loss_dro`` (``policy_loss.dro_beta`` = ``objective.beta``): loss and gradient w.r.t. log π_θ,
  for each ``loss_agg_mode``, with and without ``rollout_is_weights`` (steadyrl: a ``token_tis`` correction with no
  cap, whose weight is the same π_prox/μ).
* ``agg_loss(loss_agg_mode="token-sum")``: ``masking.aggregate(mode="token-sum")``.
* ``rloo`` (loop form: a group of one keeps A = R, ``advantage.singleton=reward``) and ``rloo_vectorized`` (A = 0,
  the default); ``reinforce_plus_plus`` (``algorithm.gamma``) and ``reinforce_plus_plus_baseline``: the token
  advantages ``compute_loss(..., return_details=True)`` hands the objective. verl's whitening raises on fewer than
  two trained tokens; those batches are left out, and so are batches whose values are all equal: verl's masked mean
  divides by Σm + 1e-8, so it whitens a constant to ~1e-8·rsqrt(1e-8) = ~1e-4 where steadyrl gives exact zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss
from steadyrl.core.masking import aggregate
from tests.parity._parity import DT, Case, assert_close, batch, cases, grad, leaf

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs verl==0.9.1")

EXAMPLES = 15


def _actor_config(agg: str, beta: float) -> Any:
    from verl.workers.config import ActorConfig, PolicyLossConfig

    return ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1, loss_agg_mode=agg,
        policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=beta),
    )  # fmt: skip


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"])
@pytest.mark.parametrize("beta", [0.1, 1.5])
@pytest.mark.parametrize("weighted", [False, True])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_verl_dro(case: Case, agg: str, beta: float, weighted: bool) -> None:
    assume(bool(case.mask.any()))  # verl's means of nothing are NaN; steadyrl's exact 0 is tested elsewhere
    theta = leaf(case.theta)
    log_w = torch.where(case.mask, case.prox - case.behav, 0.0)
    w = torch.exp(log_w) if weighted else None
    loss, _ = core_algos.get_policy_loss_fn("dro")(
        old_log_prob=case.prox, log_prob=theta, advantages=case.adv_tok, response_mask=case.mask, loss_agg_mode=agg,
        config=_actor_config(agg, beta), rollout_is_weights=w,
    )  # fmt: skip
    logp = leaf(case.ours(case.theta))
    b = batch(case, logp, case.adv_tok)
    method = "dro+token_tis" if weighted else "dro"
    overrides: dict[str, Any] = {"advantage.type": "given", "agg": agg, "objective.beta": beta}
    if weighted:
        b["behav_logp"] = case.ours(case.behav)
        overrides["token_tis.cap"] = None
    out = compute_loss(method, b, overrides=overrides)
    assert_close(out.loss, loss, rtol=1e-7, atol=1e-9)  # verl adds 1e-8 to the row lengths
    assert_close(grad(out.loss, logp), grad(loss, theta), rtol=1e-7, atol=1e-9)


@settings(max_examples=50, deadline=None)
@given(case=cases())
def test_verl_token_sum(case: Case) -> None:
    x = leaf(case.adv_tok)
    theirs = core_algos.agg_loss(x, case.mask, "token-sum")
    y = leaf(case.ours(case.adv_tok))
    mine = aggregate(y, case.mask, "token-sum")
    assert_close(mine, theirs)
    assert_close(grad(mine, y), torch.where(case.mask, grad(theirs, x), 0.0))


# ------------------------------------------------------------------------------------------------- advantages
@st.composite
def reward_batches(draw: Any) -> tuple[Case, torch.Tensor, np.ndarray]:
    """A case whose rows are split into prompt groups (sizes 1–4, shuffled), with real-valued rewards."""
    case = draw(cases(max_B=8, empty=False))
    B = case.mask.shape[0]
    ids = np.array(draw(st.lists(st.integers(0, min(3, B - 1)), min_size=B, max_size=B)))  # ids in [0, B)
    rewards = torch.tensor(draw(st.lists(st.floats(-3, 3), min_size=B, max_size=B)), dtype=DT)
    return case, rewards, ids


def _token_rewards(case: Case, rewards: torch.Tensor) -> torch.Tensor:
    """verl's token_level_rewards: the outcome reward on each row's last trained token."""
    last = case.mask.long().cumsum(-1).argmax(-1)
    out = torch.zeros_like(case.theta)
    out[torch.arange(len(rewards)), last] = rewards
    return out


def _ours(case: Case, rewards: torch.Tensor, ids: np.ndarray, method: str, **overrides: Any) -> torch.Tensor:
    logp = leaf(case.ours(case.theta))
    b = batch(case, logp, case.adv_tok) | {"rewards": rewards, "group_ids": torch.as_tensor(ids)}
    return compute_loss(method, b, overrides=overrides, return_details=True).advantages


@pytest.mark.parametrize(("verl_name", "singleton"), [("rloo", "reward"), ("rloo_vectorized", "zero")])
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=reward_batches())
def test_verl_rloo(data: tuple[Case, torch.Tensor, np.ndarray], verl_name: str, singleton: str) -> None:
    case, rewards, ids = data
    theirs, _ = core_algos.get_adv_estimator_fn(verl_name)(
        token_level_rewards=_token_rewards(case, rewards), response_mask=case.mask.to(DT), index=ids
    )
    mine = _ours(case, rewards, ids, "rloo", **{"advantage.singleton": singleton})
    assert_close(mine, torch.where(case.mask, theirs, 0.0), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("gamma", [1.0, 0.95])
@settings(max_examples=EXAMPLES, deadline=None)
@given(data=reward_batches())
def test_verl_reinforce_plus_plus(data: tuple[Case, torch.Tensor, np.ndarray], gamma: float) -> None:
    from verl.trainer.config import AlgoConfig

    case, rewards, ids = data
    assume(int(case.mask.sum()) >= 2)  # verl's unbiased whitening raises below two tokens
    theirs, _ = core_algos.get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=_token_rewards(case, rewards), response_mask=case.mask.to(DT),
        config=AlgoConfig(gamma=gamma),
    )  # fmt: skip
    assume(float(theirs[case.mask].abs().max()) > 1e-2)  # not a constant whitened to verl's ~1e-4 residue
    mine = _ours(case, rewards, ids, "reinforce_pp", **{"advantage.gamma": gamma})
    assert_close(mine, torch.where(case.mask, theirs, 0.0), rtol=1e-7, atol=1e-7)


@settings(max_examples=EXAMPLES, deadline=None)
@given(data=reward_batches())
def test_verl_reinforce_plus_plus_baseline(data: tuple[Case, torch.Tensor, np.ndarray]) -> None:
    case, rewards, ids = data
    assume(int(case.mask.sum()) >= 2)
    theirs, _ = core_algos.get_adv_estimator_fn("reinforce_plus_plus_baseline")(
        token_level_rewards=_token_rewards(case, rewards), response_mask=case.mask.to(DT), index=ids
    )
    assume(float(theirs[case.mask].abs().max()) > 1e-2)  # not a constant whitened to verl's ~1e-4 residue
    mine = _ours(case, rewards, ids, "reinforce_pp_baseline")
    assert_close(mine, torch.where(case.mask, theirs, 0.0), rtol=1e-7, atol=1e-7)
