"""State restored onto a model that lives on another device follows the model: resume, guard rollback, adapters.

The model sits on ``meta``, a second device torch has without hardware: mixing it with ``cpu`` raises where mixing
``cuda`` with ``cpu`` does, so a tensor left on the CPU by a checkpoint (read with ``map_location="cpu"``), by a
rollback snapshot (held on the CPU) or by an adapter's bookkeeping shows here as a device assertion. Every check
runs before anything reads a value to the host (which ``meta`` cannot do).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from steadyrl.base.device import Placement
from steadyrl.config.guard import GuardConfig
from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers, loss_inputs
from steadyrl.integrations import step_control as step_control_module
from steadyrl.integrations.step_control import StepControl
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.sampler import generate
from steadyrl.train import checkpoint as ckpt
from steadyrl.train import collapse_guard as guard_module
from steadyrl.train.collapse_guard import CollapseGuard
from steadyrl.train.learner import Learner

pytestmark = pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter:UserWarning")
ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
META = torch.device("meta")
CPU = torch.device("cpu")


def _tensors(state: Any, where: str = "state") -> Iterator[tuple[str, Tensor]]:
    if isinstance(state, Tensor):
        yield where, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{where}.{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{where}[{i}]")


def _host_step_counter(name: str) -> bool:
    """AdamW's per-parameter ``step`` counter: torch keeps it on the CPU by design (unless fused or capturable)."""
    return ".optimizer.state." in name and name.endswith(".step")


def _assert_on(state: Any, device: torch.device, what: str) -> None:
    wrong = [f"{n} on {t.device}" for n, t in _tensors(state) if t.device != device and not _host_step_counter(n)]
    assert not wrong, f"{what}: tensors not on the model's device {device}: {wrong[:5]}"


def _learner(method: str, device: torch.device = CPU) -> Learner:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    spec = resolve_method(method)
    if device.type == "meta":
        model = model.to(device)
        model.tie_weights()  # moving to meta unties the shared embedding; the checkpoint's parameters are tied
    return Learner(
        model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(),
        log=lambda _: None, placement=Placement(device=device),
    )  # fmt: skip


def _trained_state(method: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, learner state) after two CPU learner steps: the previous gradient and controller states exist."""
    learner = _learner(method)
    tok = build_char_tokenizer()
    for seed in range(2):
        rollouts = generate(
            learner.model, tok, ["1+2=", "7-3="], group_size=4, max_new_tokens=4,
            generator=torch.Generator().manual_seed(seed), version=learner.version,
        )  # fmt: skip
        learner.step(rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0] * 2))
    return learner.model.state_dict(), learner.state_dict()


@pytest.mark.parametrize("method", ["grpo", "seq_tis+gac", "seq_tis+ess_lr", "copc", "grpo+adaptive_entropy"])
def test_resumed_learner_state_follows_the_model_device(tmp_path, method: str) -> None:
    """A checkpoint is read to the CPU; the restored previous gradient, controller and critic states must sit on
    the model's device, or the first step after ``resume=true`` mixes devices (``grad/cos_prev``, GAC)."""
    model_state, learner_state = _trained_state(method)
    path = ckpt.save_checkpoint(
        tmp_path, {"step": 2, "model": model_state, "learner": learner_state, "source": {}, "rng": {}, "metrics": {},
                   "config": {}}, keep=1,
    )  # fmt: skip
    loaded = ckpt.load_checkpoint(path)
    resumed = _learner(method, META)
    resumed.model.load_state_dict(loaded["model"])  # a no-op on meta: the weights are not what is checked here
    resumed.load_state_dict(loaded["learner"])
    assert resumed.prev_grad is not None
    _assert_on(resumed.prev_grad, META, "previous gradient")
    _assert_on(resumed.state_dict(), META, "learner state after resume")
    _assert_on([c.state_dict() for c in resumed.controllers], META, "controller states after resume")


@pytest.mark.parametrize("method", ["grpo", "seq_tis+gac"])
def test_guard_rollback_restores_state_onto_the_model_device(tmp_path, method: str) -> None:
    """The guard keeps its snapshots on the CPU; a rollback must put the learner's state back on the model's device."""
    model_state, learner_state = _trained_state(method)
    learner = _learner(method, META)
    guard = CollapseGuard(
        GuardConfig(mode="rollback"), out_dir=tmp_path, model=learner.model,
        learner=learner, base_lr=1e-2, say=lambda _: None,
    )  # fmt: skip
    snapshot = guard_module._Snapshot(0, guard_module._cpu_clone(model_state), guard_module._cpu_clone(learner_state))
    guard._target = snapshot  # a healthy step's state, held on the CPU as the guard holds it

    class Source:
        def restart(self, *, step: int, version: int, model: torch.nn.Module) -> None:
            self.restarted = (step, version)

    guard._rollback(3, Source())
    assert learner.prev_grad is not None
    _assert_on(learner.prev_grad, META, "previous gradient after rollback")
    _assert_on(learner.state_dict(), META, "learner state after rollback")


@pytest.mark.parametrize("method", ["seq_tis+ess_lr", "seq_tis+gac", "vcpo"])
def test_adapter_step_control_keeps_every_tensor_on_the_model_device(monkeypatch, method: str) -> None:
    """The step control every adapter uses (verl, OpenRLHF, AReaL, TRL): its control dict, built from metrics and
    gradients on the model's device, holds no tensor of another device when it is read to the host."""
    spec = resolve_method(method)
    model = torch.nn.Linear(4, 3).to(META)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen: list[list[Tensor]] = []

    def host_values(values: Any) -> list[float]:
        items = list(values)
        seen.append(items)
        _assert_on(items, META, "values read to the host")
        return [1.0] * len(items)

    monkeypatch.setattr(step_control_module, "host_values", host_values)
    monkeypatch.setattr("steadyrl.control.ess_lr.host_values", host_values)
    control = StepControl(spec, framework="test")
    control.wrap(optimizer)
    for _ in range(2):  # GAC's second step has a previous gradient
        ess = torch.tensor(0.5, device=META)
        control.record({"vcpo/ess_ratio": ess, "is/ess_ratio": ess})
        control.prepare(optimizer, list(model.parameters()))
        _assert_on(control.control, META, "the adapter's control dict")
        control.finish(optimizer)
    assert seen and control.last["steadyrl/lr"] == pytest.approx(1e-3)


def test_adaptive_entropy_state_and_control_values_follow_the_model_device() -> None:
    """The adaptive entropy controller of a learner on ``meta`` (its state restored from a CPU checkpoint): the
    coefficient it hands the loss, its state after ``before_step`` on the loss's metrics and the control values it
    returns all live on the model's device."""
    _, learner_state = _trained_state("grpo+adaptive_entropy")
    learner = _learner("grpo+adaptive_entropy", META)
    learner.load_state_dict(learner_state)
    (ctrl,) = learner.controllers
    _assert_on(ctrl.state_dict(), META, "controller state after resume")
    inputs = loss_inputs(learner.controllers, META)
    _assert_on(inputs, META, "the coefficient handed to the loss")
    metrics = {"entropy/token_sum": torch.tensor(3.0, device=META), "entropy/tokens": torch.tensor(4.0, device=META)}
    control = ctrl.before_step(optimizer=learner.optimizer, params=learner.params, metrics=metrics)
    _assert_on(control, META, "control values")
    _assert_on(ctrl.state_dict(), META, "controller state after a step")
    fresh = build_controllers(resolve_method("grpo+adaptive_entropy"))  # built on the CPU, used on meta
    _assert_on(loss_inputs(fresh, META), META, "a fresh controller's coefficient")
    _assert_on(fresh[0].state_dict(), META, "a fresh controller's state once used")
