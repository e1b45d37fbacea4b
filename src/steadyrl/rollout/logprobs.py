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
Confidence: [exact] (a forward pass; the distribution is that of :mod:`steadyrl.rollout.distribution`).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, overload

import torch
from jaxtyping import Float
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from steadyrl.core.advantages.otb import sum_squared_probs
from steadyrl.rollout.distribution import SamplingParams, entropy_from_log_probs, sampling_log_probs
from steadyrl.rollout.rollouts import TokenBatchLike, attention_mask
from steadyrl.rollout.sampler import cache_kwarg, positions_from_mask


class SequenceLogprobs(NamedTuple):
    """Per-token log-probs ``logp`` ``[N, T]`` and entropies ``entropy`` ``[N, T]`` (None unless asked for)."""

    logp: Float[Tensor, "N T"]
    entropy: Float[Tensor, "N T"] | None


class SequenceLogprobsHidden(NamedTuple):
    """:class:`SequenceLogprobs` plus ``hidden`` [N, T, H]: the final hidden state at the position predicting y_t."""

    logp: Float[Tensor, "N T"]
    entropy: Float[Tensor, "N T"] | None
    hidden: Float[Tensor, "N T H"]


@overload
def sequence_logprobs(
    model: PreTrainedModel, batch: TokenBatchLike, *, temperature: float = ..., top_k: int = ..., top_p: float = ...,
    return_entropy: bool = ..., return_hidden: Literal[False] = ..., share_prompts: bool = ...,
) -> SequenceLogprobs: ...  # fmt: skip


@overload
def sequence_logprobs(
    model: PreTrainedModel, batch: TokenBatchLike, *, temperature: float = ..., top_k: int = ..., top_p: float = ...,
    return_entropy: bool = ..., return_hidden: Literal[True], share_prompts: bool = ...,
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
) -> SequenceLogprobs | SequenceLogprobsHidden:
    """log π(y_t | x, y_<t) for every response token (gradient flows when called under grad).

    Args:
        model: a causal LM supporting ``logits_to_keep`` (every ``transformers`` decoder does).
        batch: :class:`~steadyrl.rollout.rollouts.Rollouts` or :class:`~steadyrl.rollout.rollouts.TokenBatch`.
        temperature, top_k, top_p: score under this sampling distribution (defaults: the plain policy, T = 1).
            With the sampler's settings, the result equals the recorded ``behav_logp`` for unchanged weights.
        return_entropy: also return H_t = −Σ_v π(v) log π(v) of the same distribution at each response position.
        return_hidden: also return the final hidden states of the positions that predict the response tokens (same
            forward, ``output_hidden_states=True``; the critic of ``steadyrl.train.critic`` reads them).
        share_prompts: run each distinct prompt once (:func:`_shared_prompt_log_probs`; G responses per prompt
            cost one prompt forward instead of G), when some rows share a prompt and ``return_hidden`` is off.
            The same values as the one-pass forward up to float rounding, gradient included.

    Returns:
        :class:`SequenceLogprobs` (unpacks as ``logp, entropy``); both float32 and 0 at padding. With
        ``return_hidden``: :class:`SequenceLogprobsHidden` (``logp, entropy, hidden``).
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    response_mask = batch.response_mask.bool()
    N, T = batch.response_ids.shape
    if T == 0:
        empty = torch.zeros(N, 0, device=batch.response_ids.device)
        entropy0 = empty.clone() if return_entropy else None
        if return_hidden:
            hidden0 = torch.zeros(N, 0, model.config.hidden_size, device=empty.device, dtype=model.dtype)
            return SequenceLogprobsHidden(empty, entropy0, hidden0)
        return SequenceLogprobs(empty, entropy0)
    shared = _shared_prompt_log_probs(model, batch, params=params) if share_prompts and not return_hidden else None
    if shared is not None:
        log_probs, out = shared, None
    else:
        log_probs, out = _response_log_probs(model, batch, params=params, return_hidden=return_hidden)
    logp = _masked(_token_logp(log_probs, batch), response_mask)
    entropy = _masked(entropy_from_log_probs(log_probs), response_mask) if return_entropy else None
    if return_hidden:
        last = out.hidden_states[-1][:, -(T + 1) : -1]  # the output layer's input at positions P−1 … P+T−2: [N, T, H]
        hidden = torch.where(response_mask.unsqueeze(-1), last, torch.zeros_like(last))
        return SequenceLogprobsHidden(logp, entropy, hidden)
    return SequenceLogprobs(logp, entropy)


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


def _checkpointing(model: PreTrainedModel) -> bool:
    """Whether transformers' gradient (activation) checkpointing is on (its attribute was renamed in 5.x)."""
    new = "is_activation_checkpointing"
    return bool(getattr(model, new if hasattr(type(model), new) else "is_gradient_checkpointing", False))


def _shared_prompt_log_probs(
    model: PreTrainedModel, batch: TokenBatchLike, *, params: SamplingParams
) -> Float[Tensor, "N T V"] | None:
    """:func:`_response_log_probs` with each distinct prompt forwarded once; None when no two rows share one.

    1. The U distinct (prompt ids, prompt mask) rows are forwarded once, with a KV cache, keeping the last logits
       (which predict response token 0);
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
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.zeros(unique.shape[0], dtype=torch.long, device=key.device).scatter_(0, inverse, rows)  # one row each
    p_ids, p_mask = batch.prompt_ids[first], batch.prompt_mask.bool()[first]
    cache = DynamicCache(config=model.config)
    prefill = model(
        input_ids=p_ids,
        attention_mask=p_mask.long(),
        position_ids=positions_from_mask(p_mask),
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg(model): cache},
    )
    first_logits = prefill.logits[inverse, -1:]  # [N, 1, V]: predicts response token 0
    T = batch.response_ids.shape[1]
    if T == 1:
        return sampling_log_probs(first_logits, params=params)
    cache.batch_select_indices(inverse)
    mask = attention_mask(batch)[:, : P + T - 1]  # tokens 0..T−2 are inputs; the last is only predicted
    out = model(
        input_ids=batch.response_ids[:, : T - 1],
        attention_mask=mask.long(),
        position_ids=positions_from_mask(mask)[:, P:],
        use_cache=True,
        logits_to_keep=T - 1,
        **{cache_kwarg(model): cache},
    )
    logits = torch.cat([first_logits, out.logits], dim=1)  # position P−1+t predicts response token t: [N, T, V]
    return sampling_log_probs(logits, params=params)


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
    model: PreTrainedModel, batch: TokenBatchLike, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> ProximalLogprobs:
    """log π(y_t) and Σ_v π_v² at every response token from one forward (call under ``torch.no_grad``).

    Σ_v π_v² is OTB's (arXiv 2602.07078; verl ``sum_pi_squared``) of the distribution the tokens are scored under
    (``temperature``, ``top_k``, ``top_p`` as in :func:`sequence_logprobs`), computed in log space by
    :func:`steadyrl.core.advantages.otb.sum_squared_probs` on the normalized log-probs (shift invariance: the same
    value as on the logits). Confidence: [reference-code].
    """
    N, T = batch.response_ids.shape
    if T == 0:
        empty = torch.zeros(N, 0, device=batch.response_ids.device)
        return ProximalLogprobs(empty, empty.clone())
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    log_probs, _ = _response_log_probs(model, batch, params=params)
    response_mask = batch.response_mask.bool()
    token_logp = _token_logp(log_probs, batch)
    sum_p2 = sum_squared_probs(log_probs).to(token_logp.dtype)
    return ProximalLogprobs(_masked(token_logp, response_mask), _masked(sum_p2, response_mask))
