"""TRL 1.16.0's entropy bonus (``entropy_coef``) and adaptive entropy control (``use_adaptive_entropy``,
``entropy_target``, ``entropy_coef_delta``, ``entropy_coef_min/max``) against ``core.entropy.entropy_bonus`` and
``control.adaptive_entropy.AdaptiveEntropyController``.

TRL's ``GRPOTrainer._compute_loss`` runs unbound on a stand-in ``self`` (as ``_parity.trl_loss``) whose forward returns
a given per-token entropy tensor with gradient; one call is one optimizer step (no gradient accumulation). Over a
sequence of steps with entropies above and below the target, the bonus TRL adds (its loss minus the same call with
the bonus off), its gradient w.r.t. the entropies and TRL's coefficient after each step equal ours, in float64.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import pytest
import torch

from steadyrl.control.adaptive_entropy import AdaptiveEntropyController
from steadyrl.core.entropy import entropy_bonus
from tests.parity._parity import DT, _OneProcess, _Trainer, assert_close, grad, leaf, make_case

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


class _Accelerator(_OneProcess):
    sync_gradients = True  # every call ends an optimizer step


def _stand_in(entropy: torch.Tensor, logp: torch.Tensor, bonus: bool, **config: Any) -> Any:
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, **config)
    return _Trainer(
        args=args, accelerator=_Accelerator(), model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        beta=args.beta, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        max_completion_length=args.max_completion_length, current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=bonus, aux_loss_enabled=False, entropy_coef=args.entropy_coef,
        use_adaptive_entropy=args.use_adaptive_entropy, _last_world_entropy=float("inf"), _entropy_window_stats=None,
    )  # fmt: skip


def _call(trainer: Any, case: Any, logp: torch.Tensor) -> torch.Tensor:
    from trl import GRPOTrainer

    B, T = case.mask.shape
    ids = torch.ones(B, T, dtype=torch.long)
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1], "completion_ids": ids,
              "completion_mask": case.mask.long(), "advantages": case.adv_seq, "old_per_token_logps": case.prox,
              "num_items_in_batch": case.mask.sum()}  # fmt: skip
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (logp, trainer._entropy, None)
    return GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_trl_entropy_bonus_and_adaptive_coefficient(adaptive: bool, seed: int) -> None:
    config = {"entropy_coef": 0.01, "use_adaptive_entropy": adaptive, "entropy_target": 1.0,
              "entropy_coef_delta": 0.004, "entropy_coef_min": 0.002, "entropy_coef_max": 0.02,
              "loss_type": "dapo"}  # fmt: skip
    ours = AdaptiveEntropyController(0.01, adaptive=adaptive, target=1.0, delta=0.004, coef_min=0.002,
                                     coef_max=0.02)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    levels = [0.5, 0.7, 2.0, 0.3, 3.0, 0.9, 0.8]  # token-mean entropies below and above the target
    trainer = None
    for step, level in enumerate(levels):
        case = make_case(seed * 100 + step, [3, 0, 4, 2], 5, log_scale=0.3)
        ent = (level * (0.5 + torch.rand(4, 5, generator=g, dtype=DT))).masked_fill(~case.mask, 7.0)
        if trainer is None:
            trainer = _stand_in(ent, case.theta, True, **config)
        plain = _stand_in(ent, case.theta, False, **config)
        h_theirs, h_plain = leaf(ent), leaf(ent)
        trainer._entropy, plain._entropy = h_theirs, h_plain
        bonus_theirs = _call(trainer, case, leaf(case.theta)) - _call(plain, case, leaf(case.theta))
        h_ours = leaf(case.ours(ent))
        out = entropy_bonus(entropy=h_ours, mask=case.mask, coef=ours.applied)
        assert_close(out.loss, bonus_theirs, rtol=1e-9, atol=1e-12)
        assert_close(grad(out.loss, h_ours), torch.where(case.mask, grad(bonus_theirs, h_theirs), 0.0), atol=1e-12)
        ours.step(float(out.metrics["entropy/mean"]))
        assert ours.coef == pytest.approx(trainer.entropy_coef, abs=1e-15), step
    assert trainer is not None and (not adaptive or trainer.entropy_coef != 0.01)  # the coefficient moved


@pytest.mark.parametrize("seed", range(4))
def test_verl_compute_entropy_loss_token_mean(seed: int) -> None:
    """verl 0.9.1 ``compute_entropy_loss(logits, mask, "token-mean")`` (its actor subtracts ``entropy_coeff`` times
    it) against ``entropy_bonus`` on the full-vocabulary entropy steadyrl's vocabulary term computes, with the
    gradient w.r.t. the logits."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs verl==0.9.1")
    from steadyrl.rollout.distribution import entropy_from_log_probs

    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(3, 5, 11, generator=g, dtype=DT)).requires_grad_(True)
    mask = torch.rand(3, 5, generator=g) > 0.3
    mask[:, 0] = True
    theirs = -0.02 * core_algos.compute_entropy_loss(logits, mask.to(DT), "token-mean")
    h = entropy_from_log_probs(torch.log_softmax(logits, dim=-1))
    ours = entropy_bonus(entropy=h, mask=mask, coef=0.02).loss
    assert_close(ours, theirs, rtol=1e-6, atol=1e-12)  # verl's entropy_from_logits: logsumexp − Σ p·z
    (g_ours,) = torch.autograd.grad(ours, logits, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs, logits)
    assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-12)
