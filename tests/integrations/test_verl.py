"""The verl adapter against the real verl 0.9.1 registries and loss path, on CPU, float64 unless said otherwise.

(1) every hostable preset, looked up with verl's ``get_policy_loss_fn`` and called with the keywords verl's
    ``ppo_loss`` uses (``rollout_is_weights=`` from verl's own rollout-correction helper), equals
    ``steadyrl.compute_loss`` on the same tensors (loss and gradient, 1e-6);
(2) through verl's own ``verl.workers.utils.losses.ppo_loss`` (TensorDict, unpadded log-probs, two micro-batches with
    the step's ``batch_num_tokens`` / ``global_batch_size``): each micro-batch is ``compute_loss`` times its share, and
    steadyrl's PPO / token-TIS with verl's dual clip equal verl's ``vanilla`` loss;
(3) the traps: the seventh argument (alias ``rollout_log_probs``, callers ``rollout_is_weights=``), truncated weights,
    a missing μ, ``loss_agg_mode``; the refusals; the advantage estimators; the step controllers; import hygiene.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch

verl = pytest.importorskip(
    "verl", reason="the verl adapter tests need verl==0.9.1 (requirements/integrations/verl.txt, installed --no-deps)"
)

from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from steadyrl import compute_loss, resolve_method  # noqa: E402
from steadyrl.integrations import verl as sverl  # noqa: E402
from steadyrl.methods import PRESETS  # noqa: E402

HOSTED = [p.name for p in PRESETS if sverl.supported(p.name)[0]]
REFUSED = [p.name for p in PRESETS if not sverl.supported(p.name)[0]]
CONTROLLER_WARNING = "ignore:method .* has step-level controllers:UserWarning"


def tensors(seed: int = 0, B: int = 6, T: int = 7, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """π_θ (leaf), π_prox = π_θ + δ₁, μ = π_prox + δ₂, right-padded responses of lengths 1..T, token advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 3, 5, 1, T - 1, 4][:B])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.05
    old = logp + 0.15 * torch.randn(B, T, generator=g, dtype=dtype)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    adv_seq = torch.randn(B, generator=g, dtype=dtype)
    adv = adv_seq[:, None].expand(B, T) * mask
    return {"logp": logp, "old": old, "rollout": rollout, "mask": mask, "adv": adv.contiguous()}


def verl_weights(x: dict[str, torch.Tensor], **corr: Any) -> torch.Tensor:
    """``rollout_is_weights`` as verl's trainer computes them (decoupled mode); by default the adapter's setting."""
    settings = {k: v for k, v in {**sverl.ROLLOUT_CORRECTION, **corr}.items() if k != "bypass_mode"}
    proto, _, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=x["old"], rollout_log_prob=x["rollout"], response_mask=x["mask"], **settings
    )
    return proto.batch["rollout_is_weights"]


def actor_config(loss_mode: str, agg: str, **kw: Any) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=agg, **kw,
    )  # fmt: skip


def reference(name: str | Any, x: dict[str, torch.Tensor], logp: torch.Tensor, behav: torch.Tensor | None = None):
    spec = resolve_method(name) if isinstance(name, str) else name
    spec = resolve_method(spec, {"advantage.type": "given"})
    batch = {
        "logp": logp, "behav_logp": x["rollout"] if behav is None else behav, "prox_logp": x["old"],
        "mask": x["mask"], "advantages": x["adv"],
    }  # fmt: skip
    return compute_loss(spec, batch)


def call_as_verl(loss_mode: str, x: dict[str, torch.Tensor], logp: torch.Tensor, agg: str, weights: Any, **cfg: Any):
    """The call of ``verl.workers.utils.losses.ppo_loss`` (keywords, the actor config, ``rollout_is_weights=``)."""
    fn = core_algos.get_policy_loss_fn(loss_mode)
    return fn(
        old_log_prob=x["old"], log_prob=logp, advantages=x["adv"], response_mask=x["mask"], loss_agg_mode=agg,
        config=actor_config(loss_mode, agg, **cfg), rollout_is_weights=weights,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ (1) registry
def test_every_preset_is_registered_under_its_name() -> None:
    names = {sverl.PREFIX + p.name for p in PRESETS}
    assert names <= set(core_algos.POLICY_LOSS_REGISTRY)
    assert len(HOSTED) >= 20 and "seq_tis" in HOSTED and "vcpo" in REFUSED


@pytest.mark.filterwarnings(CONTROLLER_WARNING)
@pytest.mark.parametrize("name", HOSTED)
def test_registered_loss_equals_compute_loss(name: str) -> None:
    x = tensors()
    agg = resolve_method(name).agg
    logp = x["logp"].clone().requires_grad_()
    loss, metrics = call_as_verl(sverl.PREFIX + name, x, logp, agg, verl_weights(x))
    logp_ref = x["logp"].clone().requires_grad_()
    ref = reference(name, x, logp_ref)
    assert torch.allclose(loss, ref.loss, rtol=1e-6, atol=1e-6), (float(loss), float(ref.loss))
    (g,) = torch.autograd.grad(loss, logp, allow_unused=True, materialize_grads=True)
    (g_ref,) = torch.autograd.grad(ref.loss, logp_ref, allow_unused=True, materialize_grads=True)
    assert torch.allclose(g, g_ref, rtol=1e-6, atol=1e-9)
    assert math.isclose(metrics["steadyrl/loss/total"], ref.loss.item(), rel_tol=1e-6, abs_tol=1e-9)
    assert all(k.startswith("steadyrl/") and isinstance(v, float) for k, v in metrics.items())


@pytest.mark.parametrize("name", ["token_tis", "seq_tis", "icepop"])
def test_float32_weights_recover_behavior(name: str) -> None:
    """In float32 log(w) recovers ℓ to rounding: the loss matches to 1e-5."""
    x = tensors(seed=3, dtype=torch.float32)
    agg = resolve_method(name).agg
    loss, _ = call_as_verl(sverl.PREFIX + name, x, x["logp"], agg, verl_weights(x))
    assert torch.allclose(loss, reference(name, x, x["logp"]).loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", REFUSED)
def test_unhostable_presets_raise_naming_what_is_missing(name: str) -> None:
    x = tensors()
    missing = r"cannot run: .*(rewards|entropy|ref_logp|group_ids|versions|centering)"
    with pytest.raises(ValueError, match=missing):
        call_as_verl(sverl.PREFIX + name, x, x["logp"], "token-mean", verl_weights(x))
    with pytest.raises(ValueError, match="cannot run as a verl policy loss"):
        sverl.register("steadyrl-test/" + name, name)


# ------------------------------------------------------------------------------------------------ (2) ppo_loss
def ppo_loss_data(x: dict[str, torch.Tensor], rows: slice, weights: torch.Tensor | None, info: dict[str, Any]):
    """A verl training micro-batch: padded TensorDict plus the unpadded log-probs the model would output."""
    mask = x["mask"][rows]
    B, T = mask.shape
    P = 2
    fields = {
        "prompts": torch.ones(B, P, dtype=torch.long), "responses": torch.ones(B, T, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], dim=1),
        "response_mask": mask.long(), "old_log_probs": x["old"][rows], "advantages": x["adv"][rows],
    }  # fmt: skip
    if weights is not None:
        fields["rollout_is_weights"] = weights[rows]
    data = TensorDict(fields, batch_size=[B])
    tu.assign_non_tensor(data, **info)
    return data


def flat_log_probs(logp: torch.Tensor, mask: torch.Tensor, prompt_len: int = 2) -> torch.Tensor:
    """Unpadded model output: sequence b takes P + L_b slots; response token t sits at P − 1 + t (next-token shift)."""
    pieces = []
    for row, m in zip(logp, mask, strict=True):
        L = int(m.sum())
        pieces += [row.new_zeros(prompt_len - 1), row[:L], row.new_zeros(1)]
    return torch.cat(pieces)


def run_ppo_loss(loss_mode: str, agg: str, x: dict[str, torch.Tensor], logp: torch.Tensor, weights: Any,
                 split: int = 3, **cfg: Any) -> list[torch.Tensor]:  # fmt: skip
    """verl's ``ppo_loss`` on two micro-batches with the step's normalizers, as its FSDP engine sets them."""
    m = x["mask"]
    info = {"dp_size": 1, "batch_num_tokens": int(m.sum()), "global_batch_size": m.shape[0]}
    config = actor_config(loss_mode, agg, **cfg)
    out = []
    for rows in (slice(0, split), slice(split, None)):
        data = ppo_loss_data(x, rows, weights, info)
        loss, _ = ppo_loss(config, {"log_probs": flat_log_probs(logp[rows], m[rows])}, data)
        out.append(loss)
    return out


@pytest.mark.parametrize(
    ("name", "overrides"),
    [("token_tis", {}), ("seq_tis", {}), ("icepop", {}), ("grpo", {}), ("dr_grpo", {"norm_len": 10})],
)
def test_through_verl_ppo_loss_each_micro_batch_is_its_share(name: str, overrides: dict[str, Any]) -> None:
    x = tensors(seed=1)
    loss_mode = sverl.register(f"steadyrl-test/{name}-share", name, overrides)
    spec = resolve_method(name, overrides)
    cfg = {"loss_scale_factor": overrides["norm_len"]} if "norm_len" in overrides else {}
    logp = x["logp"].clone().requires_grad_()
    losses = run_ppo_loss(loss_mode, spec.agg, x, logp, verl_weights(x), **cfg)
    m = x["mask"]
    for rows, loss in zip((slice(0, 3), slice(3, None)), losses, strict=True):
        sub = {k: v[rows] for k, v in x.items()}
        ref = reference(spec, sub, x["logp"][rows])
        share = m[rows].sum() / m.sum() if spec.agg == "token-mean" else m[rows].any(-1).sum() / m.shape[0]
        assert torch.allclose(loss, ref.loss * share, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("name", ["ppo", "token_tis"])
def test_equals_verl_vanilla_loss_with_dual_clip(name: str, agg: str) -> None:
    """steadyrl's PPO (and token TIS, cap 2) with verl's dual clip c = 3 is verl's ``vanilla`` loss (with verl's own
    truncated token weights): same loss and gradient through ``ppo_loss``, step normalizers included."""
    x = tensors(seed=2)
    loss_mode = sverl.register(f"steadyrl-test/{name}-dual-{agg}", name, {"objective.dual_clip": 3.0, "agg": agg})
    logp = x["logp"].clone().requires_grad_()
    ours = sum(run_ppo_loss(loss_mode, agg, x, logp, verl_weights(x)))
    logp_v = x["logp"].clone().requires_grad_()
    tis = verl_weights(x, rollout_is_threshold=2.0) if name == "token_tis" else None
    theirs = sum(run_ppo_loss("vanilla", agg, x, logp_v, tis))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-9), (float(ours), float(theirs))
    (g,) = torch.autograd.grad(ours, logp)
    (g_v,) = torch.autograd.grad(theirs, logp_v)
    assert torch.allclose(g, g_v, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------------ (3) traps
def test_seventh_argument_is_keyword_only_and_log_probs_are_accepted_by_name() -> None:
    x = tensors()
    fn = core_algos.get_policy_loss_fn("steadyrl/seq_tis")
    cfg = actor_config("steadyrl/seq_tis", "seq-mean-token-mean")
    args = (x["old"], x["logp"], x["adv"], x["mask"], "seq-mean-token-mean", cfg)
    with pytest.raises(TypeError):
        fn(*args, x["rollout"])  # the alias's positional rollout_log_probs: refused, never read as weights
    by_weights, _ = fn(*args, rollout_is_weights=verl_weights(x))
    by_logp, _ = fn(*args, rollout_log_probs=x["rollout"])
    assert torch.allclose(by_weights, by_logp, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="not both"):
        fn(*args, rollout_is_weights=verl_weights(x), rollout_log_probs=x["rollout"])


def test_truncated_or_missing_weights_are_refused_with_the_setting_to_use() -> None:
    x = tensors()
    x["rollout"][0, :2] = x["old"][0, :2] - 3.0  # weight e³ ≈ 20: outside IcePop's band, so verl zeroes it
    icepop = verl_weights(x, rollout_is_threshold="0.5_5.0")  # verl zeroes weights outside the band
    with pytest.raises(ValueError, match="rollout_is_threshold=1e9"):
        call_as_verl("steadyrl/token_tis", x, x["logp"], "token-mean", icepop)
    with pytest.raises(ValueError, match="rollout_is=token"):
        call_as_verl("steadyrl/token_tis", x, x["logp"], "token-mean", None)


def test_method_without_behavior_needs_no_weights() -> None:
    """PPO's loss does not depend on μ: without weights μ := π_prox, and the loss is compute_loss's."""
    x = tensors()
    loss, metrics = call_as_verl("steadyrl/ppo", x, x["logp"], "token-mean", None)
    ref = reference("ppo", x, x["logp"], behav=x["old"])
    assert torch.allclose(loss, ref.loss, rtol=1e-9, atol=1e-12)
    assert metrics["steadyrl/is/ess_ratio"] == pytest.approx(1.0)


def test_an_entropy_bonus_points_to_verls_own_entropy_coeff() -> None:
    """verl adds its entropy bonus outside the policy loss (``actor.entropy_coeff``, aggregated with loss_agg_mode):
    a method with one is refused, naming that setting."""
    with pytest.raises(ValueError, match=r"needs 'entropy'.*actor_rollout_ref\.actor\.entropy_coeff"):
        sverl.make_policy_loss("seq_tis", {"entropy.coef": 0.01})
    assert not sverl.supported("adaptive_entropy")[0]


def test_loss_agg_mode_must_match_the_method() -> None:
    x = tensors()
    with pytest.raises(ValueError, match=r"loss_agg_mode is 'token-mean'.*seq-mean-token-mean"):
        call_as_verl("steadyrl/seq_tis", x, x["logp"], "token-mean", verl_weights(x))


def test_data_parallel_without_the_step_token_count_is_refused() -> None:
    x = tensors()
    cfg = actor_config("steadyrl/ppo", "token-mean")
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=None, global_batch_size=None)
    fn = core_algos.get_policy_loss_fn("steadyrl/ppo")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fn(old_log_prob=x["old"], log_prob=x["logp"], advantages=x["adv"], response_mask=x["mask"],
           loss_agg_mode="token-mean", config=cfg, rollout_is_weights=None)  # fmt: skip


def test_behavior_from_weights_inverts_verl_weights() -> None:
    x = tensors(seed=5)
    behav = sverl.behavior_from_weights(x["old"], verl_weights(x), x["mask"])
    m = x["mask"]
    assert torch.allclose(behav[m], x["rollout"][m], atol=1e-12)
    assert torch.equal(behav[~m], x["old"][~m])


# ------------------------------------------------------------------------------------------------ advantages
def grpo_reference(R: list[float], uid: list[str], scale: bool, eps: float = 1e-6) -> list[float]:
    """(R_i − mean_g)/(std_g + ε) with the n−1 std, or R_i − mean_g (Dr.GRPO), written out per group."""
    out = []
    for i, r in enumerate(R):
        g = [R[j] for j in range(len(R)) if uid[j] == uid[i]]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((v - mean) ** 2 for v in g) / (len(g) - 1))
        out.append((r - mean) / (std + eps) if scale else r - mean)
    return out


@pytest.mark.parametrize(("name", "scale"), [("steadyrl/grpo", True), ("steadyrl/dr_grpo", False)])
def test_advantage_estimator_as_verl_calls_it(name: str, scale: bool) -> None:
    import numpy as np

    x = tensors()
    B, T = x["mask"].shape
    uid = np.array(["a", "b", "a", "c", "b", "c"], dtype=object)
    R = torch.tensor([1.0, 0.0, 0.0, 2.0, 1.0, 0.5], dtype=torch.float64)
    token_rewards = torch.zeros(B, T, dtype=torch.float64)
    last = x["mask"].sum(-1) - 1
    token_rewards[torch.arange(B), last] = R  # outcome reward on the last response token, as verl's reward manager
    fn = core_algos.get_adv_estimator_fn(name)
    adv, ret = fn(token_level_rewards=token_rewards, response_mask=x["mask"].long(), config=None, index=uid)
    expected = torch.tensor(grpo_reference(R.tolist(), list(uid), scale), dtype=torch.float64)
    assert torch.allclose(adv, expected[:, None] * x["mask"], atol=1e-9)
    assert torch.equal(adv, ret)
    native, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=token_rewards, response_mask=x["mask"].long(), index=uid, norm_adv_by_std_in_grpo=scale
    )
    assert torch.allclose(adv, native.to(adv.dtype), atol=1e-6)


@pytest.mark.parametrize("adv", ["opob", "vaco", "otb", "copc", "brace"])
def test_unhostable_advantage_estimators_raise(adv: str) -> None:
    fn = core_algos.get_adv_estimator_fn("steadyrl/" + adv)
    with pytest.raises(ValueError, match="cannot run"):
        fn(token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), index=None)
    with pytest.raises(ValueError, match="needs more than rewards and groups"):
        sverl.register_advantage("steadyrl-test/" + adv, adv)


# ------------------------------------------------------------------------------------------------ controllers
def test_ess_step_size_scales_the_step_and_restores_the_lr() -> None:
    loss_mode = sverl.register("steadyrl-test/seq_tis+ess_lr", "seq_tis+ess_lr")
    x = tensors(seed=6)
    theta = torch.nn.Parameter(x["logp"].clone())
    opt = torch.optim.SGD([theta], lr=0.5)
    sverl.wrap_optimizer(opt, loss_mode)
    ratios = []
    for rows in (slice(0, 3), slice(3, None)):
        sub = {k: v[rows] for k, v in x.items()}
        loss, metrics = call_as_verl(loss_mode, sub, theta[rows], "seq-mean-token-mean", verl_weights(sub))
        loss.backward()
        ratios.append(metrics["steadyrl/vcpo/ess_ratio"])
    grad = theta.grad.clone()
    before = theta.detach().clone()
    opt.step()
    scale = math.sqrt(min(1.0, sum(ratios) / 2))
    assert scale < 0.99  # the stale batch really shrinks the step
    assert torch.allclose(theta.detach(), before - 0.5 * scale * grad, atol=1e-12)
    assert opt.param_groups[0]["lr"] == 0.5
    ctrl = sverl._CONTROLS[loss_mode]
    assert ctrl.last["steadyrl/vcpo/ess_scale"] == pytest.approx(scale, rel=1e-6)


def test_gac_skips_an_aligned_step_and_warns_when_unwrapped() -> None:
    loss_mode = sverl.register("steadyrl-test/gac", "gac", {"gac.tau_skip": 0.5})
    x = tensors(seed=7)
    theta = torch.nn.Parameter(x["logp"].clone())
    with pytest.warns(UserWarning, match="wrap_optimizer"):
        call_as_verl(loss_mode, x, theta, "token-mean", None)[0].backward()
    theta.grad = None
    opt = sverl.wrap_optimizer(torch.optim.SGD([theta], lr=0.1), loss_mode)
    with pytest.raises(ValueError, match="already wrapped"):
        sverl.wrap_optimizer(opt, loss_mode)
    snapshots = []
    for _ in range(2):  # the same batch twice: cos(g_t, g_{t−1}) ≈ 1 > τ_skip at the second step
        opt.zero_grad()
        call_as_verl(loss_mode, x, theta, "token-mean", None)[0].backward()
        opt.step()
        snapshots.append(theta.detach().clone())
    assert not torch.equal(snapshots[0], x["logp"])
    assert torch.equal(snapshots[1], snapshots[0])  # skipped: weights untouched
    assert sverl._CONTROLS[loss_mode].last["steadyrl/gac/skipped"] == 1.0


# ------------------------------------------------------------------------------------------------ import hygiene
def _run(code: str, **env: str) -> str:
    res = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env={**os.environ, **env}
    )
    return res.stdout.strip()


def test_verl_loads_the_adapter_from_its_external_modules_variable() -> None:
    code = (
        "import verl.trainer.ppo.core_algos as c\n"
        "print('steadyrl/seq_tis' in c.POLICY_LOSS_REGISTRY, 'steadyrl/grpo' in c.ADV_ESTIMATOR_REGISTRY)"
    )
    assert _run(code, VERL_USE_EXTERNAL_MODULES="steadyrl.integrations.verl") == "True True"


def test_import_steadyrl_imports_no_verl_and_a_missing_verl_says_what_to_install() -> None:
    assert _run("import sys, steadyrl, steadyrl.integrations; print('verl' in sys.modules)") == "False"
    code = (
        "import sys\nsys.modules['verl'] = None\n"
        "try:\n    import steadyrl.integrations.verl\nexcept ImportError as e:\n    print(e)\n"
    )
    with warnings.catch_warnings():
        out = _run(code)
    assert out == (
        "steadyrl.integrations.verl needs verl: pip install 'steadyrl[verl]' (tested with verl==0.9.1;"
        " in a checkout: pip install --no-deps -r requirements/integrations/verl.txt)"
    )
