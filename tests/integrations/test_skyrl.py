"""The SkyRL adapter against the real SkyRL 0.3.0 registries and loss-reduction code, on CPU.

(1) For every steadyrl method SkyRL can host: SkyRL's own path (its ``compute_advantages_and_returns`` with the
    registered estimator, its ``apply_loss_reduction_to_advantages_minibatch``, the registered loss fetched from
    ``PolicyLossRegistry`` and called per micro-batch exactly as its policy worker calls it, micro-batch losses summed)
    equals ``steadyrl.compute_loss`` on the whole mini-batch (rewards and groups, no SkyRL in the reference), loss and
    gradient, to 1e-6; a stale sampler is simulated (μ ≠ π_prox ≠ π_θ).
(2) The traps: the registry synced to a Ray actor (a loss registered in the driver, then fetched and run inside a Ray
    worker process); ``rollout_logprobs`` (SkyRL's example loss omits it); refusals naming the field.
(3) Methods SkyRL cannot host raise a clear error; ``import steadyrl`` imports no SkyRL.

Python 3.11 note: ``import skyrl.backends`` fails inside skyrl 0.3.0 on Python < 3.12 (its Tinker API types use
``typing.TypedDict``, which pydantic refuses there). SkyRL's registries live in ``skyrl.backends.skyrl_train``, whose
modules do not need that package ``__init__`` (it only re-exports the Tinker backend), so :func:`_skyrl_backends_shim`
registers ``skyrl.backends`` as a bare package before the import. Everything under test is SkyRL's own code.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import types
from typing import Any

import pytest
import torch

pytest.importorskip("skyrl", reason="the SkyRL adapter tests need skyrl==0.3.0 (requirements/integrations/skyrl.txt)")


def _skyrl_backends_shim() -> None:
    """Register ``skyrl.backends`` without running its ``__init__`` (Python 3.11 only; see the module docstring)."""
    if sys.version_info >= (3, 12) or "skyrl.backends" in sys.modules:
        return
    spec = importlib.util.find_spec("skyrl")
    assert spec is not None and spec.submodule_search_locations
    pkg = types.ModuleType("skyrl.backends")
    pkg.__path__ = [spec.submodule_search_locations[0] + "/backends"]
    sys.modules["skyrl.backends"] = pkg


_skyrl_backends_shim()
ppo = pytest.importorskip("skyrl.backends.skyrl_train.utils.ppo_utils", reason="SkyRL's ppo_utils must import")

from skyrl.train.config import AlgorithmConfig  # noqa: E402

from steadyrl import compute_loss, resolve_method  # noqa: E402
from steadyrl.integrations import skyrl as ssky  # noqa: E402
from steadyrl.methods import PRESETS  # noqa: E402

G, N_PROMPTS, T = 4, 3, 7
B = G * N_PROMPTS
HOSTED = [p.name for p in PRESETS if ssky.supported(p.name)[0]]
NOT_HOSTED = [p.name for p in PRESETS if not ssky.supported(p.name)[0]]
#: Corrections whose budget couples the whole batch: one micro-batch, as SkyRL would need to match.
BATCH_COUPLED = {"m2po", "m2po_clip", "bapo"}  # budgets or bounds over the batch: one micro-batch
#: Methods whose filters drop every sequence at the default staleness: a milder sampler lag keeps some.
MILD = {"geo_mis": 0.002, "rejection": 0.1}


def stale_batch(seed: int = 0, behav_noise: float = 0.4) -> dict[str, Any]:
    """A mini-batch with a stale sampler: π_prox = π₀ + δ₁, μ = π_prox + δ₂, π_θ = π₀ + δ₃ (float64, right padding)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    logp0 = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    noise = lambda s: s * torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    rewards = torch.randint(0, 3, (B,), generator=g).to(torch.float64)
    token_rewards = torch.zeros(B, T, dtype=torch.float64)
    token_rewards[torch.arange(B), lengths - 1] = rewards  # SkyRL: the outcome reward on the last response token
    prox = (logp0 + noise(0.2)) * mask
    return {
        "mask": mask, "prox": prox, "behav": (prox + noise(behav_noise)) * mask,
        "theta": ((logp0 + noise(0.1)) * mask).requires_grad_(True), "rewards": rewards,
        "token_rewards": token_rewards, "uids": [f"prompt-{i // G}" for i in range(B)],
        "group_ids": torch.arange(B) // G,
    }  # fmt: skip


def config_for(spec: Any) -> AlgorithmConfig:
    """SkyRL's ``trainer.algorithm`` with the loss_reduction the method's agg names (max_seq_len = T)."""
    return dataclasses.replace(
        AlgorithmConfig(), loss_reduction=ssky.AGG_TO_LOSS_REDUCTION[spec.agg], max_seq_len=T,
        advantage_estimator="unused", policy_loss_type="unused",
    )  # fmt: skip


def skyrl_path(name: str, cfg: AlgorithmConfig, d: dict[str, Any], micro: int) -> tuple[torch.Tensor, list[dict]]:
    """SkyRL's trainer + worker path for one mini-batch: estimator → pre-scaling → per-micro-batch loss → sum."""
    adv, _ = ppo.compute_advantages_and_returns(
        token_level_rewards=d["token_rewards"], response_mask=d["mask"].to(torch.float64), index=d["uids"],
        adv_estimator=name, config=cfg, values=None, gamma=1.0, lambd=1.0, grpo_norm_by_std=True,
    )  # fmt: skip
    scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=adv, loss_mask=d["mask"].to(torch.float64), loss_reduction=cfg.loss_reduction,
        micro_batch_size=micro, max_seq_len=cfg.max_seq_len,
    )  # fmt: skip
    loss_fn = ppo.PolicyLossRegistry.get(name)  # as PolicyWorkerBase.__init__
    total, metrics = torch.zeros((), dtype=torch.float64), []
    for s in range(0, B, micro):
        sl = slice(s, s + micro)
        loss, m = loss_fn(  # exactly as PolicyWorkerBase._forward_backward_micro calls it
            d["theta"][sl], d["prox"][sl], scaled[sl], config=cfg, loss_mask=d["mask"][sl].to(torch.float64),
            rollout_logprobs=d["behav"][sl],
        )  # fmt: skip
        total = total + loss  # gradient accumulation over micro-batches, dp_size = 1
        metrics.append(m)
    return total, metrics


def reference(method: str, d: dict[str, Any], overrides: dict[str, Any] | None = None) -> Any:
    return compute_loss(
        resolve_method(method, overrides),
        {"logp": d["theta"], "behav_logp": d["behav"], "prox_logp": d["prox"], "mask": d["mask"],
         "rewards": d["rewards"], "group_ids": d["group_ids"]},
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- (1) same loss
@pytest.mark.parametrize("method", HOSTED)
def test_skyrl_path_equals_compute_loss(method: str) -> None:
    d = stale_batch(behav_noise=MILD.get(method, 0.4))
    ref = reference(method, d)
    overrides: dict[str, Any] | None = None
    masked = float(ref.metrics["loss/masked_frac"])
    if masked > 0 and resolve_method(method).agg != "token-mean":
        # A correction removed tokens that SkyRL's pre-scaling counted; under token_mean that is one known factor.
        overrides = {"agg": "token-mean"}
        ref = reference(method, d, overrides)
        masked = float(ref.metrics["loss/masked_frac"])
    spec = resolve_method(method, overrides)
    name = ssky.register(method, method_overrides=overrides)
    assert name == ssky.NAME_PREFIX + method
    micro = B if method in BATCH_COUPLED else B // 3
    total, metrics = skyrl_path(name, config_for(spec), d, micro)

    expected = ref.loss * (1.0 - masked)  # SkyRL keeps removed tokens in its denominator (masked = 0: identity)
    assert float(total.detach()) == pytest.approx(float(expected.detach()), abs=1e-6, rel=0)
    (g_sky,) = torch.autograd.grad(total, d["theta"])
    (g_ref,) = torch.autograd.grad(expected, d["theta"])
    torch.testing.assert_close(g_sky, g_ref, atol=1e-9, rtol=1e-7)
    assert all(isinstance(v, float) for m in metrics for v in m.values())
    assert ssky.METRIC_PREFIX + "is/ess_ratio" in metrics[0]
    assert masked < 1.0, "every token masked: the comparison would be 0 = 0"
    if ssky.needs_behavior(spec) and method not in MILD:
        assert float(ref.metrics["is/ess_ratio"]) < 0.999, "the simulated staleness must show"


def test_masking_correction_is_exercised() -> None:
    """The factor (1 − masked_frac) of the test above is not vacuous: token_mis removes tokens on this batch."""
    d = stale_batch()
    assert 0.0 < float(reference("token_mis", d).metrics["loss/masked_frac"]) < 1.0


def test_estimator_matches_skyrl_grpo_on_its_defaults() -> None:
    """steadyrl's GRPO with SkyRL's convention (unbiased std, ε = 1e-6) equals SkyRL's built-in 'grpo' estimator."""
    d = stale_batch()
    est = ssky.AdvantageEstimator("grpo", {"advantage.eps": 1e-6, "advantage.unbiased": True})
    mask = d["mask"].to(torch.float64)
    ours, _ = est(d["token_rewards"], mask, d["uids"], config=AlgorithmConfig(), grpo_norm_by_std=True)
    theirs, _ = ppo.AdvantageEstimatorRegistry.get("grpo")(
        token_level_rewards=d["token_rewards"].clone(), response_mask=mask, index=d["uids"], grpo_norm_by_std=True
    )
    torch.testing.assert_close(ours, theirs.to(torch.float64), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------- (2) traps
def _run_in_ray_worker(name: str, tensors: dict[str, torch.Tensor]) -> float:
    """Fetch ``name`` from SkyRL's registry inside a Ray worker process and run it there (nested: pickled by value)."""
    import ray

    @ray.remote(num_cpus=0)
    def remote_loss(name: str, t: dict[str, torch.Tensor]) -> float:
        import importlib.util as iu
        import sys as s
        import types as ty

        if s.version_info < (3, 12) and "skyrl.backends" not in s.modules:  # the same 3.11 shim, in this process
            sp = iu.find_spec("skyrl")
            pkg = ty.ModuleType("skyrl.backends")
            pkg.__path__ = [sp.submodule_search_locations[0] + "/backends"]
            s.modules["skyrl.backends"] = pkg
        from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
        from skyrl.train.config import AlgorithmConfig

        assert name not in PolicyLossRegistry._functions  # a fresh process: only what the actor holds
        fn = PolicyLossRegistry.get(name)  # syncs from the Ray actor, unpickles steadyrl's PolicyLoss
        loss, _ = fn(t["theta"], t["prox"], t["adv"], config=AlgorithmConfig(), loss_mask=t["mask"],
                     rollout_logprobs=t["behav"])  # fmt: skip
        return float(loss)

    return ray.get(remote_loss.remote(name, tensors))


@pytest.mark.slow
def test_registry_reaches_a_ray_worker() -> None:
    """Registered in the driver before ray.init, synced by SkyRL's sync_registries, run in another process."""
    ray = pytest.importorskip("ray", reason="SkyRL's registries sync through a Ray actor")
    name = ssky.register("seq_tis", method_overrides={"agg": "token-mean"}, name="steadyrl_ray_trap")
    d = stale_batch(3)
    t = {k: d[k].detach() for k in ("theta", "prox", "behav")}
    t["mask"] = d["mask"].to(torch.float64)
    t["adv"] = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * t["mask"]
    local, _ = ppo.PolicyLossRegistry.get(name)(
        t["theta"], t["prox"], t["adv"], config=AlgorithmConfig(), loss_mask=t["mask"], rollout_logprobs=t["behav"]
    )
    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024**2, log_to_driver=False)
    try:
        ppo.sync_registries()  # what SkyRL's initialize_ray does after ray.init
        remote = _run_in_ray_worker(name, t)
    finally:
        ray.shutdown()
        ppo.PolicyLossRegistry.reset()  # drop the stale actor handle; built-ins come back below
        ppo.AdvantageEstimatorRegistry.reset()
        ppo.repopulate_all_registries()
    assert remote == pytest.approx(float(local), abs=1e-12)


def test_registering_twice_replaces() -> None:
    first = ssky.register("token_tis", name="steadyrl_twice")
    second = ssky.register("token_tis", method_overrides={"token_tis.cap": 4.0}, name="steadyrl_twice")
    assert first == second
    assert ppo.PolicyLossRegistry.get(second).method.corrections[0].cap == 4.0


def test_rollout_logprobs_required_for_corrections() -> None:
    d = stale_batch()
    cfg = config_for(resolve_method("token_tis"))
    loss = ssky.PolicyLoss("token_tis")
    mask = d["mask"].to(torch.float64)
    with pytest.raises(ValueError, match=r"generator\.sampling_params\.logprobs"):
        loss(d["theta"], d["prox"], mask, config=cfg, loss_mask=mask)
    grpo_loss = ssky.PolicyLoss("ppo")  # reads no μ: runs without rollout_logprobs
    out, _ = grpo_loss(d["theta"], d["prox"], mask, config=config_for(grpo_loss.method), loss_mask=mask)
    assert torch.isfinite(out)


def test_example_style_loss_without_rollout_logprobs_breaks_in_skyrl() -> None:
    """Why the adapter's signature keeps ``rollout_logprobs``: SkyRL's worker passes it by keyword."""

    def example_loss(log_probs, old_log_probs, advantages, config, loss_mask=None):
        return (-log_probs * advantages).sum(), {}

    d = stale_batch()
    with pytest.raises(TypeError, match="rollout_logprobs"):
        example_loss(d["theta"], d["prox"], d["prox"], config=None, loss_mask=None, rollout_logprobs=d["behav"])


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("loss_reduction", "sequence_mean", r"loss_reduction must be 'token_mean'.*'agg': 'seq-mean-token-mean'"),
        ("loss_reduction", "prompt_mean", r"loss_reduction must be 'token_mean'"),
    ],
)
def test_config_refusals_name_the_field(field: str, value: str, match: str) -> None:
    d = stale_batch()
    loss = ssky.PolicyLoss("token_tis")
    cfg = dataclasses.replace(config_for(loss.method), **{field: value})
    with pytest.raises(ValueError, match=match):
        loss(d["theta"], d["prox"], d["prox"], config=cfg, loss_mask=d["mask"], rollout_logprobs=d["behav"])


def test_off_policy_correction_needs_the_rollout_log_probs() -> None:
    """The block is honoured (tests/parity/test_skyrl_off_policy.py); without μ it is refused, naming the fix."""
    d = stale_batch()
    loss = ssky.PolicyLoss("ppo")
    cfg = config_for(loss.method)
    cfg = dataclasses.replace(cfg, off_policy_correction=dataclasses.replace(cfg.off_policy_correction,
                                                                              tis_ratio_type="token"))  # fmt: skip
    with pytest.raises(ValueError, match=r"off_policy_correction.*sampling_params.logprobs"):
        loss(d["theta"], d["prox"], d["prox"], config=cfg, loss_mask=d["mask"], rollout_logprobs=None)


def test_estimator_refusals() -> None:
    d = stale_batch()
    mask = d["mask"].to(torch.float64)
    with pytest.raises(ValueError, match=r"grpo_norm_by_std.*advantage\.scale"):
        ssky.AdvantageEstimator("grpo")(d["token_rewards"], mask, d["uids"], grpo_norm_by_std=False)
    cfg = dataclasses.replace(AlgorithmConfig(), advantage_batch_normalize=True)
    with pytest.raises(ValueError, match=r"advantage_batch_normalize"):
        ssky.AdvantageEstimator("grpo")(d["token_rewards"], mask, d["uids"], config=cfg)
    with pytest.raises(ValueError, match=r"advantage.type='opob'"):
        ssky.AdvantageEstimator("opob")


# ---------------------------------------------------------------------------------------------------- (3) refusals
@pytest.mark.parametrize("method", NOT_HOSTED)
def test_not_hosted_methods_raise_naming_why(method: str) -> None:
    ok, reason = ssky.supported(method)
    assert not ok and reason
    with pytest.raises(ValueError, match=rf"method '{method}' cannot run as a SkyRL policy loss: "):
        ssky.PolicyLoss(method)


def test_expected_split_of_the_catalog() -> None:
    assert set(NOT_HOSTED) == {
        "tic_grpo", "gmc_grpo", "vcpo", "ess_lr", "opob", "gac", "oapl", "vaco", "copc", "estr", "kl_in_reward",
        "kl_in_loss", "otb", "brace", "score_centering",
        "a3po",  # token versions
        "kl_bias_corrected",  # reference log-probs, as kl_in_loss
        "topr", "luspo",  # seq-mean-token-sum has no SkyRL loss_reduction
        "clip_cov", "kl_cov",  # batch-wide covariance ranking
        "dro", "ipo",  # a penalty that does not scale with the pre-scaled advantages
        "rloo", "reinforce_pp", "reinforce_pp_baseline",  # only the GRPO estimator is registered
        "adaptive_entropy",  # a step-level controller, and no entropy reaches SkyRL's policy loss
    }  # fmt: skip


def test_import_steadyrl_imports_no_skyrl() -> None:
    code = "import sys, steadyrl, steadyrl.integrations; print('skyrl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_skyrl_is_a_one_line_import_error() -> None:
    code = "import sys; sys.modules['skyrl'] = None\nimport steadyrl.integrations.skyrl"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: steadyrl.integrations.skyrl needs SkyRL: pip install 'steadyrl[skyrl]' (")
