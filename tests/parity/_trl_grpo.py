"""TRL 1.16.0's whole ``GRPOTrainer._compute_loss`` on a stand-in ``self`` that also resolves the trainer's static
helpers (``get_gamma_weights`` for VESPO, ``get_off_policy_mask`` for OPSM) and any config-derived attribute.

``tests/parity/_parity.trl_loss`` builds the same stand-in without the static helpers; this one delegates every
attribute it does not hold to ``GRPOTrainer`` itself, so the code TRL runs from the log-probs on is all TRL's.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from tests.parity._parity import _OneProcess


class _Trainer(types.SimpleNamespace):
    """Instance attributes first, then the class's (TRL's static methods come back as plain functions)."""

    def __getattr__(self, name: str) -> Any:
        from trl import GRPOTrainer

        return getattr(GRPOTrainer, name)


def trl_compute_loss(
    logp: Tensor, inputs: dict[str, Tensor], *, training: bool = True, **config: Any
) -> tuple[Tensor, dict[str, list[float]]]:
    """``GRPOTrainer._compute_loss(self, model, inputs)`` with ``self`` holding what ``GRPOTrainer.__init__`` derives
    from ``GRPOConfig(**config)`` (ε_low = ``epsilon``, ε_high = ``epsilon_high`` or ``epsilon``, ...) and a
    ``_get_per_token_logps_and_entropies`` returning ``logp``. Returns the loss and TRL's logged metrics (``train``
    mode unless ``training=False``)."""
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, **config)
    B, T = logp.shape
    mode = "train" if training else "eval"
    self = _Trainer(
        args=args, accelerator=_OneProcess(), model=types.SimpleNamespace(training=training),
        _metrics={mode: defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp.detach()), None),
        loss_type=args.loss_type, importance_sampling_level=args.importance_sampling_level,
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        beta=args.beta, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=args.use_vllm,
        vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        max_completion_length=args.max_completion_length, current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False,
    )  # fmt: skip
    ids = torch.ones(B, T, dtype=torch.long)
    full = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1], "completion_ids": ids} | inputs
    loss = GRPOTrainer._compute_loss(self, None, full)
    return loss, dict(self._metrics[mode])
