"""COPC's critic in the loop: hidden-state alignment, value loss and explained variance against float64 references,
targets equal COPC's returns, the critic learns, trunk_grad leaves the actor alone, skip, and `steadyrl train` end to
end with an exact resume."""

from __future__ import annotations

import copy
import dataclasses
import statistics
from pathlib import Path

import pytest
import torch

from steadyrl.config.critic import CriticConfig
from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import OptimConfig, TrainConfig
from steadyrl.control import build_controllers
from steadyrl.core.advantages.vtrace import copc_advantages
from steadyrl.core.kl import last_token_mask
from steadyrl.methods import compute_loss, resolve_method
from steadyrl.methods.compose import copc_value_targets
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train.checkpoint import list_checkpoints
from steadyrl.train.critic import Critic, explained_variance, value_loss
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]
G = 4
CRITIC_KEYS = {"critic/loss", "critic/explained_var", "critic/value_mean", "copc/masked_frac"}


@pytest.fixture
def model() -> torch.nn.Module:
    return build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)


def _rollouts(model: torch.nn.Module, seed: int = 0) -> Rollouts:
    """Prompts of different lengths (left padding) and responses cut by EOS at different lengths (right padding)."""
    return generate(
        model, build_char_tokenizer(), PROMPTS, group_size=G, max_new_tokens=6, version=0,
        generator=torch.Generator().manual_seed(seed), eos_token_ids=[20, 21, 22],
    )  # fmt: skip


def _learner(model: torch.nn.Module, critic: CriticConfig, lr: float = 1e-2, **optim) -> Learner:
    spec = resolve_method("copc")
    return Learner(model=model, method=spec, controllers=build_controllers(spec), lr=lr, optim=OptimConfig(**optim),
                   log=lambda _: None, critic=critic)  # fmt: skip


# ------------------------------------------------------------------------------------------- hidden states
def test_hidden_state_at_t_is_the_state_before_y_t(model) -> None:
    rollouts = _rollouts(model)
    assert not rollouts.response_mask.all() and not rollouts.prompt_mask.all()  # padding on both sides
    with torch.no_grad():
        plain = sequence_logprobs(model, rollouts)
        out = sequence_logprobs(model, rollouts, return_hidden=True)
    N, T = rollouts.response_ids.shape
    assert out.hidden.shape == (N, T, ARCH.hidden_size)
    assert torch.equal(out.logp, plain.logp)  # the default path's log-probs are unchanged
    assert torch.all(out.hidden[~rollouts.response_mask.bool()] == 0)
    checked = 0
    for i in range(N):
        prompt = rollouts.prompt_ids[i][rollouts.prompt_mask[i].bool()]
        response = rollouts.response_ids[i][rollouts.response_mask[i].bool()]
        for t in range(len(response)):
            prefix = torch.cat([prompt, response[:t]]).unsqueeze(0)  # x, y_<t: the state s_t before y_t is emitted
            with torch.no_grad():
                h = model(prefix, output_hidden_states=True).hidden_states[-1][0, -1]
                logp_t = torch.log_softmax(model.lm_head(h), -1)[response[t]]
            torch.testing.assert_close(out.hidden[i, t], h, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.logp[i, t], logp_t, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked == int(rollouts.response_mask.sum())


def test_hidden_states_carry_the_gradient_and_the_empty_batch(model) -> None:
    rollouts = _rollouts(model)
    out = sequence_logprobs(model, rollouts, return_hidden=True)
    assert out.hidden.requires_grad and out.logp.requires_grad
    tok = rollouts.tokens
    empty = tok._replace(response_ids=tok.response_ids[:, :0], response_mask=tok.response_mask[:, :0])
    logp, entropy, hidden = sequence_logprobs(model, empty, return_hidden=True, return_entropy=True)
    assert logp.shape == entropy.shape == (len(PROMPTS) * G, 0) and hidden.shape == (*logp.shape, ARCH.hidden_size)


def test_critic_value_is_the_head_on_the_hidden_state(model) -> None:
    rollouts = _rollouts(model)
    critic = Critic(ARCH.hidden_size, CriticConfig())
    assert torch.all(critic.head.weight == 0) and torch.all(critic.head.bias == 0)  # V ≡ 0 at the start
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(1))
    torch.nn.init.constant_(critic.head.bias, 0.3)
    with torch.no_grad():
        hidden = sequence_logprobs(model, rollouts, return_hidden=True).hidden
        V = critic.values(hidden, rollouts.response_mask)
    m = rollouts.response_mask.bool()
    want = torch.where(m, hidden.double() @ critic.head.weight.double()[0] + 0.3, torch.zeros((), dtype=torch.double))
    torch.testing.assert_close(V.double(), want, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------ loss formulas
def _random(seed: int, B: int = 5, T: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    V = torch.randn(B, T, generator=g, dtype=torch.float64)
    target = 2 * torch.randn(B, T, generator=g, dtype=torch.float64) + 0.5
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[0] = False  # an empty row
    mask[1, 0] = True
    return V, target, mask


@pytest.mark.parametrize("seed", range(5))
def test_value_loss_and_its_gradient_match_a_float64_loop(seed: int) -> None:
    V, target, mask = _random(seed)
    V.requires_grad_(True)
    loss = value_loss(V, target, mask)
    loss.backward()
    n = int(mask.sum())
    ref = 0.0
    ref_grad = torch.zeros_like(V)
    for i in range(V.shape[0]):
        for t in range(V.shape[1]):
            if mask[i, t]:
                d = float(V[i, t].detach()) - float(target[i, t])
                ref += 0.5 * d * d / n  # ½ · masked mean (V − target)²
                ref_grad[i, t] = d / n
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(V.grad, ref_grad, atol=1e-14, rtol=1e-12)
    assert value_loss(V, target, torch.zeros_like(mask)).item() == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_explained_variance_matches_a_float64_loop(seed: int) -> None:
    V, target, mask = _random(seed)
    ts = [float(target[i, t]) for i, t in mask.nonzero().tolist()]
    ds = [float(target[i, t] - V[i, t]) for i, t in mask.nonzero().tolist()]
    ref = 1 - statistics.pvariance(ds) / statistics.pvariance(ts)  # 1 − Var(target − V) / Var(target)
    assert explained_variance(V, target, mask).item() == pytest.approx(ref, rel=1e-10)
    assert explained_variance(target, target, mask).item() == pytest.approx(1.0)  # V = target
    mean = torch.full_like(V, statistics.fmean(ts))
    assert explained_variance(mean, target, mask).item() == pytest.approx(0.0, abs=1e-12)  # the targets' mean
    assert explained_variance(V, torch.ones_like(V), mask).isnan()  # constant targets: undefined


def test_critic_terms_regress_on_copc_returns_of_the_same_values(model) -> None:
    """L_V = value_coef · ½ · masked mean (V − (V + Â))², Â from copc_advantages with the reward on the last token."""
    rollouts = _rollouts(model)
    critic = Critic(ARCH.hidden_size, CriticConfig(value_coef=0.7))
    torch.nn.init.normal_(critic.head.weight, std=0.5, generator=torch.Generator().manual_seed(2))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS))
    with torch.no_grad():
        out = sequence_logprobs(model, rollouts, return_hidden=True)
    logp = out.logp + 0.3 * torch.randn(out.logp.shape, generator=torch.Generator().manual_seed(3))  # ρ ≠ 1
    mask = rollouts.response_mask
    batch = {"logp": logp, "behav_logp": rollouts.behav_logp, "mask": mask, "rewards": rewards,
             "group_ids": rollouts.group_ids}  # fmt: skip
    terms = critic.terms(method=resolve_method("copc"), batch=batch, hidden=out.hidden)
    V = critic.values(out.hidden, mask).detach()
    token_r = torch.where(last_token_mask(mask.bool()), rewards[:, None].expand_as(logp), torch.zeros_like(logp))
    returns = copc_advantages(rewards=token_r, values=V, log_rhos=logp - rollouts.behav_logp, mask=mask).returns
    m = mask.bool()
    ref = 0.7 * 0.5 * ((V.double() - returns.double())[m] ** 2).mean()
    assert terms.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert torch.equal(terms.values, V)
    torch.testing.assert_close(copc_value_targets("copc", {**batch, "values": V}), returns, atol=0, rtol=0)
    assert terms.metrics["critic/loss"].item() == pytest.approx(ref.item() / 0.7, rel=1e-5)
    assert terms.metrics["critic/value_mean"].item() == pytest.approx(V[m].mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"advantage.type='grpo'; value targets need 'copc'"):
        copc_value_targets("grpo", {**batch, "values": V})


# ---------------------------------------------------------------------------------------- in the learner
def test_the_critic_learns_on_a_fixed_batch_with_constant_rewards(model) -> None:
    rollouts = _rollouts(model)
    learner = _learner(model, CriticConfig(lr=3e-2), lr=1e-4)
    losses = []
    for _ in range(40):
        out = learner.step(rollouts, torch.ones(len(rollouts)))
        assert out.applied == 1 and out.metrics.keys() >= CRITIC_KEYS
        losses.append(out.metrics["critic/loss"])
    assert losses[0] > 0.1  # V ≡ 0 against targets ≈ ρ̄ · 1 ∈ [0.5, 1]
    assert losses[-1] < 0.1 * losses[0], losses
    assert learner.version == 40


def _manual_actor_grad(model: torch.nn.Module, critic: Critic, rollouts: Rollouts, rewards: torch.Tensor, *,
                       value_coef: float | None) -> torch.Tensor:
    """∇θ of the actor's COPC loss (values from ``critic``'s head), plus value_coef · ∇θ L_V through the trunk."""
    model = copy.deepcopy(model)
    out = sequence_logprobs(model, rollouts, return_hidden=True)
    V = critic.head(out.hidden.float()).squeeze(-1) * rollouts.response_mask
    batch = {"logp": out.logp, "behav_logp": rollouts.behav_logp, "mask": rollouts.response_mask,
             "rewards": rewards, "group_ids": rollouts.group_ids, "versions": rollouts.versions,
             "learner_version": 3, "values": V.detach()}  # fmt: skip
    loss = compute_loss("copc", batch).loss
    if value_coef is not None:
        loss = loss + value_coef * value_loss(V, copc_value_targets("copc", batch), rollouts.response_mask)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("trunk_grad", [False, True])
def test_trunk_grad_false_leaves_the_actor_gradient_alone(model, trunk_grad: bool) -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS))
    learner = _learner(model, CriticConfig(trunk_grad=trunk_grad, value_coef=2.0), grad_clip=None)
    for seed in range(3):  # the head leaves 0 and the policy moves
        learner.step(_rollouts(model, seed), rewards)
    assert learner.critic is not None and learner.critic.head.weight.abs().sum() > 0
    rollouts = _rollouts(model, 7)
    head_before = copy.deepcopy(learner.critic)
    actor_only = _manual_actor_grad(model, head_before, rollouts, rewards, value_coef=None)
    with_trunk = _manual_actor_grad(model, head_before, rollouts, rewards, value_coef=2.0)
    assert (actor_only - with_trunk).abs().max() > 1e-6  # the value loss does reach the trunk when allowed
    learner.step(rollouts, rewards)
    assert learner.prev_grad is not None  # the policy's raw gradient of that step (before controllers and clipping)
    got = torch.cat([g.reshape(-1) for g in learner.prev_grad])
    torch.testing.assert_close(got, with_trunk if trunk_grad else actor_only, atol=1e-6, rtol=1e-5)


def test_a_skipped_actor_step_skips_the_critic(model) -> None:
    rollouts = _rollouts(model)
    behav = rollouts.behav_logp.clone()
    behav[rollouts.response_mask.bool()] = float("nan")
    learner = _learner(model, CriticConfig())
    assert learner.critic is not None
    head = copy.deepcopy(learner.critic.head.state_dict())
    out = learner.step(dataclasses.replace(rollouts, behav_logp=behav), torch.ones(len(rollouts)))
    assert out.skipped == 1 and out.reasons == ["loss is nan"]
    assert all(torch.equal(v, learner.critic.head.state_dict()[k]) for k, v in head.items())
    assert not learner.critic.optimizer.state
    assert learner.step(rollouts, torch.ones(len(rollouts))).applied == 1
    assert learner.critic.optimizer.state  # the next finite step trains it


def test_only_a_method_with_values_builds_a_critic_and_checkpoints_it(model) -> None:
    spec = resolve_method("grpo")
    plain = Learner(model=model, method=spec, controllers=[], lr=1e-3, optim=OptimConfig(), critic=CriticConfig())
    assert plain.critic is None and plain.state_dict()["critic"] is None
    learner = _learner(model, CriticConfig())
    learner.step(_rollouts(model), torch.ones(len(PROMPTS) * G))
    state = copy.deepcopy(learner.state_dict())
    fresh = _learner(build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0), CriticConfig())
    fresh.load_state_dict(state)
    assert fresh.critic is not None and learner.critic is not None
    assert torch.equal(fresh.critic.head.weight, learner.critic.head.weight)
    assert fresh.critic.optimizer.state_dict()["state"][0]["step"] == 1


def test_critic_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"critic.lr"):
        load_config(TrainConfig, overrides=["critic.lr=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'critic.coef'"):
        load_config(TrainConfig, overrides=["critic.coef=1"])
    cfg = load_config(TrainConfig, overrides=["method=copc", "critic.trunk_grad=true", "critic.grad_clip=null"])
    assert cfg.critic == CriticConfig(trunk_grad=True, grad_clip=None)


# ------------------------------------------------------------------------------------------- end to end
def test_steadyrl_train_copc_logs_the_critic_and_resumes_exactly(tiny_overrides: list[str], tmp_path: Path) -> None:
    common = [*tiny_overrides, "method=copc", "runtime.lag.k=2", "critic.lr=1e-2"]
    straight = tmp_path / "straight"
    assert main([*common, "steps=10", f"out_dir={straight}"]) == 0
    records = read_metrics(straight / "metrics.jsonl")
    steps = records[:-1]
    assert len(steps) == 10 and all(r.keys() >= CRITIC_KEYS for r in steps)
    assert all(r["train/skipped"] == 0 and r["critic/loss"] >= 0 for r in steps)
    assert steps[-1]["critic/value_mean"] != 0.0  # the head moved off its zero init
    state = torch.load(list_checkpoints(straight)[0], weights_only=False)
    assert set(state["learner"]["critic"]) == {"head", "optimizer"}

    split = tmp_path / "split"
    assert main([*common, "steps=5", f"out_dir={split}"]) == 0
    assert main([*common, "steps=10", f"out_dir={split}", "resume=true"]) == 0
    assert (split / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
