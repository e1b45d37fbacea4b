"""The step control every adapter uses, without a framework: one optimizer step of VCPO's ESS step size and GAC."""

from __future__ import annotations

import pytest
import torch

from steadyrl.integrations import step_control as sc
from steadyrl.integrations.step_control import StepControl
from steadyrl.methods import resolve_method


def _model() -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_ess_step_size_scales_one_step_by_the_mean_over_micro_batches() -> None:
    model, opt = _model()
    control = StepControl(resolve_method("seq_tis+ess_lr"), framework="test")
    control.wrap(opt)
    before = [p.detach().clone() for p in model.parameters()]
    for ess in (0.1, 0.4):  # two micro-batches: mean ESS ratio 0.25 -> lr scale sqrt(0.25) = 0.5
        control.record({"vcpo/ess_ratio": torch.tensor(ess), "loss": torch.tensor(1.0)})
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert control.last["steadyrl/vcpo/ess_scale"] == pytest.approx(0.5)
    assert control.last["steadyrl/lr"] == pytest.approx(0.05)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # restored after the step
    for b, p in zip(before, model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), b - 0.05)


def test_gac_skip_leaves_the_weights_alone() -> None:
    model, opt = _model()
    control = StepControl(resolve_method("gac", {"gac.tau_skip": 0.9}), framework="test")
    control.wrap(opt)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = 2 * torch.ones_like(p)  # cos 1 with the previous gradient: skip
    assert opt.step() is None
    assert control.last["steadyrl/gac/skipped"] == 1.0
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters(), strict=True))


def test_gac_refuses_more_than_one_process(monkeypatch) -> None:
    _, opt = _model()
    monkeypatch.setattr(sc, "world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"GAC reads the flat local gradient.*one process"):
        StepControl(resolve_method("seq_tis+gac"), framework="test").wrap(opt)
    StepControl(resolve_method("seq_tis+ess_lr"), framework="test").wrap(opt)  # the ESS step size is fine


def test_recording_without_a_wrapped_optimizer_warns_once() -> None:
    control = StepControl(resolve_method("ess_lr"), framework="verl")
    with pytest.warns(UserWarning, match=r"wrap_optimizer"):
        control.record({"vcpo/ess_ratio": torch.tensor(0.5)})
    _, opt = _model()
    with pytest.raises(ValueError, match="already wrapped"):
        control.wrap(control.wrap(opt))
