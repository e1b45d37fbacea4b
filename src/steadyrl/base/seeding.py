"""Seeds derived from (run seed, stream name, index), so every random draw of a run can be replayed on its own.

A run never advances one global RNG across steps: step t's sampling uses ``generator(seed, "sample", t)``, the eval
uses ``generator(seed, "eval")``, the problem order of epoch e uses ``generator(seed, "order", e)``. A resumed run
therefore draws exactly what an uninterrupted one draws, without restoring RNG state.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

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


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Within the block, ``torch.use_deterministic_algorithms(enabled, warn_only=True)``; the previous setting is
    restored afterwards.

    Why (measured, docs/results.md "Reproducibility"): on the CPU the default ``index_put_(accumulate=True)`` — the
    backward of advanced indexing, e.g. the shared-prompt recompute's ``logits[inverse]`` — adds duplicates in the
    order its threads reach them, so two processes running the main job with 2 threads wrote the same metrics up to
    step 12 and different ones (float rounding) from step 13 on; with the deterministic algorithms they are identical,
    at no measurable cost there. ``warn_only``: an op without a deterministic implementation (some CUDA kernels)
    warns instead of failing the run.
    """
    before = torch.are_deterministic_algorithms_enabled()
    before_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=before_warn)
