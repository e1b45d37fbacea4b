"""How often a learner step reads a value to the host (each read of a GPU tensor waits for the GPU to finish).

Counted: ``.item()``, ``.tolist()``, ``float()``, ``int()`` and ``bool()`` of a tensor called from steadyrl's own code
(torch's internals, such as AdamW's step counter on the CPU, are not steadyrl's to change). A learner step reads twice:
the loss and the gradient norm (whether to go on), then every metric with the post-clip norm and the controllers'
decision (whether to step); VCPO's ESS step size reads its lr factor once more (optimizers take a Python lr). The
adaptive entropy coefficient reaches the loss and moves on the device: no read of its own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.sampler import generate
from steadyrl.train.learner import Learner

SRC = str(Path(__import__("steadyrl").__file__).parent)
ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
READS = ("item", "tolist", "__float__", "__int__", "__bool__")


class HostReads:
    """Counts the reads of a tensor to the host made from steadyrl's source files while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def _wrap(self, name: str, original: Callable) -> Callable:
        def read(tensor: torch.Tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(SRC):
                self.calls.append(f"{name} in {Path(caller.co_filename).name}:{caller.co_name}")
            return original(tensor, *args, **kwargs)

        return read


@pytest.mark.parametrize(
    ("method", "most"), [("grpo", 2), ("seq_tis+gac", 2), ("seq_tis+ess_lr", 3), ("grpo+adaptive_entropy", 2)]
)
def test_a_learner_step_reads_to_the_host_at_most_twice(
    monkeypatch: pytest.MonkeyPatch, method: str, most: int
) -> None:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    spec = resolve_method(method)
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(),
                      log=lambda _: None)  # fmt: skip
    rollouts = generate(model, build_char_tokenizer(), ["1+2=", "7-3="], group_size=4, max_new_tokens=5,
                        generator=torch.Generator().manual_seed(0), version=0)  # fmt: skip
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * 2)
    learner.step(rollouts, rewards)  # the first step (no previous gradient yet)
    reads = HostReads(monkeypatch)
    out = learner.step(rollouts, rewards)
    monkeypatch.undo()
    assert out.applied == 1
    assert len(reads.calls) <= most, reads.calls
