"""GRPO advantages (``advantage.type=grpo``: scale, eps, unbiased, batch_std, singleton) against the frameworks.

verl 0.9.1 ``compute_grpo_outcome_advantage`` (and its vectorized twin, float32), SkyRL 0.3.0's ``grpo`` estimator,
AReaL 1.0.4 ``Normalization`` (its ``reward_norm`` with group / batch levels) and TRL 1.16.0's advantages, computed
inline in ``GRPOTrainer._generate_and_score_completions`` (run here on a tiny local model with a reward function that
returns heavy-tailed rewards; ``scale_rewards`` group / batch / none). steadyrl's advantages are read from
``compute_loss(..., return_details=True)``, so the spec options are what is tested. Rewards are heavy-tailed; groups
have 1–4 members (verl and SkyRL give a group of one mean 0 and std 1: ``singleton='reward'``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss, resolve_method
from steadyrl.core.advantages.grpo import AREAL_STD_EPS, TRL_STD_EPS, VERL_STD_EPS
from tests.parity._parity import DT, assert_close, heavy

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations inside TRL


def groups_case(seed: int, sizes: list[int], T: int = 4) -> dict[str, torch.Tensor]:
    """Groups of the given sizes (ids 0..G−1), heavy-tailed rewards, rows of 0..T tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    B = int(ids.shape[0])
    perm = torch.randperm(B, generator=g)  # members need not be contiguous
    ids = ids[perm]
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return {"ids": ids, "rewards": heavy(g, B), "mask": mask}


def ours(x: dict[str, torch.Tensor], **adv: Any) -> torch.Tensor:
    """[B, T] token advantages steadyrl's ``grpo`` hands the objective (0 off the mask)."""
    B, T = x["mask"].shape
    spec = resolve_method("grpo", {f"advantage.{k}": v for k, v in adv.items()})
    logp = torch.zeros(B, T, dtype=DT, requires_grad=True)
    b = {"logp": logp, "behav_logp": torch.zeros(B, T, dtype=DT), "mask": x["mask"], "rewards": x["rewards"],
         "group_ids": x["ids"]}  # fmt: skip
    return compute_loss(spec, b, return_details=True).advantages


def token_rewards(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The outcome reward on the last response token (position 0 for an empty row), as verl and SkyRL take it."""
    B, T = x["mask"].shape
    last = (x["mask"].sum(-1) - 1).clamp(min=0)
    out = torch.zeros(B, T, dtype=DT)
    out[torch.arange(B), last] = x["rewards"]
    return out


sizes = st.lists(st.integers(1, 4), min_size=1, max_size=5)


# ------------------------------------------------------------------------------------------------------- verl
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sizes=sizes, norm=st.booleans(), eps=st.sampled_from([VERL_STD_EPS, 1e-2]))
def test_verl_grpo(seed: int, sizes: list[int], norm: bool, eps: float) -> None:
    """``norm_adv_by_std_in_grpo`` ↔ ``scale`` group / none; ``epsilon`` ↔ ``eps``; a group of one: mean 0, std 1."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1")
    x = groups_case(seed, sizes)
    index = np.array([f"uid-{int(i)}" for i in x["ids"]], dtype=object)
    theirs, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards(x), response_mask=x["mask"].to(DT), index=index, epsilon=eps,
        norm_adv_by_std_in_grpo=norm,
    )  # fmt: skip
    mine = ours(x, scale="group" if norm else "none", eps=eps, singleton="reward")
    assert_close(mine, theirs, rtol=1e-7, atol=1e-12)  # verl's lone-group std 1 is a float32 tensor: 1 + ε in float32
    if 1 in sizes and norm:  # the default (a lone response gets 0) differs exactly there
        alone = (x["ids"][:, None] == x["ids"][None, :]).sum(-1) == 1
        default = ours(x, scale="group", eps=eps)
        assert torch.equal(default[alone], torch.zeros_like(default[alone]))


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sizes=sizes, norm=st.booleans())
def test_verl_grpo_vectorized(seed: int, sizes: list[int], norm: bool) -> None:
    """``grpo_vectorized`` (float32 group statistics) agrees to float32 precision."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1")
    x = groups_case(seed, sizes)
    theirs, _ = core_algos.compute_grpo_vectorized_outcome_advantage(
        token_level_rewards=token_rewards(x), response_mask=x["mask"].to(DT), index=x["ids"].numpy(),
        norm_adv_by_std_in_grpo=norm,
    )  # fmt: skip
    mine = ours(x, scale="group" if norm else "none", singleton="reward")
    assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * max(1.0, float(mine.abs().max())))


# ------------------------------------------------------------------------------------------------------ SkyRL
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sizes=sizes, norm=st.booleans())
def test_skyrl_grpo(seed: int, sizes: list[int], norm: bool) -> None:
    """SkyRL's ``grpo`` estimator (ported from verl): the same options."""
    pytest.importorskip("skyrl", reason="skyrl==0.3.0")
    from tests.parity._parity import skyrl_ppo_utils

    ppo = skyrl_ppo_utils()
    x = groups_case(seed, sizes)
    index = np.array([f"p{int(i)}" for i in x["ids"]], dtype=object)
    theirs, _ = ppo.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards(x), response_mask=x["mask"].to(DT), index=index, epsilon=VERL_STD_EPS,
        grpo_norm_by_std=norm,
    )  # fmt: skip
    assert_close(ours(x, scale="group" if norm else "none", singleton="reward"), theirs, rtol=1e-7, atol=1e-12)


# ------------------------------------------------------------------------------------------------------- AReaL
AREAL = {("group", "group"): {"scale": "group"}, ("group", "batch"): {"scale": "batch", "batch_std": "centered"},
         ("group", None): {"scale": "none"}}  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), G=st.integers(1, 4), n=st.integers(1, 4), levels=st.sampled_from(sorted(AREAL,
       key=str)), unbiased=st.booleans(), eps=st.sampled_from([AREAL_STD_EPS, 1e-2]))  # fmt: skip
def test_areal_reward_norm(seed: int, G: int, n: int, levels: tuple[str, Any], unbiased: bool, eps: float) -> None:
    """AReaL's ``Normalization`` of the rewards (``reward_norm``, contiguous groups of ``group_size``): the group mean
    with the group std, the batch std of the group-centred rewards (``batch_std='centered'``) or no std. AReaL
    returns float32 (computed in float64)."""
    pytest.importorskip("areal", reason="areal==1.0.4")
    from areal.api.cli_args import NormConfig
    from areal.utils.data import Normalization

    x = groups_case(seed, [G] * n)
    x["ids"] = torch.arange(G * n) // G  # AReaL's groups are contiguous slices
    cfg = NormConfig(mean_level=levels[0], std_level=levels[1], group_size=G, eps=eps, std_unbiased=unbiased)
    theirs = Normalization(cfg)(x["rewards"]).to(DT)
    mine = ours(x, eps=eps, unbiased=unbiased, **AREAL[levels])
    expected = torch.where(x["mask"], theirs[:, None].expand_as(x["mask"]), 0.0)
    assert_close(mine, expected, rtol=1e-6, atol=1e-6 * max(1.0, float(mine.abs().max())))


# --------------------------------------------------------------------------------------------------------- TRL
class _Rewards:
    """A TRL reward function returning heavy-tailed rewards, remembering the last list it returned."""

    def __init__(self) -> None:
        self.__name__ = "heavy_reward"
        self.g = torch.Generator().manual_seed(0)
        self.last: list[float] = []

    def __call__(self, completions: list[Any], **_: Any) -> list[float]:
        self.last = heavy(self.g, len(completions)).tolist()
        return self.last


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    trl = pytest.importorskip("trl", reason="trl==1.16.0")
    datasets = pytest.importorskip("datasets")
    from transformers.utils import logging as hf_logging

    from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
    from steadyrl.models.tokenizer import build_char_tokenizer

    hf_logging.set_verbosity_error()
    path: Path = tmp_path_factory.mktemp("trl-grpo-adv")
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                             tokenizer=tok, seed=0)  # fmt: skip
    args = trl.GRPOConfig(output_dir=str(path), per_device_train_batch_size=12, num_generations=4,
                          max_completion_length=4, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                          disable_tqdm=True, seed=0, beta=0.0)  # fmt: skip
    reward = _Rewards()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(
            model=model, reward_funcs=reward, args=args, processing_class=tok,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["1+1=", "22+3=", "4+4="]}),
        )  # fmt: skip
    trainer.model.train()
    return trainer, reward


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_trl_scale_rewards(trl_trainer: Any, scale: str) -> None:
    """TRL's advantages from its own generate-and-score step: group mean, then divided by the group's std
    (``group``), the std of all rewards around the batch mean (``batch``), or nothing, + 1e-4; rewards in float32."""
    trainer, reward = trl_trainer
    trainer.scale_rewards = scale
    samples = next(iter(trainer.get_train_dataloader()))  # 3 prompts × 4 generations, each prompt's rows consecutive
    with torch.no_grad():
        out = trainer._generate_and_score_completions(samples)
    rewards = torch.tensor(reward.last, dtype=torch.float32).to(DT)  # TRL holds its rewards in float32
    B = rewards.shape[0]
    x = {"ids": torch.arange(B) // 4, "rewards": rewards, "mask": torch.ones(B, 1, dtype=torch.bool)}
    mine = ours(x, scale=scale, eps=TRL_STD_EPS)[:, 0]
    theirs = out["advantages"].to(DT)
    assert float(theirs.abs().max()) > 0.1, "the rewards must vary"
    assert_close(mine, theirs, rtol=1e-5, atol=1e-5 * max(1.0, float(mine.abs().max())))
