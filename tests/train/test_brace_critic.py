"""BRACE's critic in the loop (arXiv 2609.09783): clipped value loss against a float64 reference, targets equal the
estimator's, lr and critic-only warm-up, V_old with several updates per batch, and `steadyrl train method=brace`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers
from steadyrl.core.advantages.brace import brace_advantages
from steadyrl.methods import resolve_method
from steadyrl.methods.compose import brace_value_targets
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train.critic import CriticConfig, clipped_value_loss
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]
G = 4


def _rollouts(model: torch.nn.Module) -> Rollouts:
    return generate(
        model, build_char_tokenizer(), PROMPTS, group_size=G, max_new_tokens=6, version=0,
        generator=torch.Generator().manual_seed(0), eos_token_ids=[20, 21, 22],
    )  # fmt: skip


def _learner(model: torch.nn.Module, overrides: dict | None = None, **optim) -> Learner:
    spec = resolve_method("brace", overrides)
    return Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(**optim),
                   log=lambda _: None, critic=CriticConfig())  # fmt: skip


def test_clipped_value_loss_matches_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    V, V_old, targ = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(3, 5, generator=g) > 0.3
    got = clipped_value_loss(V, V_old, targ, mask, 0.5)
    terms = []
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                v, o, y = float(V[b, t]), float(V_old[b, t]), float(targ[b, t])
                vc = min(max(v, o - 0.5), o + 0.5)
                terms.append(0.5 * max((v - y) ** 2, (vc - y) ** 2))
    assert got.item() == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert clipped_value_loss(V, V_old, targ, torch.zeros_like(mask), 0.5).item() == 0.0


def test_value_targets_are_the_estimators() -> None:
    g = torch.Generator().manual_seed(1)
    B, T = 4, 7
    batch = {
        "logp": -torch.rand(B, T, generator=g, dtype=torch.float64), "mask": torch.rand(B, T, generator=g) > 0.2,
        "rewards": torch.randn(B, generator=g, dtype=torch.float64),
        "values": torch.randn(B, T, generator=g, dtype=torch.float64),
    }  # fmt: skip
    batch["behav_logp"] = batch["logp"] - 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    got = brace_value_targets("brace", batch)
    ref = brace_advantages(
        rewards=torch.zeros(B, T, dtype=torch.float64),
        returns=batch["rewards"],
        values=batch["values"],
        log_ratio=batch["logp"] - batch["behav_logp"],
        mask=batch["mask"],
    )
    torch.testing.assert_close(got, ref.targets)


def test_critic_lr_and_warmup_steps_leave_the_policy_alone() -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    learner = _learner(model, {"advantage.critic_warmup": 2})
    assert learner.critic is not None
    assert learner.critic.optimizer.param_groups[0]["lr"] == 1e-5  # the paper's, not critic.lr
    rollouts = _rollouts(model)
    rewards = torch.arange(len(PROMPTS) * G, dtype=torch.float32) % 2
    before = [p.detach().clone() for p in learner.params]
    for _ in range(2):
        out = learner.step(rollouts, rewards)
        assert out.metrics["critic/warmup"] == 1.0
    assert learner.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, learner.params, strict=True))
    assert learner.critic.head.bias.abs().item() > 0  # the critic stepped
    learner.step(rollouts, rewards)
    assert learner.version == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, learner.params, strict=True))
    assert learner.state_dict()["critic"]["warmup_left"] == 0


def test_several_updates_per_batch_clip_around_the_first_values(monkeypatch) -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    learner = _learner(model, {"advantage.critic_warmup": 0}, updates_per_batch=2)
    assert learner.critic is not None
    seen: list[torch.Tensor | None] = []
    terms = learner.critic.terms

    def spy(**kw):
        seen.append(kw.get("old_values"))
        return terms(**kw)

    monkeypatch.setattr(learner.critic, "terms", spy)
    learner.step(_rollouts(model), torch.ones(len(PROMPTS) * G))
    assert len(seen) == 2 and all(v is not None for v in seen)
    assert seen[0] is seen[1]  # one V_old for the batch, from the π_prox pass


@pytest.mark.slow
def test_steadyrl_train_brace(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "brace"
    assert main([*tiny_overrides, "method=brace", "runtime.lag.k=2", "steps=8", f"out_dir={out}"]) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert len(steps) == 8
    assert [r.get("critic/warmup", 0.0) for r in steps[:6]] == [1.0] * 5 + [0.0]
    assert steps[-1]["version"] == 2  # the version a step starts from: steps 5 and 6 moved the policy
    for key in ("brace/bias_hat", "brace/gap_hat", "brace/slope_h1_4", "critic/loss", "adv/std"):
        assert key in steps[-1], key
