"""The critic's settings (``critic.*``), used when the method's advantage needs values; the critic itself is
:mod:`steadyrl.train.critic`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    """The critic of COPC (used only when the method's advantage needs ``values``; ignored otherwise)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-3, gt=0, le=1, description="AdamW learning rate of the value head (constant, no warm-up; "
                      "BRACE uses its method.advantage.critic_lr instead).")
    value_coef: float = Field(
        0.5,
        gt=0,
        le=1000,
        description="Weight of the value loss ½·masked mean (V − target)² added to the actor's loss.",
    )
    trunk_grad: bool = Field(
        False,
        description="false: the value loss trains the head only (on detached hidden "
        "states); true: it also flows into the policy's trunk, weighted by value_coef.",
    )
    grad_clip: float | None = Field(
        1.0, gt=0, description="Clip the value head's gradient norm to this (None: no clip)."
    )
