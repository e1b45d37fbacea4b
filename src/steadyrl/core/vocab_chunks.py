"""The output layer and log-probs in chunks of tokens: never the full ``[M, V]`` logits, forward or backward.

Every log-prob of this library ends the same way: an output layer ``z_t = h_t Wᵀ + b`` over a vocabulary of V tokens,
then a map ``f`` from logits to log-probs (the sampling distribution of :mod:`steadyrl.rollout.distribution`:
temperature, top-k, top-p, renormalized). Done for M tokens at once it materializes ``[M, V]`` logits, their
log-probs and, in the backward, their gradient, each ``M·V`` floats: at V = 152k and M = 16k about 10 GB apiece.
:func:`chunked_log_probs` computes the same function

    logp_t = f(h_t Wᵀ + b)[y_t],      term_{k,t} = g_k(f(h_t Wᵀ + b), t)     (t = 1 … M)

``chunk_tokens`` tokens at a time, as one ``torch.autograd.Function``:

- forward (no graph): per chunk, the logits ``[m, V]``, ``f``, the gathered ``logp`` and every term; only the
  ``[m]`` results are kept. Saved for the backward: ``h`` ``[M, H]``, ``W``, ``b``, the tokens; no ``[·, V]`` tensor.
- backward: per chunk, the logits are recomputed, ``f`` and the terms are re-run under grad, one
  ``torch.autograd.grad`` gives ∂L/∂z ``[m, V]`` for that chunk, and the linear layer's gradient follows by hand:
  ∂L/∂h = (∂L/∂z) W (that chunk's rows), ∂L/∂W += (∂L/∂z)ᵀ h, ∂L/∂b += Σ_t ∂L/∂z_t, accumulated in one
  ``[V, H]`` buffer in the compute dtype (the weight's own dtype when that is float32: then the buffer is the
  returned gradient).

So no step holds more than one chunk's ``[m, V]`` tensors (the logits, ``f``'s intermediates and their gradient),
plus ``W``, its gradient buffer and ``[M, H]``. Cost: one more product ``h Wᵀ`` per token than the direct form
(the recompute), 8·M·H·V FLOPs in all against 6·M·H·V.

Why a custom ``autograd.Function`` rather than ``torch.utils.checkpoint`` per chunk: the weight's gradient is
accumulated in place in one buffer (per-chunk checkpoints give each chunk its own ``[V, H]`` gradient for autograd to
sum), a weight in another dtype is upcast once per pass instead of once per chunk, the order in which chunks are
recomputed does not depend on the autograd engine's scheduling, and outputs whose gradient is unused (an entropy
that is only logged) are never recomputed in the backward.

Precision: the logits are computed in float32, or float64 when ``hidden`` is float64 (``torch.promote_types(hidden,
float32)``), with autocast off: the float32 output layer of :mod:`steadyrl.base.device`. ``W`` and ``b`` are cast to
that dtype once per pass, which is no copy when they already have it. ``logp`` and the terms come back in the compute
dtype.

Terms (full-vocabulary quantities with gradient): ``terms`` maps a name to a callable
``g(log_probs [m, V], index [m]) -> [m]``: it receives a chunk's log-probs (from ``f``, with grad in the backward) and
the chunk's token indices (``token_index[start:end]``, by default the positions 0 … M−1 in ``hidden``), and returns
one value per token. Examples: the entropy −Σ_v π_v log π_v (an entropy bonus), Σ_v π_v² (OTB), Σ_v c_v log π_v
(score centering). Its gradient flows to ``hidden``, ``W`` and ``b`` through the log-probs. A term must be computed
token by token (rows of the chunk independently: chunks split the tokens arbitrarily) and deterministically (it runs
twice: forward and backward recompute); tensors it closes over are constants (no gradient reaches them).

Limits: first-order gradients only (no double backward: ``once_differentiable``); not traceable by ``torch.func``
transforms (``vmap``, ``grad``): the caller uses the direct form there.

Shapes: ``hidden`` ``[M, H]``, ``weight`` ``[V, H]``, ``bias`` ``[V]`` or None, ``tokens`` ``[M]`` int64 → ``logp``
``[M]`` and each term ``[M]``.
Confidence: [exact] (the same function as the direct form; tests compare values and gradients to 1e-6 in float32
and 1e-12 in float64).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

#: Default element budget of one chunk: at most this many logits (``chunk_tokens · V``) at a time, 2^26 = 64M
#: (256 MiB in float32). V = 49,152 → 1,365 tokens per chunk; V = 151,936 → 441.
DEFAULT_CHUNK_ELEMENTS: int = 2**26

#: A full-vocabulary term: (log-probs ``[m, V]``, token indices ``[m]``) → one value per token ``[m]``.
VocabTerm = Callable[[Tensor, Tensor], Tensor]
#: Logits → log-probs over the last axis (the sampling distribution); differentiable.
LogProbsFn = Callable[[Tensor], Tensor]


def log_softmax(logits: Float[Tensor, "m V"]) -> Float[Tensor, "m V"]:
    """The plain policy's log-probs: ``log_softmax`` over the vocabulary (the default ``log_probs`` map)."""
    return torch.log_softmax(logits, dim=-1)


def chunk_tokens_for(*, vocab_size: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Tokens per chunk for an element budget: ``max(1, chunk_elements // vocab_size)``."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    return max(1, chunk_elements // max(vocab_size, 1))


def compute_dtype(hidden_dtype: torch.dtype) -> torch.dtype:
    """dtype of the logits: float32, or float64 for float64 hidden states (never lower than float32)."""
    return torch.promote_types(hidden_dtype, torch.float32)


class ChunkedLogProbs(NamedTuple):
    """``logp`` ``[M]`` = log π(y_t) and ``terms``: each named term ``[M]`` (with gradient when the inputs have it)."""

    logp: Float[Tensor, " M"]
    terms: dict[str, Float[Tensor, " M"]]


def chunked_log_probs(
    *,
    hidden: Float[Tensor, "M H"],
    weight: Float[Tensor, "V H"],
    bias: Float[Tensor, " V"] | None = None,
    tokens: Int[Tensor, " M"],
    chunk_tokens: int,
    log_probs: LogProbsFn = log_softmax,
    terms: Mapping[str, VocabTerm] | None = None,
    token_index: Int[Tensor, " M"] | None = None,
) -> ChunkedLogProbs:
    """log π(y_t) = ``log_probs``(h_t Wᵀ + b)[y_t] and the ``terms`` at every token, ``chunk_tokens`` tokens at a time.

    Args:
        hidden: the output layer's input for each scored token ``[M, H]`` (any float dtype; upcast per chunk).
        weight, bias: the output layer's ``[V, H]`` weight and ``[V]`` bias (None: no bias).
        tokens: the token y_t whose log-prob is returned ``[M]``.
        chunk_tokens: tokens per chunk (:func:`chunk_tokens_for` turns an element budget into it).
        log_probs: logits ``[m, V]`` → log-probs ``[m, V]`` (default: ``log_softmax``; the sampling distribution:
            ``functools.partial(sampling_log_probs, params=...)``). Must act row by row.
        terms: named full-vocabulary terms (module docstring), returned in ``terms`` under the same names.
        token_index: what a term receives as the tokens' indices ``[M]`` (default: 0 … M−1).

    Returns:
        :class:`ChunkedLogProbs`, float32 (float64 for float64 ``hidden``). Gradients flow to ``hidden``, ``weight``
        and ``bias`` from ``logp`` and every term (module docstring: one chunk at a time in the backward).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    M, H = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected [V, {H}]")
    if tuple(tokens.shape) != (M,):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}, expected {(M,)}")
    if token_index is None:
        token_index = torch.arange(M, device=hidden.device)
    named = tuple((terms or {}).items())
    spec = _Spec(log_probs=log_probs, terms=tuple(fn for _, fn in named), chunk=chunk_tokens)
    outs = _ChunkedHead.apply(hidden, weight, bias, tokens, token_index, spec)
    return ChunkedLogProbs(outs[0], {name: out for (name, _), out in zip(named, outs[1:], strict=True)})


@dataclass(frozen=True)
class _Spec:
    """The non-tensor arguments of :class:`_ChunkedHead`."""

    log_probs: LogProbsFn
    terms: tuple[VocabTerm, ...]
    chunk: int


def _linear(h: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """z = h Wᵀ + b in ``dtype`` with autocast off (``weight``/``bias`` already in ``dtype``)."""
    with torch.autocast(device_type=h.device.type, enabled=False):
        return F.linear(h.to(dtype), weight, bias)


def _per_token(name: str, value: Tensor, m: int) -> Tensor:
    if tuple(value.shape) != (m,):
        raise ValueError(f"vocabulary term {name} returned shape {tuple(value.shape)}, expected {(m,)}")
    return value


class _ChunkedHead(torch.autograd.Function):
    """(hidden, W, b, tokens, index) → (logp, *terms), one chunk of tokens at a time (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, index: Tensor,
        spec: _Spec,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        dtype = compute_dtype(hidden.dtype)
        w = weight.to(dtype)  # no copy when the weight already has the compute dtype
        b = None if bias is None else bias.to(dtype)
        M = hidden.shape[0]
        outs: list[list[Tensor]] = [[] for _ in range(1 + len(spec.terms))]
        for start in range(0, M, spec.chunk):
            end = min(start + spec.chunk, M)
            lp = spec.log_probs(_linear(hidden[start:end], w, b, dtype))  # [m, V]
            outs[0].append(lp.gather(-1, tokens[start:end, None]).squeeze(-1))
            for k, term in enumerate(spec.terms):
                outs[k + 1].append(_per_token(f"#{k}", term(lp, index[start:end]), end - start))
            del lp
        ctx.save_for_backward(hidden, weight, bias, tokens, index)
        ctx.spec = spec  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: its term is not recomputed
        return tuple(torch.cat(o) if o else hidden.new_zeros(0, dtype=dtype) for o in outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, bias, tokens, index = ctx.saved_tensors  # type: ignore[attr-defined]
        spec: _Spec = ctx.spec  # type: ignore[attr-defined]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        dtype = compute_dtype(hidden.dtype)
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b and bias is not None else None
        g_logp, g_terms = grads[0], grads[1:]
        used = [(k, g) for k, g in enumerate(g_terms) if g is not None]
        if g_logp is None and not used:
            return None, None, None, None, None, None
        for start in range(0, hidden.shape[0], spec.chunk):
            end = min(start + spec.chunk, hidden.shape[0])
            h = hidden[start:end].to(dtype)
            z = _linear(h, w, b, dtype).detach()  # the chunk's logits [m, V], recomputed (no graph to h, W, b)
            with torch.enable_grad():
                z.requires_grad_()  # a leaf: the one tensor differentiated below
                lp = spec.log_probs(z)
                outputs, cotangents = [], []
                if g_logp is not None:
                    outputs.append(lp.gather(-1, tokens[start:end, None]).squeeze(-1))
                    cotangents.append(g_logp[start:end])
                for k, g in used:
                    outputs.append(_per_token(f"#{k}", spec.terms[k](lp, index[start:end]), end - start))
                    cotangents.append(g[start:end])
                (g_z,) = torch.autograd.grad(outputs, z, cotangents, allow_unused=True)  # ∂L/∂z [m, V]
            del lp, outputs
            if g_z is None:
                continue
            if grad_h is not None:
                grad_h[start:end] = (g_z @ w).to(hidden.dtype)  # ∂L/∂h = ∂L/∂z W
            if grad_w is not None:
                grad_w.addmm_(g_z.transpose(0, 1), h)  # ∂L/∂W += ∂L/∂zᵀ h
            if grad_b is not None:
                grad_b += g_z.sum(dim=0)  # ∂L/∂b += Σ_t ∂L/∂z_t
            del g_z, z
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None,
        )  # fmt: skip
