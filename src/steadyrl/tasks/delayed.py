"""The fast proxy of a delayed reward (``task.reward_delay``): what a batch trains on before its true reward arrives.

``noisy``: the true reward r replaced by 1 − r with probability ``flip`` (a cheap judge that is wrong a fixed share
of the time), drawn from ``generator``; ``zero``: b = 0 (no fast signal). Both are our stand-ins for a fast reward
channel; Retroactive Advantage Correction (arXiv 2606.27580) corrects what they got wrong when the true reward lands.
"""

from __future__ import annotations

from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

ProxyKind = Literal["noisy", "zero"]


def proxy_rewards(
    rewards: Float[Tensor, " N"], *, kind: ProxyKind, flip: float, generator: torch.Generator
) -> Float[Tensor, " N"]:
    """The fast reward b_i of each row from its true reward r_i (module docstring)."""
    if kind == "zero":
        return torch.zeros_like(rewards)
    if kind != "noisy":
        raise ValueError(f"task.proxy_reward {kind!r} is not one of noisy, zero")
    flipped = torch.rand(rewards.shape, generator=generator, device=generator.device) < flip
    return torch.where(flipped.to(rewards.device), 1.0 - rewards, rewards)
