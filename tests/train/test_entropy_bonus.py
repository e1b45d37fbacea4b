"""The entropy bonus and the adaptive entropy controller in the learner and in ``steadyrl train``.

In the learner (float64 tiny Llama, lr 0 so the weights stay put): the gradient of a method with ``entropy.coef = c``
is the method's gradient plus c times the gradient of −agg(H), H written here from the model's full logits at the
learner's temperature, on the direct path, the chunked vocabulary path and with micro-batches; with a critic too.
The adaptive controller's coefficient reaches the loss each step and survives ``state_dict``. ``steadyrl train``
logs the entropy metrics, and a resumed adaptive run writes the metrics of the straight run (the coefficient is
restored from the checkpoint).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import steadyrl.rollout.logprobs as lp_mod
from steadyrl.config.train import OptimConfig
from steadyrl.control import AdaptiveEntropyController, build_controllers
from steadyrl.core.masking import aggregate
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]
TEMPERATURE = 0.8
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS), dtype=torch.float64)


@pytest.fixture
def float64_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' RMSNorm rounds to float32: a float64 one, so the two forms meet to float64 rounding."""

    def forward(self: LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


def _model_and_rollouts() -> tuple[torch.nn.Module, Rollouts]:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0).double()
    rollouts = generate(model, tok, PROMPTS, group_size=4, max_new_tokens=6, version=0, temperature=TEMPERATURE,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    return model, rollouts


def _grad(method: str, options: dict, *, optim: dict | None = None) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The raw gradient of one learner step (lr 0) and its metrics."""
    model, rollouts = _model_and_rollouts()
    spec = resolve_method(method, options)
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=0.0,
                      optim=OptimConfig(grad_clip=None, **(optim or {})), temperature=TEMPERATURE)  # fmt: skip
    grads: list[torch.Tensor] = []
    real_step = learner.optimizer.step
    learner.optimizer.step = lambda: grads.extend(p.grad.clone() for p in learner.params) or real_step()  # type: ignore[method-assign]
    out = learner.step(rollouts, REWARDS)
    assert out.applied == 1 and math.isfinite(out.metrics["loss"])
    return grads, out.metrics


def _bonus_grad(coef: float, agg: str) -> list[torch.Tensor]:
    """∇θ of −c·agg(H): H = −Σ_v p log p of softmax(logits / T), from the model's full logits (no steadyrl helper)."""
    model, rollouts = _model_and_rollouts()
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=1)
    att = torch.cat([rollouts.prompt_mask, rollouts.response_mask], dim=1).long()
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    T = rollouts.response_ids.shape[1]
    z = model(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, -(T + 1) : -1] / TEMPERATURE
    H = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    loss = -coef * aggregate(H, rollouts.response_mask.bool(), agg)
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True))


@pytest.mark.usefixtures("float64_norms")
@pytest.mark.parametrize("path", ["direct", "chunked", "microbatch"])
def test_the_bonus_adds_the_gradient_of_minus_c_times_the_entropy(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """grpo (seq-mean-token-mean, also the entropy's reduction by default) with and without entropy.coef = 0.05."""
    optim = {"microbatch_tokens": 40} if path == "microbatch" else {}
    if path == "chunked":  # a budget of 3 tokens per chunk: the learner's forward goes through the chunked head
        monkeypatch.setattr(lp_mod, "DEFAULT_CHUNK_ELEMENTS", 3 * build_char_tokenizer().vocab_size)
        calls: list[int] = []
        real = lp_mod.chunked_log_probs
        monkeypatch.setattr(lp_mod, "chunked_log_probs", lambda **kw: calls.append(1) or real(**kw))
    with_bonus, metrics = _grad("grpo", {"entropy.coef": 0.05}, optim=optim)
    plain, _ = _grad("grpo", {}, optim=optim)
    bonus = _bonus_grad(0.05, "seq-mean-token-mean")
    if path == "chunked":
        assert calls, "the chunked head did not run"
    if path == "microbatch":
        assert metrics["train/microbatches"] > 1
    for got, a, b in zip(with_bonus, plain, bonus, strict=True):
        want = a + b
        assert float((got - want).norm()) <= 1e-10 * max(float(want.norm()), 1e-12)
    assert sum(float(b.norm()) for b in bonus) > 1e-6  # the bonus moves the gradient (else the test is vacuous)
    assert metrics["entropy/coef"] == 0.05 and metrics["entropy/mean"] > 0
    assert metrics["loss/entropy_bonus"] == pytest.approx(-0.05 * metrics["entropy/mean"], rel=0.2)


@pytest.mark.usefixtures("float64_norms")
def test_the_bonus_runs_with_a_critic() -> None:
    """COPC (a critic reading the same forward's hidden states) with an entropy bonus: the term comes along."""
    _, metrics = _grad("copc", {"entropy.coef": 0.01})
    assert metrics["entropy/coef"] == 0.01 and math.isfinite(metrics["loss/entropy_bonus"])


@pytest.mark.usefixtures("float64_norms")
def test_opob_norms_with_a_vocabulary_term_take_the_separate_pass() -> None:
    """The fused norm pass computes no vocabulary term: asked for explicitly it is refused; by default the learner
    takes the separate ghost pass, and a step runs (``steadyrl train method=vcpo method.entropy.coef=...``)."""
    model, _ = _model_and_rollouts()
    spec = resolve_method("vcpo", {"entropy.coef": 0.01})
    with pytest.raises(ValueError, match="grad_norms='ghost'"):
        Learner(model=model, method=spec, controllers=[], lr=0.0, optim=OptimConfig(), grad_norms="fused")
    assert Learner(model=model, method=spec, controllers=[], lr=0.0, optim=OptimConfig()).grad_norms == "ghost"
    assert Learner(model=model, method=resolve_method("vcpo"), controllers=[], lr=0.0,
                   optim=OptimConfig()).grad_norms == "fused_shared"  # fmt: skip
    grads, metrics = _grad("vcpo", {"entropy.coef": 0.01})
    assert all(torch.isfinite(g).all() for g in grads) and metrics["entropy/coef"] == 0.01


@pytest.mark.usefixtures("float64_norms")
def test_the_adaptive_coefficient_reaches_the_loss_and_is_restored() -> None:
    """Target above the entropy: c rises by δ each step and is applied from the second step on; a learner rebuilt
    from the state dict applies the same coefficient."""
    model, rollouts = _model_and_rollouts()
    spec = resolve_method("grpo+adaptive_entropy", {"entropy.coef": 0.01, "adaptive_entropy.target": 50.0,
                                                    "adaptive_entropy.delta": 0.002})  # fmt: skip
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-3, optim=OptimConfig(),
                      temperature=TEMPERATURE)  # fmt: skip
    seen = []
    for _ in range(3):
        m = learner.step(rollouts, REWARDS).metrics
        seen.append((m["entropy/coef"], m["entropy/adaptive_coef"], m["entropy/step_mean"], m["entropy/mean"]))
    assert [s[0] for s in seen] == pytest.approx([0.0, 0.012, 0.014], abs=1e-12)  # nothing applied at step 1
    assert [s[1] for s in seen] == pytest.approx([0.012, 0.014, 0.016], abs=1e-12)
    assert all(s[2] == pytest.approx(s[3], rel=1e-6) for s in seen)  # one minibatch: the step's token mean
    ctrl = learner.controllers[0]
    assert isinstance(ctrl, AdaptiveEntropyController) and ctrl.coef.device == model.lm_head.weight.device

    state = learner.state_dict()
    fresh = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-3, optim=OptimConfig(),
                    temperature=TEMPERATURE)  # fmt: skip
    assert float(fresh.controllers[0].coef) == 0.01  # type: ignore[attr-defined]
    fresh.load_state_dict(state)
    assert float(fresh.controllers[0].coef) == pytest.approx(0.016, abs=1e-15)  # type: ignore[attr-defined]
    assert fresh.step(rollouts, REWARDS).metrics["entropy/coef"] == pytest.approx(0.016, abs=1e-12)


@pytest.mark.slow
def test_steadyrl_train_logs_the_bonus_and_resumes_the_adaptive_coefficient(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """``method.entropy.coef`` on a preset, and ``grpo+adaptive_entropy``: the entropy metrics in metrics.jsonl; the
    adaptive run stopped at step 2 and resumed to 4 writes the straight run's metrics (its coefficient restored)."""
    common = [*tiny_overrides, "eval.every=0", "eval.n=16", "checkpoint.every=2", "runtime.lag.k=1"]
    assert main([*common, "steps=2", "method=seq_tis", "method.entropy.coef=0.01", f"out_dir={tmp_path / 'c'}"]) == 0
    rows = read_metrics(tmp_path / "c" / "metrics.jsonl")[:-1]
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["entropy/coef"] == pytest.approx(0.01) and r["entropy/mean"] > 0 and r["train/skipped"] == 0
        assert r["loss/entropy_bonus"] < 0

    adaptive = [*common, "method=grpo+adaptive_entropy", "method.entropy.coef=0.02",
                "method.adaptive_entropy.target=100.0", "method.adaptive_entropy.delta=0.01"]  # fmt: skip
    straight = tmp_path / "straight"
    assert main([*adaptive, "steps=4", f"out_dir={straight}"]) == 0
    split = tmp_path / "split"
    assert main([*adaptive, "steps=2", f"out_dir={split}"]) == 0
    assert main([*adaptive, "steps=4", f"out_dir={split}", "resume=true"]) == 0
    assert (split / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    rows = read_metrics(straight / "metrics.jsonl")[:-1]
    assert [r["entropy/coef"] for r in rows] == pytest.approx([0.0, 0.03, 0.04, 0.05], abs=1e-9)
