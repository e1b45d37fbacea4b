"""Where a GRPO step's time goes at 48 forced tokens, and what did and did not make it faster (docs/scale.md).

The setting of ``benchmarks/peer_trl.py``'s 48-forced-token budget: the cached warm-started default model (1.06M
parameters) with a stop token no row can sample, 16 prompts × 8 responses of exactly 48 tokens, one torch thread,
process CPU time. Every comparison is a set of interleaved pairs (A B, B A, ...) measured in this one run, printed as
medians and the ratio B/A per pair. Sections (``--sections``, comma-separated; default all but the two slow ones):

* ``generate``: the sampler's ``generate`` in all, and the part of it inside ``model.forward``;
* ``ablation``: a decode forward built from the model's own modules (no transformers mask, cache or output
  machinery) over a KV cache of the real shape, whole and with parts removed (ms per forward of 128 rows);
* ``attention``: one-token attention as two matmuls with a float32 softmax (transformers' "eager" arithmetic)
  against SDPA's CPU kernel, alone at 16–128 cached keys and inside ``generate`` (switched in through transformers'
  attention registry for the benchmark only: steadyrl does not use it);
* ``learner``: forward + backward of the learner's recompute (``sequence_logprobs``, shared prompts) with SDPA against
  eager attention, and with torch's deterministic algorithms off against on (gradients compared); the one-pass
  recompute against a forward from the same modules with q/k/v and gate/up fused into one matmul each (gradients
  compared); transformers' RMSNorm against ``F.rms_norm`` (forward + backward of one norm);
* ``matmul``: GFLOP/s of the learner's matmul shapes against a 1024³ one;
* ``mismatch``: the lag-0 gap max/mean |log π_learner − log μ| for SDPA / eager attention in the sampler × the learner
  (one-pass and shared-prompt recompute), and in float64 (transformers' RMSNorm, which rounds to float32, replaced);
* ``compile`` (slow, not default): ``torch.compile`` of the learner's model, its first call and then eager against
  compiled (one-pass recompute);
* ``malloc`` (not default): ``generate`` + learner in fresh processes with and without glibc ``mallopt`` (no mmap
  threshold, no trimming), alternating.

Usage::

    .venv/bin/python benchmarks/step_breakdown.py                  # about 8 minutes here
    .venv/bin/python benchmarks/step_breakdown.py --sections compile,malloc
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts, attention_mask
from steadyrl.rollout.sampler import generate, positions_from_mask
from steadyrl.tasks import ChainSumConfig, build_task
from timing import cpu_seconds, paired, ratio_line

PROMPTS, GROUP, TOKENS = 16, 8, 48
DEFAULT_SECTIONS = "generate,ablation,attention,learner,matmul,mismatch"
#: Name of the benchmark's two-matmul attention in transformers' registries.
MATMUL_ATTENTION = "steadyrl_bench_matmul"


# ------------------------------------------------------------------------------------------------------- setting
def forced_model_dir(dst: Path) -> Path:
    """peer_trl's 48-forced-token copy of the cached warm-started default model."""
    import peer_trl

    return peer_trl.forced_length_copy(peer_trl.default_model_dir(0), dst)


def load(model_dir: Path, attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn).eval()


def prompts() -> list[str]:
    return [p.prompt for p in build_task(ChainSumConfig()).problems("train", PROMPTS, seed=0)]


def sample(model: Any, tokenizer: Any, seed: int = 0) -> Rollouts:
    return generate(model, tokenizer, prompts(), group_size=GROUP, max_new_tokens=TOKENS, version=0,
                    generator=torch.Generator().manual_seed(seed))  # fmt: skip


def learner_pass(model: Any, rollouts: Rollouts, *, share: bool = True, logp_fn: Callable | None = None) -> list:
    """Forward + backward of Σ log π over the response tokens; the gradients (then cleared)."""
    model.train()
    logp = logp_fn() if logp_fn else sequence_logprobs(model, rollouts, share_prompts=share).logp
    logp.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model.eval()
    return grads


# ------------------------------------------------------------------------------------------ two-matmul attention
def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:  # fmt: skip
    """softmax(q Kᵀ · scale + mask) V, float32 softmax; query [N, H, q, D], key/value [N, H, L, D] (no GQA here)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if mask is not None:
        mask = mask[..., : key.shape[2]]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)


def _matmul_for_one_token(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return matmul_attention(query, key, value, attention_mask, scale).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def one_token_matmul_attention(model: Any) -> Iterator[None]:
    """Within the block, ``model``'s one-token (decode) attention calls use :func:`matmul_attention`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(MATMUL_ATTENTION, _matmul_for_one_token)
    AttentionMaskInterface.register(MATMUL_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(MATMUL_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# ------------------------------------------------------------------------------------------------------ sections
def section_generate(model: Any, tokenizer: Any, repeats: int) -> None:
    inside = [0.0]
    forward = model.forward

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        t = cpu_seconds(lambda: out.append(forward(*args, **kwargs)))
        inside[0] += t
        return out.pop()

    out: list = []
    model.forward = timed_forward
    totals, forwards = [], []
    try:
        sample(model, tokenizer)
        for _ in range(repeats):
            inside[0] = 0.0
            totals.append(cpu_seconds(lambda: sample(model, tokenizer)))
            forwards.append(inside[0])
    finally:
        del model.forward
    total, fwd = statistics.median(totals), statistics.median(forwards)
    print(f"generate {PROMPTS}x{GROUP}, {TOKENS} tokens: {total:.3f} s, of which model.forward {fwd:.3f} s "
          f"({fwd / total:.0%}); the loop's own ops {total - fwd:.3f} s")  # fmt: skip


def lean_decode(model: Any, keys: list, values: list, keep: torch.Tensor, length: int, skip: str) -> torch.Tensor:
    """One decode forward of all rows at cache position ``length`` built from ``model``'s modules."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, n = model.model, keep.shape[0]
    heads = model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    h = m.embed_tokens(torch.full((n, 1), 5))
    cos, sin = m.rotary_emb(h, torch.full((n, 1), length))
    mask = keep[:, None, None, : length + 1]
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        if "attention" not in skip:
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(n, 1, heads, dim).transpose(1, 2)
            k = a.k_proj(x).view(n, 1, heads, dim).transpose(1, 2)
            v = a.v_proj(x).view(n, 1, heads, dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[i][:, :, length : length + 1], values[i][:, :, length : length + 1] = k, v
            kk, vv = keys[i][:, :, : length + 1], values[i][:, :, : length + 1]
            if "sdpa" in skip:
                o = q
            elif "eager" in skip:
                o = matmul_attention(q, kk, vv, mask, a.scaling)
            else:
                o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=a.scaling)
            h = h + a.o_proj(o.transpose(1, 2).reshape(n, 1, heads * dim))
        if "mlp" not in skip:
            h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(m.norm(h))


def section_ablation(model: Any, repeats: int) -> None:
    n, prompt = PROMPTS * GROUP, 8
    heads = model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    g = torch.Generator().manual_seed(0)
    layers = model.config.num_hidden_layers
    keys = [torch.randn(n, heads, prompt + TOKENS, dim, generator=g) for _ in range(layers)]
    values = [torch.randn(n, heads, prompt + TOKENS, dim, generator=g) for _ in range(layers)]
    keep = torch.ones(n, prompt + TOKENS, dtype=torch.bool)
    keep[::3, :1] = False  # left padding

    def run(skip: str) -> None:
        for length in range(prompt, prompt + TOKENS - 1):
            lean_decode(model, keys, values, keep, length, skip)

    variants = {
        "whole (SDPA)": "", "whole (two-matmul attention)": "eager", "without SDPA": "sdpa", "without the MLP": "mlp",
        "without attention": "attention", "without both": "attention,mlp",
    }  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        run("")
        for _ in range(repeats):
            for name, skip in variants.items():
                times[name].append(cpu_seconds(lambda skip=skip: run(skip)))
    cells = ", ".join(f"{k} {statistics.median(v) * 1e3 / (TOKENS - 1):.1f}" for k, v in times.items())
    print(f"lean decode forward, ms per forward of {n} rows: {cells}")


def section_attention(model: Any, tokenizer: Any, pairs: int) -> None:
    n, heads = PROMPTS * GROUP, model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    g = torch.Generator().manual_seed(0)
    for length in (16, 32, 64, 128):
        q = torch.randn(n, heads, 1, dim, generator=g)
        k = torch.randn(n, heads, length + 16, dim, generator=g)[:, :, :length]
        v = torch.randn(n, heads, length + 16, dim, generator=g)[:, :, :length]
        keep = torch.ones(n, 1, 1, length, dtype=torch.bool)
        keep[::3, ..., :2] = False
        scale = dim**-0.5

        def sdpa(q=q, k=k, v=v, keep=keep, scale=scale) -> None:
            for _ in range(20):
                F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)

        def ours(q=q, k=k, v=v, keep=keep, scale=scale) -> None:
            for _ in range(20):
                matmul_attention(q, k, v, keep, scale)

        torch.testing.assert_close(matmul_attention(q, k, v, keep, scale),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale))  # fmt: skip
        print(ratio_line(f"one-token attention, L={length} (per call)", paired(sdpa, ours, pairs=pairs),
                         a="SDPA", b="two matmuls", unit=1e3 / 20, suffix="ms"))  # fmt: skip

    def with_matmul() -> Rollouts:
        with one_token_matmul_attention(model):
            return sample(model, tokenizer)

    same = torch.equal(sample(model, tokenizer).response_ids, with_matmul().response_ids)
    print(ratio_line(f"generate {PROMPTS}x{GROUP}, {TOKENS} tokens", paired(lambda: sample(model, tokenizer),
          with_matmul, pairs=pairs), a="SDPA", b="two matmuls") + f"  same tokens: {same}")  # fmt: skip


def fused_logp(model: Any, rollouts: Rollouts) -> torch.Tensor:
    """The one-pass recompute from ``model``'s modules with q/k/v and gate/up each one matmul (weights concatenated
    per call, so the gradient reaches the separate parameters)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, cfg = model.model, model.config
    heads = cfg.num_attention_heads
    dim = cfg.hidden_size // heads
    T = rollouts.response_ids.shape[1]
    ids = torch.cat([rollouts.prompt_ids, rollouts.response_ids], dim=-1)
    mask = attention_mask(rollouts)
    n, L = ids.shape
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, positions_from_mask(mask))
    allowed = torch.ones(L, L, dtype=torch.bool).tril_()[None] & mask[:, None, :]
    additive = torch.zeros(n, 1, L, L).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    for layer in m.layers:
        a, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm(h)
        w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        q, k, v = (t.view(n, L, heads, dim).transpose(1, 2) for t in F.linear(x, w).chunk(3, dim=-1))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = matmul_attention(q, k, v, additive, a.scaling)
        h = h + a.o_proj(o.transpose(1, 2).reshape(n, L, heads * dim))
        gate, up = F.linear(layer.post_attention_layernorm(h), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                            ).chunk(2, dim=-1)  # fmt: skip
        h = h + mlp.down_proj(F.silu(gate) * up)
    logits = model.lm_head(m.norm(h))[:, -(T + 1) : -1]
    logp = logits.log_softmax(-1).gather(-1, rollouts.response_ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(rollouts.response_mask, logp, torch.zeros_like(logp))


def section_learner(model_dir: Path, tokenizer: Any, pairs: int) -> None:
    sdpa, eager = load(model_dir), load(model_dir, "eager")
    rollouts = sample(sdpa, tokenizer)
    print(ratio_line("learner fwd+bwd, shared prompts", paired(lambda: learner_pass(sdpa, rollouts),
          lambda: learner_pass(eager, rollouts), pairs=pairs), a="SDPA", b="eager"))  # fmt: skip

    def deterministic(on: bool) -> list:
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(on, warn_only=True)
        try:
            return learner_pass(sdpa, rollouts)
        finally:
            torch.use_deterministic_algorithms(before, warn_only=True)

    same = all(torch.equal(x, y) for x, y in zip(deterministic(True), deterministic(False), strict=True))
    print(ratio_line("learner fwd+bwd, deterministic algorithms", paired(lambda: deterministic(True),
          lambda: deterministic(False), pairs=pairs), a="on", b="off") + f"  same gradients: {same}")  # fmt: skip
    one_pass = learner_pass(eager, rollouts, share=False)
    fused = learner_pass(eager, rollouts, logp_fn=lambda: fused_logp(eager, rollouts))
    gap = max((x - y).abs().max().item() / x.abs().max().item() for x, y in zip(one_pass, fused, strict=True))
    print(ratio_line("learner fwd+bwd, one pass (eager attention)", paired(
          lambda: learner_pass(eager, rollouts, share=False),
          lambda: learner_pass(eager, rollouts, logp_fn=lambda: fused_logp(eager, rollouts)), pairs=pairs),
          a="transformers", b="fused qkv/gate-up") + f"  max |Δ grad| / max |grad| per tensor {gap:.1e}")  # fmt: skip
    norm = sdpa.model.norm
    x = torch.randn(PROMPTS * GROUP, TOKENS - 1, sdpa.config.hidden_size, requires_grad=True)

    def hf_norm() -> None:
        for _ in range(10):
            norm(x).sum().backward()

    def fused_norm() -> None:
        for _ in range(10):
            F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon).sum().backward()

    print(ratio_line("RMSNorm fwd+bwd on [128, 47, 128] (per call)", paired(hf_norm, fused_norm, pairs=pairs),
                     a="transformers", b="F.rms_norm", unit=1e3 / 10, suffix="ms"))  # fmt: skip


def section_matmul() -> None:
    from cpu_kernels import _matmul_gflops

    tokens = PROMPTS * GROUP * (TOKENS - 1)
    shapes = [(tokens, 128, 128), (tokens, 128, 512), (tokens, 512, 128), (1024, 1024, 1024)]
    cells = ", ".join(f"{s} {_matmul_gflops(*s, torch.float32, 5):.1f}" for s in shapes)
    print(f"fp32 matmul GFLOP/s (M, K, N): {cells}")


def _gap(model: Any, tokenizer: Any, sampler_attn: str, learner_attn: str, share: bool) -> tuple[float, float]:
    """max and mean |log π − log μ| at lag 0 with the given attention in the sampler and in the learner."""
    model.set_attn_implementation(sampler_attn)
    rollouts = sample(model, tokenizer)
    model.set_attn_implementation(learner_attn)
    with torch.no_grad():
        logp = sequence_logprobs(model, rollouts, share_prompts=share).logp
    d = (logp.double() - rollouts.behav_logp.double()).abs()[rollouts.response_mask]
    return d.max().item(), d.mean().item()


def section_mismatch(model_dir: Path, tokenizer: Any) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model, cells = load(model_dir), []
    for sampler_attn in ("sdpa", "eager"):
        for learner_attn in ("sdpa", "eager"):
            for share in (False, True):
                top, mean = _gap(model, tokenizer, sampler_attn, learner_attn, share)
                cells.append(f"sampler {sampler_attn} / learner {learner_attn}{' shared' if share else ''}: "
                             f"max {top:.1e} mean {mean:.1e}")  # fmt: skip
    print("lag-0 |log π − log μ| (float32): " + "; ".join(cells))
    forward = LlamaRMSNorm.forward
    LlamaRMSNorm.forward = lambda self, h: self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True)
                                                                           + self.variance_epsilon))  # fmt: skip
    try:
        top, mean = _gap(load(model_dir).double(), tokenizer, "sdpa", "sdpa", True)
    finally:
        LlamaRMSNorm.forward = forward
    print(f"lag-0 |log π − log μ| (float64, float64 RMSNorm, shared prompts): max {top:.1e} mean {mean:.1e}")


def section_compile(model_dir: Path, tokenizer: Any, pairs: int) -> None:
    model = load(model_dir)
    rollouts = sample(model, tokenizer)
    compiled = torch.compile(model)
    first = cpu_seconds(lambda: learner_pass(compiled, rollouts, share=False))
    print(f"torch.compile: first learner pass (compiling) {first:.1f} s CPU")
    print(ratio_line("learner fwd+bwd, one pass", paired(lambda: learner_pass(model, rollouts, share=False),
          lambda: learner_pass(compiled, rollouts, share=False), pairs=pairs), a="eager", b="compiled"))  # fmt: skip


def malloc_child(model_dir: Path, tuned: bool, repeats: int) -> None:
    """(In a fresh process) median CPU seconds of ``generate`` and of the learner pass, after ``mallopt`` if tuned."""
    if tuned:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 1 << 30)
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
    from transformers import AutoTokenizer

    model, tokenizer = load(model_dir), AutoTokenizer.from_pretrained(model_dir)
    gens, learns = [], []
    out: list[Rollouts] = []
    for _ in range(repeats + 1):
        gens.append(cpu_seconds(lambda: out.append(sample(model, tokenizer))))
        learns.append(cpu_seconds(lambda: learner_pass(model, out[-1])))
    print(f"{statistics.median(gens[1:])} {statistics.median(learns[1:])}")


def section_malloc(model_dir: Path, pairs: int) -> None:
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(pairs):
        for tuned in (False, True) if i % 2 == 0 else (True, False):
            cmd = [sys.executable, __file__, "--malloc-child", str(model_dir), "tuned" if tuned else "plain"]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-2:]
            results[tuned].append((float(line[0]), float(line[1])))
    for k, name in ((0, "generate"), (1, "learner fwd+bwd")):
        pairs_k = [(a[k], b[k]) for a, b in zip(results[False], results[True], strict=True)]
        print(ratio_line(f"{name}, fresh processes", pairs_k, a="default malloc", b="mallopt"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma-separated (default {DEFAULT_SECTIONS}; "
                        "also compile, malloc)")  # fmt: skip
    parser.add_argument("--pairs", type=int, default=4, help="interleaved pairs per comparison")
    parser.add_argument("--malloc-child", nargs=2, metavar=("MODEL_DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.malloc_child:
        malloc_child(Path(args.malloc_child[0]), args.malloc_child[1] == "tuned", repeats=3)
        return 0
    from transformers import AutoTokenizer

    sections = set(args.sections.split(","))
    unknown = sections - set(DEFAULT_SECTIONS.split(",")) - {"compile", "malloc"}
    if unknown:
        parser.error(f"--sections: unknown {', '.join(sorted(unknown))}; allowed: {DEFAULT_SECTIONS},compile,malloc")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = forced_model_dir(Path(tmp) / "forced")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = load(model_dir)
        print(f"1 thread, CPU time; {PROMPTS} prompts x {GROUP}, {TOKENS} forced tokens; {args.pairs} pairs each")
        if "generate" in sections:
            section_generate(model, tokenizer, args.pairs)
        if "ablation" in sections:
            section_ablation(model, args.pairs)
        if "attention" in sections:
            section_attention(model, tokenizer, args.pairs)
        if "learner" in sections:
            section_learner(model_dir, tokenizer, args.pairs)
        if "matmul" in sections:
            section_matmul()
        if "mismatch" in sections:
            section_mismatch(model_dir, tokenizer)
        if "compile" in sections:
            section_compile(model_dir, tokenizer, args.pairs)
        if "malloc" in sections:
            section_malloc(model_dir, args.pairs)
    return 0


if __name__ == "__main__":
    status = main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
    raise SystemExit(status)
