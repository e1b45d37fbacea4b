"""Which train problem each prompt slot gets: one seeded permutation of the train pool per epoch, walked in order.

Slot s (a global position: step t's prompt i is slot t·P + i in the lag runtime, group id s in the concurrent ones)
gets problem ``perm_e[s mod n]`` with e = ⌊s / n⌋, so every runtime visits the same problems in the same order.
"""

from __future__ import annotations

import torch

from steadyrl.base.seeding import generator


def problem_indices(first: int, count: int, *, pool: int, seed: int) -> list[int]:
    """Train-pool indices of slots ``first`` … ``first + count − 1``."""
    if pool < 1 or first < 0 or count < 0:
        raise ValueError(f"need pool >= 1, first >= 0, count >= 0; got {pool}, {first}, {count}")
    out: list[int] = []
    perms: dict[int, list[int]] = {}
    for pos in range(first, first + count):
        epoch, i = divmod(pos, pool)
        if epoch not in perms:
            perms[epoch] = torch.randperm(pool, generator=generator(seed, "order", epoch)).tolist()
        out.append(perms[epoch][i])
    return out


def problem_order(step: int, *, pool: int, per_step: int, seed: int) -> list[int]:
    """Indices into the train pool for ``step``: slots step·P … step·P+P−1."""
    return problem_indices(step * per_step, per_step, pool=pool, seed=seed)
