"""Batched sampling with a KV cache from any ``transformers`` causal LM, recording behavior log-probs and versions.

The model is called directly (not ``model.generate``): one prefill over the left-padded prompts, then one forward per
new token with the KV cache. Every row draws its next token from the sampling distribution of
:func:`steadyrl.rollout.distribution.sampling_log_probs` (temperature, top-k, top-p, renormalized) with
``torch.multinomial`` and the caller's ``torch.Generator``, and records that token's log-prob under the same
distribution: μ as ALGORITHMS.md defines it, "of the distribution it actually sampled from". The same generator state
gives the same tokens.

Positions follow the rule of :mod:`steadyrl.rollout.rollouts`: prompt token j of a left-padded row sits at (number of
real tokens before it), response token t at ``prompt_len + t``, so the learner's recompute over
``[prompt; response]`` sees exactly the positions the sampler used.

Each distinct prompt is prefilled once and its logits and KV cache are repeated G times. Rows that have ended keep
being fed padding (their outputs are discarded) so the batch keeps its shape; generation stops when every row ended.
Confidence: [exact] (μ is defined by this code; no paper formula involved).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from steadyrl.rollout.distribution import SamplingParams, check_sampling_params, entropy_from_log_probs
from steadyrl.rollout.distribution import sampling_log_probs as _sampling_log_probs
from steadyrl.rollout.rollouts import PAD_VERSION, Rollouts


def positions_from_mask(mask: Tensor) -> Tensor:
    """Position ids of a (left-)padded sequence: number of real tokens before each one (0 at leading pads)."""
    return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the KV-cache argument of ``model.forward``: ``cache`` (transformers ≥ 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class EncodedPrompts(NamedTuple):
    """Left-padded prompt tokens: ``ids`` ``[n, P]`` int64 and ``mask`` ``[n, P]`` bool."""

    ids: Tensor
    mask: Tensor


def stop_token_ids(model: object, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens that end a response by default: the tokenizer's EOS, then every ``eos_token_id`` of the model's
    ``generation_config`` (an int or a list) not already there.

    Chat checkpoints list their end-of-turn token there, and it is not always the tokenizer's EOS (e.g. a Llama 3
    Instruct tokenizer whose EOS is ``<|end_of_text|>`` with ``<|eot_id|>`` in ``generation_config.json``): without it
    a turn would run on to the token budget. vLLM stops at the same set by default.
    """
    ids: list[int] = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *, device: torch.device
) -> EncodedPrompts:
    """Encode ``prompts`` as the tokenizer does (BOS and all), padded on the left."""
    enc = tokenizer(list(prompts), padding=True, padding_side="left", return_tensors="pt")
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()
    empty = (~mask.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompts {empty} encode to no token (the tokenizer adds no BOS); give them some text")
    return EncodedPrompts(ids, mask)


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator,
    version: int,
    use_cache: bool = True,
    record_entropy: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    before_forward: Callable[[], int] | None = None,
) -> Rollouts:
    """Sample ``group_size`` responses for each prompt; N = ``len(prompts) * group_size`` rows.

    Args:
        model: a causal LM (any ``AutoModelForCausalLM``); its mode and weights are left untouched.
        tokenizer: encodes the prompts (left padding) and decodes ``texts``; its ``pad_token_id`` pads.
        prompts: the prompt texts; prompt i's samples are rows ``i*G … i*G+G−1``.
        group_size: G, samples per prompt.
        max_new_tokens: a row stops at its first EOS or after this many tokens (then ``truncated``).
        temperature, top_p, top_k: the sampling distribution (see :mod:`steadyrl.rollout.distribution`).
        generator: source of every random draw; must live on the model's device.
        version: policy version of the weights; recorded for every sampled token (−1 at padding).
        use_cache: decode with a KV cache (default); False re-runs the whole sequence each step (for tests).
        record_entropy: also return the entropy of the sampling distribution at each step (``behav_entropy``).
        eos_token_ids: tokens that end a response (default: :func:`stop_token_ids`, the tokenizer's EOS and the
            model generation config's).
        before_forward: in-flight weight updates (PipelineRL/AReaL partial rollouts): called before the prefill and
            before every decode forward; it may load newer weights into ``model`` in place and returns the version
            of the weights that forward will use. Each token records the version of the forward whose logits it was
            drawn from (the KV cache of earlier tokens is kept, as those systems do). None: every token has
            ``version``.

    Returns:
        :class:`Rollouts` with ``T`` = the longest response (≤ ``max_new_tokens``); ``behav_logp`` is
        log μ(y_t) of the tempered and truncated distribution each token was drawn from.
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    check_sampling_params(params)
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if group_size < 1 or max_new_tokens < 1:
        raise ValueError(f"group_size and max_new_tokens must be >= 1, got {group_size} and {max_new_tokens}")
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its EOS) before sampling")
    stop_ids = stop_token_ids(model, tokenizer) if eos_token_ids is None else list(eos_token_ids)
    if not stop_ids or any(i is None for i in stop_ids):
        raise ValueError("no EOS token id: pass eos_token_ids or use a tokenizer with an eos_token")
    device = next(model.parameters()).device
    pad_id = int(tokenizer.pad_token_id)
    stop = torch.tensor(stop_ids, device=device)
    prompts_enc = encode_prompts(tokenizer, prompts, device=device)
    with torch.no_grad():
        steps = _decode(
            model,
            prompts=prompts_enc,
            group_size=group_size,
            params=params,
            max_new_tokens=max_new_tokens,
            stop_ids=stop,
            pad_id=pad_id,
            generator=generator,
            use_cache=use_cache,
            record_entropy=record_entropy,
            before_forward=before_forward or (lambda: version),
        )
    return _assemble(
        steps,
        prompt_ids=prompts_enc.ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompts_enc.mask.repeat_interleave(group_size, dim=0),
        tokenizer=tokenizer,
        stop_ids=stop,
        pad_id=pad_id,
        group_size=group_size,
    )


@dataclass
class _Steps:
    """Per-step outputs of the decoding loop (lists of ``[N]`` tensors, stacked by :func:`_assemble`)."""

    tokens: list[Tensor] = field(default_factory=list)
    logps: list[Tensor] = field(default_factory=list)
    alive: list[Tensor] = field(default_factory=list)  # the row had not stopped before this step
    entropies: list[Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # version of the forward each step's token was drawn from
    stopped: Tensor | None = None  # [N] the row emitted a stop token


def _decode(
    model: PreTrainedModel,
    *,
    prompts: EncodedPrompts,
    group_size: int,
    params: SamplingParams,
    max_new_tokens: int,
    stop_ids: Tensor,
    pad_id: int,
    generator: torch.Generator,
    use_cache: bool,
    record_entropy: bool,
    before_forward: Callable[[], int],
) -> _Steps:
    cache_kw = {cache_kwarg(model): DynamicCache(config=model.config)} if use_cache else {}
    logits_version = before_forward()
    out = model(  # prefill each distinct prompt once, then repeat its logits and KV cache G times
        input_ids=prompts.ids,
        attention_mask=prompts.mask.long(),
        position_ids=positions_from_mask(prompts.mask),
        use_cache=use_cache,
        logits_to_keep=1,
        **cache_kw,
    )
    logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)
    for cache in cache_kw.values():
        cache.batch_repeat_interleave(group_size)
    seq_ids = prompts.ids.repeat_interleave(group_size, dim=0)
    seq_mask = prompts.mask.repeat_interleave(group_size, dim=0)
    N = seq_ids.shape[0]
    prompt_len = seq_mask.sum(dim=-1)
    finished = torch.zeros(N, dtype=torch.bool, device=seq_ids.device)
    steps = _Steps()
    for t in range(max_new_tokens):
        log_mu = _sampling_log_probs(logits, params=params)  # [N, V], log μ
        token = torch.multinomial(log_mu.exp(), 1, generator=generator).squeeze(-1)  # y_t ~ μ
        steps.logps.append(log_mu.gather(-1, token.unsqueeze(-1)).squeeze(-1))  # log μ(y_t)
        if record_entropy:
            steps.entropies.append(entropy_from_log_probs(log_mu))
        steps.alive.append(~finished)
        steps.versions.append(logits_version)
        token = token.masked_fill(finished, pad_id)
        steps.tokens.append(token)
        finished = finished | torch.isin(token, stop_ids)
        if t + 1 == max_new_tokens or bool(finished.all()):
            break
        seq_ids = torch.cat([seq_ids, token.unsqueeze(-1)], dim=-1)
        seq_mask = torch.cat([seq_mask, torch.ones_like(finished).unsqueeze(-1)], dim=-1)
        logits_version = before_forward()
        if use_cache:  # feed only the new token at position prompt_len + t
            out = model(
                input_ids=token.unsqueeze(-1),
                attention_mask=seq_mask.long(),
                position_ids=(prompt_len + t).unsqueeze(-1),
                use_cache=True,
                logits_to_keep=1,
                **cache_kw,
            )
        else:  # recompute the whole sequence (reference path)
            out = model(
                input_ids=seq_ids,
                attention_mask=seq_mask.long(),
                position_ids=positions_from_mask(seq_mask),
                use_cache=False,
                logits_to_keep=1,
            )
        logits = out.logits[:, -1]
    steps.stopped = finished
    return steps


def _assemble(
    steps: _Steps,
    *,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Tensor,
    pad_id: int,
    group_size: int,
) -> Rollouts:
    response_ids = torch.stack(steps.tokens, dim=-1)
    response_mask = torch.stack(steps.alive, dim=-1)  # the EOS is included: the row was alive when it drew it
    N = response_ids.shape[0]
    zeros = torch.zeros_like(response_ids, dtype=torch.float32)
    behav_logp = torch.where(response_mask, torch.stack(steps.logps, dim=-1), zeros)
    step_versions = torch.tensor(steps.versions, dtype=response_ids.dtype, device=response_ids.device)
    versions = torch.where(response_mask, step_versions.expand_as(response_ids), PAD_VERSION)
    entropy = None
    if steps.entropies:
        entropy = torch.where(response_mask, torch.stack(steps.entropies, dim=-1), zeros)
    keep = response_mask & ~torch.isin(response_ids, stop_ids)  # decoded text: no EOS, no padding
    rows = [row[k].tolist() for row, k in zip(response_ids, keep, strict=True)]
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    stopped = steps.stopped if steps.stopped is not None else torch.zeros_like(response_mask[:, 0])
    return Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        behav_logp=behav_logp,
        versions=versions,
        group_ids=torch.arange(N, device=response_ids.device) // group_size,
        truncated=~stopped,
        texts=texts,
        pad_id=pad_id,
        behav_entropy=entropy,
    )
