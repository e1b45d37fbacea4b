"""Shared pieces of the parity tests: random stale batches, and the framework loaders and TRL trainer stand-in of
``steadyrl.check.losses``.

Each parity test calls a framework's own function and ``steadyrl.compute_loss`` (or the ``core`` function the spec
dispatches to) on the same batch. The frameworks multiply by the mask (``x * mask``), which lets NaN at padding leak,
so they get *finite* garbage at masked-out positions, while steadyrl gets NaN/±inf there (``Case.ours``): equal results
then also show that steadyrl ignores padding. Float64 throughout unless a framework forces float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st
from torch import Tensor

# The framework loaders and TRL's trainer stand-in live with ``steadyrl check losses``, which calls the same functions;
# re-exported here for the parity tests.
from steadyrl.check.losses import OneProcessAccelerator as _OneProcess  # noqa: F401
from steadyrl.check.losses import TrainerStandIn as _Trainer  # noqa: F401
from steadyrl.check.losses import openrlhf_module, skyrl_ppo_utils, trl_loss  # noqa: F401

DT = torch.float64
NAN, INF = float("nan"), float("inf")


class Case(NamedTuple):
    """A stale batch (framework view: finite garbage off the mask)."""

    mask: Tensor  # [B, T] bool (rows may be empty)
    theta: Tensor  # log π_θ
    prox: Tensor  # log π_prox (a framework's "old" log-probs)
    behav: Tensor  # log μ
    ref: Tensor  # log π_ref
    adv_seq: Tensor  # [B] heavy-tailed
    adv_tok: Tensor  # [B, T] heavy-tailed, varying along the sequence

    def ours(self, x: Tensor) -> Tensor:
        """``x`` with NaN, +inf and −inf garbage at masked-out positions (what steadyrl must ignore)."""
        junk = torch.tensor([NAN, INF, -INF], dtype=x.dtype)[torch.arange(x.numel()) % 3].view_as(x)
        return torch.where(self.mask, x, junk)

    def seq_tok(self) -> Tensor:
        """The sequence advantages on every token (finite garbage off the mask, as the frameworks broadcast them)."""
        return torch.where(self.mask, self.adv_seq[:, None].expand_as(self.mask), self.adv_tok)


def heavy(g: torch.Generator, *shape: int) -> Tensor:
    """A scale mixture of normals, N(0, 1)·exp(1.5·N(0, 1)): heavy tails, |x| up to ~10³ in small batches."""
    return torch.randn(*shape, generator=g, dtype=DT) * torch.exp(1.5 * torch.randn(*shape, generator=g, dtype=DT))


def make_case(seed: int, lengths: list[int], T: int, log_scale: float) -> Case:
    """Rows of the given lengths (0 = all masked); log π_θ − log π_prox ~ log_scale · N(0, 1), clamped to ±20."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    prox = -3.0 * torch.rand(B, T, generator=g, dtype=DT)
    theta = prox + (log_scale * torch.randn(B, T, generator=g, dtype=DT)).clamp(-20.0, 20.0)
    behav = prox + 0.5 * torch.randn(B, T, generator=g, dtype=DT)
    ref = theta + torch.randn(B, T, generator=g, dtype=DT) * torch.exp(torch.randn(B, T, generator=g, dtype=DT))
    garbage = 40.0 * torch.rand(4, B, T, generator=g, dtype=DT) - 20.0  # finite junk for the frameworks
    clean = (theta, prox, behav, ref)
    theta, prox, behav, ref = (torch.where(mask, x, j) for x, j in zip(clean, garbage.unbind(0), strict=True))
    return Case(mask, theta, prox, behav, ref, heavy(g, B), heavy(g, B, T))


@st.composite
def cases(draw: Any, *, max_B: int = 5, max_T: int = 7, empty: bool = True) -> Case:
    """Hypothesis: 1–5 rows of 0–7 tokens (all-masked rows when ``empty``), log-ratios of scale 1e-3 … 20."""
    T = draw(st.integers(1, max_T))
    lengths = draw(st.lists(st.integers(0 if empty else 1, T), min_size=1, max_size=max_B))
    log_scale = draw(st.sampled_from([1e-3, 0.1, 1.0, 5.0, 20.0]))
    return make_case(draw(st.integers(0, 2**31 - 1)), lengths, T, log_scale)


def leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def grad(loss: Tensor, x: Tensor) -> Tensor:
    (g,) = torch.autograd.grad(loss, x, allow_unused=True, materialize_grads=True)
    return g


def assert_close(ours: Tensor, theirs: Tensor | float, *, rtol: float = 1e-9, atol: float = 1e-9) -> None:
    theirs = torch.as_tensor(theirs, dtype=ours.dtype)
    torch.testing.assert_close(ours.detach(), theirs.detach().to(ours.dtype), rtol=rtol, atol=atol)


def batch(case: Case, logp: Tensor, advantages: Tensor, **extra: Tensor) -> dict[str, Tensor]:
    """A ``compute_loss`` batch with NaN/inf garbage off the mask; μ = π_prox unless ``behav_logp`` is given."""
    out = {"logp": logp, "behav_logp": case.ours(case.prox), "prox_logp": case.ours(case.prox), "mask": case.mask,
           "advantages": case.ours(advantages) if advantages.dim() == 2 else advantages}  # fmt: skip
    return out | extra
