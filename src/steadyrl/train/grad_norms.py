"""Per-trajectory squared gradient norms of the learner's token batches (VCPO's OPOB in ``steadyrl train``).

The computation itself is :mod:`steadyrl.core.grad_norms` (any model, any log-prob function); here ``logp_fn`` is the
learner's own recompute, :func:`steadyrl.rollout.logprobs.sequence_logprobs` (the same forward, positions and
``logits_to_keep``), so the norms measure the gradient the learner takes, and ``mask`` defaults to the batch's
``response_mask`` (tool-output tokens, ``tool_mask``, are attended as in the learner's forward but never in ℓ_i).
Three methods:

- ``"ghost"`` (default): :class:`GhostPass`, one forward and one backward over the batch (the core's method);
  ``share_prompts=True`` runs that forward with each distinct prompt once and splits the backward where the prompt
  joins the rows, so the norms stay exact (:class:`GhostPass`). Where the chunked head applies (and the scoring is
  plain temperature) the output layer runs in vocabulary chunks and its part of each norm is formed from its inputs
  (the core's ``_Head``), so the pass holds no ``[N, T, V]`` logits.
- ``"vmap"``: ``torch.func`` — ``vmap`` over trajectories of ``grad`` of a ``functional_call`` of the whole learner
  forward, ``chunk_size`` trajectories at a time (each chunk holds its per-sample gradients). Hugging Face's mask
  builder branches on the mask's values, which ``vmap`` cannot trace, so during the call the model runs on an
  attention implementation registered here (``steadyrl_vmap_sdpa``: SDPA with a materialized mask; a new key in
  transformers' global registries, nothing existing is changed); the previous one is restored afterwards.
  Activation checkpointing refuses it.
- ``"naive"``: the reference: for each trajectory alone (its padding trimmed), one forward and one backward.

w_i is a detached constant, so every method computes ‖∇ Σ_t m log π‖² and multiplies by w_i² afterwards (exact; it
also keeps w_i out of ``sequence_logprobs``' log-softmax, which runs in float32 even for a float64 model).

Shapes: ``batch`` as in :mod:`steadyrl.rollout.rollouts` (prompt ``[N, P]`` left-padded, response ``[N, T]``
right-padded); ``mask`` ``[N, T]``, ``weights`` ``[N]`` → ``[N]`` (float32, or float64 for a float64 model), detached.
Confidence: [exact] (an identity of the gradient; the three methods agree to ~1e-15 relative in float64).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, get_args

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from steadyrl.core import grad_norms as core
from steadyrl.core.grad_norms import GHOST_STRATEGIES, GhostStrategy, masked_row_sums
from steadyrl.core.groups import rank_in_group
from steadyrl.rollout.distribution import TOP_K_OFF, TOP_P_OFF
from steadyrl.rollout.logprobs import (
    HeadCall,
    SharedPrefill,
    observe_head,
    observe_shared_prefill,
    sequence_logprobs,
    splits_output_layer,
)
from steadyrl.rollout.rollouts import TokenBatch, TokenBatchLike, context_mask, trim_padding

GradNormMethod = Literal["ghost", "vmap", "naive"]
GRAD_NORM_METHODS: tuple[str, ...] = get_args(GradNormMethod)

#: Trajectories per ``vmap`` chunk of ``method="vmap"`` (memory: this many copies of the per-sample gradients).
DEFAULT_VMAP_CHUNK_SIZE: int = 16
#: Name under which the vmap-traceable attention (SDPA, mask always materialized) is registered in transformers.
VMAP_ATTENTION: str = "steadyrl_vmap_sdpa"


def per_trajectory_grad_sq_norms(
    model: nn.Module,
    batch: TokenBatchLike,
    *,
    method: GradNormMethod | str = "ghost",
    weights: Float[Tensor, " N"] | None = None,
    mask: Bool[Tensor, "N T"] | None = None,
    temperature: float = 1.0,
    top_k: int = TOP_K_OFF,
    top_p: float = TOP_P_OFF,
    ghost_strategy: GhostStrategy | str = "auto",
    vmap_chunk_size: int = DEFAULT_VMAP_CHUNK_SIZE,
    share_prompts: bool = False,
) -> Float[Tensor, " N"]:
    """n_i = ‖∇_θ w_i Σ_t m_{i,t} log π_θ(y_{i,t})‖² for every trajectory of a token batch (VCPO, OPOB's ‖∇‖²).

    ===================  ======  =====================================================================================
    argument             shape   meaning
    ===================  ======  =====================================================================================
    ``model``                    causal LM accepted by :func:`~steadyrl.rollout.logprobs.sequence_logprobs`
    ``batch``                    :class:`~steadyrl.rollout.rollouts.Rollouts` / ``TokenBatch`` (prompt ``[N, P]``
                                 left-padded, response ``[N, T]`` right-padded)
    ``method``                   ``ghost`` (one batched forward + backward) | ``vmap`` (torch.func) | ``naive``
                                 (one backward per trajectory, the reference)
    ``weights``          [N]     w_i, a detached per-trajectory factor on ℓ_i, so n_i = w_i² ‖∇ Σ_t m log π‖²
                                 (applied after the norm); None: 1. The authors' code variant measures
                                 ‖∇(w̄_i Σ_t log π)‖ with w̄_i the sequence-TIS weight: pass w̄.
    ``mask``             [N, T]  m: tokens summed into ℓ_i (default ``batch.response_mask``; must lie inside it)
    ``temperature``,             distribution scored, as in ``sequence_logprobs`` (default: the plain policy)
    ``top_k``, ``top_p``
    ``ghost_strategy``           ``auto`` (cheaper of Gram / materialized per parameter) | ``gram`` | ``materialize``
    ``vmap_chunk_size``          trajectories per ``vmap`` chunk (``method="vmap"`` only)
    ``share_prompts``            ``method="ghost"`` only: forward each distinct prompt once (:class:`GhostPass`);
                                 the same norms up to float rounding
    ===================  ======  =====================================================================================

    Returns ``[N]`` detached, float32 (float64 for a float64 model), summed over all trainable parameters; rows
    with no masked-in token give 0. ``.grad`` of the parameters is neither read nor changed.
    """
    if method not in GRAD_NORM_METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(GRAD_NORM_METHODS)}")
    if ghost_strategy not in GHOST_STRATEGIES:
        raise ValueError(f"ghost_strategy={ghost_strategy!r} is not one of {', '.join(GHOST_STRATEGIES)}")
    if vmap_chunk_size < 1:
        raise ValueError(f"vmap_chunk_size={vmap_chunk_size} must be >= 1")
    N, T = batch.response_ids.shape
    if mask is None:
        mask = batch.response_mask
    if tuple(mask.shape) != (N, T):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(N, T)}")
    if weights is not None and tuple(weights.shape) != (N,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected {(N,)}")
    m = mask.bool() & batch.response_mask.bool()
    score = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    dtype = core._result_dtype(model)
    if N == 0 or not core._trainable(model):
        return torch.zeros(N, dtype=dtype, device=batch.response_ids.device)
    if method == "ghost" and share_prompts:
        with torch.enable_grad(), GhostPass(model, batch, mask=m, strategy=ghost_strategy, share_prompts=True,
                                            **score) as ghost:  # fmt: skip
            out = ghost.sq_norms().to(dtype)
        return (out if weights is None else out * weights.detach().to(dtype).square()).detach()
    if method == "ghost":
        return core.per_trajectory_grad_sq_norms(
            model, _logp_fn(batch, score), m, weights=weights, ghost_strategy=ghost_strategy
        )
    with torch.enable_grad():
        if method == "naive":
            out = _naive(model, batch, m, score, dtype)
        else:
            out = _vmapped(model, batch, m, score, dtype, vmap_chunk_size)
    if weights is not None:
        out = out * weights.detach().to(dtype).square()  # ‖∇(w_i Σ_t m log π)‖² = w_i² ‖∇ Σ_t m log π‖² (w_i constant)
    return out.detach()


class GhostPass(core.GhostPass):
    """:class:`steadyrl.core.grad_norms.GhostPass` on the learner's forward (``sequence_logprobs`` of ``batch``).

    ``mask`` ``[N, T]`` (default ``batch.response_mask``; intersected with it) and the scoring arguments as in
    :func:`per_trajectory_grad_sq_norms`. ``.logp`` is ``sequence_logprobs(model, batch, ...).logp`` with its graph.

    ``share_prompts=True``: the forward is the learner's shared-prompt recompute (each distinct prompt forwarded
    once, its G responses against its KV cache; ``sequence_logprobs(share_prompts=True)``), and the norms stay
    exact. Row i's gradient ∇θ ℓ_i includes the prompt's part, Σ_s g_{i,s} a_{u,s}ᵀ over the prompt positions s of
    each Linear, with the prompt's inputs a_{u,s} shared by the group but output gradients g_{i,s} = ∂ℓ_i/∂out_s that
    differ per row (what the row's response does with the prompt's keys and values). One backward of Σ_i ℓ_i gives
    only Σ_{i∈u} g_{i,s}, which is not enough for ‖∇θ ℓ_i‖² (the norm is quadratic in g_i). So the backward is split
    where the prompt joins the rows (:class:`~steadyrl.rollout.logprobs.SharedPrefill`):

    1. one backward to the responses' module outputs and to the rows' copies of the prompt's keys, values and last
       output (row i of each is row i's own cotangent, the copies being indexed per row);
    2. for k = 0 … G_max − 1, one backward through the prompt forward (U rows) of the cotangents of the k-th row of
       every group, to the prompt's module outputs: each row's g_{i,s}, at the cost of backpropagating N prompt rows
       (as the unshared pass), while the forward ran U.

    The per-row norms then use the shared inputs once per group (Gram matrices a_u·a_u per prompt, not per row;
    :meth:`accumulate_grad` sums Σ_{i∈u} c_i g_{i,s} before its one matmul with a_{u,s}). Without rows sharing a
    prompt, or where the shared forward does not run (activation checkpointing in training mode), the forward is
    the one-pass one and nothing changes.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: TokenBatchLike,
        *,
        mask: Tensor | None = None,
        temperature: float = 1.0,
        top_k: int = TOP_K_OFF,
        top_p: float = TOP_P_OFF,
        strategy: GhostStrategy | str = "auto",
        share_prompts: bool = False,
    ) -> None:
        m = batch.response_mask.bool() if mask is None else mask.bool() & batch.response_mask.bool()
        score = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self._prefill: SharedPrefill | None = None
        self._prompt_calls = 0  # the first calls recorded, before the prefill was reported: the prompt forward's
        self._head: HeadCall | None = None
        logp_fn = _shared_logp_fn(batch, score, self._observe) if share_prompts else _logp_fn(batch, score)
        # The output layer in vocabulary chunks (plain temperature scoring, a model the chunked head fits): its part
        # of each norm comes from _Head, not from recording its [N, T, V] output.
        plain = top_k == TOP_K_OFF and top_p == TOP_P_OFF
        head = chunkable_head(model, batch.response_ids.device) if plain else None
        if head is not None:
            logp_fn = _observing_head(logp_fn, self._observe_head)
        super().__init__(model, logp_fn, m, strategy=strategy, skip=() if head is None else (head,))
        if head is not None and self._head is None and self.logp.requires_grad:
            raise RuntimeError("GhostPass: the forward did not run the chunked output layer it was set up for")
        self.batch = batch

    def _observe(self, prefill: SharedPrefill) -> None:
        if self._prefill is not None:
            raise RuntimeError("GhostPass: the forward reported two shared-prompt prefills; expected one")
        self._prefill, self._prompt_calls = prefill, len(self._recorded)

    def _observe_head(self, call: HeadCall) -> None:
        if self._head is not None:
            raise RuntimeError("GhostPass: the forward applied the output layer twice; expected once")
        self._head = call

    def _extra_contributions(self) -> list[tuple[nn.Parameter, core._Contribution]]:
        """The output layer's weight (and bias) as :class:`~steadyrl.core.grad_norms._Head` contributions."""
        call = self._head
        if call is None:
            return []
        head = call.head
        dtype = torch.promote_types(torch.promote_types(call.hidden.dtype, head.weight.dtype), torch.float32)
        h, weight = call.hidden.detach().to(dtype), head.weight.detach()
        bias = None if head.bias is None else head.bias.detach()
        # log Σ_v exp(z_v/τ) from the forward itself: log p(y) = z_y/τ − lse, so lse = z_y/τ − log p(y) (one [N, T]
        # product with the rows W[y], not another pass over the vocabulary); +inf off the scored tokens (p = 0 there).
        z_y = (h * weight[call.tokens].to(dtype)).sum(dim=-1)
        if bias is not None:
            z_y = z_y + bias[call.tokens].to(dtype)
        lse = torch.where(call.mask.bool(), z_y / call.params.temperature - self.logp.detach().to(dtype), torch.inf)
        parts = dict(h=h, y=call.tokens, m=self.mask & call.mask.bool(), weight=weight, bias=bias,
                     tau=call.params.temperature, lse=lse)  # fmt: skip
        out: list[tuple[nn.Parameter, core._Contribution]] = []
        if head.weight.requires_grad:
            out.append((head.weight, core._Head(**parts)))
        if head.bias is not None and head.bias.requires_grad:
            out.append((head.bias, core._Head(**parts, of_bias=True)))
        return out

    def close(self) -> None:
        super().close()
        self._prefill = None
        self._head = None

    def _output_grads(self, loss: Tensor) -> list[tuple[core._Call, Tensor | None, Tensor | None]]:
        """Steps 1–2 of the class docstring: per-row output gradients of the responses' calls (row map None) and of
        the prompt's calls (``group`` = each row's prompt)."""
        view = self._prefill
        if view is None:
            return super()._output_grads(loss)
        prompt_ids = {id(c) for c in self._recorded[: self._prompt_calls]}
        prompt = [c for c in self._calls if id(c) in prompt_ids]
        rows = [c for c in self._calls if id(c) not in prompt_ids]
        grads = torch.autograd.grad(loss, [c.output for c in rows] + view.after, allow_unused=True, retain_graph=True)
        out = [(c, g, None) for c, g in zip(rows, grads[: len(rows)], strict=True)]
        joined = [(b, d) for b, d in zip(view.before, grads[len(rows) :], strict=True) if d is not None]
        if not prompt or not joined:
            return out
        inverse = view.inverse
        slots = _group_slots(inverse, view.before[0].shape[0])
        N = inverse.numel()
        dest = torch.where(slots >= 0, slots, N)  # [G_max, U]: the row each backward's row u lands in (N: nowhere)
        per_rank = []
        for k in range(slots.shape[0]):  # the k-th row of every group at once (U rows: one prompt backward)
            cot = [_take(d, slots[k]) for _, d in joined]
            per_rank.append(torch.autograd.grad([b for b, _ in joined], [c.output for c in prompt], grad_outputs=cot,
                                                allow_unused=True, retain_graph=True))  # fmt: skip
        for j, call in enumerate(prompt):
            parts = [r[j] for r in per_rank]
            if all(p is None for p in parts):
                out.append((call, None, inverse))
                continue
            # Row i: its rank's backward at its prompt, copied once into row order (one spare row takes the empty
            # slots), so the per-row gradients are never held twice.
            rows_of = call.output.new_empty((N + 1, *call.output.shape[1:]))
            for k, part in enumerate(parts):
                if part is None:
                    rows_of.index_fill_(0, dest[k], 0.0)
                else:
                    rows_of.index_copy_(0, dest[k], part.to(rows_of.dtype))
            out.append((call, rows_of[:N], inverse))
        return out


def _logp_fn(batch: TokenBatchLike, score: dict[str, Any]) -> core.LogpFn:
    """``model ↦ sequence_logprobs(model, batch, **score).logp``: the learner's forward as the core's ``logp_fn``."""
    return lambda model: sequence_logprobs(model, batch, **score).logp


def chunkable_head(model: nn.Module, device: torch.device) -> nn.Module | None:
    """The output layer when the pass can form its part in vocabulary chunks: the chunked head applies, and its
    weight is used by no module but itself and an embedding (a tied input embedding; the core's ``_Head`` has no
    cross term with a Linear); else None (the pass then records the layer's call)."""
    if not splits_output_layer(model, device):
        return None
    head = model.get_output_embeddings()
    users = [m for m in model.modules() if m is not head and any(p is head.weight for p in m.parameters(recurse=False))]
    return head if all(isinstance(m, nn.Embedding) for m in users) else None


def _observing_head(logp_fn: core.LogpFn, observe: Any) -> core.LogpFn:
    """``logp_fn`` with its forward's output layer run in vocabulary chunks and reported to ``observe``."""

    def fn(model: nn.Module) -> Tensor:
        with observe_head(observe):
            return logp_fn(model)

    return fn


def _shared_logp_fn(batch: TokenBatchLike, score: dict[str, Any], observe: Any) -> core.LogpFn:
    """The learner's shared-prompt forward, reporting where the prompt joins the rows to ``observe``."""

    def logp_fn(model: nn.Module) -> Tensor:
        with observe_shared_prefill(observe):
            return sequence_logprobs(model, batch, share_prompts=True, **score).logp

    return logp_fn


def _group_slots(inverse: Tensor, U: int) -> Tensor:
    """slots [G_max, U]: the row that is the k-th of prompt u's group, or −1."""
    N = inverse.numel()
    counts = torch.bincount(inverse, minlength=U)
    rank = rank_in_group(inverse)
    slots = torch.full((int(counts.max()), U), -1, dtype=torch.long, device=inverse.device)  # one host read
    slots[rank, inverse] = torch.arange(N, device=inverse.device)
    return slots


def _take(d: Tensor, idx: Tensor) -> Tensor:
    """Rows ``idx`` [U] of ``d`` [N, ...], zero where ``idx`` is −1 (a group without a k-th row)."""
    picked = d[idx.clamp(min=0)]
    return torch.where((idx >= 0).view(-1, *([1] * (d.dim() - 1))), picked, torch.zeros_like(picked))


def _row(batch: TokenBatchLike, i: int) -> TokenBatch:
    return TokenBatch(
        batch.prompt_ids[i : i + 1], batch.prompt_mask[i : i + 1], batch.response_ids[i : i + 1],
        batch.response_mask[i : i + 1], _tool_mask(batch)[i : i + 1],
    )  # fmt: skip


def _tool_mask(batch: TokenBatchLike) -> Tensor:
    """The batch's tool-output mask [N, T] (all False when it has none): attended context, never in ℓ_i."""
    return context_mask(batch) & ~batch.response_mask.bool()


def _per_trajectory(model: nn.Module, batch: TokenBatchLike, mask: Tensor, score: dict[str, Any]) -> Tensor:
    """Σ_t m_{i,t} log π(y_{i,t}) for the rows of ``batch`` (``mask`` may be wider than a trimmed batch's T)."""
    logp = sequence_logprobs(model, batch, **score).logp
    return masked_row_sums(logp, mask[:, : logp.shape[1]])


# ---------------------------------------------------------------------------------------------------------------------
# "naive": one forward and one backward per trajectory, its padding trimmed (the reference)


def _naive(model: nn.Module, batch: TokenBatchLike, mask: Tensor, score: dict[str, Any], dtype: torch.dtype) -> Tensor:
    params = core._trainable(model)
    device = batch.response_ids.device
    norms = []
    for i in range(batch.response_ids.shape[0]):
        row = trim_padding(_row(batch, i))  # this trajectory alone: no padding it does not need
        loss = _per_trajectory(model, row, mask[i : i + 1], score).sum()
        if not loss.requires_grad:  # no response token: a constant
            norms.append(torch.zeros((), dtype=dtype, device=device))
            continue
        grads = torch.autograd.grad(loss, params, allow_unused=True)  # ∇θ ℓ_i; .grad untouched
        norms.append(core._sq_norm(list(grads), dtype, device))
    return torch.stack(norms)


# ---------------------------------------------------------------------------------------------------------------------
# "vmap": torch.func over trajectories


class _OneTrajectory(nn.Module):
    """ℓ_i of one trajectory given as unbatched rows, the model as a submodule (so ``functional_call`` reaches it)."""

    def __init__(self, model: nn.Module, score: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.score = score

    def forward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor,
                tool_mask: Tensor, mask: Tensor) -> Tensor:  # fmt: skip
        row = TokenBatch(prompt_ids[None], prompt_mask[None], response_ids[None], response_mask[None], tool_mask[None])
        return _per_trajectory(self.model, row, mask[None], self.score).sum()


def _vmapped(
    model: nn.Module, batch: TokenBatchLike, mask: Tensor, score: dict[str, Any], dtype: torch.dtype, chunk: int
) -> Tensor:
    wrapper = _OneTrajectory(model, score)
    params = {f"model.{name}": p.detach() for name, p in model.named_parameters() if p.requires_grad}
    device = batch.response_ids.device

    def sq_norm_of_one(p: dict[str, Tensor], *row: Tensor) -> Tensor:
        # tie_weights (default): a tied parameter is passed once and used by all its modules, so its gradient sums.
        g = grad(lambda q: functional_call(wrapper, q, row))(p)  # ∇θ ℓ_i, one trajectory
        return core._sq_norm(list(g.values()), dtype, device)

    rows = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, _tool_mask(batch), mask)
    with _vmap_traceable_attention(model), warnings.catch_warnings():
        # SDPA has no batching rule on CPU: vmap loops over it and warns each time.
        warnings.filterwarnings("ignore", message=".*have not yet implemented the batching rule.*")
        return vmap(sq_norm_of_one, in_dims=(None,) + (0,) * len(rows), chunk_size=chunk)(params, *rows)


@contextmanager
def _vmap_traceable_attention(model: nn.Module) -> Iterator[None]:
    """Run a transformers model on SDPA with an always-materialized mask, then restore its attention implementation.

    ``sdpa_mask`` skips building the mask when no token is padded, a test on the mask's values that ``vmap`` cannot
    trace. The registered variant forces ``allow_is_causal_skip=False``; the attention kernel is the stock SDPA one.
    Models without ``set_attn_implementation`` (plain ``nn.Module``) are left alone.
    """
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or previous is None:
        yield
        return
    _register_vmap_attention()
    model.set_attn_implementation(VMAP_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _register_vmap_attention() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def materialized_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionMaskInterface.register(VMAP_ATTENTION, materialized_sdpa_mask)
    AttentionInterface.register(VMAP_ATTENTION, sdpa_attention_forward)
