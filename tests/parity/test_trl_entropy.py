"""The entropy bonus and the adaptive entropy coefficient against TRL 1.16.0 and verl 0.9.1, through ``compute_loss``.

TRL (``entropy_coef``, ``use_adaptive_entropy``, ``entropy_target``, ``entropy_coef_delta``, ``entropy_coef_min/max``):
``GRPOTrainer._compute_loss`` runs unbound on a stand-in ``self`` (as ``_parity.trl_loss``) whose forward returns a
given per-token entropy tensor with gradient, with gradient accumulation (several micro-batches per optimizer step,
``sync_gradients`` on the last). steadyrl's side is the method the TRL adapter maps the same ``GRPOConfig`` onto
(``integrations.trl.with_trl_entropy``: ``entropy.coef``, ``entropy.agg=token-mean``, ``entropy.mask=input``, the
``adaptive_entropy`` controller) run through ``compute_loss`` and the step control every adapter uses: the
controller's coefficient reaches each micro-batch's batch (``entropy_coef``), its ``before_step`` reads the step's
Σ m H and Σ m. Over steps with entropies above and below the target, the bonus TRL adds (its loss minus the same call
with the bonus off), its gradient w.r.t. the entropies and TRL's coefficient after each step equal ours, in float64.

verl (``actor.entropy_coeff``): ``compute_entropy_loss(logits / T, mask, loss_agg_mode)`` (its ``agg_loss`` of
``entropy_from_logits``, what its ``ppo_loss`` subtracts ``entropy_coeff`` times) against ``compute_loss`` with
``entropy.coef`` for every aggregation mode, the entropy from steadyrl's vocabulary term at temperature T.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import pytest
import torch

from steadyrl import compute_loss, resolve_method
from steadyrl.core.entropy import entropy_term
from steadyrl.integrations.step_control import StepControl
from steadyrl.rollout.distribution import SamplingParams, sampling_log_probs
from tests.parity._parity import DT, _OneProcess, _Trainer, assert_close, grad, leaf, make_case

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class _Accelerator(_OneProcess):
    sync_gradients = True  # set per micro-batch: True on the last of an optimizer step's


def _stand_in(bonus: bool, accumulation: int, **config: Any) -> Any:
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, **config)
    return _Trainer(
        args=args, accelerator=_Accelerator(), model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        beta=args.beta, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        max_completion_length=args.max_completion_length, current_gradient_accumulation_steps=accumulation,
        _entropy_bonus_enabled=bonus, aux_loss_enabled=False, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=args.use_adaptive_entropy, _last_world_entropy=float("inf"), _entropy_window_stats=None,
    )  # fmt: skip


def _call(trainer: Any, case: Any, logp: torch.Tensor, entropy: torch.Tensor, last: bool) -> torch.Tensor:
    from trl import GRPOTrainer

    B, T = case.mask.shape
    ids = torch.ones(B, T, dtype=torch.long)
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1], "completion_ids": ids,
              "completion_mask": case.mask.long(), "advantages": case.adv_seq, "old_per_token_logps": case.prox,
              "num_items_in_batch": case.mask.sum()}  # fmt: skip
    trainer.accelerator.sync_gradients = last
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropy, None)
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_trl_entropy_bonus_and_adaptive_coefficient_through_compute_loss(
    adaptive: bool, accumulation: int, seed: int
) -> None:
    from trl import GRPOConfig

    from steadyrl.integrations.trl import with_trl_entropy

    config = {"entropy_coef": 0.01, "use_adaptive_entropy": adaptive, "entropy_target": 1.0,
              "entropy_coef_delta": 0.004, "entropy_coef_min": 0.002, "entropy_coef_max": 0.02,
              "loss_type": "dapo"}  # fmt: skip
    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, **config)
    # the TRL adapter's mapping, on a method whose own aggregation is not TRL's token mean
    spec = with_trl_entropy(resolve_method("grpo", {"advantage.type": "given"}), args)
    assert (spec.entropy.coef, spec.entropy.agg, spec.entropy.mask) == (0.01, "token-mean", "input")
    assert [c.type for c in spec.controllers] == (["adaptive_entropy"] if adaptive else [])
    control = StepControl(spec, framework="test")
    optimizer = control.wrap(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))

    g = torch.Generator().manual_seed(seed)
    levels = [0.5, 0.7, 2.0, 0.3, 3.0, 0.9, 0.8]  # token-mean entropies below and above the target
    trainer, plain = _stand_in(True, accumulation, **config), _stand_in(False, accumulation, **config)
    for step, level in enumerate(levels):
        for micro in range(accumulation):
            lengths = [[3, 0, 4, 2], [5, 5, 1, 0], [2, 4, 4, 3]][(step + micro) % 3]  # token counts vary
            case = make_case(seed * 1000 + step * 10 + micro, lengths, 5, log_scale=0.3)
            ent = (level * (0.5 + torch.rand(4, 5, generator=g, dtype=DT))).masked_fill(~case.mask, 7.0)
            h_theirs, h_plain = leaf(ent), leaf(ent)
            last = micro == accumulation - 1
            bonus_theirs = _call(trainer, case, leaf(case.theta), h_theirs, last) - _call(
                plain, case, leaf(case.theta), h_plain, last
            )
            h_ours = leaf(case.ours(ent))
            batch = {"logp": leaf(case.ours(case.theta)), "behav_logp": case.ours(case.prox),
                     "prox_logp": case.ours(case.prox), "mask": case.mask, "advantages": case.adv_seq,
                     "entropy": h_ours, **control.loss_inputs("cpu")}  # fmt: skip
            out = compute_loss(spec, batch, validate=False)  # π_θ's garbage off the mask is NaN/inf
            control.record(out.metrics)
            ours = out.metrics["loss/entropy_bonus"] / accumulation  # the adapter's loss / accumulation steps
            assert_close(ours, bonus_theirs, rtol=1e-9, atol=1e-12)
            g_ours = grad(out.loss / accumulation, h_ours)
            assert_close(g_ours, torch.where(case.mask, grad(bonus_theirs, h_theirs), 0.0), atol=1e-12)
        optimizer.step()  # the wrapped step: every controller's before_step on the step's metrics, then after_step
        if adaptive:
            assert control.last["steadyrl/entropy/adaptive_coef"] == pytest.approx(trainer.entropy_coef, abs=1e-15)
            assert control.last["steadyrl/entropy/step_mean"] == pytest.approx(trainer._last_world_entropy, rel=1e-12)
    assert not adaptive or trainer.entropy_coef != 0.01  # the coefficient moved


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                 "token-sum"])  # fmt: skip
@pytest.mark.parametrize("seed", range(3))
def test_verl_entropy_coeff_through_compute_loss(agg: str, seed: int) -> None:
    """verl aggregates the entropy with the actor's loss_agg_mode: ``entropy.agg=None`` (the default) does too."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs verl==0.9.1")
    T_temp = 0.7
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 5, 11, generator=g, dtype=DT)).requires_grad_(True)
    mask = torch.rand(3, 5, generator=g) > 0.3
    mask[:, 0] = True
    if agg != "seq-mean-token-sum-norm":  # (bare agg_loss divides that one by the non-empty rows, its trainer by B)
        mask[1] = False  # an empty row: left out of the sequence means by both
    theirs = -0.02 * core_algos.compute_entropy_loss(logits / T_temp, mask.to(DT), agg)

    lp = sampling_log_probs(logits, params=SamplingParams(temperature=T_temp))
    h = entropy_term(lp.reshape(15, 11), torch.arange(15)).reshape(3, 5)  # steadyrl's vocabulary term
    logp = leaf(-torch.rand(3, 5, generator=g, dtype=DT))
    batch = {"logp": logp, "behav_logp": logp.detach(), "mask": mask, "advantages": torch.randn(3, generator=g,
             dtype=DT), "entropy": h}  # fmt: skip
    spec = resolve_method("grpo", {"agg": agg, "advantage.type": "given", "entropy.coef": 0.02})
    out = compute_loss(spec, batch)
    rtol = 1e-7 if agg == "seq-mean-token-mean" else 1e-12  # verl divides each row by L_i + 1e-8
    assert_close(out.metrics["loss/entropy_bonus"], theirs, rtol=rtol, atol=1e-14)
    (g_ours,) = torch.autograd.grad(out.loss, logits, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    assert_close(g_ours, g_theirs, rtol=rtol, atol=1e-13)
