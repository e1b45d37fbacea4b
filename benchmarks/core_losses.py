"""Time every method's loss (forward + backward) relative to PPO-clip on the same batch.

Usage::

    .venv/bin/python benchmarks/core_losses.py                      # B=256, T=1024, fp32, 1 thread
    .venv/bin/python benchmarks/core_losses.py --reps 5 --methods ppo,m2po,token_tis

Every catalog preset runs through the public entry point ``steadyrl.compute_loss(name, batch)``; the reference is
the ``ppo`` preset (PPO-clip). The bare core function ``ppo_clip_loss`` is timed too, so the cost of what
``compute_loss`` adds around it (advantages, the diagnostics every method logs: ESS, KL, lag) is visible.

Measurement: one warm-up call per method, then ``reps`` rounds; each round runs every method once, in an order
shuffled per round (seeded), so machine noise hits all methods alike; the median per method is reported. With one
thread the clock is the process CPU time (user + system: page faults count, time spent descheduled by other jobs
does not); ``--clock wall`` times wall-clock instead. The header names any allocator setting in the environment
(``MALLOC_*``, ``LD_PRELOAD``): on CPU, fresh [B, T] buffers cost page faults, so the allocator moves the numbers.

Targets (the project issue): elementwise corrections ≤ 1.2× PPO-clip; M2PO (vectorized) ≤ 2×. PPO variants (another
aggregation, a KL term, bypass, controllers) and sequence-level methods whose objective differs from PPO's (backward
recursions, group statistics) are reported without a target.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import steadyrl
from steadyrl.core.advantages import grpo
from steadyrl.core.objectives.ppo import ppo_clip_loss
from steadyrl.methods import PRESETS

#: The reference preset every ratio divides by.
REFERENCE = "ppo"
#: Environment variables that change how CPU memory is allocated (reported in the header when set).
ALLOCATOR_ENV = ("MALLOC_", "LD_PRELOAD")
#: Name of the row timing the bare core function (not a preset).
BARE_PPO = "bare ppo_clip_loss"
#: Sequences per prompt group (GRPO's G).
GROUP_SIZE = 8
#: Spread of the behavior log-ratio: log μ = log π + SPREAD · N(0, 1) per token.
SPREAD = 0.3
#: Shortest response, as a fraction of T (lengths are uniform in [MIN_LEN_FRAC·T, T]).
MIN_LEN_FRAC = 0.25
#: Largest version lag in the batch (versions are learner_version − U{0..MAX_LAG}).
MAX_LAG = 4
LEARNER_VERSION = 10

#: Target ratio to ``ppo`` per class (the issue's: elementwise corrections and M2PO); other classes have none.
TARGETS: dict[str, float] = {"elementwise": 1.2, "m2po": 2.0}
#: Elementwise corrections: PPO-clip (or REINFORCE) on per-token or per-sequence weights and masks computed in a few
#: O(B·T) elementwise passes and masked reductions (TIS, MIS, IcePop, veto, rejection, OPSM, prefix ratio, filters).
_ELEMENTWISE = (
    "token_tis", "seq_tis", "token_mis", "seq_mis", "geo_mis", "icepop", "token_veto", "rejection", "opsm",
    "decoupled_ppo", "prefix_ratio", "pnpo", "vaco", "estr",
)  # fmt: skip
#: PPO variants that change no correction: another aggregation, a KL term, the policy pair, a step-level controller.
_VARIANT = ("grpo", "dr_grpo", "bypass", "kl_in_reward", "kl_in_loss", "ess_lr", "gac")
#: Another objective or advantage estimator: group statistics, sequence ratios, backward recursions over T.
_SEQUENCE = ("gspo", "tic_grpo", "gmc_grpo", "oapl", "vcpo", "opob", "otb", "copc")
CLASSES: dict[str, str] = {
    REFERENCE: "reference",
    **dict.fromkeys(_ELEMENTWISE, "elementwise"),
    "m2po": "m2po",
    "m2po_clip": "m2po",
    **dict.fromkeys(_VARIANT, "variant"),
    **dict.fromkeys(_SEQUENCE, "sequence"),
}


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    name: str
    cls: str
    median_ms: float
    ratio: float
    target: float | None

    @property
    def flag(self) -> str:
        if self.target is None:
            return ""
        return "ok" if self.ratio <= self.target else "ABOVE TARGET"


def make_batch(*, B: int, T: int, seed: int = 0) -> dict[str, object]:
    """A float32 batch holding every tensor any preset may ask for (the keys of ``LossBatch``)."""
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    behav = logp.detach() + SPREAD * torch.randn(B, T, generator=g)  # log μ = log π + 0.3·N(0, 1)
    lens = torch.randint(int(MIN_LEN_FRAC * T), T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lens.unsqueeze(1)
    return {
        "logp": logp,
        "behav_logp": behav,
        "mask": mask,
        "prox_logp": logp.detach().clone(),  # π_prox at the first update of a phase (VACO requires it)
        "rewards": torch.randint(0, 2, (B,), generator=g).float(),
        "group_ids": torch.arange(B // GROUP_SIZE).repeat_interleave(GROUP_SIZE),
        "versions": LEARNER_VERSION - torch.randint(0, MAX_LAG + 1, (B, T), generator=g),
        "learner_version": LEARNER_VERSION,
        "behav_entropy": torch.rand(B, T, generator=g) + 0.1,
        "ref_logp": logp.detach() + 0.1 * torch.randn(B, T, generator=g),
        "values": torch.rand(B, T, generator=g),
        "grad_sq_norms": torch.rand(B, generator=g) + 0.5,
        "sum_p2": torch.rand(B, T, generator=g) * 0.5 + 0.1,
    }


def loss_step(name: str, batch: dict[str, object]) -> Callable[[], None]:
    """One forward + backward of preset ``name`` through ``steadyrl.compute_loss``."""
    logp = batch["logp"]
    assert isinstance(logp, torch.Tensor)

    def step() -> None:
        logp.grad = None
        steadyrl.compute_loss(name, batch).loss.backward()

    return step


def bare_ppo_step(batch: dict[str, object]) -> Callable[[], None]:
    """One forward + backward of ``ppo_clip_loss`` alone, on GRPO token advantages computed once outside the timer."""
    logp, mask, rewards, group_ids = (batch[k] for k in ("logp", "mask", "rewards", "group_ids"))
    assert isinstance(logp, torch.Tensor) and isinstance(mask, torch.Tensor)
    assert isinstance(rewards, torch.Tensor) and isinstance(group_ids, torch.Tensor)
    adv_seq = grpo.grpo_advantages(rewards=rewards, group_ids=group_ids).advantages
    adv_tok = grpo.token_advantages(advantages=adv_seq, mask=mask)

    def step() -> None:
        logp.grad = None
        ppo_clip_loss(logp=logp, prox_logp=logp.detach(), advantages=adv_tok, mask=mask).loss.backward()

    return step


#: Clocks a step can be timed with: process CPU time (user + system, all threads) or wall-clock time.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def measure(
    steps: dict[str, Callable[[], None]], *, reps: int, clock: Callable[[], float], seed: int = 0
) -> dict[str, float]:
    """Median seconds per step: one warm-up each, then ``reps`` rounds in a per-round shuffled order."""
    for step in steps.values():
        step()
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for _ in range(reps):
        rng.shuffle(names)
        for name in names:
            t0 = clock()
            steps[name]()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def build_rows(medians: dict[str, float], order: list[str]) -> list[Row]:
    ref = medians[REFERENCE]
    rows = []
    for name in order:
        cls = "core" if name == BARE_PPO else CLASSES.get(name, "unclassified")
        rows.append(Row(name, cls, 1e3 * medians[name], medians[name] / ref, TARGETS.get(cls)))
    return rows


def format_table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'method':<{width}}  {'class':<12}  {'median ms':>9}  {'x ppo':>6}  {'target':>6}  check", "-" * 72]
    for r in rows:
        target = f"<={r.target:g}" if r.target is not None else "-"
        line = f"{r.name:<{width}}  {r.cls:<12}  {r.median_ms:9.2f}  {r.ratio:6.2f}  {target:>6}  {r.flag}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=256, help="sequences per batch")
    p.add_argument("--T", type=int, default=1024, help="tokens per sequence (padded length)")
    p.add_argument("--reps", type=int, default=40, help="timed rounds per method (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--methods", default="", help="comma-separated presets (default: the whole catalog); ppo is added")
    p.add_argument("--seed", type=int, default=0, help="seed of the batch and of the round order")
    p.add_argument(
        "--clock", choices=sorted(CLOCKS), default=None,
        help="cpu: process CPU time (user + system), blind to the time spent descheduled on a shared machine; "
        "wall: wall clock. Default: cpu with one thread, wall with more (CPU time adds the threads up)",
    )  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    names = [n.strip() for n in args.methods.split(",") if n.strip()] or [p.name for p in PRESETS]
    names = [REFERENCE, *(n for n in names if n != REFERENCE)]
    if args.B % GROUP_SIZE:
        raise SystemExit(f"--B must be a multiple of the group size {GROUP_SIZE}")
    batch = make_batch(B=args.B, T=args.T, seed=args.seed)
    steps = {name: loss_step(name, batch) for name in names}
    steps[BARE_PPO] = bare_ppo_step(batch)
    t0 = time.perf_counter()
    medians = measure(steps, reps=args.reps, clock=CLOCKS[clock], seed=args.seed)
    wall = time.perf_counter() - t0
    allocator = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(ALLOCATOR_ENV)) or "default"
    print(
        f"steadyrl {steadyrl.__version__}  torch {torch.__version__}  python {platform.python_version()}  "
        f"cpus {os.cpu_count()}  threads {torch.get_num_threads()}  allocator {allocator}"
    )
    print(
        f"B={args.B} T={args.T} fp32 CPU  median of {args.reps} interleaved rounds, {clock} clock  "
        f"(whole measurement {wall:.0f} s)"
    )
    rows = build_rows(medians, [*names, BARE_PPO])
    print(format_table(rows))
    print(f"compute_loss('ppo') / bare ppo_clip_loss = {medians[REFERENCE] / medians[BARE_PPO]:.2f}x")
    for cls, target in TARGETS.items():
        held = [r for r in rows if r.cls == cls]
        if held:
            met = sum(r.ratio <= target for r in held)
            print(f"{cls} (target <= {target:g}x ppo): {met} of {len(held)} within target")


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
