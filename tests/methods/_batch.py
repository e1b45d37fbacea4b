"""A random float64 batch holding every tensor any method can ask for."""

from __future__ import annotations

import torch


def make_batch(
    *, seed: int = 0, n_groups: int = 4, G: int = 4, T: int = 9, scale: float = 0.3, on_policy: bool = False
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B = n_groups * G
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    behav = logp.detach().clone() if on_policy else logp.detach() + scale * torch.randn(B, T, generator=g).double()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    return {
        "logp": logp,
        "behav_logp": behav,
        "mask": mask,
        "prox_logp": logp.detach().clone(),  # π_prox at the first update of a phase: π_θ's value
        "rewards": torch.randint(0, 2, (B,), generator=g).double(),
        "group_ids": torch.arange(n_groups).repeat_interleave(G),
        "versions": torch.randint(0, 5, (B, T), generator=g),
        "learner_version": 7,
        "behav_entropy": torch.rand(B, T, generator=g, dtype=torch.float64) + 0.1,
        "ref_logp": logp.detach() + 0.1 * torch.randn(B, T, generator=g).double(),
        "values": torch.rand(B, T, generator=g, dtype=torch.float64),
        "grad_sq_norms": torch.rand(B, generator=g, dtype=torch.float64) + 0.5,
        "sum_p2": torch.rand(B, T, generator=g, dtype=torch.float64) * 0.5 + 0.1,
        # score centering's Σ_v sg(μ_v w_v) log π_θ(v): a function of π_θ, so it carries logp's gradient here
        "centering": 0.9 * logp - 0.3 * torch.rand(B, T, generator=g, dtype=torch.float64),
        # the policy's entropy H: a function of π_θ, so it carries logp's gradient here too
        "entropy": 1.5 + 0.4 * logp + 0.2 * torch.rand(B, T, generator=g, dtype=torch.float64),
    }
