"""Time of the per-trajectory squared gradient norms (OPOB's ‖∇ log π(y_i)‖²): ghost vs vmap vs naive, one run.

Default model (hidden 128, 4 layers, MLP 512, tied embeddings, the character tokenizer's ~100-token vocabulary),
seeded random weights; a batch of ``--trajectories`` random token sequences, prompts of ``--prompt-len`` tokens
(left-padded to the longest) and responses of ``--response-len`` tokens (right-padded), about 20 tokens each by
default. The time depends on the shapes, not on the weights or tokens. Each method is timed ``--repeats`` times
(median) after one untimed call; ratios are against ghost, and the largest relative difference to naive is printed
as a check. The ``step`` line is one plain forward + backward of the summed log-probs of the batch (what a learner
step costs without any per-trajectory norm), for scale.

    .venv/bin/python benchmarks/grad_norms.py [--threads 1] [--trajectories 128] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import TokenBatch
from steadyrl.train.grad_norms import GRAD_NORM_METHODS, per_trajectory_grad_sq_norms
from timing import timed


def _lengths(spec: str, n: int, generator: torch.Generator) -> torch.Tensor:
    low, high = (int(x) for x in spec.split("-"))
    return torch.randint(low, high + 1, (n,), generator=generator)


def random_batch(*, n: int, prompt_len: str, response_len: str, vocab: int, seed: int) -> TokenBatch:
    """Random ids in [3, vocab) (0–2 are pad/BOS/EOS), prompts left-padded and responses right-padded."""
    gen = torch.Generator().manual_seed(seed)
    p_len, r_len = _lengths(prompt_len, n, gen), _lengths(response_len, n, gen)
    P, T = int(p_len.max()), int(r_len.max())
    prompt_mask = torch.arange(P).flip(0).unsqueeze(0) < p_len.unsqueeze(1)  # left padding
    response_mask = torch.arange(T).unsqueeze(0) < r_len.unsqueeze(1)  # right padding
    prompt_ids = torch.randint(3, vocab, (n, P), generator=gen).masked_fill(~prompt_mask, 0)
    response_ids = torch.randint(3, vocab, (n, T), generator=gen).masked_fill(~response_mask, 0)
    return TokenBatch(prompt_ids, prompt_mask, response_ids, response_mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--trajectories", type=int, default=128, help="N")
    parser.add_argument("--prompt-len", default="8-12", help="prompt length range low-high")
    parser.add_argument("--response-len", default="6-12", help="response length range low-high")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per method (median)")
    parser.add_argument("--methods", default=",".join(GRAD_NORM_METHODS), help="comma-separated, ghost first")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyArchConfig(), tokenizer=tokenizer, seed=0).to(getattr(torch, args.dtype))
    batch = random_batch(
        n=args.trajectories, prompt_len=args.prompt_len, response_len=args.response_len, vocab=len(tokenizer), seed=0
    )
    params = sum(p.numel() for p in model.parameters())
    tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum()) / args.trajectories
    print(f"default model: {params / 1e6:.2f}M parameters, {args.dtype}, {args.threads} thread(s); "
          f"{args.trajectories} trajectories x {tokens:.1f} tokens (padded {batch.prompt_ids.shape[1]} + "
          f"{batch.response_ids.shape[1]})")  # fmt: skip

    results: dict[str, torch.Tensor] = {}

    def norms(method: str) -> Callable[[], None]:
        def run() -> None:
            results[method] = per_trajectory_grad_sq_norms(model, batch, method=method)

        return run

    def step() -> None:
        loss = sequence_logprobs(model, batch).logp.sum()
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    runs = {method: norms(method) for method in args.methods.split(",")} | {"step": step}
    seconds = {name: timed(fn, repeats=args.repeats).median for name, fn in runs.items()}
    base = seconds[next(iter(seconds))]
    reference = results.get("naive")
    print(f"{'method':<8} {'ms':>10} {'x ghost':>9} {'max rel diff vs naive':>22}")
    for name, s in seconds.items():
        diff = ""
        if reference is not None and name in results:
            diff = f"{((results[name] - reference).abs() / reference).max().item():.2e}"
        print(f"{name:<8} {s * 1e3:>10.1f} {s / base:>9.2f} {diff:>22}")

if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
