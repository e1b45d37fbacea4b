"""Retroactive Advantage Correction (arXiv 2606.27580): c_i against a float64 reference, its properties, the delayed
reward's plumbing through the lag runtime, the learner's correction step and `steadyrl train` with a late reward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from steadyrl.config.train import OptimConfig, RacConfig, RolloutConfig
from steadyrl.core.advantages.rac import rac_corrections
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.scored import DelayedRewards, ScoredRollouts
from steadyrl.runtime.lag import LagSampler, LagSchedule, LagSource
from steadyrl.tasks.delayed import proxy_rewards
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3="]


def _ref(slow, fast, log_ratio, age, *, alpha=1.0, tau=50.0, rho_bar=1.2, cap=5.0) -> list[float]:
    c = [math.exp(-a / tau) * min(rho_bar, math.exp(min(lr, 700.0))) * alpha * (s - b)
         for s, b, lr, a in zip(slow, fast, log_ratio, age, strict=True)]  # fmt: skip
    biggest = max(abs(x) for x in c)
    return [x * cap / biggest for x in c] if biggest > cap else c


@pytest.mark.parametrize("alpha", [1.0, 30.0])  # 30: the rescale to max |c| = 5 is active
def test_corrections_match_float64_reference(alpha: float) -> None:
    g = torch.Generator().manual_seed(0)
    slow = torch.randint(0, 2, (8,), generator=g).double()
    fast = torch.randint(0, 2, (8,), generator=g).double()
    log_ratio = 0.5 * torch.randn(8, generator=g, dtype=torch.float64)
    age = torch.randint(0, 120, (8,), generator=g).double()
    out = rac_corrections(slow_rewards=slow, fast_rewards=fast, log_ratio=log_ratio, age=age, alpha=alpha)
    ref = _ref(slow.tolist(), fast.tolist(), log_ratio.tolist(), age.tolist(), alpha=alpha)
    torch.testing.assert_close(out.corrections, torch.tensor(ref, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert out.corrections.abs().max().item() <= 5.0 + 1e-12
    assert (out.metrics["rac/rescale"].item() < 1.0) == (alpha == 30.0)


def test_agreeing_rewards_and_masked_rows_give_no_correction() -> None:
    r = torch.tensor([1.0, 0.0, 1.0])
    out = rac_corrections(slow_rewards=r, fast_rewards=r, log_ratio=torch.zeros(3), age=torch.full((3,), 4.0))
    assert (out.corrections == 0).all()
    out = rac_corrections(slow_rewards=torch.ones(3), fast_rewards=torch.zeros(3), log_ratio=torch.zeros(3),
                          age=torch.zeros(3), valid=torch.zeros(3, dtype=torch.bool))  # fmt: skip
    assert (out.corrections == 0).all() and all(torch.isfinite(v) for v in out.metrics.values())


def test_extreme_log_ratios_stay_finite_and_react_to_behavior() -> None:
    slow, fast, age = torch.ones(4), torch.zeros(4), torch.full((4,), 2.0)
    lr = torch.tensor([1000.0, -1000.0, 0.0, -0.5])
    out = rac_corrections(slow_rewards=slow, fast_rewards=fast, log_ratio=lr, age=age)
    assert torch.isfinite(out.corrections).all() and all(torch.isfinite(v) for v in out.metrics.values())
    assert out.corrections[0].item() == pytest.approx(math.exp(-2 / 50) * 1.2)  # ratio capped at ρ̄
    assert out.corrections[1].item() == 0.0
    moved = rac_corrections(slow_rewards=slow, fast_rewards=fast, log_ratio=lr - 0.3, age=age)
    assert not torch.equal(out.corrections, moved.corrections)  # reacts to μ


def test_proxy_rewards_are_seeded_and_flip_a_share() -> None:
    r = (torch.arange(4000) % 2).float()
    a = proxy_rewards(r, kind="noisy", flip=0.2, generator=torch.Generator().manual_seed(3))
    b = proxy_rewards(r, kind="noisy", flip=0.2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and abs((a != r).float().mean().item() - 0.2) < 0.03
    assert (proxy_rewards(r, kind="zero", flip=0.2, generator=torch.Generator()) == 0).all()


class _Task:
    name = "fake"

    def score(self, problem, completion: str) -> float:
        return float(len(completion) % 2)


def _source(model, tmp_path: Path, delay: int) -> LagSource:
    from steadyrl.tasks import Problem

    sampler = LagSampler(model=model, tokenizer=build_char_tokenizer(), schedule=LagSchedule(kind="pipeline", lag=0),
                         sampling=RolloutConfig(max_new_tokens=6), group_size=2, seed=0,
                         snapshot_budget_bytes=1 << 30, snapshot_dir=tmp_path)  # fmt: skip
    pool = [Problem(prompt=p, answer="0", uid=f"fake/train/{i}") for i, p in enumerate(PROMPTS)]
    return LagSource(sampler, task=_Task(), train_pool=pool, prompts_per_step=2, seed=0, reward_delay=delay,  # type: ignore[arg-type]
                     proxy="noisy", proxy_flip=0.5)  # fmt: skip


def test_lag_source_holds_the_true_reward_back_delta_steps(tmp_path: Path) -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    source = _source(model, tmp_path, delay=2)
    batches: list[ScoredRollouts] = []
    for step in range(4):
        source.publish(step=step, version=step, model=model)
        batches.append(source.next_batch(step=step))
        if step == 2:  # a resumed source continues with the same pending batches
            state = source.state_dict()
            fresh = _source(model, tmp_path, delay=2)
            fresh.load_state_dict(state)
            assert sorted(fresh.delay.pending) == sorted(source.delay.pending) == [1, 2]
    assert batches[0].delayed is None and batches[1].delayed is None
    for step in (2, 3):
        d = batches[step].delayed
        assert d is not None and d.age == 2
        sent = batches[step - 2]
        assert torch.equal(d.rollouts.response_ids, sent.rollouts.response_ids)
        assert torch.equal(d.fast, sent.rewards)  # the proxy the batch trained on
        assert d.slow.tolist() == [float(len(t) % 2) for t in sent.rollouts.texts]  # the verifier's reward
        assert batches[step].metrics["reward/slow_mean"] == pytest.approx(float(d.slow.mean()))


def test_learner_adds_the_correction_once(tmp_path: Path) -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    source = _source(model, tmp_path, delay=1)
    source.publish(step=0, version=0, model=model)
    first = source.next_batch(step=0)
    source.publish(step=1, version=0, model=model)
    second = source.next_batch(step=1)
    assert second.delayed is not None
    delayed = DelayedRewards(second.delayed.rollouts, 1.0 - second.delayed.fast, second.delayed.fast, 1)

    def grads(rac: RacConfig, d: DelayedRewards | None) -> list[torch.Tensor]:
        m = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
        learner = Learner(
            model=m,
            method=resolve_method("grpo"),
            controllers=[],
            lr=1e-2,
            optim=OptimConfig(updates_per_batch=2, grad_clip=None),
            log=lambda _: None,
            rac=rac,
        )
        seen: list[list[torch.Tensor]] = []
        step = learner.optimizer.step

        def spy(*a, **k):
            seen.append([p.grad.clone() for p in learner.params])
            return step(*a, **k)

        learner.optimizer.step = spy  # type: ignore[method-assign]
        out = learner.step(second.rollouts, second.rewards, delayed=d)
        assert ("rac/corr_mean" in out.metrics) == (d is not None and rac.enabled)
        return seen

    base, with_rac, off = (
        grads(RacConfig(), None),
        grads(RacConfig(), delayed),
        grads(RacConfig(enabled=False), delayed),
    )
    assert len(base) == len(with_rac) == 2
    assert any(not torch.allclose(a, b) for a, b in zip(base[0], with_rac[0], strict=True))  # first step corrected
    assert all(torch.equal(a, b) for a, b in zip(base[0], off[0], strict=True))
    del first


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_late_reward_in_the_local_runtime(tiny_overrides: list[str], tmp_path: Path) -> None:
    """The concurrent runtimes hold the samplers' true reward back Δ learner steps as the lag runtime does."""
    out = tmp_path / "rac-local"
    assert main([*tiny_overrides, "method=grpo", "task.reward_delay=2", "runtime.mode=local", "runtime.lag.k=0",
                 "runtime.concurrent.sync=true", "steps=4", "checkpoint.every=0", f"out_dir={out}"]) == 0  # fmt: skip
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert ["rac/corr_mean" in r for r in steps] == [False, False, True, True]
    assert all("reward/true_mean" in r for r in steps) and all("reward/slow_mean" in r for r in steps[2:])


@pytest.mark.slow
def test_steadyrl_train_with_a_late_reward(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "rac"
    assert main([*tiny_overrides, "method=grpo", "task.reward_delay=2", "runtime.lag.k=1", "steps=5",
                 f"out_dir={out}"]) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert len(steps) == 5 and all(r["train/skipped"] == 0 for r in steps)
    assert ["rac/corr_mean" in r for r in steps] == [False, False, True, True, True]
    assert all(abs(r["rac/corr_abs_max"]) <= 5.0 for r in steps[2:])
