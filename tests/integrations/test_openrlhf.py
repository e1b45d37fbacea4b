"""The OpenRLHF adapter against the real OpenRLHF 0.11.2 loss module, on CPU, float64.

``openrlhf.models`` cannot be imported here: its ``__init__`` imports the actor, whose ring-attention helpers import
flash-attn (CUDA only). ``openrlhf/models/loss.py`` itself needs only ``.utils`` (deepspeed) and torch, so the tests
load it on its own: ``openrlhf.models`` and ``openrlhf.utils`` are registered as bare packages (their ``__init__``
files are not run) and ``openrlhf.models.loss`` / ``openrlhf.utils.loss_utils`` are imported normally from the
installed files. With them:

(1) every hostable preset, called the way ``PolicyModelActor.training_step`` calls its loss (positional log-probs and
    advantages, ``action_mask=``, ``rollout_log_probs=``, and the step normalizers from OpenRLHF's own
    ``iter_grad_accum_global_norm``), equals ``steadyrl.compute_loss`` times the micro-batch's share (1e-6);
(2) steadyrl's PPO, token TIS (OpenRLHF's token ``clip`` correction) and GSPO equal OpenRLHF's ``PolicyLoss``;
(3) the output tuple, the refusals, the factory that stands in for the class in ``ppo_actor``, import hygiene.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

openrlhf = pytest.importorskip(
    "openrlhf",
    reason="the OpenRLHF adapter tests need openrlhf==0.11.2: pip install --no-deps -r "
    "requirements/integrations/openrlhf.txt",
)
pytest.importorskip("deepspeed", reason="openrlhf/models/loss.py imports deepspeed (requirements/integrations)")

from steadyrl import compute_loss, resolve_method  # noqa: E402
from steadyrl.integrations import openrlhf as sopen  # noqa: E402
from steadyrl.methods import PRESETS  # noqa: E402

HOSTED = [p.name for p in PRESETS if sopen.supported(p.name)[0]]
REFUSED = [p.name for p in PRESETS if not sopen.supported(p.name)[0]]


def _load(name: str) -> types.ModuleType:
    """Import ``openrlhf.<pkg>.<mod>`` without running ``openrlhf/<pkg>/__init__.py`` (which needs flash-attn)."""
    pkg = name.rsplit(".", 1)[0]
    if pkg not in sys.modules:
        bare = types.ModuleType(pkg)
        bare.__path__ = [str(Path(openrlhf.__path__[0]) / pkg.split(".")[1])]
        sys.modules[pkg] = bare
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def orl() -> types.SimpleNamespace:
    saved = {k: sys.modules.get(k) for k in ("openrlhf.models", "openrlhf.utils")}
    try:
        yield types.SimpleNamespace(loss=_load("openrlhf.models.loss"), loss_utils=_load("openrlhf.utils.loss_utils"))
    finally:  # leave no bare package behind for other tests
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def tensors(seed: int = 0, B: int = 6, T: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 5, 1, T - 1, 4][:B])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    old = logp + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None].expand(B, T) * mask
    return {"logp": logp, "old": old, "rollout": rollout, "mask": mask, "adv": adv.contiguous()}


def reference(spec: Any, x: dict[str, torch.Tensor], logp: torch.Tensor, *, behav: torch.Tensor | None = None):
    spec = resolve_method(resolve_method(spec) if isinstance(spec, str) else spec, {"advantage.type": "given"})
    batch = {
        "logp": logp, "behav_logp": x["rollout"] if behav is None else behav, "prox_logp": x["old"],
        "mask": x["mask"], "advantages": x["adv"],
    }  # fmt: skip
    return compute_loss(spec, batch)


def micro_batches(orl: types.SimpleNamespace, x: dict[str, torch.Tensor], split: int = 3):
    """Two micro-batches of one optimizer step (gas = 2) with OpenRLHF's normalizers, as ``ppo_train`` pairs them."""
    items = [{k: v[rows] for k, v in x.items()} for rows in (slice(0, split), slice(split, None))]
    return list(orl.loss_utils.iter_grad_accum_global_norm(iter(items), None, 2, lambda e: e["mask"]))


def call_as_actor(loss_fn: Any, mb: dict[str, torch.Tensor], logp: torch.Tensor, info: dict[str, Any],
                  with_rollout: bool = True):  # fmt: skip
    """``PolicyModelActor.training_step``'s call of ``self.actor_loss_fn``."""
    return loss_fn(
        logp, mb["old"], mb["adv"], action_mask=mb["mask"],
        rollout_log_probs=mb["rollout"] if with_rollout else None, **info,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore:method .* has step-level controllers:UserWarning")
@pytest.mark.parametrize("name", HOSTED)
def test_loss_equals_compute_loss_times_its_share_of_the_step(orl: types.SimpleNamespace, name: str) -> None:
    x = tensors()
    loss_fn = sopen.PolicyLoss(name)
    spec = resolve_method(name)
    for mb, info in micro_batches(orl, x):
        logp = mb["logp"].clone().requires_grad_()
        loss, *_ = call_as_actor(loss_fn, mb, logp, info)
        logp_ref = mb["logp"].clone().requires_grad_()
        ref = reference(name, mb, logp_ref)
        m, M = mb["mask"], x["mask"]
        # iter_grad_accum_global_norm divides its counts by gas (DeepSpeed then scales every loss by 1/gas)
        share = 2 * (m.sum() / M.sum() if spec.agg == "token-mean" else m.any(-1).sum() / M.any(-1).sum())
        assert torch.allclose(loss, ref.loss * share, rtol=1e-6, atol=1e-9), (float(loss), float(ref.loss * share))
        (g,) = torch.autograd.grad(loss, logp, allow_unused=True, materialize_grads=True)
        (g_ref,) = torch.autograd.grad(ref.loss * share, logp_ref, allow_unused=True, materialize_grads=True)
        assert torch.allclose(g, g_ref, rtol=1e-6, atol=1e-9)
    assert loss_fn.last_metrics["steadyrl/loss/total"] == pytest.approx(ref.loss.item(), rel=1e-6, abs=1e-9)


@pytest.mark.filterwarnings("ignore:method .* has step-level controllers:UserWarning")
@pytest.mark.parametrize("name", HOSTED)
def test_without_normalizers_the_loss_is_compute_loss(name: str) -> None:
    x = tensors(seed=1)
    loss_fn = sopen.PolicyLoss(name)
    loss, *_ = loss_fn(x["logp"], x["old"], x["adv"], action_mask=x["mask"], rollout_log_probs=x["rollout"])
    assert torch.allclose(loss, reference(name, x, x["logp"]).loss, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    ("name", "overrides", "theirs"),
    [
        ("ppo", {}, {}),
        ("ppo", {"objective.dual_clip": 3.0}, {"dual_clip": 3.0}),
        ("ppo", {"agg": "seq-mean-token-mean"}, {"token_level_loss": False}),
        ("token_tis", {"token_tis.cap": 2.0, "token_tis.floor": 0.5},
         {"is_correction_level": "token", "is_correction_mode": "clip", "is_correction_threshold": (0.5, 2.0)}),
        ("gspo", {"objective.clip_low": 0.05, "objective.clip_high": 0.08},
         {"policy_loss_type": "gspo", "clip_eps_low": 0.05, "clip_eps_high": 0.08}),
    ],
)  # fmt: skip
def test_equals_openrlhf_policy_loss(orl: types.SimpleNamespace, name: str, overrides: dict, theirs: dict) -> None:
    """Where OpenRLHF has the same method, its ``PolicyLoss`` and ours agree (loss and gradient, step normalizers)."""
    x = tensors(seed=2)
    ours, native = sopen.PolicyLoss(name, overrides), orl.loss.PolicyLoss(**theirs)
    for mb, info in micro_batches(orl, x):
        a = mb["logp"].clone().requires_grad_()
        b = mb["logp"].clone().requires_grad_()
        la, clip_a, kl_a, vkl_a, _ = call_as_actor(ours, mb, a, info)
        lb, clip_b, kl_b, vkl_b, _ = call_as_actor(native, mb, b, info)
        assert torch.allclose(la, lb, rtol=1e-6, atol=1e-9), (float(la), float(lb))
        assert torch.allclose(torch.autograd.grad(la, a)[0], torch.autograd.grad(lb, b)[0], rtol=1e-6, atol=1e-9)
        assert torch.allclose(kl_a, kl_b, atol=1e-9)
        if vkl_b is not None:
            assert torch.allclose(vkl_a, vkl_b, atol=1e-9)
        if name == "ppo":
            assert torch.allclose(clip_a.to(clip_b.dtype), clip_b, atol=1e-9)


def test_outputs_without_and_with_behavior_log_probs() -> None:
    x = tensors(seed=3)
    loss, _, ppo_kl, vllm_kl, filt = sopen.PolicyLoss("ppo")(x["logp"], x["old"], x["adv"], action_mask=x["mask"])
    assert vllm_kl is None and filt is None  # OpenRLHF then logs neither
    m = x["mask"]
    assert torch.allclose(ppo_kl, (x["old"] - x["logp"])[m].mean())
    assert torch.allclose(loss, reference("ppo", x, x["logp"], behav=x["old"]).loss)
    _, _, _, vllm_kl, filt = sopen.PolicyLoss("icepop")(
        x["logp"], x["old"], x["adv"], action_mask=m, rollout_log_probs=x["rollout"]
    )
    assert torch.allclose(vllm_kl, (x["rollout"] - x["old"])[m].mean())
    ratio = torch.exp(x["old"] - x["rollout"])[m]
    assert math.isclose(float(filt), float(((ratio < 0.5) | (ratio > 5.0)).double().mean()), abs_tol=1e-9)


def test_missing_behavior_or_normalizers_are_refused() -> None:
    x = tensors()
    with pytest.raises(ValueError, match="is_correction_level token"):
        sopen.PolicyLoss("seq_tis")(x["logp"], x["old"], x["adv"], action_mask=x["mask"])
    with pytest.raises(ValueError, match="batch_num_tokens"):
        sopen.PolicyLoss("ppo")(x["logp"], x["old"], x["adv"], action_mask=x["mask"], dp_size=2)


@pytest.mark.parametrize("name", REFUSED)
def test_unhostable_presets_raise_naming_what_is_missing(name: str) -> None:
    missing = r"cannot run as an OpenRLHF policy loss: .*(rewards|entropy|ref_logp|versions|centering)"
    with pytest.raises(ValueError, match=missing):
        sopen.PolicyLoss(name)
    with pytest.raises(ValueError, match="cannot run"):
        sopen.policy_loss_factory(name)


def test_install_replaces_the_class_ppo_actor_builds() -> None:
    """``install`` swaps ``PolicyLoss`` in the actor module; the actor's constructor call (its keyword arguments,
    ``ppo_actor.py``) then builds steadyrl's loss. A stand-in module: the real one needs flash-attn and vLLM."""
    actor_module = types.ModuleType("ppo_actor_stand_in")
    actor_module.PolicyLoss = object
    sopen.install("seq_tis", {"seq_tis.cap": 4.0}, module=actor_module)
    loss_fn = actor_module.PolicyLoss(
        clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=None, token_level_loss=True, policy_loss_type="ppo",
        is_correction_level="token", is_correction_mode="mask", is_correction_gating="ratio",
        is_correction_threshold=(0.5, 5.0),
    )  # fmt: skip
    assert isinstance(loss_fn, sopen.PolicyLoss)
    assert loss_fn.steadyrl_method.corrections[0].cap == 4.0
    with pytest.raises(ValueError, match="no PolicyLoss"):
        sopen.install("ppo", module=types.ModuleType("empty"))


def test_install_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    target = types.ModuleType("openrlhf.trainer.ray.ppo_actor")
    target.PolicyLoss = object
    monkeypatch.setitem(sys.modules, "openrlhf.trainer.ray.ppo_actor", target)
    monkeypatch.setenv(sopen.METHOD_ENV, "icepop")
    monkeypatch.setenv(sopen.OVERRIDES_ENV, '{"icepop.upper": 4.0}')
    sopen.install_from_env()
    assert target.PolicyLoss().steadyrl_method.corrections[0].upper == 4.0


def test_ess_step_size_through_wrap_optimizer() -> None:
    x = tensors(seed=4)
    loss_fn = sopen.PolicyLoss("seq_tis+ess_lr")
    theta = torch.nn.Parameter(x["logp"].clone())
    opt = loss_fn.wrap_optimizer(torch.optim.SGD([theta], lr=0.5))
    loss, *_ = loss_fn(theta, x["old"], x["adv"], action_mask=x["mask"], rollout_log_probs=x["rollout"])
    loss.backward()
    ess = loss_fn.last_metrics["steadyrl/vcpo/ess_ratio"]
    grad, before = theta.grad.clone(), theta.detach().clone()
    opt.step()
    assert ess < 0.98
    assert torch.allclose(theta.detach(), before - 0.5 * math.sqrt(ess) * grad, atol=1e-12)
    assert opt.param_groups[0]["lr"] == 0.5


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          env=dict(os.environ)).stdout.strip()  # fmt: skip


def test_import_steadyrl_imports_no_openrlhf_and_a_missing_one_says_what_to_install() -> None:
    assert _run("import sys, steadyrl, steadyrl.integrations; print('openrlhf' in sys.modules)") == "False"
    code = (
        "import sys\nsys.modules['openrlhf'] = None\n"
        "try:\n    import steadyrl.integrations.openrlhf\nexcept ImportError as e:\n    print(e)\n"
    )
    assert _run(code) == (
        "steadyrl.integrations.openrlhf needs OpenRLHF: pip install 'steadyrl[openrlhf]' (tested with openrlhf==0.11.2;"
        " in a checkout: pip install --no-deps -r requirements/integrations/openrlhf.txt)"
    )
