"""The learner step on a tiny random model: updates, non-finite skips, several updates per batch, per-row grad norms."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers
from steadyrl.methods import compute_loss, resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train import learner as learner_module
from steadyrl.train.learner import Learner, aggregate_metrics, group_minibatches

ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]
G = 4


@pytest.fixture
def model() -> torch.nn.Module:
    return build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)


@pytest.fixture
def batch(model: torch.nn.Module) -> tuple[Rollouts, torch.Tensor]:
    tok = build_char_tokenizer()
    rollouts = generate(
        model, tok, PROMPTS, group_size=G, max_new_tokens=5, generator=torch.Generator().manual_seed(0), version=0
    )
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS))
    return rollouts, rewards


def _learner(model: torch.nn.Module, method: str = "seq_tis", messages: list[str] | None = None, **optim) -> Learner:
    spec = resolve_method(method)
    return Learner(
        model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(**optim),
        log=(messages if messages is not None else []).append,
    )


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_step_moves_the_weights_and_logs_gradient_metrics(model, batch) -> None:
    learner = _learner(model)
    before = _weights(model)
    first = learner.step(*batch)
    assert (first.applied, first.skipped, learner.version) == (1, 0, 1)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert first.metrics["grad/cos_prev"] == 0.0 and first.metrics["grad/norm"] > 0
    assert first.metrics["lr"] == pytest.approx(1e-2) and first.metrics["train/skipped"] == 0.0
    second = learner.step(*batch)
    assert -1.0 <= second.metrics["grad/cos_prev"] <= 1.0 and second.metrics["grad/cos_prev"] != 0.0


def test_a_nan_loss_is_skipped_and_the_weights_are_unchanged(model, batch) -> None:
    rollouts, rewards = batch
    behav = rollouts.behav_logp.clone()
    behav[0, 0] = float("nan")  # a masked-in token: the sequence weight and so the loss are NaN
    poisoned = dataclasses.replace(rollouts, behav_logp=behav)
    messages: list[str] = []
    learner = _learner(model, messages=messages)
    before = _weights(model)
    out = learner.step(poisoned, rewards)
    assert (out.applied, out.skipped, learner.version) == (0, 1, 0)
    assert out.metrics["train/skipped"] == 1.0 and out.reasons == ["loss is nan"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not learner.optimizer.state and all(p.grad is None for p in model.parameters())
    assert len(messages) == 1 and "loss is nan" in messages[0]
    assert learner.step(rollouts, rewards).applied == 1  # the next finite batch trains normally


def test_a_nan_gradient_is_skipped(model, batch) -> None:
    learner = _learner(model, method="grpo")
    param = next(model.parameters())
    handle = param.register_hook(lambda g: g * float("nan"))
    before = _weights(model)
    out = learner.step(*batch)
    handle.remove()
    assert out.skipped == 1 and out.reasons == ["gradient norm is nan"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_several_updates_per_batch_recompute_prox_and_aggregate(model, batch) -> None:
    learner = _learner(model, method="ppo", updates_per_batch=2, minibatches=2)
    out = learner.step(*batch)
    assert (out.applied, learner.version) == (4, 4)
    # the first update of the first minibatch sees π_θ = π_prox: its PPO ratio is exactly 1; later ones are not
    assert out.metrics["loss/ratio_max"] > 1.0


def test_minibatches_keep_groups_whole() -> None:
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    parts = group_minibatches(groups, 2)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="cannot be split"):
        group_minibatches(groups, 3)


def test_metrics_aggregate_by_kind() -> None:
    steps = [{"a": 1.0, "is/weight_max": 2.0, "x/min": 1.0, "time/learn_s": 1.0}, {"a": 3.0, "is/weight_max": 5.0,
             "x/min": 0.5, "time/learn_s": 2.0}]
    assert aggregate_metrics(steps) == {"a": 2.0, "is/weight_max": 5.0, "x/min": 0.5, "time/learn_s": 3.0}


def test_vcpo_gets_per_trajectory_gradient_norms_at_the_current_weights(model, batch, monkeypatch) -> None:
    rollouts, rewards = batch
    seen: dict[str, torch.Tensor] = {}

    def spy(method, batch, **kwargs):
        assert kwargs == {"validate": False}  # the learner's tensors are its own: no input checks, no host sync
        seen["grad_sq_norms"] = batch["grad_sq_norms"]
        return compute_loss(method, batch, **kwargs)

    monkeypatch.setattr(learner_module, "compute_loss", spy)
    learner = _learner(model, method="vcpo")
    want = torch.stack(  # ‖∇ Σ_t log π_θ(y_i,t)‖², one backward per trajectory
        [
            sum(g.pow(2).sum() for g in torch.autograd.grad(sequence_logprobs(model, rollouts.select([i])).logp.sum(),
                                                            list(model.parameters())))
            for i in range(len(rollouts))
        ]
    )
    out = learner.step(rollouts, rewards)
    torch.testing.assert_close(seen["grad_sq_norms"], want.detach(), rtol=1e-4, atol=1e-8)
    assert out.applied == 1 and 0.0 < out.metrics["vcpo/ess_scale"] <= 1.0


class _GradSpy:
    """A controller that records the flat gradient the learner hands to the controllers (before clipping)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def before_step(self, *, optimizer, params, metrics) -> dict[str, torch.Tensor]:
        self.grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())  # in the parameters' dtype
        return {}

    def after_step(self, *, optimizer) -> None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        return None


@pytest.mark.parametrize(
    ("method", "options", "fused"),
    [  # float64 model, float64 gradients: the two paths agree to rounding
        ("vcpo", {}, 1.0),  # ∂L/∂logp constant along each trajectory: one backward, gradient assembled from pieces
        ("vcpo", {"advantage.weighting": "authors_code", "agg": "seq-mean-token-sum"}, 1.0),
        ("vcpo", {"agg": "token-mean"}, 1.0),  # 1/Σ_j L_j instead of 1/L_i: still constant along a row
        ("opob+token_tis", {}, 0.0),  # token weights differ along a row: the kept graph is backpropagated again
        ("opob", {"policy": "bypass"}, 0.0),  # PPO-clip on token ratios π_θ/μ ≠ 1
    ],
)
def test_fused_gradient_norms_give_the_plain_gradient(batch, method: str, options: dict, fused: float) -> None:
    """The fused VCPO step (norms and gradient from one forward) = separate norms + a plain backward, in float64."""
    rollouts, rewards = batch
    noise = 0.3 * torch.randn(rollouts.behav_logp.shape, generator=torch.Generator().manual_seed(0))
    rollouts = dataclasses.replace(rollouts, behav_logp=rollouts.behav_logp + noise)  # a stale behavior policy
    grads, outs = [], []
    for mode in ("fused", "ghost"):
        model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0).double()
        spec = resolve_method(method, options)
        spy = _GradSpy()
        learner = Learner(
            model=model, method=spec, controllers=[spy, *build_controllers(spec)], lr=1e-2, optim=OptimConfig(),
            log=[].append, grad_norms=mode,
        )  # fmt: skip
        outs.append(learner.step(rollouts, rewards).metrics)
        grads.append(spy.grads[0])
    # LlamaRMSNorm runs in float32 inside a float64 model, so a gradient that flows through it is rounded to float32
    # there, and scaling the seed (c_i ∂ℓ_i vs ∂(Σ c_i ℓ_i)) rounds differently: agreement to ~1e-7 relative.
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-6 * float(grads[1].abs().max()))
    assert grads[0].abs().sum() > 0
    assert outs[0]["grad/fused"] == fused and "grad/fused" not in outs[1]
    for key in ("grad/per_traj_norm_mean", "vcpo/baseline_mean", "loss", "grad/norm"):
        assert outs[0][key] == pytest.approx(outs[1][key], rel=1e-6), key


def test_gac_shares_the_previous_gradient_with_the_learner(model, batch) -> None:
    """With GAC (raw previous gradient) the learner keeps no second copy; its cos_prev is GAC's cosine."""
    learner = _learner(model, method="seq_tis+gac")
    learner.step(*batch)
    out = learner.step(*batch)
    assert learner._prev_grad is None and learner.controllers[0].prev is not None
    assert learner.prev_grad is learner.controllers[0].prev
    assert out.metrics["grad/cos_prev"] == pytest.approx(out.metrics["gac/cos"], abs=1e-6)
    assert out.metrics["grad/cos_prev"] != 0.0


@pytest.mark.parametrize("updates", [1, 2])
def test_otb_gets_sum_p2_of_the_proximal_policy(model, batch, monkeypatch, updates: int) -> None:
    """OTB's Σ_v π_v² per token equals a float64 reference from the model's logits at the step's starting weights
    (π_prox), for one update (π_prox = π_θ detached) and for several (π_prox recomputed); 0 at padding."""
    rollouts, rewards = batch
    seen: list[dict[str, torch.Tensor]] = []

    def spy(method, batch, **kwargs):
        seen.append({k: batch[k] for k in ("sum_p2", "logp", "mask")} | {"prox": batch.get("prox_logp")})
        return compute_loss(method, batch, **kwargs)

    with torch.no_grad():  # reference: each row alone, unpadded, in float64
        want = torch.zeros(rollouts.response_ids.shape, dtype=torch.float64)
        for i in range(len(rollouts)):
            prompt = rollouts.prompt_ids[i][rollouts.prompt_mask[i]]
            L = int(rollouts.response_mask[i].sum())
            ids = torch.cat([prompt, rollouts.response_ids[i, :L]]).unsqueeze(0)
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + L].double()
            want[i, :L] = logits.softmax(-1).pow(2).sum(-1)
    monkeypatch.setattr(learner_module, "compute_loss", spy)
    out = _learner(model, method="otb", updates_per_batch=updates).step(rollouts, rewards)
    assert out.applied == updates and len(seen) == updates
    for s in seen:  # the same Σπ² (of π_prox) at every optimizer step of the batch
        torch.testing.assert_close(s["sum_p2"].double(), want, rtol=1e-5, atol=1e-7)
        assert (s["sum_p2"][~s["mask"]] == 0).all()
    assert (seen[0]["prox"] is None) == (updates == 1)
    assert float(want[rollouts.response_mask].min()) > 0.0 and float(want.max()) <= 1.0


class _PoisonGrad:
    """A controller that writes inf into one gradient entry (as a broken GAC projection would)."""

    def before_step(self, *, optimizer, params, metrics):  # type: ignore[no-untyped-def]
        params[0].grad.view(-1)[0] = float("inf")
        return {}

    def after_step(self, *, optimizer) -> None:  # type: ignore[no-untyped-def]
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


@pytest.mark.parametrize("grad_clip", [1.0, None])
def test_a_gradient_a_controller_made_non_finite_is_skipped(model, batch, grad_clip) -> None:  # type: ignore[no-untyped-def]
    spec = resolve_method("seq_tis")
    messages: list[str] = []
    learner = Learner(model=model, method=spec, controllers=[_PoisonGrad()], lr=1e-2,
                      optim=OptimConfig(grad_clip=grad_clip), log=messages.append)  # fmt: skip
    before = _weights(model)
    out = learner.step(*batch)
    assert (out.applied, out.skipped) == (0, 1)
    assert out.reasons == ["gradient is not finite after the controllers"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_fused_adamw_trains_like_the_default_to_float32_rounding(model, batch) -> None:  # type: ignore[no-untyped-def]
    import copy

    twin = copy.deepcopy(model)
    _learner(model).step(*batch)
    _learner(twin, fused=True).step(*batch)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_a3po_never_runs_the_recompute_pass_and_interpolates_prox(model, batch, monkeypatch) -> None:
    """A-3PO (``prox_approx=loglinear``): with several optimizer steps per batch (where every other method recomputes
    π_prox) no no-grad pass runs and the loss gets no ``prox_logp``; the token versions and the learner's reach it."""
    rollouts, rewards = batch
    seen: list[dict] = []

    def spy(method, batch, **kwargs):
        seen.append({"prox": batch.get("prox_logp"), "versions": batch["versions"], "v": batch["learner_version"]})
        return compute_loss(method, batch, **kwargs)

    no_grad_calls: list[int] = []
    monkeypatch.setattr(learner_module, "compute_loss", spy)
    learner = _learner(model, method="a3po", updates_per_batch=2)
    original = learner._no_grad
    monkeypatch.setattr(learner, "_no_grad", lambda *a, **k: no_grad_calls.append(1) or original(*a, **k))
    out = learner.step(rollouts, rewards)
    assert out.applied == 2 and not no_grad_calls
    assert all(s["prox"] is None for s in seen) and [s["v"] for s in seen] == [0, 1]
    assert "a3po/alpha_mean" in out.metrics
    ppo = _learner(build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0), method="decoupled_ppo",
                   updates_per_batch=2)  # fmt: skip
    calls: list[int] = []
    original_ppo = ppo._no_grad
    monkeypatch.setattr(ppo, "_no_grad", lambda *a, **k: calls.append(1) or original_ppo(*a, **k))
    ppo.step(rollouts, rewards)
    assert calls == [1]  # the same setting recomputes once for decoupled PPO
