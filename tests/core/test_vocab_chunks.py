"""The chunked output layer + log-probs head against the direct form: values and gradients (hidden states, weight,
bias) to 1e-6 relative in float32 and 1e-12 in float64, under temperature, top-k and top-p (ties included), ragged
chunks, full-vocabulary terms with gradient; and a memory bound that the direct form breaks."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from steadyrl.core.vocab_chunks import chunk_tokens_for, chunked_log_probs, log_softmax
from steadyrl.rollout.distribution import SamplingParams, entropy_from_log_probs, sampling_log_probs

#: Relative error allowed (‖chunked − direct‖ / ‖direct‖) per dtype.
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=0.8, top_k=7, top_p=0.9),
]


def rel(a: Tensor, b: Tensor) -> float:
    """‖a − b‖ / ‖b‖ over the finite entries of b (−inf log-probs of tokens outside a top-k/top-p set: equal)."""
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a)) and torch.equal(a[~finite], b[~finite])
    return float((a[finite] - b[finite]).norm() / b[finite].norm().clamp_min(1e-300))


def problem(dtype: torch.dtype, *, kind: str = "tied", M: int = 37, H: int = 12, V: int = 40, seed: int = 0,
            bias: bool = True):  # type: ignore[no-untyped-def]  # fmt: skip
    """Hidden states ``[M, H]``, an output layer ``[V, H]`` (+ bias) and a generator for the tokens.

    ``kind="gaussian"``: normal entries. ``kind="tied"``: multiples of 1/4 in [−0.75, 0.75] and every weight row
    twice, so every logit is an exact dyadic sum (the same in any summation order, hence in both forms) and tied
    with its twin's: ties at the k-th value of top-k and inside top-p's sorted mass.
    """
    g = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        hidden = torch.randn(M, H, generator=g, dtype=dtype)
        weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.7
        b = torch.randn(V, generator=g, dtype=dtype) * 0.1 if bias else None
        return hidden, weight, b, g
    hidden = torch.randint(-3, 4, (M, H), generator=g).to(dtype) / 4
    half = torch.randint(-3, 4, (V // 2, H), generator=g).to(dtype) / 4
    order = torch.randperm(V, generator=g)
    weight = torch.cat([half, half])[order]
    b = torch.cat([torch.randint(-2, 3, (V // 2,), generator=g).to(dtype) / 8] * 2)[order] if bias else None
    return hidden, weight, b, g


def draw_tokens(logits_lp: Tensor, g: torch.Generator, outside: int = 3) -> Tensor:
    """One token per row from the distribution; the first ``outside`` rows get a token outside the kept set if any."""
    probs = logits_lp.detach().exp()
    tokens = torch.multinomial(probs.float(), 1, generator=g).squeeze(-1)
    for i in range(min(outside, tokens.shape[0])):
        dropped = (~torch.isfinite(logits_lp[i])).nonzero().flatten()
        if dropped.numel():
            tokens[i] = dropped[0]
    return tokens


def direct(hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, fn: Callable[[Tensor], Tensor],
           terms: dict[str, Callable[[Tensor, Tensor], Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The direct form: the full [M, V] logits, ``fn``, the gather and each term on all tokens at once."""
    lp = fn(torch.nn.functional.linear(hidden, weight, bias))
    index = torch.arange(hidden.shape[0])
    return lp.gather(-1, tokens[:, None]).squeeze(-1), {k: t(lp, index) for k, t in terms.items()}


def entropy(lp: Tensor, index: Tensor) -> Tensor:
    return entropy_from_log_probs(lp)


def loss_of(logp: Tensor, terms: dict[str, Tensor], coef: Tensor) -> Tensor:
    """A loss reading every output with its own per-token weights (a token outside the kept set, logp = −inf, is
    left out)."""
    total = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)).mul(coef[0]).sum()
    for k, v in enumerate(terms.values()):
        total = total + (v * coef[k + 1]).sum()
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("chunk", [1, 7, 37, 100])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["gaussian", "tied"])
def test_chunked_equals_direct_values_and_gradients(
    dtype: torch.dtype, params: SamplingParams, chunk: int, bias: bool, kind: str
) -> None:
    """log π(y_t), the entropy (a term with gradient) and ∂/∂(hidden, W, b) of a loss over both: the chunked head
    (7 → 5 chunks of 7 and a ragged one of 2; 1 → 37 chunks; ≥ M → one) equals the direct form, on generic logits
    and on exactly tied ones."""
    hidden, weight, b, g = problem(dtype, kind=kind, bias=bias)
    fn = functools.partial(sampling_log_probs, params=params)
    tokens = draw_tokens(fn(torch.nn.functional.linear(hidden, weight, b)), g)
    coef = torch.randn(2, hidden.shape[0], generator=g, dtype=dtype)
    inputs = [hidden, weight] + ([b] if b is not None else [])
    results = []
    for chunked in (False, True):
        leaves = [x.clone().requires_grad_() for x in inputs]
        h, w, bb = leaves[0], leaves[1], (leaves[2] if b is not None else None)
        if chunked:
            out = chunked_log_probs(hidden=h, weight=w, bias=bb, tokens=tokens, chunk_tokens=chunk, log_probs=fn,
                                    terms={"entropy": entropy})  # fmt: skip
            logp, terms = out.logp, out.terms
        else:
            logp, terms = direct(h, w, bb, tokens, fn, {"entropy": entropy})
        grads = torch.autograd.grad(loss_of(logp, terms, coef), leaves)
        results.append((logp.detach(), terms["entropy"].detach(), grads))
    (logp0, ent0, grads0), (logp1, ent1, grads1) = results
    assert logp1.dtype == dtype and torch.isfinite(logp1).sum() >= hidden.shape[0] - 3
    assert rel(logp1, logp0) <= TOL[dtype]
    assert rel(ent1, ent0) <= TOL[dtype]
    for got, want in zip(grads1, grads0, strict=True):
        assert want.abs().sum() > 0
        assert rel(got, want) <= TOL[dtype]


def test_ties_are_kept_alike() -> None:
    """With tied logits at the k-th value, top-k keeps every tied token in both forms (the chunked head calls the same
    distribution); checked on the kept-set sizes, which exceed k."""
    hidden, weight, b, _ = problem(torch.float64)
    fn = functools.partial(sampling_log_probs, params=SamplingParams(top_k=5))
    lp = fn(torch.nn.functional.linear(hidden, weight, b))
    kept = torch.isfinite(lp).sum(-1)
    assert (kept >= 6).all()  # the 5th largest is tied with its twin: 6 kept
    count = {"kept": lambda x, i: torch.isfinite(x).sum(-1).double()}
    out = chunked_log_probs(hidden=hidden, weight=weight, bias=b, tokens=torch.zeros(37, dtype=torch.long),
                            chunk_tokens=4, log_probs=fn, terms=count)  # fmt: skip
    assert torch.equal(out.terms["kept"], kept.double())


def test_terms_receive_token_indices_and_carry_gradient() -> None:
    """A score-centering term Σ_v c_{t,v} log π_v with per-token constants c looked up by the token indices the head
    passes (here a custom ``token_index``), alone in the loss (``logp``'s gradient unused): same value and gradient
    as the direct form."""
    dtype = torch.float64
    hidden, weight, b, g = problem(dtype, M=23)
    positions = torch.arange(23) * 3 + 1  # e.g. flat positions in a [N, T] grid
    c = torch.randn(100, 40, generator=g, dtype=dtype)
    seen: list[Tensor] = []

    def centered(lp: Tensor, index: Tensor) -> Tensor:
        seen.append(index)
        return (c[index] * lp).sum(-1)  # Σ_v c_{t,v} log π_v

    h1, w1, b1 = (x.clone().requires_grad_() for x in (hidden, weight, b))
    out = chunked_log_probs(hidden=h1, weight=w1, bias=b1, tokens=torch.zeros(23, dtype=torch.long), chunk_tokens=5,
                            terms={"centered": centered}, token_index=positions)  # fmt: skip
    assert torch.equal(torch.cat(seen), positions)  # forward: chunk by chunk, in order
    out.terms["centered"].sum().backward()
    h0, w0, b0 = (x.clone().requires_grad_() for x in (hidden, weight, b))
    lp0 = log_softmax(torch.nn.functional.linear(h0, w0, b0))
    ref = (c[positions] * lp0).sum(-1)
    ref.sum().backward()
    assert rel(out.terms["centered"].detach(), ref.detach()) <= 1e-12
    for got, want in ((h1.grad, h0.grad), (w1.grad, w0.grad), (b1.grad, b0.grad)):
        assert got is not None and want is not None and rel(got, want) <= 1e-12
    assert len(seen) == 2 * 5  # the backward recomputed the term once per chunk (5 chunks: 5, 5, 5, 5, 3)


def test_unused_term_is_not_recomputed_and_no_grad_builds_no_graph() -> None:
    calls = []

    def counted(lp: Tensor, index: Tensor) -> Tensor:
        calls.append(index.shape[0])
        return entropy_from_log_probs(lp)

    hidden, weight, b, _ = problem(torch.float32)
    h = hidden.clone().requires_grad_()
    out = chunked_log_probs(hidden=h, weight=weight, bias=b, tokens=torch.zeros(37, dtype=torch.long),
                            chunk_tokens=10, terms={"h": counted})  # fmt: skip
    out.logp.sum().backward()  # the term is only logged
    assert calls == [10, 10, 10, 7]  # forward only
    with torch.no_grad():
        out = chunked_log_probs(hidden=h, weight=weight, tokens=torch.zeros(37, dtype=torch.long), chunk_tokens=10)
    assert not out.logp.requires_grad


def test_low_precision_inputs_compute_in_float32_under_autocast() -> None:
    """bf16 hidden states and weight: logits in float32 with autocast off (as the float32 output layer), gradients
    back in bf16."""
    hidden, weight, _, _ = problem(torch.float32)
    h, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_log_probs(hidden=h, weight=w, tokens=torch.zeros(37, dtype=torch.long), chunk_tokens=8)
    ref = torch.log_softmax(h.float() @ w.float().T, -1)[:, 0]
    assert out.logp.dtype == torch.float32
    torch.testing.assert_close(out.logp, ref, rtol=1e-6, atol=1e-6)
    out.logp.sum().backward()
    assert h.grad is not None and h.grad.dtype == torch.bfloat16
    assert w.grad is not None and w.grad.dtype == torch.bfloat16


def test_chunk_tokens_for_and_argument_checks() -> None:
    assert chunk_tokens_for(vocab_size=49_152) == 1365
    assert chunk_tokens_for(vocab_size=151_936) == 441
    assert chunk_tokens_for(vocab_size=10, chunk_elements=5) == 1
    with pytest.raises(ValueError, match="chunk_elements"):
        chunk_tokens_for(vocab_size=10, chunk_elements=0)
    hidden, weight, _, _ = problem(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_log_probs(hidden=hidden, weight=weight, tokens=torch.zeros(37, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="returned shape"):
        chunked_log_probs(hidden=hidden, weight=weight, tokens=torch.zeros(37, dtype=torch.long), chunk_tokens=4,
                          terms={"bad": lambda lp, i: lp.sum()})  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Memory: what the head creates and saves


class LargestTensors(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns whose shape contains ``V`` (forward and
    backward: the CPU backward runs on this thread, inside the mode)."""

    def __init__(self, V: int) -> None:
        super().__init__()
        self.V, self.largest = V, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and self.V in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


def _head_step(chunked: bool, *, M: int, H: int, V: int, chunk: int) -> tuple[int, int]:
    """(largest tensor created, largest tensor saved for the backward) with V in its shape, over forward + backward."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(M, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (M,), generator=g)
    saved: list[int] = []

    def pack(t: Tensor) -> Tensor:
        if V in t.shape:
            saved.append(t.numel())
        return t

    fn = functools.partial(sampling_log_probs, params=SamplingParams(temperature=0.9, top_k=20, top_p=0.95))
    with LargestTensors(V) as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if chunked:
                out = chunked_log_probs(hidden=h, weight=w, tokens=tokens, chunk_tokens=chunk, log_probs=fn,
                                        terms={"entropy": entropy})  # fmt: skip
                logp, ent = out.logp, out.terms["entropy"]
            else:
                logp, terms = direct(h, w, None, tokens, fn, {"entropy": entropy})
                ent = terms["entropy"]
        loss = torch.where(torch.isfinite(logp), logp, 0.0).sum() + ent.sum()
        loss.backward()
    return mode.largest, max(saved)


def test_no_tensor_larger_than_one_chunk_forward_or_backward() -> None:
    """M = 96 tokens, chunks of 8, V = 64, H = 16: no op of the chunked head (forward, backward recompute, gradient
    accumulation) returns a tensor with a V-sized axis above max(chunk, H)·V elements, and the only V-sized saved
    tensor is the weight [V, H]; the direct form creates and saves [M, V] (so this check can fail)."""
    M, H, V, chunk = 96, 16, 64, 8
    created, saved = _head_step(True, M=M, H=H, V=V, chunk=chunk)
    assert created <= max(chunk, H) * V
    assert saved == V * H  # the weight itself; no [·, V] activation
    created_direct, saved_direct = _head_step(False, M=M, H=H, V=V, chunk=chunk)
    assert created_direct >= M * V and saved_direct >= M * V
