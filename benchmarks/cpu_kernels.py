"""Two kernel-level facts docs/scale.md relies on, measured in one run: bf16 against fp32 matmuls, and PyTorch's
fused AdamW against its default for-loop AdamW, on this machine's CPU.

    .venv/bin/python benchmarks/cpu_kernels.py              # 1 thread, AdamW on 135M parameters (SmolLM2's size)
    .venv/bin/python benchmarks/cpu_kernels.py --threads 2 --params 20e6

Prints GFLOP/s per matmul shape and dtype with the bf16/fp32 ratio, and the median AdamW step time per variant with
its ratio to the default (``optim.fused`` in steadyrl), plus the largest parameter difference after the same steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

#: (M, K, N) matmul shapes: the learner's [tokens, hidden] × [hidden, 4·hidden] of the default model, and a cube.
SHAPES = [(7168, 128, 512), (1024, 1024, 1024)]


def _matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / min(times) / 1e9


def _adamw(params: list[torch.Tensor], grads: list[torch.Tensor], steps: int, **kw: bool) -> tuple[float, list]:
    ps = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ps, lr=1e-3, **kw)
    times = []
    for _ in range(steps):
        for p, g in zip(ps, grads, strict=True):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), ps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--params", type=float, default=135e6, help="AdamW parameters (split into 50 tensors)")
    parser.add_argument("--steps", type=int, default=4, help="AdamW steps per variant (the first is not timed)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'matmul (M, K, N)':>22} {'fp32 GFLOP/s':>13} {'bf16 GFLOP/s':>13} {'bf16/fp32':>10}")
    for m, k, n in SHAPES:
        f32 = _matmul_gflops(m, k, n, torch.float32, 10)
        b16 = _matmul_gflops(m, k, n, torch.bfloat16, 10)
        print(f"{(m, k, n)!s:>22} {f32:13.1f} {b16:13.1f} {b16 / f32:10.2f}")
    size = int(args.params) // 50
    params = [torch.randn(size) for _ in range(50)]
    grads = [torch.randn(size) for _ in range(50)]
    base, ref = _adamw(params, grads, args.steps)
    print(f"AdamW step on {50 * size / 1e6:.0f}M parameters (median of {args.steps - 1}):")
    print(f"  for-loop (default)   {base:7.3f} s")
    for label, kw in (("foreach", {"foreach": True}), ("fused (optim.fused)", {"fused": True})):
        t, ps = _adamw(params, grads, args.steps, **kw)
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(ps, ref, strict=True))
        print(f"  {label:<20} {t:7.3f} s   ratio {t / base:.2f}   max |Δθ| after {args.steps} steps {diff:.1e}")
    return 0


if __name__ == "__main__":
    status = main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
    sys.exit(status)
