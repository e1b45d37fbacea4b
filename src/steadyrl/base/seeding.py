"""Seeds derived from (run seed, stream name, index), so every random draw of a run can be replayed on its own.

A run never advances one global RNG across steps: step t's sampling uses ``generator(seed, "sample", t)``, the eval
uses ``generator(seed, "eval")``, the problem order of epoch e uses ``generator(seed, "order", e)``. A resumed run
therefore draws exactly what an uninterrupted one draws, without restoring RNG state.
"""

from __future__ import annotations

import hashlib

import torch

#: Derived seeds are taken modulo 2**63 (torch generators accept 64-bit seeds).
SEED_BITS = 63


def derive_seed(seed: int, *parts: str | int) -> int:
    """A 63-bit seed from ``seed`` and a stream path (BLAKE2b of the parts; stable across processes and versions)."""
    text = "/".join(str(p) for p in (seed, *parts))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << SEED_BITS)


def generator(seed: int, *parts: str | int, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` (the CPU by default; a sampler draws on its model's device) seeded with
    :func:`derive_seed`. The same seed gives different draws on a CPU and a CUDA generator."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, *parts))
