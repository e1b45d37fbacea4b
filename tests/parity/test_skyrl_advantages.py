"""SkyRL 0.3.0's ``rloo`` and ``reinforce++`` advantage estimators (``ppo_utils``) against steadyrl's ``rloo``
(a group of one gets A = 0: ``advantage.singleton=zero``, the default) and ``reinforce_pp`` (``advantage.gamma``):
the token advantages ``compute_loss(..., return_details=True)`` hands the objective, on the same float64 batches
(prefix masks, as SkyRL's responses). Batches whose whitened values are all equal are left out (SkyRL's masked mean
divides by Σm + 1e-8, leaving a ~1e-4 residue where steadyrl gives exact zeros), and so are single-token batches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings

from tests.parity._parity import Case, assert_close, skyrl_ppo_utils
from tests.parity.test_verl_dro_advantages import _ours, _token_rewards, reward_batches

pytest.importorskip("skyrl", reason="needs skyrl==0.3.0")


@settings(max_examples=15, deadline=None)
@given(data=reward_batches())
def test_skyrl_rloo(data: tuple[Case, torch.Tensor, np.ndarray]) -> None:
    case, rewards, ids = data
    theirs, _ = skyrl_ppo_utils().compute_rloo_outcome_advantage(
        token_level_rewards=_token_rewards(case, rewards), response_mask=case.mask.to(torch.float64), index=ids
    )
    assert_close(_ours(case, rewards, ids, "rloo"), torch.where(case.mask, theirs, 0.0), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@settings(max_examples=15, deadline=None)
@given(data=reward_batches())
def test_skyrl_reinforce_plus_plus(data: tuple[Case, torch.Tensor, np.ndarray], gamma: float) -> None:
    case, rewards, ids = data
    assume(int(case.mask.sum()) >= 2)
    theirs, _ = skyrl_ppo_utils().compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=_token_rewards(case, rewards), response_mask=case.mask.to(torch.float64), gamma=gamma
    )
    assume(float(theirs[case.mask].abs().max()) > 1e-2)
    mine = _ours(case, rewards, ids, "reinforce_pp", **{"advantage.gamma": gamma})
    assert_close(mine, torch.where(case.mask, theirs, 0.0), rtol=1e-7, atol=1e-7)
