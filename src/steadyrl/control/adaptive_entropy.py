"""Adaptive entropy coefficient as a step-level controller (Skywork-OR1, arXiv 2505.22312; TRL 1.16.0's rule).

Holds (c, Ĥ_{t−1}); :attr:`applied` is the coefficient this step's entropy bonus uses, :meth:`step` feeds the step's
token-mean entropy (one host value per optimizer step, read with the step's other metrics) and moves c by δ toward
keeping the entropy at the target (``core.entropy`` has the equations). State survives a checkpoint through
:meth:`state_dict` / :meth:`load_state_dict`, as TRL saves its ``entropy_coef`` and last entropy.
"""

from __future__ import annotations

import math
from typing import Any

from steadyrl.core.entropy import (
    ENTROPY_COEF_DELTA,
    ENTROPY_COEF_MAX,
    ENTROPY_COEF_MIN,
    ENTROPY_TARGET,
    adaptive_entropy_coef,
    applied_entropy_coef,
)


class AdaptiveEntropyController:
    """The entropy coefficient c, moved once per optimizer step; ``adaptive=False`` keeps c constant and applied."""

    def __init__(
        self,
        coef: float,
        *,
        adaptive: bool = True,
        target: float = ENTROPY_TARGET,
        delta: float = ENTROPY_COEF_DELTA,
        coef_min: float = ENTROPY_COEF_MIN,
        coef_max: float = ENTROPY_COEF_MAX,
    ) -> None:
        if coef_min > coef_max:
            raise ValueError(f"entropy coef_min={coef_min} must not exceed coef_max={coef_max}")
        if delta < 0:
            raise ValueError(f"entropy delta={delta} must be ≥ 0")
        self.coef, self.adaptive, self.target = float(coef), adaptive, target
        self.delta, self.coef_min, self.coef_max = delta, coef_min, coef_max
        self.last_entropy = math.inf

    @property
    def applied(self) -> float:
        """The coefficient of this step's bonus (0 while the last step's entropy was above the target)."""
        return applied_entropy_coef(self.coef, self.last_entropy, target=self.target) if self.adaptive else self.coef

    def step(self, entropy: float) -> float:
        """Feed the step's token-mean entropy; returns the coefficient for the next step."""
        if self.adaptive:
            self.coef = adaptive_entropy_coef(self.coef, entropy, target=self.target, delta=self.delta,
                                              coef_min=self.coef_min, coef_max=self.coef_max)  # fmt: skip
            self.last_entropy = float(entropy)
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
