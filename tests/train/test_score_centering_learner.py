"""Score centering in the learner: on-policy it is REINFORCE's gradient (the centering term has mean zero under
π_θ = μ), it reacts to an off-policy μ, it refuses rollouts without the behavior record, and `steadyrl train` runs it
(the record through the lag path)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from steadyrl.config.train import OptimConfig
from steadyrl.methods import MethodSpec, resolve_method
from steadyrl.methods import spec as S
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.sampler import generate
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]


def _grad(
    method: str | MethodSpec, options: dict, record_dist: int | None, *, perturb: float = 0.0
) -> list[torch.Tensor]:
    """The gradient of one learner step (lr 0: the weights do not move) on rollouts sampled by the same model
    (perturbed by ``perturb`` before learning: then μ ≠ π_θ)."""
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0).double()
    rollouts = generate(model, tok, PROMPTS, group_size=4, max_new_tokens=5, version=0, record_dist=record_dist,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.add_(perturb * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS), dtype=torch.float64)
    spec = resolve_method(method, options)
    learner = Learner(model=model, method=spec, controllers=[], lr=0.0, optim=OptimConfig(grad_clip=None))
    grads: list[torch.Tensor] = []
    real_step = learner.optimizer.step
    learner.optimizer.step = lambda: grads.extend(p.grad.clone() for p in learner.params) or real_step()  # type: ignore[method-assign]
    out = learner.step(rollouts, rewards)
    assert out.applied == 1 and math.isfinite(out.metrics["loss"])
    return grads


REINFORCE = {"advantage.type": "grpo", "advantage.scale": "none", "objective.type": "reinforce",
             "objective.surrogate": "log_prob"}  # fmt: skip


@pytest.mark.parametrize(("f", "k"), [("tis", 0), ("mis", 0), ("none", 16)])
def test_on_policy_it_is_reinforce(f: str, k: int) -> None:
    """π_θ = μ (float64, lag 0): w = 1 and E_μ[∇log π_θ] = 0, so the gradient is −A·∇log π_θ(a) (Dr.GRPO advantages,
    token-mean), as the plain REINFORCE objective with the same advantages."""
    sc = _grad("score_centering", {"objective.weight": f, "objective.top_k": k}, k)
    ref = _grad("grpo", REINFORCE, None)
    for a, b in zip(sc, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-11)


def test_off_policy_the_centering_moves_the_gradient() -> None:
    """μ ≠ π_θ: the same loss without the centering term (−A·min(π_θ/μ, 2)·log π_θ(a)) has another gradient."""
    sc = _grad("score_centering", {"objective.weight": "tis"}, 0, perturb=0.3)
    uncentred = MethodSpec(
        name="uncentred", advantage=S.GrpoAdvantage(scale="none"), corrections=(S.TokenTIS(cap=2.0),),
        objective=S.Reinforce(surrogate="log_prob"), policy="bypass", bypass_ratio="current",
    )  # fmt: skip
    ref = _grad(uncentred, {}, None, perturb=0.3)
    diff = sum(float((a - b).norm()) for a, b in zip(sc, ref, strict=True))
    assert diff > 1e-3 * sum(float(b.norm()) for b in ref)


def test_rollouts_without_the_record_are_refused() -> None:
    with pytest.raises(ValueError, match="needs the behavior distribution"):
        _grad("score_centering", {}, None)
    with pytest.raises(ValueError, match="top_k=0, the exact form"):
        _grad("score_centering", {}, 16)


@pytest.mark.slow
def test_steadyrl_train_runs_score_centering_top_k(tiny_overrides: list[str], tmp_path: Path) -> None:
    """A few steps at lag 2 with the top-k form (the behavior record goes through the lag ring's sampler)."""
    args = [*tiny_overrides, "eval.every=0", "eval.n=16", "checkpoint.every=0", "runtime.lag.k=2", "steps=2",
            "method=score_centering", "method.objective.top_k=16", f"out_dir={tmp_path / 'sc'}"]  # fmt: skip
    assert main(args) == 0
    steps = read_metrics(tmp_path / "sc" / "metrics.jsonl")[:-1]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["train/skipped"] == 0
        assert {"sc/weight_mean", "sc/centering_mean"} <= r.keys() and r["sc/centering_mean"] < 0
