"""Step-level controllers on a real optimizer: the ESS step size and GAC."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl import resolve_method
from steadyrl.control import build_controllers
from steadyrl.control.base import SKIP_STEP


def _model_and_opt(lr: float = 0.1) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def test_ess_step_size_scales_for_one_step_and_restores() -> None:
    model, opt = _model_and_opt(lr=0.1)
    (ctrl,) = build_controllers(resolve_method("ess_lr"))
    metrics = {"vcpo/ess_ratio": torch.tensor(0.25)}
    out = ctrl.before_step(optimizer=opt, params=list(model.parameters()), metrics=metrics)
    assert out["vcpo/ess_scale"].item() == pytest.approx(0.5)  # sqrt(min(1, 0.25 / 1.0))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    ctrl.after_step(optimizer=opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def test_ess_step_size_identity_and_rho_base() -> None:
    model, opt = _model_and_opt(lr=1.0)
    (ctrl,) = build_controllers(resolve_method("ess_lr", {"ess_lr.fn": "identity", "ess_lr.rho_base": 0.5}))
    ctrl.before_step(optimizer=opt, params=list(model.parameters()), metrics={"vcpo/ess_ratio": torch.tensor(0.2)})
    assert opt.param_groups[0]["lr"] == pytest.approx(0.4)


def test_ess_step_size_without_its_metric_says_so() -> None:
    model, opt = _model_and_opt()
    (ctrl,) = build_controllers(resolve_method("ess_lr"))
    with pytest.raises(KeyError, match="vcpo/ess_ratio"):
        ctrl.before_step(optimizer=opt, params=list(model.parameters()), metrics={})


def _set_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def test_gac_projects_aligned_gradient_and_leaves_orthogonal_one() -> None:
    model, opt = _model_and_opt()
    params = list(model.parameters())
    P = sum(p.numel() for p in params)
    (ctrl,) = build_controllers(resolve_method("gac", {"gac.tau_proj": 0.3, "gac.tau_skip": 0.95}))
    e0 = torch.zeros(P)
    e0[0] = 1.0
    _set_grads(model, e0)
    first = ctrl.before_step(optimizer=opt, params=params, metrics={})
    assert first["gac/projected"].item() == 0.0 and first[SKIP_STEP].item() == 0.0
    # Second gradient at 60° from the first: cos 0.5 ∈ (τ_proj, τ_skip] → the aligned part is removed.
    g = torch.zeros(P)
    g[0], g[1] = 0.5, math.sqrt(3) / 2
    _set_grads(model, g)
    out = ctrl.before_step(optimizer=opt, params=params, metrics={})
    assert out["gac/cos"].item() == pytest.approx(0.5, abs=1e-6)
    assert out["gac/projected"].item() == 1.0
    new = torch.cat([p.grad.reshape(-1) for p in params])
    assert new[0].item() == pytest.approx(0.0, abs=1e-6) and new[1].item() == pytest.approx(math.sqrt(3) / 2)
    # An orthogonal gradient is left unchanged.
    h = torch.zeros(P)
    h[2] = 1.0
    _set_grads(model, h)
    out = ctrl.before_step(optimizer=opt, params=params, metrics={})
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), h)
    assert out["gac/projected"].item() == 0.0


def test_gac_skip_asks_the_learner_not_to_step() -> None:
    model, opt = _model_and_opt()
    params = list(model.parameters())
    P = sum(p.numel() for p in params)
    (ctrl,) = build_controllers(resolve_method("gac", {"gac.tau_skip": 0.9}))
    g = torch.ones(P)
    _set_grads(model, g)
    ctrl.before_step(optimizer=opt, params=params, metrics={})
    _set_grads(model, g * 2)
    out = ctrl.before_step(optimizer=opt, params=params, metrics={})
    assert out[SKIP_STEP].item() == 1.0 and out["gac/skipped"].item() == 1.0
    state = ctrl.state_dict()
    (fresh,) = build_controllers(resolve_method("gac"))
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.prev, ctrl.prev, strict=True))


def test_gac_reads_a_flat_previous_gradient_of_an_older_checkpoint() -> None:
    """A checkpoint that kept g_prev as one flat vector restores to the same decision as per-parameter parts."""
    model, opt = _model_and_opt()
    params = list(model.parameters())
    P = sum(p.numel() for p in params)
    prev = torch.arange(1.0, P + 1)
    per_part, flat = build_controllers(resolve_method("gac")) + build_controllers(resolve_method("gac"))
    pieces = prev.split([p.numel() for p in params])
    per_part.load_state_dict({"prev": [t.view_as(p).clone() for t, p in zip(pieces, params, strict=True)]})
    flat.load_state_dict({"prev": prev.clone()})
    outs = []
    for ctrl in (per_part, flat):
        _set_grads(model, prev * 0.5 + torch.linspace(-1, 1, P))
        outs.append((ctrl.before_step(optimizer=opt, params=params, metrics={}), [p.grad.clone() for p in params]))
    assert outs[0][0]["gac/cos"].item() == outs[1][0]["gac/cos"].item() > 0.9
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))


def test_build_controllers_takes_a_name_a_composition_a_spec_and_overrides() -> None:
    """A preset name and an ``a+b`` composition work as compute_loss's do; a spec and overrides as resolve_method's."""
    kinds = lambda cs: [type(c).__name__ for c in cs]  # noqa: E731
    assert kinds(build_controllers("vcpo")) == ["EssStepSizeController"]
    assert kinds(build_controllers("seq_tis+gac")) == ["GradientAlignmentController"]
    assert kinds(build_controllers(resolve_method("seq_tis+gac"))) == ["GradientAlignmentController"]
    assert build_controllers("seq_tis") == []
    (ctrl,) = build_controllers("vcpo", {"ess_lr.rho_base": 0.55})
    assert ctrl.spec.rho_base == 0.55
    (ctrl,) = build_controllers(resolve_method("vcpo"), {"ess_lr.rho_base": 0.5})
    assert ctrl.spec.rho_base == 0.5
    with pytest.raises(ValueError, match="unknown method 'vcp'"):
        build_controllers("vcp")
