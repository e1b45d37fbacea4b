"""Score centering's top-k form against the exact one on a real vocabulary: SmolLM2-135M-Instruct (49,152 tokens).

The sampler is a stale copy μ of the policy θ (every weight moved by ``--noise`` times its tensor's standard
deviation, seeded); it samples ``--prompts`` × ``--group`` responses of up to ``--tokens`` tokens and records the
top-``--k`` of μ at every token (``record_dist=k``, as ``steadyrl train`` does for ``objective.top_k=k``). The exact
μ at the same tokens is read back from μ's own forward over the sampled sequences. For each f (none, tis, mis) the
script backpropagates the centering term Σ_t Σ_v c_v log π_θ(v) (arXiv 2609.20807, Eq. 14; both forms through the
chunked head, :func:`steadyrl.rollout.logprobs.sequence_logprob_terms`) into θ's output layer and prints the top-k
gradient's error relative to the exact one, the term values, and the mass of μ the recorded head holds.

    .venv/bin/python benchmarks/score_centering_topk.py            # fetches SmolLM2 once (about 90 MB, a minute)
    .venv/bin/python benchmarks/score_centering_topk.py --k 16 --noise 0.02 --prompts 8 --group 4 --tokens 24
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from torch import Tensor

from steadyrl.core.objectives.score_centering import centering_term
from steadyrl.core.vocab_chunks import VocabTerm
from steadyrl.models import ModelConfig, load_policy
from steadyrl.rollout.logprobs import sequence_logprob_terms
from steadyrl.rollout.sampler import generate

PROMPTS = [
    "What is 17 + 25? Answer:", "Name a prime number larger than 50:", "Complete: the capital of France is",
    "Write one word that rhymes with cat:", "What is 9 times 7? Answer:", "The opposite of hot is",
    "Count from one to five:", "A short greeting in Spanish:",
]  # fmt: skip


def _capture(store: dict[str, Tensor]) -> VocabTerm:
    """A vocabulary term that keeps the distribution it is shown (no gradient) and contributes 0."""

    def term(log_probs: Tensor, index: Tensor) -> Tensor:
        store.setdefault("rows", []).append(log_probs.detach().float())  # type: ignore[attr-defined]
        store.setdefault("index", []).append(index)  # type: ignore[attr-defined]
        return log_probs.new_zeros(index.shape)

    return term


def measure(model: Any, tokenizer: Any, *, ks: tuple[int, ...] = (16,), noise: float = 0.02, prompts: int = 8,
            group: int = 4, tokens: int = 24, seed: int = 0,
            fs: tuple[str, ...] = ("none", "tis", "mis")) -> dict[str, Any]:  # fmt: skip
    """The top-k forms' gradient errors against the exact form (module docstring), per f and k (one sampling, which
    records the largest k; a smaller k takes its head)."""
    g = torch.Generator().manual_seed(seed)
    behavior = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in behavior.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (p.float().std() * noise))
    rollouts = generate(behavior, tokenizer, PROMPTS[:prompts], group_size=group, max_new_tokens=tokens, version=0,
                        generator=torch.Generator().manual_seed(seed), record_dist=max(ks))  # fmt: skip
    N, T = rollouts.response_ids.shape
    store: dict[str, Any] = {}
    with torch.no_grad():
        sequence_logprob_terms(behavior, rollouts, terms={"mu": _capture(store)})
    exact = torch.full((N * T, int(store["rows"][0].shape[-1])), float("-inf"))
    exact[torch.cat(store["index"])] = torch.cat(store["rows"])
    recorded = rollouts.behav_dist_logp.reshape(N * T, -1)
    recorded_ids = rollouts.behav_dist_ids.reshape(N * T, -1)
    mask = rollouts.response_mask.reshape(-1)
    out: dict[str, Any] = {
        "vocab": exact.shape[-1], "tokens": int(mask.sum()), "noise": noise,
        "recorded_vs_exact_max": (recorded[mask] - exact[mask].gather(-1, recorded_ids[mask])).abs().max().item(),
    }  # fmt: skip
    heads = {}
    for k in ks:
        top = recorded.topk(k, dim=-1)
        heads[k] = (top.values, recorded_ids.gather(-1, top.indices))
        mass = top.values[mask].exp().sum(-1)
        out[k] = {"head_mass_mean": mass.mean().item(), "head_mass_min": mass.min().item()}
    head = model.get_output_embeddings().weight

    def grad_of(term: VocabTerm) -> tuple[Tensor, float]:
        model.zero_grad(set_to_none=True)
        got = sequence_logprob_terms(model, rollouts, terms={"c": term}).terms["c"]
        total = (got * rollouts.response_mask).sum()
        total.backward()
        return head.grad.detach().clone(), total.item()

    for f in fs:
        g_exact, v_exact = grad_of(centering_term(behav_logp=exact, head_ids=None, weight=f))
        for k, (logp, ids) in heads.items():
            g_top, v_top = grad_of(centering_term(behav_logp=logp, head_ids=ids, weight=f))
            err = ((g_top - g_exact).norm() / g_exact.norm()).item()
            out[k][f] = {"grad_rel_err": err, "exact_value": v_exact, "topk_value": v_top}
    model.zero_grad(set_to_none=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[16, 64], help="head sizes (one sampling records the "
                        "largest)")
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    policy = load_policy(ModelConfig(name="smollm2-135m-instruct"), None, seed=0)
    res = measure(policy.model, policy.tokenizer, ks=tuple(args.k), noise=args.noise, prompts=args.prompts,
                  group=args.group, tokens=args.tokens, seed=args.seed)  # fmt: skip
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print(f"vocabulary {res['vocab']}, {res['tokens']} sampled tokens, μ = θ + {res['noise']}·std noise per tensor; "
          f"the sampler's recorded log μ vs μ's forward: max |Δ| {res['recorded_vs_exact_max']:.1e}")  # fmt: skip
    print("| k | mass of μ in the head (mean, min) | f | ‖∇top-k − ∇exact‖ / ‖∇exact‖ | term: exact, top-k |")
    print("|---|---|---|---|---|")
    for k in args.k:
        r = res[k]
        for f in ("none", "tis", "mis"):
            e = r[f]
            print(f"| {k} | {r['head_mass_mean']:.3f}, {r['head_mass_min']:.3f} | `{f}` | {e['grad_rel_err']:.3f} | "
                  f"{e['exact_value']:.1f}, {e['topk_value']:.1f} |")
    print()
    print_provenance()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
