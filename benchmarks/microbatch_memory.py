"""Peak memory of one learner step against the batch size, with and without ``optim.microbatch_tokens``.

Each (rows, budget) point runs in a fresh subprocess: it builds the model and a synthetic batch (random tokens,
every response of full length), records the process's peak RSS, runs one learner step, and reports the growth of
the peak RSS during the step (ru_maxrss is monotone, so the difference is the step's own peak above what was
already allocated). With a budget the peak must stay bounded as the batch grows; without one it grows with it.
Optionally also reports the step's wall time (a micro-batched step forwards each micro-batch once when the
method's loss reads each row alone, as ``seq_tis`` does, and twice otherwise, unless π_prox is recomputed anyway).

    .venv/bin/python benchmarks/microbatch_memory.py                        # the table of docs/scale.md
    .venv/bin/python benchmarks/microbatch_memory.py --rows 32,64 --budgets none,2048 --method grpo
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

#: A model large enough that activations dominate: the embedded Llama at hidden 256, 4 layers (~3.2M parameters).
ARCH = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 1024}


def _point(rows: int, budget: int | None, *, method: str, prompt_len: int, response_len: int, ckpt: bool) -> dict:
    """One learner step in this process; returns the growth of peak RSS (MiB) and the step time."""
    import torch

    from steadyrl.config.train import OptimConfig
    from steadyrl.control import build_controllers
    from steadyrl.methods import resolve_method
    from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
    from steadyrl.rollout.rollouts import Rollouts
    from steadyrl.train.learner import Learner

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyArchConfig(**ARCH), tokenizer=tok, seed=0)
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    rollouts = Rollouts(
        prompt_ids=torch.randint(3, V, (rows, prompt_len), generator=gen),
        prompt_mask=torch.ones(rows, prompt_len, dtype=torch.bool),
        response_ids=torch.randint(3, V, (rows, response_len), generator=gen),
        response_mask=torch.ones(rows, response_len, dtype=torch.bool),
        behav_logp=torch.full((rows, response_len), -4.6),
        versions=torch.zeros(rows, response_len, dtype=torch.long),
        group_ids=torch.arange(rows) // 8,
        truncated=torch.ones(rows, dtype=torch.bool),
        texts=[""] * rows,
        pad_id=0,
    )
    rewards = (torch.arange(rows) % 2).float()
    spec = resolve_method(method)
    optim = OptimConfig(microbatch_tokens=budget, activation_checkpointing=ckpt)
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-4, optim=optim,
                      log=lambda _: None)  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = learner.step(rollouts, rewards)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rows": rows, "budget": budget, "peak_growth_mib": (after - before) / 1024, "step_s": seconds,
        "microbatches": out.metrics.get("train/microbatches", 1.0), "skipped": out.skipped,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,64,128,256", help="batch sizes (rows = responses)")
    parser.add_argument("--budgets", default="none,4096", help="microbatch_tokens values (none = one pass)")
    parser.add_argument("--method", default="seq_tis")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--response-len", type=int, default=112)
    parser.add_argument("--checkpointing", action="store_true", help="also optim.activation_checkpointing=true")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # internal: run one point and print its JSON
    args = parser.parse_args(argv)
    if args.point:
        rows, budget = json.loads(args.point)
        print(json.dumps(_point(rows, budget, method=args.method, prompt_len=args.prompt_len,
                                response_len=args.response_len, ckpt=args.checkpointing)))  # fmt: skip
        return 0
    rows_list = [int(r) for r in args.rows.split(",")]
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    print(f"learner step of {args.method}, embedded Llama {ARCH}, prompt {args.prompt_len} + response "
          f"{args.response_len} tokens, 1 thread, activation checkpointing {args.checkpointing}")  # fmt: skip
    print(f"{'rows':>6} {'tokens':>8} " + " ".join(f"{'budget ' + str(b):>22}" for b in budgets))
    for rows in rows_list:
        cells = []
        for budget in budgets:
            cmd = [sys.executable, __file__, "--point", json.dumps([rows, budget]), "--method", args.method,
                   "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len)]  # fmt: skip
            if args.checkpointing:
                cmd.append("--checkpointing")
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            cells.append(f"{res['peak_growth_mib']:7.0f} MiB {res['step_s']:5.1f} s ×{res['microbatches']:<3.0f}")
        tokens = rows * (args.prompt_len + args.response_len)
        print(f"{rows:>6} {tokens:>8} " + " ".join(f"{c:>22}" for c in cells))
    print("(cells: growth of peak RSS during the step, step time, micro-batches)")
    return 0


if __name__ == "__main__":
    status = main()
    if "--point" not in sys.argv:  # a child run prints JSON only
        from _provenance import print_provenance

        print_provenance()
    sys.exit(status)
