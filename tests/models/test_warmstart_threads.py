"""The warm start's weights do not depend on the caller's torch thread count; the cache key says what they do
depend on; the progress hook sees every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import steadyrl.models.warmstart as warmstart_mod
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.models.warmstart import EvalPoint, WarmStartConfig, warm_start, warm_start_entry
from steadyrl.tasks import ChainSumConfig, Task, build_task

# Large enough that 1 and 4 torch threads give different weights when the warm start uses the caller's count
# (measured: up to 2e-7 apart after 2 steps), small enough to take a fraction of a second.
ARCH = TinyArchConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
TWO_STEPS = WarmStartConfig(batch_size=128, train_problems=128, max_steps=2, eval_every=100, eval_problems=4,
                            target_accuracy=1.0, warmup_steps=1)


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(ChainSumConfig(eval_size=16))


def _warm_started(task: Task, cfg: WarmStartConfig, **kwargs: object) -> list[torch.Tensor]:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0)
    warm_start(model, tok, task=task, cfg=cfg, seed=0, progress=False, **kwargs)  # type: ignore[arg-type]
    return [p.detach().clone() for p in model.parameters()]


def test_the_same_weights_whatever_the_callers_thread_count(task: Task) -> None:
    # 1 and 2 threads happened to give the same weights here even before; 1 and 4 did not
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        reference = _warm_started(task, TWO_STEPS)
        torch.set_num_threads(4)
        weights = _warm_started(task, TWO_STEPS)
        assert torch.get_num_threads() == 4  # the caller's count is restored
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(reference, weights, strict=True))


def test_the_cache_key_holds_the_thread_count_and_the_platform(task: Task, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def entry(cfg: WarmStartConfig) -> Path:
        return warm_start_entry(ARCH, task=task, cfg=cfg, seed=0, cache_dir=tmp_path)

    base = entry(TWO_STEPS)
    assert base.parent == tmp_path and base.name.startswith("chain_sum-")
    assert entry(TWO_STEPS) == base and entry(TWO_STEPS.model_copy(update={"threads": 3})) != base
    platform = warmstart_mod.platform_identity()
    assert platform["torch"] == torch.__version__ and platform["cpu_capability"]
    monkeypatch.setattr(warmstart_mod, "platform_identity", lambda: {**platform, "cpu_capability": "OTHER"})
    assert entry(TWO_STEPS) != base


def test_the_progress_hook_sees_every_step(task: Task) -> None:
    seen: list[tuple[int, EvalPoint]] = []
    _warm_started(task, TWO_STEPS.model_copy(update={"max_steps": 3, "eval_every": 2}),
                  on_progress=lambda step, point: seen.append((step, point)))
    assert [(step, point.step) for step, point in seen] == [(0, 0), (1, 0), (2, 2), (3, 3)]
