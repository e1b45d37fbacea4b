"""The output layer's part of VCPO's per-trajectory gradient norms at a real vocabulary: kernel against materialized.

The norm pass forms ‖Σ_t g_t h_tᵀ‖² of the output layer from its inputs over vocabulary chunks, in one of two ways
(``steadyrl.core.grad_norms``): the [T, T] kernel Σ_{s,t} K_st (h_s·h_t), T² (V + H) multiply-adds a trajectory, or
the per-sample gradient formed one vocabulary chunk at a time, T V H. ``auto`` takes the kernel while
T² (V + H) ≤ T V H + V H (about T < H). This script times both on one trajectory
of T response tokens at a SmolLM2-135M-sized head (V = 49,152, H = 576; random hidden states and weights whose logits
have std 3, a peaked softmax as in a trained head; float32), checks that they agree, and prints which one ``auto``
picks. The log-normalizer both need comes from the forward's log-probs in the learner, so it is filled in before
timing (the time of that vocabulary pass, no longer run, is printed beside them).

    .venv/bin/python benchmarks/head_norm.py [--tokens 64,256,1024] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from steadyrl.core import grad_norms as core
from timing import timed


def timed_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls after one untimed call (:func:`timing.timed`)."""
    return timed(fn, repeats=repeats).median * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,256,1024", help="response lengths T, comma-separated")
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    V, H = args.vocab, args.hidden
    weight = 3 * torch.randn(V, H, generator=gen) / H**0.5  # logits of std 3: a peaked softmax, as a trained head
    print(f"output layer V = {V}, H = {H}, float32, {args.threads} thread(s), one trajectory")
    print(f"{'T':>6} {'kernel ms':>10} {'materialized ms':>16} {'ratio':>7} {'auto':>13} {'rel diff':>9} "
          f"{'lse pass ms':>12}")
    for T in (int(t) for t in args.tokens.split(",")):
        h = torch.randn(1, T, H, generator=gen)
        y = torch.randint(0, V, (1, T), generator=gen)
        head = core._Head(h=h, y=y, m=torch.ones(1, T), weight=weight, bias=None, tau=1.0)
        lse_ms = timed_ms(lambda head=head: (setattr(head, "lse", None), core._head_lse(head)), args.repeats)
        kernel = core._param_sq_norm([head], "gram")
        materialized = core._param_sq_norm([head], "materialize")
        k_ms = timed_ms(lambda head=head: core._param_sq_norm([head], "gram"), args.repeats)
        m_ms = timed_ms(lambda head=head: core._param_sq_norm([head], "materialize"), args.repeats)
        pick = "kernel" if core._head_uses_kernel(head, "auto") else "materialized"
        diff = float((kernel - materialized).abs().max() / materialized.abs().max())
        print(f"{T:>6} {k_ms:>10.1f} {m_ms:>16.1f} {k_ms / m_ms:>6.2f}x {pick:>13} {diff:>9.1e} {lse_ms:>12.1f}")
    return 0


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
