"""Random float64 batches and loop-based reference helpers shared by the objective tests.

References here are written from docs/algorithms.md with Python loops over (i, t) on 0-d tensors (so autograd gives the
reference gradient too); they never call the code under test or ``masking.aggregate``. The last four ``assert_*``
helpers are the hostile-input checks the objectives' tests share (fully masked batch, ±1000 log-ratios, gradient flow).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from steadyrl.core.types import LossOutput

NAN = float("nan")
DT = torch.float64

seeds = st.integers(min_value=0, max_value=2**31 - 1)
dims = st.integers(min_value=1, max_value=5)


class Batch(NamedTuple):
    logp: torch.Tensor  # [B, T] leaf with requires_grad (nan where masked out)
    prox_logp: torch.Tensor  # [B, T] (nan where masked out)
    behav_logp: torch.Tensor  # [B, T] (nan where masked out)
    adv_tok: torch.Tensor  # [B, T] broadcast of adv_seq (nan where masked out)
    adv_seq: torch.Tensor  # [B]
    weights: torch.Tensor  # [B, T] positive (nan where masked out)
    mask: torch.Tensor  # [B, T] bool; row 0 empty when ``empty_row``
    group_ids: torch.Tensor  # [B] int64
    rewards: torch.Tensor  # [B]
    entropy: torch.Tensor  # [B, T] nonnegative


def make_batch(
    seed: int, B: int = 6, T: int = 5, *, scale: float = 0.4, empty_row: bool = True, garbage: bool = True
) -> Batch:
    """A batch with log-ratios of size ``scale``, an empty first row and nan garbage at masked-out positions."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=DT) * 3.0
    prox = logp + scale * torch.randn(B, T, generator=g, dtype=DT)
    behav = prox + scale * torch.randn(B, T, generator=g, dtype=DT)
    adv_seq = torch.randn(B, generator=g, dtype=DT)
    weights = 0.5 + torch.rand(B, T, generator=g, dtype=DT)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    if empty_row:
        mask[0] = False
    group_ids = torch.arange(B) // 2
    rewards = torch.randint(0, 2, (B,), generator=g).to(DT) + 0.1 * torch.randn(B, generator=g, dtype=DT)
    entropy = torch.rand(B, T, generator=g, dtype=DT) * 2.0
    adv_tok = adv_seq[:, None].expand(B, T).clone()
    if garbage:
        logp, prox, behav, adv_tok, weights = (x.masked_fill(~mask, NAN) for x in (logp, prox, behav, adv_tok, weights))
    return Batch(
        logp=logp.requires_grad_(True),
        prox_logp=prox,
        behav_logp=behav,
        adv_tok=adv_tok,
        adv_seq=adv_seq,
        weights=weights,
        mask=mask,
        group_ids=group_ids,
        rewards=rewards,
        entropy=entropy,
    )


def random_signs(seed: int, B: int, T: int) -> torch.Tensor:
    """A [B, T] float64 tensor of ±1, seeded (which tokens of a ±1000 stress batch point up and which down)."""
    return torch.where(torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.5, 1.0, -1.0).to(DT)


def clamp20(x: torch.Tensor) -> torch.Tensor:
    """The ±20 log-ratio clamp the rules prescribe before every exp."""
    return torch.clamp(x, -20.0, 20.0)


def ref_aggregate(terms: dict[tuple[int, int], torch.Tensor], B: int, T: int, mode: str) -> torch.Tensor:
    """Reduce per-token reference terms {(i, t): value} (masked-in tokens only) by a verl loss-aggregation mode."""
    zero = torch.zeros((), dtype=DT)
    rows = [[terms[(i, t)] for t in range(T) if (i, t) in terms] for i in range(B)]
    nonempty = [r for r in rows if r]
    if not nonempty:
        return zero
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat, zero) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum((sum(r, zero) / len(r) for r in nonempty), zero) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum((sum(r, zero) for r in nonempty), zero) / len(nonempty)
    if mode == "token-sum":
        return sum((v for r in rows for v in r), zero)
    return sum((v for r in rows for v in r), zero) / (B * T)


def assert_close(a: torch.Tensor, b: torch.Tensor | float, atol: float = 1e-10) -> None:
    b = torch.as_tensor(b, dtype=a.dtype)
    assert torch.allclose(a, b, atol=atol, rtol=0.0, equal_nan=False), f"{a} != {b}"


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d loss / d x (zeros when the graph does not reach x)."""
    (g,) = torch.autograd.grad(loss, x, allow_unused=True, retain_graph=True)
    return torch.zeros_like(x) if g is None else g


def assert_metrics_finite(metrics: Mapping[str, torch.Tensor]) -> None:
    """Every metric is a finite scalar."""
    assert all(torch.isfinite(v) for v in metrics.values())


def assert_finite(out: LossOutput, logp: torch.Tensor) -> None:
    """The loss, its gradient with respect to ``logp`` and every metric are finite."""
    assert torch.isfinite(out.loss)
    assert torch.isfinite(grad_of(out.loss, logp)).all()
    assert_metrics_finite(out.metrics)


def assert_all_masked_is_exact_zero(out: LossOutput, logp: torch.Tensor) -> None:
    """Backward through an exact-0 loss gives ``logp`` a zero gradient; ``loss/all_masked`` is 1, metrics finite."""
    out.loss.backward()
    assert out.loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))
    assert out.metrics["loss/all_masked"] == 1.0
    assert_metrics_finite(out.metrics)


def assert_grad_only_through_logp(
    out: LossOutput, logp: torch.Tensor, mask: torch.Tensor, others: Sequence[torch.Tensor] = ()
) -> None:
    """Backward reaches only ``logp`` (not ``others``), finite and 0 off ``mask``; metrics are detached finite 0-d."""
    out.loss.backward()
    assert all(x.requires_grad and x.grad is None for x in others)
    assert torch.isfinite(out.loss)
    assert torch.isfinite(logp.grad).all()
    assert torch.equal(logp.grad[~mask], torch.zeros_like(logp.grad[~mask]))  # nan garbage never leaks
    assert all(not v.requires_grad and v.dim() == 0 and torch.isfinite(v) for v in out.metrics.values())
