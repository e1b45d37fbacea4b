"""Batched sampling with a KV cache from any ``transformers`` causal LM, recording behavior log-probs and versions.

The model is called directly (not ``model.generate``): one prefill over the left-padded prompts, then one forward per
new token with the KV cache. Every row draws its next token from the sampling distribution of
:func:`steadyrl.rollout.distribution.sampling_log_probs` (temperature, top-k, top-p, renormalized) with
``torch.multinomial`` and the caller's ``torch.Generator``, and records that token's log-prob under the same
distribution: μ as docs/algorithms.md has it, "of the distribution it actually sampled from". The same generator state
gives the same tokens.

Positions follow the rule of :mod:`steadyrl.rollout.rollouts`: prompt token j of a left-padded row sits at (number of
real tokens before it), response token t at ``prompt_len + t``, so the learner's recompute over
``[prompt; response]`` sees exactly the positions the sampler used.

Each distinct prompt is prefilled once and its logits and KV cache are repeated G times. Rows that have ended are fed
padding (their outputs are discarded) until a compaction drops them; generation stops when every row ended.

Two things keep the decode loop's cost to the rows and positions that need it:

* **Row compaction**: once the rows still generating are at most ``COMPACT_BELOW`` of the forward's batch, the rows
  that ended leave it (their cache rows are dropped), so later forwards run on the live rows only. The draw still
  covers all N rows (:class:`_Sampler`), so the same generator state gives the same tokens as without compaction.
* **A preallocated KV cache** for long generations (``max_new_tokens ≥ PREALLOCATE_MIN_NEW_TOKENS``) when every layer
  of the model's ``DynamicCache`` is a plain full-attention layer (Llama, Qwen2, most decoders): keys and values are
  written in place into buffers that double when full (:class:`PreallocatedLayer`) instead of concatenated at every
  token. Sliding-window, hybrid and linear-attention models keep their ``DynamicCache``. The attention mask is one
  buffer (:class:`_GrowingMask`) either way. Attention reads exactly the filled positions, so the logits are the same.

Confidence: [exact] (μ is defined by this code; no paper formula involved).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from steadyrl.base.device import LaggedCount
from steadyrl.core.objectives.score_centering import EXACT_VOCAB_LIMIT
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


#: Decode positions the KV-cache and mask buffers are first allocated for (beyond the prompt); a longer generation
#: doubles them (at most log2(max_new_tokens / INITIAL_ROOM) copies instead of one concatenation per token).
INITIAL_ROOM: int = 64
#: Generations of at least this many new tokens decode with a :class:`PreallocatedLayer` cache (when the model's layers
#: allow it). Measured once, when this was written (old against new code; docs/scale.md), on the CPU (1M-parameter
#: default model, 128 rows, 1 thread, CPU time against the growing
#: ``DynamicCache``): 12 tokens 1.12× (slower: fresh buffers fault their pages in, strided K/V views slow the CPU
#: flash-attention kernel), 48 tokens 1.0×, 200 tokens 0.88×, as the concatenation cost grows with the length.
PREALLOCATE_MIN_NEW_TOKENS: int = 128
#: Rows that ended leave the decode forward (row compaction) once the rows still generating are at most this fraction
#: of the batch the forward runs on: each compaction copies the cache once, each forward then skips the ended rows.
COMPACT_BELOW: float = 0.75


class PreallocatedLayer(CacheLayerMixin):
    """One attention layer's KV cache in buffers written in place: ``keys``/``values`` ``[N, H, allocated, D]``.

    :meth:`update` writes the new positions into the buffers and returns views of the filled prefix
    ``[N, H, length, D]``: what a ``DynamicLayer`` returns, without its ``torch.cat`` of the whole cache at every
    token. The buffers hold ``INITIAL_ROOM`` positions beyond the prefill and double when full, up to ``capacity``.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, keys: Tensor, values: Tensor, *, length: int, capacity: int) -> None:
        super().__init__()
        if keys.shape[:3] != values.shape[:3] or not 0 <= length <= keys.shape[2] <= capacity:
            raise ValueError(
                f"keys {tuple(keys.shape)}, values {tuple(values.shape)}, length {length} and capacity {capacity} "
                "disagree"
            )
        self.keys, self.values = keys, values
        self.length = length
        self.capacity = capacity
        self.device = keys.device
        self.is_initialized = True

    @classmethod
    def from_prefill(cls, layer: DynamicLayer, *, repeats: int, capacity: int) -> PreallocatedLayer:
        """``layer``'s keys and values with each row repeated ``repeats`` times (row i → rows i·repeats …
        i·repeats + repeats − 1, as ``repeat_interleave``), in buffers with room for more positions."""
        length = layer.keys.shape[2]
        allocated = min(capacity, length + INITIAL_ROOM)
        filled = []
        for src in (layer.keys, layer.values):
            n, heads, _, dim = src.shape
            buf = src.new_empty(n * repeats, heads, allocated, dim)
            buf[:, :, :length] = src.repeat_interleave(repeats, dim=0)
            filled.append(buf)
        return cls(filled[0], filled[1], length=length, capacity=max(capacity, length))

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Never needed: the buffers exist from construction."""
        raise RuntimeError("a PreallocatedLayer is built from its prefill (PreallocatedLayer.from_prefill)")

    def _grow(self, needed: int) -> None:
        if needed > self.capacity:
            raise RuntimeError(f"KV cache full: {needed} positions needed, capacity {self.capacity}")
        allocated = min(self.capacity, max(needed, 2 * self.keys.shape[2]))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(*old.shape[:2], allocated, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Write ``key_states``/``value_states`` ``[N, H, q, D]`` at the next q positions; return the filled prefix."""
        end = self.length + key_states.shape[-2]
        if end > self.keys.shape[2]:
            self._grow(end)
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep only the rows ``indices`` (as ``DynamicLayer``; copies the kept rows' buffers)."""
        self.keys, self.values = self.keys[indices], self.values[indices]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv length, kv offset) of the mask for ``query_length`` new positions (as ``DynamicLayer``)."""
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Positions filled so far."""
        return self.length

    def get_max_length(self) -> int:
        """The most positions the layer will hold."""
        return self.capacity


def expand_prefill_cache(cache: Cache, *, repeats: int, capacity: int) -> Cache:
    """The decode cache after a prefill of the distinct prompts: every row repeated ``repeats`` times.

    A :class:`PreallocatedLayer` cache with room for ``capacity`` positions when every layer is a plain
    ``DynamicLayer`` (full attention); otherwise ``cache`` itself, repeated in place (``batch_repeat_interleave``).
    """
    layers = list(cache.layers)
    if layers and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers):
        return Cache(
            layers=[PreallocatedLayer.from_prefill(layer, repeats=repeats, capacity=capacity) for layer in layers]
        )
    cache.batch_repeat_interleave(repeats)
    return cache


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
    lagged_reads: bool | None = None,
    record_dist: int | None = None,
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
        record_dist: also return the sampling distribution at each step (``behav_dist_logp``, score centering):
            None (default) not at all; 0 all V log-probs (vocabularies up to
            :data:`~steadyrl.core.objectives.score_centering.EXACT_VOCAB_LIMIT` tokens); k ≥ 1 the k most likely
            tokens' log-probs and ids (``behav_dist_ids``). Recording draws no random number: the tokens are the
            same with or without it.
        eos_token_ids: tokens that end a response (default: :func:`stop_token_ids`, the tokenizer's EOS and the
            model generation config's).
        before_forward: in-flight weight updates (PipelineRL/AReaL partial rollouts): called before the prefill and
            before every decode forward; it may load newer weights into ``model`` in place and returns the version
            of the weights that forward will use. Each token records the version of the forward whose logits it was
            drawn from (the KV cache of earlier tokens is kept, as those systems do). None: every token has
            ``version``.
        lagged_reads: how the loop learns how many rows still run (to stop, and to drop ended rows from the
            forward): None (default) reads it without waiting on a GPU (:class:`~steadyrl.base.device.LaggedCount`:
            a count one or a few steps old, so no decoded token stalls the host; ended rows may run a few steps
            longer, fed padding, and trailing steps where every row had ended are dropped) and at once on the CPU,
            where a read costs no stall. True forces the lagged form (tests); the samples of a row are its tokens
            either way, but the random stream of a batch depends on which rows a forward holds.

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
    if record_dist is not None:
        check_record_dist(record_dist, vocab_size=_vocab_size(model))
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
            lagged_reads=lagged_reads,
            record_dist=record_dist,
        )
    return assemble_rollouts(
        steps,
        prompt_ids=prompts_enc.ids.repeat_interleave(group_size, dim=0),
        prompt_mask=prompts_enc.mask.repeat_interleave(group_size, dim=0),
        tokenizer=tokenizer,
        stop_ids=stop,
        pad_id=pad_id,
        group_size=group_size,
    )


@dataclass
class DecodeSteps:
    """Per-step outputs of the decoding loop (lists of ``[N]`` tensors, stacked by :func:`assemble_rollouts`)."""

    tokens: list[Tensor] = field(default_factory=list)
    logps: list[Tensor] = field(default_factory=list)
    alive: list[Tensor] = field(default_factory=list)  # the row had not stopped before this step
    entropies: list[Tensor] = field(default_factory=list)
    dists: list[Tensor] = field(default_factory=list)  # [N, K] log μ of the recorded tokens (record_dist)
    dist_ids: list[Tensor] = field(default_factory=list)  # [N, K] their ids (top-k)
    versions: list[int] = field(default_factory=list)  # version of the forward each step's token was drawn from
    stopped: Tensor | None = None  # [N] the row emitted a stop token


class _GrowingMask:
    """The decode loop's attention mask ``[n, length]`` (int64, as models take it) in one buffer: the prompts'
    padding mask, then ones; allocated for :data:`INITIAL_ROOM` new positions and doubled when a longer view is asked
    for (never beyond ``capacity``), so no step concatenates."""

    def __init__(self, prompt_mask: Tensor, *, capacity: int) -> None:
        self.capacity = capacity
        P = prompt_mask.shape[1]
        self.buf = prompt_mask.new_ones((prompt_mask.shape[0], min(capacity, P + INITIAL_ROOM)), dtype=torch.long)
        self.buf[:, :P] = prompt_mask

    def view(self, length: int) -> Tensor:
        """The mask of the first ``length`` positions (a view of the buffer)."""
        if length > self.buf.shape[1]:
            grown = self.buf.new_ones((self.buf.shape[0], min(self.capacity, max(length, 2 * self.buf.shape[1]))))
            grown[:, : self.buf.shape[1]] = self.buf
            self.buf = grown
        return self.buf[:, :length]

    def select(self, rows: Tensor) -> None:
        """Keep only ``rows`` (indices into the current rows)."""
        self.buf = self.buf[rows]


class _Draw(NamedTuple):
    """One step's draw for all N rows: ``token`` [N] int64, ``logp`` [N] = log μ(token), ``entropy`` [N] or None,
    ``dist`` [N, K] recorded log μ (``record_dist``) or None, ``dist_ids`` [N, K] their ids (top-k) or None."""

    token: Tensor
    logp: Tensor
    entropy: Tensor | None
    dist: Tensor | None = None
    dist_ids: Tensor | None = None


def _vocab_size(model: PreTrainedModel) -> int | None:
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    return int(head.weight.shape[0]) if head is not None and hasattr(head, "weight") else None


def check_record_dist(record_dist: int | None, *, vocab_size: int | None) -> None:
    """Raise ``ValueError`` for a ``record_dist`` the sampler cannot honour (negative, or the full distribution of a
    vocabulary above the exact form's limit)."""
    if record_dist is None:
        return
    if record_dist < 0:
        raise ValueError(f"record_dist must be None, 0 (the full distribution) or k >= 1 (its top-k): {record_dist}")
    if record_dist == 0 and vocab_size is not None and vocab_size > EXACT_VOCAB_LIMIT:
        raise ValueError(
            f"recording the full behavior distribution is allowed up to {EXACT_VOCAB_LIMIT} tokens; this model's "
            f"vocabulary has {vocab_size}: use the top-k form (method.objective.top_k=16, for example)"
        )


def _record(log_mu: Tensor, k: int | None) -> tuple[Tensor | None, Tensor | None]:
    """(log μ of the recorded tokens [n, K], their ids [n, K] or None): all V (k = 0) or the k most likely."""
    if k is None:
        return None, None
    if k == 0:
        return log_mu, None
    if k >= log_mu.shape[-1]:  # a head as large as the vocabulary: every token, in id order
        return log_mu, torch.arange(log_mu.shape[-1], device=log_mu.device).expand_as(log_mu).contiguous()
    values, ids = torch.topk(log_mu, k, dim=-1)
    return values, ids


class _Sampler:
    """Draws y_t ~ μ for every row with one ``torch.multinomial`` over all N rows, also when the model ran on a subset.

    ``torch.multinomial(p, 1)`` draws row by row from one stream of random numbers whose length depends only on
    p's shape, and each row's token depends only on that row of p. So the rows that ended can leave the forward (row
    compaction) while the draw still covers ``[N, V]``: their rows hold the last distribution they had (any valid one
    does; their tokens are discarded), and every other row gets exactly the token it would get without compaction.
    """

    def __init__(
        self, *, params: SamplingParams, generator: torch.Generator, record_entropy: bool,
        record_dist: int | None = None,
    ) -> None:  # fmt: skip
        self.params = params
        self.generator = generator
        self.record_entropy = record_entropy
        self.record_dist = record_dist
        self.probs: Tensor | None = None  # [N, V] μ of every row, kept once rows have left the forward

    def draw(self, logits: Tensor, rows: Tensor | None) -> _Draw:
        """Draw from the logits of ``rows`` (indices into the N rows; None: ``logits`` has all N rows)."""
        log_mu = _sampling_log_probs(logits, params=self.params)  # [n, V], log μ
        entropy = entropy_from_log_probs(log_mu) if self.record_entropy else None
        dist, dist_ids = _record(log_mu, self.record_dist)
        if rows is None:
            token = torch.multinomial(log_mu.exp(), 1, generator=self.generator).squeeze(-1)  # y_t ~ μ
            return _Draw(token, log_mu.gather(-1, token.unsqueeze(-1)).squeeze(-1), entropy, dist, dist_ids)
        if self.probs is None:
            raise RuntimeError("rows left the forward before a draw over all rows")
        self.probs.index_copy_(0, rows, log_mu.exp())
        token = torch.multinomial(self.probs, 1, generator=self.generator).squeeze(-1)  # all N rows: the same stream
        logp = log_mu.new_zeros(token.shape).index_copy_(0, rows, log_mu.gather(-1, token[rows].unsqueeze(-1))[:, 0])
        if entropy is not None:
            entropy = entropy.new_zeros(token.shape).index_copy_(0, rows, entropy)
        if dist is not None:  # rows out of the forward have ended: their entries are padding
            dist = dist.new_full((token.shape[0], dist.shape[-1]), -torch.inf).index_copy_(0, rows, dist)
        if dist_ids is not None:
            dist_ids = dist_ids.new_zeros((token.shape[0], dist_ids.shape[-1])).index_copy_(0, rows, dist_ids)
        return _Draw(token, logp, entropy, dist, dist_ids)

    def keep_all(self, logits: Tensor) -> None:
        """Remember μ of all N rows (from their full-batch ``logits``) before the first compaction."""
        self.probs = _sampling_log_probs(logits, params=self.params).exp()


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
    lagged_reads: bool | None = None,
    record_dist: int | None = None,
) -> DecodeSteps:
    n_prompts, P = prompts.ids.shape
    N = n_prompts * group_size
    capacity = P + max_new_tokens - 1  # positions ever fed: the prompt, then every drawn token but the last
    prefill_cache = DynamicCache(config=model.config) if use_cache else None
    kw = cache_kwarg(model)
    logits_version = before_forward()
    out = model(  # prefill each distinct prompt once, then repeat its logits and KV cache G times
        input_ids=prompts.ids,
        attention_mask=prompts.mask.long(),
        position_ids=positions_from_mask(prompts.mask),
        use_cache=use_cache,
        logits_to_keep=1,
        **({kw: prefill_cache} if use_cache else {}),
    )
    logits = out.logits[:, -1].repeat_interleave(group_size, dim=0)
    cache: Cache | None = None
    if prefill_cache is not None:
        preallocate = max_new_tokens >= PREALLOCATE_MIN_NEW_TOKENS
        if preallocate:
            cache = expand_prefill_cache(prefill_cache, repeats=group_size, capacity=capacity)
        else:
            prefill_cache.batch_repeat_interleave(group_size)
            cache = prefill_cache
    mask = _GrowingMask(prompts.mask.repeat_interleave(group_size, dim=0), capacity=capacity)
    seq_ids = None if use_cache else prompts.ids.repeat_interleave(group_size, dim=0)
    prompt_len = mask.view(P).sum(dim=-1)
    rows: Tensor | None = None  # the rows in the forward (indices into N); None: all of them
    sampler = _Sampler(params=params, generator=generator, record_entropy=record_entropy, record_dist=record_dist)
    finished = torch.zeros(N, dtype=torch.bool, device=prompts.ids.device)
    alive = LaggedCount(finished.device, lagged=lagged_reads)
    steps = DecodeSteps()
    for t in range(max_new_tokens):
        draw = sampler.draw(logits, rows)
        steps.logps.append(draw.logp)
        if draw.entropy is not None:
            steps.entropies.append(draw.entropy)
        if draw.dist is not None:
            steps.dists.append(draw.dist)
        if draw.dist_ids is not None:
            steps.dist_ids.append(draw.dist_ids)
        steps.alive.append(~finished)
        steps.versions.append(logits_version)
        token = draw.token.masked_fill(finished, pad_id)
        steps.tokens.append(token)
        finished = finished | torch.isin(token, stop_ids)
        alive.push((~finished).sum())  # read without waiting on a GPU (a count one or a few steps old)
        n_alive = alive.latest()
        if t + 1 == max_new_tokens or n_alive == 0:
            break
        batch = N if rows is None else rows.numel()
        if cache is not None and n_alive is not None and n_alive <= COMPACT_BELOW * batch:  # ended rows leave
            keep = (~finished if rows is None else ~finished[rows]).nonzero().flatten()  # into the batch's rows
            if keep.numel() < batch:
                if rows is None:
                    sampler.keep_all(logits)
                rows = keep if rows is None else rows[keep]
                cache.batch_select_indices(keep)
                mask.select(keep)
                prompt_len = prompt_len[keep]
        attention = mask.view(P + t + 1)  # ended rows still in the batch are fed padding and attended
        logits_version = before_forward()
        if cache is not None:  # feed only the new token at position prompt_len + t
            fed = token if rows is None else token[rows]
            out = model(
                input_ids=fed.unsqueeze(-1),
                attention_mask=decode_mask(attention, model) if alive.lagged else attention,
                position_ids=(prompt_len + t).unsqueeze(-1),
                use_cache=True,
                logits_to_keep=1,
                **{kw: cache},
            )
        else:  # recompute the whole sequence (reference path)
            seq_ids = torch.cat([seq_ids, token.unsqueeze(-1)], dim=-1)
            out = model(
                input_ids=seq_ids,
                attention_mask=attention,
                position_ids=positions_from_mask(attention),
                use_cache=False,
                logits_to_keep=1,
            )
        logits = out.logits[:, -1]
    steps.stopped = finished
    if alive.lagged:  # a count read late may have run steps after every row had ended: drop them (one read)
        ran = int(torch.stack(steps.alive).any(dim=1).nonzero().max()) + 1
        for name in ("tokens", "logps", "entropies", "dists", "dist_ids", "alive", "versions"):
            values = getattr(steps, name)
            del values[ran:]
    return steps


def decode_mask(attention: Tensor, model: nn.Module) -> Tensor:
    """The one-token decode step's attention mask ``[n, 1, 1, length]``, built here so the model uses it as it is.

    Given the 2-D padding mask, ``transformers`` checks whether it may skip the mask (``masking_utils``: whether
    every position is attended), which reads the mask's values on the host once per forward: on a GPU, a stall per
    decoded token. A 4-D mask is taken as prepared. For one query token the causal part is empty (every kept position
    precedes it), so the mask is the padding mask itself: boolean for SDPA, additive (0 or the dtype's lowest) for
    the eager implementation. Other implementations get the 2-D mask (and their own reads).
    """
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    keep = attention.bool()[:, None, None, :]
    if implementation == "sdpa":
        return keep
    if implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)
    return attention

def assemble_rollouts(
    steps: DecodeSteps,
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
    dist = ids = None
    if steps.dists:
        alive = response_mask.unsqueeze(-1)
        stacked = torch.stack(steps.dists, dim=1)  # [N, T, K]
        dist = torch.where(alive, stacked.to(torch.promote_types(stacked.dtype, torch.float32)), -torch.inf)
        if steps.dist_ids:
            ids = torch.where(alive, torch.stack(steps.dist_ids, dim=1), 0)
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
        behav_dist_logp=dist,
        behav_dist_ids=ids,
    )
