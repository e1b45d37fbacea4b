"""Old-logit repair ("Missing Old Logits", arXiv 2605.12070): the PPO-EWMA recursion against a float64 reference, the
mismatch split, behavior_snapshot's π_old^train equal to the behavior version's log-probs, and short runs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import OptimConfig, RolloutConfig, TrainConfig
from steadyrl.core.proximal import ewma_update_, mismatch_split
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.runtime.lag import LagSampler, LagSchedule
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3="]


def test_ewma_recursion_is_the_beta_weighted_average_of_the_iterates() -> None:
    g = torch.Generator().manual_seed(0)
    beta, n = 0.7, 6
    iterates = [[torch.randn(3, 2, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)]
                for _ in range(n + 1)]  # fmt: skip
    ewma = [t.clone() for t in iterates[0]]
    weight = 1.0
    for i in range(1, n + 1):
        weight = ewma_update_(ewma, iterates[i], weight=weight, beta=beta)
    coef = [beta ** (n - i) for i in range(n + 1)]
    for k in range(2):
        ref = sum(c * it[k] for c, it in zip(coef, iterates, strict=True)) / sum(coef)
        torch.testing.assert_close(ewma[k], ref, rtol=1e-12, atol=1e-12)
    assert weight == pytest.approx(sum(coef))
    with pytest.raises(ValueError, match="proximal_beta"):
        ewma_update_(ewma, iterates[0], weight=1.0, beta=1.0)


def test_mismatch_split_k3_means() -> None:
    g = torch.Generator().manual_seed(1)
    behav = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    old = behav + 0.1 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    prox = old + 0.2 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.3

    def k3(x: torch.Tensor) -> float:
        return float((x.exp() - x - 1)[mask].mean())

    out = mismatch_split(behav_logp=behav, old_logp=old, prox_logp=prox, mask=mask)
    assert out["kl/discrepancy"].item() == pytest.approx(k3(old - behav), rel=1e-12)
    assert out["kl/staleness"].item() == pytest.approx(k3(prox - old), rel=1e-12)
    same = mismatch_split(behav_logp=behav, old_logp=behav, prox_logp=prox, mask=mask)
    assert same["kl/discrepancy"].item() == 0.0


def test_behavior_snapshot_recomputes_the_behavior_versions_log_probs(tmp_path: Path) -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    versions = [copy.deepcopy(model)]
    sampler = LagSampler(model=model, tokenizer=build_char_tokenizer(), schedule=LagSchedule(kind="pipeline", lag=2),
                         sampling=RolloutConfig(max_new_tokens=6), group_size=2, seed=0,
                         snapshot_budget_bytes=1 << 30, snapshot_dir=tmp_path)  # fmt: skip
    for step in range(3):  # the learner moves its weights every step; step 2 samples with step 0's
        sampler.publish(step=step, version=step, model=model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        versions.append(copy.deepcopy(model))
    rollouts = sampler.sample(step=2, prompts=PROMPTS)
    old = sampler.old_logprobs(step=2, rollouts=rollouts)
    with torch.no_grad():
        want = sequence_logprobs(versions[0], rollouts).logp
        now = sequence_logprobs(model, rollouts).logp
    m = rollouts.response_mask
    torch.testing.assert_close(old[m], want[m], rtol=0, atol=1e-6)  # the behavior version's weights, recomputed
    torch.testing.assert_close(old[m], rollouts.behav_logp[m], rtol=0, atol=1e-5)  # no mismatch injected: = μ
    assert (old[m] - now[m]).abs().max() > 1e-3  # not the current weights
    split = mismatch_split(behav_logp=rollouts.behav_logp, old_logp=old, prox_logp=now, mask=m)
    assert split["kl/discrepancy"].item() < 1e-10 and split["kl/staleness"].item() > 1e-6


def test_ewma_learner_tracks_the_weights_on_their_device() -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    learner = Learner(model=model, method=resolve_method("grpo"), controllers=[], lr=1e-2, optim=OptimConfig(),
                      log=lambda _: None, proximal="ewma", proximal_beta=0.5)  # fmt: skip
    assert learner.ewma is not None
    theta0 = [p.detach().clone() for p in model.parameters()]
    sampler = LagSampler(model=model, tokenizer=build_char_tokenizer(), schedule=LagSchedule(kind="pipeline", lag=1),
                         sampling=RolloutConfig(max_new_tokens=6), group_size=4, seed=0)  # fmt: skip
    sampler.publish(step=0, version=0, model=model)
    rollouts = sampler.sample(step=0, prompts=PROMPTS)
    out = learner.step(rollouts, torch.arange(len(rollouts), dtype=torch.float32) % 2)
    assert learner.version == 1 and out.metrics["train/skipped"] == 0
    assert learner.ewma_weight == pytest.approx(1.5)
    for e, p0, p1 in zip(learner.ewma.parameters(), theta0, model.parameters(), strict=True):
        assert e.device == p1.device and e.dtype == p1.dtype and not e.requires_grad
        torch.testing.assert_close(e, (0.5 * p0 + p1.detach()) / 1.5)
    state = learner.state_dict()["ewma"]
    assert state["weight"] == learner.ewma_weight
    with pytest.raises(ValueError, match="proximal=ewma sets π_prox"):
        Learner(model=model, method=resolve_method("a3po"), controllers=[], lr=1e-2, optim=OptimConfig(),
                proximal="ewma")  # fmt: skip


def test_behavior_snapshot_needs_the_lag_runtime() -> None:
    with pytest.raises(ConfigError, match="proximal=behavior_snapshot needs the snapshot ring"):
        load_config(TrainConfig, overrides=["proximal=behavior_snapshot", "runtime.mode=local", "runtime.lag.k=0"])
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    learner = Learner(model=model, method=resolve_method("grpo"), controllers=[], lr=1e-2, optim=OptimConfig(),
                      proximal="behavior_snapshot")  # fmt: skip
    sampler = LagSampler(model=model, tokenizer=build_char_tokenizer(), schedule=LagSchedule(kind="pipeline", lag=1),
                         sampling=RolloutConfig(max_new_tokens=6), group_size=2, seed=0)  # fmt: skip
    sampler.publish(step=0, version=0, model=model)
    rollouts = sampler.sample(step=0, prompts=PROMPTS)
    with pytest.raises(ValueError, match="needs each token's log-prob under its behavior version"):
        learner.step(rollouts, torch.ones(len(rollouts)))


@pytest.mark.slow
@pytest.mark.parametrize("proximal", ["behavior_snapshot", "ewma"])
def test_steadyrl_train_with_old_logit_repair(proximal: str, tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / proximal
    assert main([*tiny_overrides, "method=grpo", f"proximal={proximal}", "runtime.lag.k=2", "steps=4",
                 f"out_dir={out}"]) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert len(steps) == 4 and all(r["train/skipped"] == 0 for r in steps)
    assert all(r["kl/discrepancy"] < 1e-8 for r in steps)  # fp32 transformers sampler: no mismatch
    assert steps[-1]["kl/staleness"] > 0  # two steps behind
