"""Adaptive entropy coefficient as a step-level controller (Skywork-OR1, arXiv 2505.22312, §3.2; TRL 1.16.0's rule).

The controller ``adaptive_entropy`` (method ``grpo+adaptive_entropy``, or ``controllers`` of any spec) holds c and
Ĥ_{t−1}, the previous optimizer step's token-mean entropy, as float64 tensors on the model's device. Each step:

1. :meth:`AdaptiveEntropyController.loss_inputs` hands the loss the coefficient to apply, c if Ĥ_{t−1} ≤ target
   else 0, as the batch key ``entropy_coef`` (a 0-d tensor: ``compute_loss`` uses it instead of ``entropy.coef``);
2. the loss's metrics carry Σ m H and Σ m of the step (``entropy/token_sum``, ``entropy/tokens``; summed over the
   step's micro-batches and averaged over processes by an adapter's step control, their ratio is the step's token
   mean, TRL's window-global entropy);
3. :meth:`~AdaptiveEntropyController.before_step` moves c by δ toward keeping Ĥ at the target and keeps Ĥ, on the
   device (no host read: the learner reads ``entropy/adaptive_coef`` with the step's other metrics).

c starts at the method's ``entropy.coef``; Ĥ_{−1} = +∞, so the first step applies nothing (TRL's ``inf``). A step
skipped before the controllers run (a non-finite loss or gradient) leaves c and Ĥ as they were. The state (c, Ĥ) is
saved with the learner's checkpoint and restored onto the device the model lives on (``core.entropy`` has the
equations).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from steadyrl.core.entropy import ENTROPY_SUM, ENTROPY_TOKENS, adaptive_entropy_coef, applied_entropy_coef
from steadyrl.methods.spec import AdaptiveEntropy

#: Batch key through which the coefficient reaches ``compute_loss``.
COEF_INPUT = "entropy_coef"


class AdaptiveEntropyController:
    """The entropy bonus's coefficient c, moved once per optimizer step from the step's token-mean entropy.

    ``spec``: the controller's options (target, δ, bounds); ``coef``: the initial c (the method's ``entropy.coef``);
    ``device``: where c and Ĥ live (they also follow the device of what they are used with).
    """

    reads: tuple[str, ...] = (ENTROPY_SUM, ENTROPY_TOKENS)
    keeps_raw_prev = False
    prev_grad = None

    def __init__(self, spec: AdaptiveEntropy, coef: float = 0.0, *, device: torch.device | str | None = None) -> None:
        self.spec = spec
        self.coef = torch.tensor(float(coef), dtype=torch.float64, device=device)
        """c, the coefficient the rule moves (float64, 0-d)."""
        self.last_entropy = torch.tensor(math.inf, dtype=torch.float64, device=device)
        """Ĥ_{t−1}, the previous step's token-mean entropy (+∞ before the first step)."""

    def _follow(self, device: torch.device) -> None:
        if self.coef.device != device:
            self.coef, self.last_entropy = self.coef.to(device), self.last_entropy.to(device)

    @property
    def applied(self) -> Tensor:
        """The coefficient of this step's bonus: c while Ĥ_{t−1} ≤ target, else 0 (0-d float64 tensor)."""
        out = applied_entropy_coef(self.coef, self.last_entropy, target=self.spec.target)
        assert isinstance(out, Tensor)
        return out

    def loss_inputs(self, *, device: torch.device | str) -> dict[str, Tensor]:
        """``{"entropy_coef": applied c}`` on ``device`` (the loss's), for the batch of this step's loss."""
        self._follow(torch.device(device))
        return {COEF_INPUT: self.applied}

    def observe(self, entropy: Tensor | float) -> Tensor:
        """Feed the step's token-mean entropy Ĥ; moves c (TRL's update) and returns it."""
        h = torch.as_tensor(entropy, dtype=torch.float64, device=self.coef.device)
        s = self.spec
        c = adaptive_entropy_coef(self.coef, h, target=s.target, delta=s.delta, coef_min=s.coef_min,
                                  coef_max=s.coef_max)  # fmt: skip
        assert isinstance(c, Tensor)
        self.coef, self.last_entropy = c, h.reshape(())
        return self.coef

    def before_step(
        self, *, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], metrics: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        missing = [k for k in self.reads if k not in metrics]
        if missing:
            raise KeyError(f"the adaptive entropy coefficient needs the metrics {missing} from compute_loss")
        total, tokens = metrics[ENTROPY_SUM].detach(), metrics[ENTROPY_TOKENS].detach()
        self._follow(total.device)
        h = total.to(torch.float64) / tokens.to(torch.float64).clamp(min=1.0)  # TRL: Σ m H / max(Σ m, 1)
        coef = self.observe(h)
        return {"entropy/step_mean": h, "entropy/adaptive_coef": coef}

    def after_step(self, *, optimizer: torch.optim.Optimizer) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (tensors keep the device they come on; floats, as TRL's saved state, land on
        the controller's device)."""
        for key in ("coef", "last_entropy"):
            value = state[key]
            device = value.device if isinstance(value, Tensor) else self.coef.device
            setattr(self, key, torch.as_tensor(value, dtype=torch.float64, device=device).reshape(()).clone())
