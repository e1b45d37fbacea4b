"""Speed of the sampler and of the learner's log-prob recompute on the embedded default model.

Measures, in one run on one batch (64 prompts × G = 8 samples, 16 new tokens by default):

* ``generate``: generated tokens per second (tokens in the response masks / wall time);
* ``sequence_logprobs`` without gradient (the proximal recompute) and forward + backward (the learner step's
  model part), median of a few repeats after one warm-up.

Usage::

    .venv/bin/python benchmarks/rollout_speed.py                  # random init, default architecture
    .venv/bin/python benchmarks/rollout_speed.py --model default  # the warm-started default (built if not cached)

A randomly initialized model almost never samples EOS, so every row runs the full ``--new-tokens``; the warm-started
one stops after its answer (about 4 tokens on chain_sum), which lowers tokens/s (fixed per-step costs weigh more).
"""

from __future__ import annotations

import argparse

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from steadyrl.models import ModelConfig, TinyArchConfig, build_char_tokenizer, build_tiny_model, load_policy
from steadyrl.rollout import Rollouts, generate, sequence_logprobs
from steadyrl.tasks import ChainSumConfig, build_task
from timing import timed

#: Timed repeats of each measurement (after one warm-up run).
REPEATS = 5


def load(kind: str, *, seed: int) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if kind == "random":
        tokenizer = build_char_tokenizer()
        return build_tiny_model(TinyArchConfig(), tokenizer=tokenizer, seed=seed).eval(), tokenizer
    policy = load_policy(ModelConfig(), build_task(ChainSumConfig()), seed=seed)
    return policy.model, policy.tokenizer


def learner_step(model: PreTrainedModel, rollouts: Rollouts) -> None:
    logp, _ = sequence_logprobs(model, rollouts)
    (-logp.sum()).backward()
    model.zero_grad(set_to_none=True)


def proximal_recompute(model: PreTrainedModel, rollouts: Rollouts) -> None:
    with torch.no_grad():
        sequence_logprobs(model, rollouts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["random", "default"], default="random")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, seed=args.seed)
    prompts = [p.prompt for p in build_task(ChainSumConfig()).problems("eval", args.prompts, seed=args.seed)]

    def sample() -> Rollouts:
        gen = torch.Generator().manual_seed(args.seed)
        return generate(model, tokenizer, prompts, group_size=args.group_size, max_new_tokens=args.new_tokens,
                        generator=gen, version=0)

    rollouts = sample()
    tokens = int(rollouts.response_mask.sum())
    t_gen = timed(sample, repeats=args.repeats)
    t_prox = timed(lambda: proximal_recompute(model, rollouts), repeats=args.repeats)
    model.train()
    t_learn = timed(lambda: learner_step(model, rollouts), repeats=args.repeats)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.model} ({params / 1e6:.2f}M params), torch threads: {args.threads}, batch: "
          f"{args.prompts} prompts x G={args.group_size} = {len(rollouts)} rows, {tokens} generated tokens "
          f"(max {args.new_tokens} new), median of {args.repeats}")
    print(f"{'measurement':<36}{'seconds':>10}{'(min-max)':>18}{'tokens/s':>12}")
    for name, t in [("generate (KV cache)", t_gen), ("sequence_logprobs, no grad", t_prox),
                    ("sequence_logprobs fwd+bwd", t_learn)]:
        print(f"{name:<36}{t.median:>10.3f}{f'({t.low:.3f}-{t.high:.3f})':>18}{tokens / t.median:>12,.0f}")


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
