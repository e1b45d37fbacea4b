"""The learner's recompute: log-probs (and optionally entropies) of response tokens under a model, with gradient.

One forward over ``[prompt; response]`` with the attention mask and the position ids of :mod:`steadyrl.rollout.rollouts`
(attention ``[prompt_mask; response_mask | tool_mask]``, positions ``cumsum(attention) − 1``: what the sampler attended
and the positions it used, tool-output turns included), asking the model for the logits of the response positions only
(``logits_to_keep = T + 1``, the last one dropped), so the output layer and the log-softmax never run over the prompt.
Used for the proximal policy (``prox_logp``, under ``torch.no_grad``) and the current policy (``logp``, with gradient),
and by the warm start's supervised loss.

Shapes: prompt ``[N, P]`` left-padded, response ``[N, T]`` right-padded → ``logp`` ``[N, T]`` float32, 0 where
``response_mask`` is False (padding and tool output: context, not scored); ``entropy`` ``[N, T]`` float32 (0 there too)
or None. With ``return_hidden=True`` the same forward also asks for ``output_hidden_states`` and returns the final
hidden state (the input of the output layer, after the final norm) at each position that predicts a response token,
``hidden`` ``[N, T, H]`` in the model's dtype (0 where ``response_mask`` is False): ``hidden[:, t]`` is the state
*before* y_t is emitted, the s_t of a critic V(s_t).

**Vocabulary chunks.** When a call would hold more than ``chunk_elements`` logits (``N·T·V`` above the budget,
default :data:`~steadyrl.core.vocab_chunks.DEFAULT_CHUNK_ELEMENTS` = 2^26, 256 MiB in float32; decided from the
shapes, no host sync), the model is split at its output layer: the trunk (``model.get_decoder()``) runs with the same
attention mask, positions and KV-cache handling, its final hidden states at the scored tokens (``response_mask``)
are gathered ``[M, H]``, and :func:`steadyrl.core.vocab_chunks.chunked_log_probs` applies the output layer's weight
(and bias) and the sampling distribution a chunk of ``chunk_elements // V`` tokens at a time, forward and backward:
no ``[N, T, V]`` tensor is ever formed (at V = 49,152 and 16k tokens the direct form holds several of 3.2 GB). Same
values and gradients up to float rounding (1e-6 relative in float32, 1e-12 in float64: ``tests/core/
test_vocab_chunks.py``); the gather of the scored tokens costs one host sync per call. Within the budget the direct
form runs, unchanged (bit-identical results on small vocabularies). The direct form is also used wherever the split
is not known to be the same function: a model whose type is not in :data:`SPLITTABLE_MODEL_TYPES` or whose config
post-processes logits (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``), an output layer that is
not a plain ``nn.Linear`` / :class:`~steadyrl.base.device.Float32OutputLinear` (LoRA on the head, a tied custom
module) or a plain ``nn.Linear`` that would run in low precision (a weight not in float32/float64, or under
autocast), a model or head with forward hooks or a patched ``forward`` (accelerate's device hooks), and under
``torch.func`` transforms (``vmap``/``grad``: the chunked head is a custom autograd function). Under
:func:`observe_head` (the ghost gradient-norm pass of :mod:`steadyrl.train.grad_norms`, which then leaves the output
layer unhooked and forms its part of each norm over vocabulary chunks) the chunked head runs whenever it applies,
whatever the budget.

Full-vocabulary terms with gradient (an entropy bonus, Σ_v c_v log π_v) go through :func:`sequence_logprob_terms`,
which takes named callables ``g(log_probs [m, V], index [m]) -> [m]`` (``index``: flat positions ``n·T + t`` in the
``[N, T]`` grid) and returns them as ``[N, T]`` tensors whose gradient flows, chunked or not.
Confidence: [exact] (a forward pass; the distribution is that of :mod:`steadyrl.rollout.distribution`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal, NamedTuple, overload

import torch
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from steadyrl.base.device import Float32OutputLinear
from steadyrl.core.advantages.otb import sum_squared_probs
from steadyrl.core.entropy import entropy_term
from steadyrl.core.groups import rank_in_group
from steadyrl.core.vocab_chunks import DEFAULT_CHUNK_ELEMENTS, VocabTerm, chunk_tokens_for, chunked_log_probs
from steadyrl.rollout.distribution import SamplingParams, entropy_from_log_probs, sampling_log_probs
from steadyrl.rollout.rollouts import TokenBatchLike, attention_mask
from steadyrl.rollout.sampler import cache_kwarg, positions_from_mask

#: ``config.model_type`` of the causal LMs whose logits are exactly ``output_layer(trunk(...).last_hidden_state)``
#: (transformers' ``*ForCausalLM.forward``: no scaling, capping or extra head), so the chunked head may replace the
#: model's own output layer. Other types use the direct form.
SPLITTABLE_MODEL_TYPES: frozenset[str] = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo", "olmo2", "smollm3"}
)
#: Config attributes through which a model post-processes its logits (Gemma 2/3, Cohere, Granite): never split.
_LOGIT_POSTPROCESSING: tuple[str, ...] = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class SequenceLogprobs(NamedTuple):
    """Per-token log-probs ``logp`` ``[N, T]`` and entropies ``entropy`` ``[N, T]`` (None unless asked for)."""

    logp: Float[Tensor, "N T"]
    entropy: Float[Tensor, "N T"] | None


class SequenceLogprobsHidden(NamedTuple):
    """:class:`SequenceLogprobs` plus ``hidden`` [N, T, H]: the final hidden state at the position predicting y_t."""

    logp: Float[Tensor, "N T"]
    entropy: Float[Tensor, "N T"] | None
    hidden: Float[Tensor, "N T H"]


class SequenceLogprobTerms(NamedTuple):
    """``logp`` ``[N, T]`` and each named full-vocabulary term ``[N, T]`` (0 at padding; gradient flows); with
    ``return_hidden``, the final hidden states ``[N, T, H]`` of the same forward (else None)."""

    logp: Float[Tensor, "N T"]
    terms: dict[str, Float[Tensor, "N T"]]
    hidden: Float[Tensor, "N T H"] | None = None


@overload
def sequence_logprobs(
    model: PreTrainedModel, batch: TokenBatchLike, *, temperature: float = ..., top_k: int = ..., top_p: float = ...,
    return_entropy: bool = ..., return_hidden: Literal[False] = ..., share_prompts: bool = ...,
    chunk_elements: int | None = ...,
) -> SequenceLogprobs: ...  # fmt: skip


@overload
def sequence_logprobs(
    model: PreTrainedModel, batch: TokenBatchLike, *, temperature: float = ..., top_k: int = ..., top_p: float = ...,
    return_entropy: bool = ..., return_hidden: Literal[True], share_prompts: bool = ...,
    chunk_elements: int | None = ...,
) -> SequenceLogprobsHidden: ...  # fmt: skip


def sequence_logprobs(
    model: PreTrainedModel,
    batch: TokenBatchLike,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    return_entropy: bool = False,
    return_hidden: bool = False,
    share_prompts: bool = False,
    chunk_elements: int | None = None,
) -> SequenceLogprobs | SequenceLogprobsHidden:
    """log π(y_t | x, y_<t) for every response token (gradient flows when called under grad).

    Args:
        model: a causal LM supporting ``logits_to_keep`` (every ``transformers`` decoder does).
        batch: :class:`~steadyrl.rollout.rollouts.Rollouts` or :class:`~steadyrl.rollout.rollouts.TokenBatch`.
        temperature, top_k, top_p: score under this sampling distribution (defaults: the plain policy, T = 1).
            With the sampler's settings, the result equals the recorded ``behav_logp`` for unchanged weights.
        return_entropy: also return H_t = −Σ_v π(v) log π(v) of the same distribution at each response position.
        return_hidden: also return the final hidden states of the positions that predict the response tokens (same
            forward: ``output_hidden_states=True``, or the trunk's output when chunked; the critic of
            ``steadyrl.train.critic`` reads them).
        share_prompts: run each distinct prompt once (:func:`_shared_prompt_outputs`; G responses per prompt
            cost one prompt forward instead of G), when some rows share a prompt and ``return_hidden`` is off.
            The same values as the one-pass forward up to float rounding, gradient included.
        chunk_elements: the most logits held at once (module docstring, "Vocabulary chunks"); None:
            :data:`~steadyrl.core.vocab_chunks.DEFAULT_CHUNK_ELEMENTS`. Within it, the direct form.

    Returns:
        :class:`SequenceLogprobs` (unpacks as ``logp, entropy``); both float32 and 0 at padding. With
        ``return_hidden``: :class:`SequenceLogprobsHidden` (``logp, entropy, hidden``).
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    N, T = batch.response_ids.shape
    if T == 0:
        empty = torch.zeros(N, 0, device=batch.response_ids.device)
        entropy0 = empty.clone() if return_entropy else None
        if return_hidden:
            hidden0 = torch.zeros(N, 0, model.config.hidden_size, device=empty.device, dtype=model.dtype)
            return SequenceLogprobsHidden(empty, entropy0, hidden0)
        return SequenceLogprobs(empty, entropy0)
    terms: dict[str, VocabTerm] = {_ENTROPY: _entropy_term} if return_entropy else {}
    scored = _score(model, batch, params=params, terms=terms, return_hidden=return_hidden, share_prompts=share_prompts,
                    chunk_elements=chunk_elements)  # fmt: skip
    entropy = scored.terms.get(_ENTROPY)
    if return_hidden:
        assert scored.hidden is not None
        return SequenceLogprobsHidden(scored.logp, entropy, scored.hidden)
    return SequenceLogprobs(scored.logp, entropy)


def sequence_logprob_terms(
    model: PreTrainedModel,
    batch: TokenBatchLike,
    *,
    terms: Mapping[str, VocabTerm],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    share_prompts: bool = False,
    chunk_elements: int | None = None,
    return_hidden: bool = False,
) -> SequenceLogprobTerms:
    """log π(y_t) and named full-vocabulary terms of the same distribution at every response token, with gradient.

    Each term is ``g(log_probs, index) -> values``: ``log_probs`` ``[m, V]`` of m response tokens (the sampling
    distribution of ``temperature``/``top_k``/``top_p``; −inf outside its kept set), ``index`` ``[m]`` their flat
    positions ``n·T + t`` in the ``[N, T]`` grid, ``values`` ``[m]``. The result's ``terms[name]`` is ``[N, T]``,
    0 where ``response_mask`` is False, and its gradient flows into the model through the log-probs (an entropy
    bonus, score centering's Σ_v c_v log π_v). A term must act token by token and deterministically; tensors it
    closes over are constants. Chunked or direct as :func:`sequence_logprobs` (module docstring); the direct form
    passes every position (padding included, then zeroed), the chunked one only the scored tokens.
    ``return_hidden``: also the final hidden states, as :func:`sequence_logprobs` (a critic reads them; the prompts
    are then not shared).
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    N, T = batch.response_ids.shape
    if T == 0:
        empty = torch.zeros(N, 0, device=batch.response_ids.device)
        hidden0 = None
        if return_hidden:
            hidden0 = torch.zeros(N, 0, model.config.hidden_size, device=empty.device, dtype=model.dtype)
        return SequenceLogprobTerms(empty, {name: empty.clone() for name in terms}, hidden0)
    scored = _score(model, batch, params=params, terms=dict(terms), return_hidden=return_hidden,
                    share_prompts=share_prompts, chunk_elements=chunk_elements)  # fmt: skip
    return SequenceLogprobTerms(scored.logp, scored.terms, scored.hidden)


_ENTROPY = "entropy"
_SUM_P2 = "sum_p2"


#: H = −Σ_v π_v log π_v as a vocabulary term (:func:`steadyrl.core.entropy.entropy_term`, the entropy bonus's).
_entropy_term: VocabTerm = entropy_term


def _sum_p2_term(log_probs: Float[Tensor, "m V"], index: Tensor) -> Float[Tensor, " m"]:
    """Σ_v π_v² (:func:`~steadyrl.core.advantages.otb.sum_squared_probs`) as a vocabulary term."""
    return sum_squared_probs(log_probs)


class _Scored(NamedTuple):
    logp: Float[Tensor, "N T"]
    terms: dict[str, Float[Tensor, "N T"]]
    hidden: Float[Tensor, "N T H"] | None


def _score(
    model: PreTrainedModel,
    batch: TokenBatchLike,
    *,
    params: SamplingParams,
    terms: dict[str, VocabTerm],
    return_hidden: bool,
    share_prompts: bool,
    chunk_elements: int | None,
) -> _Scored:
    """log π(y_t), the ``terms`` and (``return_hidden``) the final hidden states, chunked or direct (T ≥ 1)."""
    response_mask = batch.response_mask.bool()
    share = share_prompts and not return_hidden
    split = _split_output_layer(model, batch, chunk_elements)
    if split is not None:
        trunk, head, chunk = split
        hidden = _shared_prompt_outputs(model, batch, trunk=trunk) if share else None
        if hidden is None:
            hidden = _one_pass_outputs(model, batch, trunk=trunk)
        observer = _HEAD_OBSERVER.get()
        if observer is not None:
            observer(HeadCall(hidden, response_mask, batch.response_ids, head, params))
        logp, values = _chunked_scores(hidden, head, batch, params=params, terms=terms, chunk=chunk)
        kept = _masked_hidden(hidden, response_mask) if return_hidden else None
        return _Scored(logp, values, kept)
    shared = _shared_prompt_outputs(model, batch, trunk=None) if share else None
    if shared is not None:
        log_probs, out = sampling_log_probs(shared, params=params), None
    else:
        log_probs, out = _response_log_probs(model, batch, params=params, return_hidden=return_hidden)
    logp = _masked(_token_logp(log_probs, batch), response_mask)
    values = {name: _masked(_direct_term(name, fn, log_probs), response_mask) for name, fn in terms.items()}
    hidden = None
    if return_hidden:
        T = batch.response_ids.shape[1]
        last = out.hidden_states[-1][:, -(T + 1) : -1]  # the output layer's input at positions P−1 … P+T−2: [N, T, H]
        hidden = _masked_hidden(last, response_mask)
    return _Scored(logp, values, hidden)


def _direct_term(name: str, fn: VocabTerm, log_probs: Float[Tensor, "N T V"]) -> Float[Tensor, "N T"]:
    """A vocabulary term on the direct form's ``[N, T, V]`` log-probs (entropy and Σπ² on the tensor as it is)."""
    if fn is _entropy_term:
        return entropy_from_log_probs(log_probs)
    if fn is _sum_p2_term:
        return sum_squared_probs(log_probs)
    N, T, V = log_probs.shape
    index = torch.arange(N * T, device=log_probs.device)
    values = fn(log_probs.reshape(N * T, V), index)
    if tuple(values.shape) != (N * T,):
        raise ValueError(f"vocabulary term {name} returned shape {tuple(values.shape)}, expected {(N * T,)}")
    return values.reshape(N, T)


def _chunked_scores(
    hidden: Float[Tensor, "N T H"],
    head: nn.Linear,
    batch: TokenBatchLike,
    *,
    params: SamplingParams,
    terms: dict[str, VocabTerm],
    chunk: int,
) -> tuple[Float[Tensor, "N T"], dict[str, Float[Tensor, "N T"]]]:
    """The chunked head on the scored tokens' hidden states, scattered back into ``[N, T]`` (0 elsewhere)."""
    mask = batch.response_mask.bool()
    index = torch.arange(mask.numel(), device=mask.device).view(mask.shape)[mask] if terms else None
    out = chunked_log_probs(
        hidden=hidden[mask],  # [M, H]: the scored tokens only (one host sync: M)
        weight=head.weight,
        bias=head.bias,
        tokens=batch.response_ids[mask],
        chunk_tokens=chunk,
        log_probs=functools.partial(sampling_log_probs, params=params),
        terms=terms,
        token_index=index,
    )
    return _scatter(out.logp, mask), {name: _scatter(v, mask) for name, v in out.terms.items()}


def _scatter(values: Float[Tensor, " M"], mask: Bool[Tensor, "N T"]) -> Float[Tensor, "N T"]:
    """``values`` of the masked-in positions (row-major order) into an ``[N, T]`` grid of zeros (differentiable)."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def _masked_hidden(last: Float[Tensor, "N T H"], response_mask: Tensor) -> Float[Tensor, "N T H"]:
    return torch.where(response_mask.unsqueeze(-1), last, torch.zeros_like(last))


def _split_output_layer(
    model: PreTrainedModel, batch: TokenBatchLike, chunk_elements: int | None
) -> tuple[nn.Module, nn.Linear, int] | None:
    """(trunk, output layer, tokens per chunk) when the chunked head applies (module docstring), else None. Under
    :func:`observe_head` it applies whenever it can, whatever the budget."""
    budget = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        return None
    N, T = batch.response_ids.shape
    if N * T * head.out_features <= budget and _HEAD_OBSERVER.get() is None:
        return None  # fits: the direct form, unchanged
    trunk = _splittable(model, head, batch.response_ids.device)
    if trunk is None:
        return None
    return trunk, head, chunk_tokens_for(vocab_size=head.out_features, chunk_elements=budget)


def splits_output_layer(model: nn.Module, device: torch.device) -> bool:
    """Whether the chunked head can replace ``model``'s output layer on ``device`` (module docstring: the model type,
    no logit post-processing, no hooks on the model or the layer, a float32 layer, no ``torch.func`` transform)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return isinstance(head, nn.Linear) and _splittable(model, head, device) is not None


def _splittable(model: nn.Module, head: nn.Linear, device: torch.device) -> nn.Module | None:
    """The trunk when the chunked head computes the same function as ``model``'s own output layer, else None."""
    config = getattr(model, "config", None)
    if (
        not isinstance(model, PreTrainedModel)
        or getattr(config, "model_type", None) not in SPLITTABLE_MODEL_TYPES
        or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_POSTPROCESSING)
        or torch._C._are_functorch_transforms_active()
    ):
        return None
    trunk = model.get_decoder()
    if trunk is model or not isinstance(trunk, nn.Module):
        return None
    if _hooked(model) or _hooked(head) or not _fp32_head(head, device):
        return None
    return trunk


def _hooked(module: nn.Module) -> bool:
    """Whether bypassing ``module``'s call would skip something: forward hooks (its own or global), a patched
    ``forward`` on the instance."""
    from torch.nn.modules import module as module_mod

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module_mod._global_forward_hooks
        or module_mod._global_forward_pre_hooks
        or "forward" in vars(module)
    )


def _fp32_head(head: nn.Linear, device: torch.device) -> bool:
    """Whether ``head`` computes ``x Wᵀ + b`` in ``promote(x.dtype, float32)`` as the chunked head does: the float32
    output layer of :mod:`steadyrl.base.device`, or a plain ``nn.Linear`` in float32/float64 outside autocast."""
    if type(head) is Float32OutputLinear:
        return True
    return (
        type(head) is nn.Linear
        and head.weight.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(device.type)
    )


def _response_log_probs(
    model: PreTrainedModel, batch: TokenBatchLike, *, params: SamplingParams, return_hidden: bool = False
) -> tuple[Float[Tensor, "N T V"], Any]:
    """log π(· | x, y_<t) of the sampling distribution ``params`` at every response position [N, T, V], and the
    model output (one forward over [prompt; response] with the rollout's attention and positions; T ≥ 1)."""
    T = batch.response_ids.shape[1]
    input_ids = torch.cat([batch.prompt_ids, batch.response_ids], dim=-1)
    mask = attention_mask(batch)  # [prompt_mask; response_mask | tool_mask]: tool output is attended context
    extra = {"output_hidden_states": True} if return_hidden else {}
    out = model(
        input_ids=input_ids,
        attention_mask=mask.long(),
        position_ids=positions_from_mask(mask),
        use_cache=False,
        logits_to_keep=T + 1,
        **extra,
    )
    logits = out.logits[:, :-1]  # position P−1+t predicts response token t: [N, T, V]
    return sampling_log_probs(logits, params=params), out


def _one_pass_outputs(model: PreTrainedModel, batch: TokenBatchLike, *, trunk: nn.Module) -> Float[Tensor, "N T H"]:
    """The trunk's final hidden states at the positions predicting the response tokens [N, T, H]: the one forward of
    :func:`_response_log_probs` without the output layer."""
    T = batch.response_ids.shape[1]
    mask = attention_mask(batch)
    out = trunk(
        input_ids=torch.cat([batch.prompt_ids, batch.response_ids], dim=-1),
        attention_mask=mask.long(),
        position_ids=positions_from_mask(mask),
        use_cache=False,
    )
    return out.last_hidden_state[:, -(T + 1) : -1]  # position P−1+t predicts response token t


def _checkpointing(model: PreTrainedModel) -> bool:
    """Whether transformers' gradient (activation) checkpointing is on (its attribute was renamed in 5.x)."""
    new = "is_activation_checkpointing"
    return bool(getattr(model, new if hasattr(type(model), new) else "is_gradient_checkpointing", False))


class SharedPrefill(NamedTuple):
    """Where :func:`_shared_prompt_outputs` joins the U distinct prompts' forward to the N rows' (for observers).

    ``inverse`` [N]: row i's prompt. ``before``: the prompt forward's outputs that the rows read, the KV cache's
    tensors ([U, ...] each) and the prefill's last output ``[U, 1, ·]`` last; ``after``: the same indexed to the
    rows (``before[j][inverse]``, [N, ...] each; the gradient of row i flows into its prompt through these only).
    """

    inverse: Tensor
    before: list[Tensor]
    after: list[Tensor]


#: Set by :func:`observe_shared_prefill`: called once per shared-prompt forward with its :class:`SharedPrefill`.
_PREFILL_OBSERVER: ContextVar[Callable[[SharedPrefill], None] | None] = ContextVar("prefill_observer", default=None)


@contextmanager
def observe_shared_prefill(callback: Callable[[SharedPrefill], None]) -> Iterator[None]:
    """Within the block, every shared-prompt forward (``share_prompts=True``) reports its :class:`SharedPrefill` to
    ``callback`` (the per-trajectory gradient-norm pass splits its backward there). Only caches whose layers are plain
    ``DynamicLayer`` / ``DynamicSlidingWindowLayer`` (keys and values, nothing else) are shared while observed; others
    take the one-pass forward."""
    token = _PREFILL_OBSERVER.set(callback)
    try:
        yield
    finally:
        _PREFILL_OBSERVER.reset(token)


class HeadCall(NamedTuple):
    """What a chunked forward applied the output layer to (for observers): ``hidden`` [N, T, H] (with its graph; row
    i's position predicting response token t), ``mask`` [N, T] (the scored tokens), ``tokens`` [N, T] (the response
    ids), ``head`` (the layer) and ``params`` (the distribution scored)."""

    hidden: Tensor
    mask: Tensor
    tokens: Tensor
    head: nn.Linear
    params: SamplingParams


#: Set by :func:`observe_head`: called with the :class:`HeadCall` of every chunked forward.
_HEAD_OBSERVER: ContextVar[Callable[[HeadCall], None] | None] = ContextVar("head_observer", default=None)


@contextmanager
def observe_head(callback: Callable[[HeadCall], None]) -> Iterator[None]:
    """Within the block, every forward that can run the chunked head runs it (whatever the budget) and reports its
    :class:`HeadCall` to ``callback``: the per-trajectory gradient-norm pass forms the output layer's part of each norm
    from it, in vocabulary chunks, instead of recording the layer's ``[N, T, V]`` output."""
    token = _HEAD_OBSERVER.set(callback)
    try:
        yield
    finally:
        _HEAD_OBSERVER.reset(token)


def _cache_tensors(cache: DynamicCache) -> list[Tensor]:
    return [t for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, Tensor) and t.numel()]


def _shared_prompt_outputs(
    model: PreTrainedModel, batch: TokenBatchLike, *, trunk: nn.Module | None
) -> Float[Tensor, "N T X"] | None:
    """The outputs of :func:`_response_log_probs`'s forward with each distinct prompt forwarded once: the logits
    ``[N, T, V]`` (``trunk`` None: the whole model) or the trunk's final hidden states ``[N, T, H]`` (the chunked
    head's input); None when no two rows share a prompt.

    1. The U distinct (prompt ids, prompt mask) rows are forwarded once, with a KV cache, keeping the last position
       (which predicts response token 0);
    2. the cache is indexed back to the N rows (``batch_select_indices``: an indexing op, so the gradient of every
       row flows into its prompt's keys and values);
    3. the responses are forwarded against it, with the rollout's attention mask and positions over
       ``[prompt; response]`` (as :func:`_response_log_probs`); position t predicts token t + 1.

    Causal attention makes the prompt's states independent of the response, so this is the same function of the
    weights as the one-pass forward (GRPO's G responses per prompt: the prompt costs 1/G). Not under gradient
    checkpointing in training mode (transformers then disables the cache).
    """
    if _checkpointing(model) and model.training:
        return None  # transformers turns the KV cache off under gradient checkpointing: no cache to share
    P = batch.prompt_ids.shape[1]
    key = torch.where(batch.prompt_mask.bool(), batch.prompt_ids, torch.full_like(batch.prompt_ids, -1))
    unique, inverse = torch.unique(key, dim=0, return_inverse=True)
    if unique.shape[0] == key.shape[0] or P == 0:
        return None
    U, observer = unique.shape[0], _PREFILL_OBSERVER.get()
    if observer is not None:  # the norm pass backpropagates once per rank: no prompt with more rows than usual
        inverse, U = _split_to_the_usual_count(inverse, U)
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.zeros(U, dtype=torch.long, device=key.device).scatter_(0, inverse, rows)  # one row each
    p_ids, p_mask = batch.prompt_ids[first], batch.prompt_mask.bool()[first]
    module = model if trunk is None else trunk

    def forward(keep: int, **kwargs: Any) -> Tensor:  # the last ``keep`` positions' logits or hidden states
        if trunk is None:
            return model(**kwargs, logits_to_keep=keep).logits
        return trunk(**kwargs).last_hidden_state[:, -keep:]

    cache = DynamicCache(config=model.config)
    if observer is not None and any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)
                                    for layer in cache.layers):  # fmt: skip
        return None  # state beyond keys and values: the observer could not follow every row's gradient
    prefill = forward(
        1,
        input_ids=p_ids,
        attention_mask=p_mask.long(),
        position_ids=positions_from_mask(p_mask),
        use_cache=True,
        **{cache_kwarg(module): cache},
    )
    first_out = prefill[inverse, -1:]  # [N, 1, ·]: predicts response token 0
    T = batch.response_ids.shape[1]
    if T == 1:
        if observer is not None:
            observer(SharedPrefill(inverse, [prefill], [first_out]))
        return first_out
    before = _cache_tensors(cache) if observer is not None else []
    cache.batch_select_indices(inverse)
    if observer is not None:
        observer(SharedPrefill(inverse, [*before, prefill], [*_cache_tensors(cache), first_out]))
    mask = attention_mask(batch)[:, : P + T - 1]  # tokens 0..T−2 are inputs; the last is only predicted
    out = forward(
        T - 1,
        input_ids=batch.response_ids[:, : T - 1],
        attention_mask=mask.long(),
        position_ids=positions_from_mask(mask)[:, P:],
        use_cache=True,
        **{cache_kwarg(module): cache},
    )
    return torch.cat([first_out, out], dim=1)  # position P−1+t predicts response token t: [N, T, ·]


def _split_to_the_usual_count(inverse: Tensor, U: int) -> tuple[Tensor, int]:
    """(row → prompt copy [N], the number of copies): each prompt's rows cut into copies of at most g rows, g the most
    common number of rows per prompt (the smaller one on a tie).

    For the per-trajectory gradient-norm pass (:class:`steadyrl.train.grad_norms.GhostPass`), which backpropagates
    once per rank within a prompt's rows: a prompt drawn by two groups of G would take 2G backwards of all U prompts
    instead of G; as two copies of G rows it takes G, for one more prompt row in the forward. Copies get consecutive
    ids; the function of the weights is unchanged (each copy is the same prompt). One host read (the count).
    """
    counts = torch.bincount(inverse, minlength=U)
    g = torch.bincount(counts).argmax()  # the most common count
    pieces = (counts + g - 1) // g
    return (torch.cumsum(pieces, 0) - pieces)[inverse] + rank_in_group(inverse) // g, int(pieces.sum())


def _token_logp(log_probs: Float[Tensor, "N T V"], batch: TokenBatchLike) -> Float[Tensor, "N T"]:
    """log π(y_t) of each response token."""
    return log_probs.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)


def _masked(values: Float[Tensor, "N T"], response_mask: Tensor) -> Float[Tensor, "N T"]:
    """``values`` at sampled response tokens, 0 elsewhere (padding, tool output)."""
    return torch.where(response_mask, values, torch.zeros_like(values))


class ProximalLogprobs(NamedTuple):
    """What OTB reads from the proximal policy at each response token: ``logp`` = log π(y_t) and ``sum_p2`` =
    Σ_v π_v² of the same distribution, both ``[N, T]`` float32 and 0 at padding."""

    logp: Float[Tensor, "N T"]
    sum_p2: Float[Tensor, "N T"]


def proximal_logprobs(
    model: PreTrainedModel,
    batch: TokenBatchLike,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_elements: int | None = None,
) -> ProximalLogprobs:
    """log π(y_t) and Σ_v π_v² at every response token from one forward (call under ``torch.no_grad``).

    Σ_v π_v² is OTB's (arXiv 2602.07078; verl ``sum_pi_squared``) of the distribution the tokens are scored under
    (``temperature``, ``top_k``, ``top_p`` as in :func:`sequence_logprobs`), computed in log space by
    :func:`steadyrl.core.advantages.otb.sum_squared_probs` on the normalized log-probs (shift invariance: the same
    value as on the logits); in vocabulary chunks past ``chunk_elements`` as :func:`sequence_logprobs`.
    Confidence: [reference-code].
    """
    N, T = batch.response_ids.shape
    if T == 0:
        empty = torch.zeros(N, 0, device=batch.response_ids.device)
        return ProximalLogprobs(empty, empty.clone())
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    scored = _score(model, batch, params=params, terms={_SUM_P2: _sum_p2_term}, return_hidden=False,
                    share_prompts=False, chunk_elements=chunk_elements)  # fmt: skip
    return ProximalLogprobs(scored.logp, scored.terms[_SUM_P2].to(scored.logp.dtype))
