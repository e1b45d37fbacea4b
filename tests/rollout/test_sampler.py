"""generate(): behavior log-probs, KV cache, determinism, EOS and masks, left padding, row compaction, the
preallocated KV cache."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from steadyrl.rollout import sampler
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.sampler import PreallocatedLayer, expand_prefill_cache, generate, stop_token_ids
from tests.rollout.test_distribution import reference_log_probs

PROMPTS = ["12+34=", "5-7=", "1+2+30-4=", "9="]  # different lengths: left padding is exercised
G = 3
MAX_NEW = 8


def sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str] = PROMPTS, *,
           seed: int = 0, **kwargs: object):
    options = {"group_size": G, "max_new_tokens": MAX_NEW, "version": 7} | kwargs
    return generate(model, tokenizer, prompts, generator=torch.Generator().manual_seed(seed), **options)


def test_layout_and_versions(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer)
    N = len(PROMPTS) * G
    assert r.response_ids.shape[0] == N == len(r.texts)
    assert r.response_ids.shape[1] <= MAX_NEW
    assert r.group_ids.tolist() == [i for i in range(len(PROMPTS)) for _ in range(G)]
    enc = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    torch.testing.assert_close(r.prompt_ids, enc["input_ids"].repeat_interleave(G, dim=0))
    assert (r.prompt_ids[:, 0] == tokenizer.pad_token_id).any()  # left padding happened
    assert r.behav_logp.dtype == torch.float32 and r.versions.dtype == torch.int64
    assert (r.versions[r.response_mask] == 7).all() and (r.versions[~r.response_mask] == -1).all()


def test_behavior_logp_is_the_sampling_distribution(model: PreTrainedModel,
                                                     tokenizer: PreTrainedTokenizerFast) -> None:
    """Recompute each row alone (no padding, full forward, float64 reference warping) and compare within 1e-5."""
    params = {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    r = sample(model, tokenizer, **params)
    for i in range(len(r)):
        prompt = r.prompt_ids[i][r.prompt_mask[i]]
        response = r.response_ids[i][r.response_mask[i]]
        with torch.no_grad():
            logits = model(torch.cat([prompt, response]).unsqueeze(0)).logits[0].double()
        for t, token in enumerate(response.tolist()):
            ref = reference_log_probs(logits[len(prompt) - 1 + t].tolist(), **params)[token]
            assert abs(r.behav_logp[i, t].item() - ref) < 1e-5
    assert (r.behav_logp[~r.response_mask] == 0).all()


def test_behavior_logp_equals_learner_recompute_at_t1(model: PreTrainedModel,
                                                       tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer)
    logp, _ = sequence_logprobs(model, r)
    torch.testing.assert_close(logp, r.behav_logp, atol=1e-5, rtol=0)
    # ... and with the sampler's truncation, the learner's recompute matches too
    params = {"temperature": 0.7, "top_p": 0.9, "top_k": 5}
    r = sample(model, tokenizer, **params)
    logp, _ = sequence_logprobs(model, r, **params)
    torch.testing.assert_close(logp, r.behav_logp, atol=1e-5, rtol=0)


def test_kv_cache_matches_full_recompute(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    cached = sample(model, tokenizer, seed=3, top_p=0.95)
    full = sample(model, tokenizer, seed=3, top_p=0.95, use_cache=False)
    assert torch.equal(cached.response_ids, full.response_ids)
    assert torch.equal(cached.response_mask, full.response_mask)
    torch.testing.assert_close(cached.behav_logp, full.behav_logp, atol=1e-5, rtol=0)


def test_deterministic_for_a_generator_state(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    a, b = sample(model, tokenizer, seed=11), sample(model, tokenizer, seed=11)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.behav_logp, b.behav_logp)
    assert a.texts == b.texts
    assert not torch.equal(a.response_ids, sample(model, tokenizer, seed=12).response_ids)


def test_eos_ends_a_row_and_is_trained_on(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    """Many stop tokens make rows end at different steps; masks, padding, texts and ``truncated`` follow."""
    stops = tokenizer.convert_tokens_to_ids(list("0123456789+-=abcdefghij"))
    r = sample(model, tokenizer, eos_token_ids=stops, max_new_tokens=6)
    is_stop = torch.isin(r.response_ids, torch.tensor(stops))
    lengths = r.response_mask.sum(dim=-1)
    assert len(set(lengths.tolist())) > 1, "rows should end at different steps"
    for i in range(len(r)):
        L = int(lengths[i])
        assert r.response_mask[i, :L].all() and not r.response_mask[i, L:].any()  # mask is a prefix
        assert (r.response_ids[i, L:] == tokenizer.pad_token_id).all()
        first_stop = is_stop[i, :L].nonzero().flatten().tolist()
        if r.truncated[i]:
            assert L == 6 and not first_stop
        else:
            assert first_stop == [L - 1]  # ends at its first stop token, which is in the mask
        kept = r.response_ids[i, : L - (0 if r.truncated[i] else 1)]
        assert r.texts[i] == tokenizer.decode(kept, skip_special_tokens=True)
        assert (r.behav_logp[i, :L] < 0).all() and (r.behav_logp[i, L:] == 0).all()


def test_stops_early_when_every_row_ended(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    every_token = list(range(len(tokenizer)))
    r = sample(model, tokenizer, eos_token_ids=every_token)
    assert r.response_ids.shape[1] == 1 and r.response_mask.all() and not r.truncated.any()
    assert r.texts == [tokenizer.decode([])] * len(r) or all(t == "" for t in r.texts)


def test_left_padding_gives_the_per_row_result_of_each_prompt_alone(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Greedy tokens (top_k = 1) and sampled-token log-probs do not depend on the other prompts of the batch."""
    batch = sample(model, tokenizer, top_k=1)
    sampled = sample(model, tokenizer)
    batch_logp, _ = sequence_logprobs(model, sampled)
    for i, prompt in enumerate(PROMPTS):
        rows = slice(i * G, (i + 1) * G)
        alone = sample(model, tokenizer, [prompt], top_k=1)
        T = alone.response_ids.shape[1]
        assert torch.equal(alone.response_ids, batch.response_ids[rows, :T])
        assert not batch.response_mask[rows, T:].any()
        alone_logp, _ = sequence_logprobs(model, sampled.select(range(i * G, (i + 1) * G)))
        T = alone_logp.shape[1]
        torch.testing.assert_close(alone_logp, batch_logp[rows, :T], atol=1e-5, rtol=0)
        torch.testing.assert_close(alone_logp, sampled.behav_logp[rows, :T], atol=1e-5, rtol=0)


def test_record_entropy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer, record_entropy=True, top_k=5)
    assert r.behav_entropy is not None
    _, entropy = sequence_logprobs(model, r, top_k=5, return_entropy=True)
    torch.testing.assert_close(r.behav_entropy, entropy, atol=1e-5, rtol=0)
    assert (r.behav_entropy[r.response_mask] <= torch.log(torch.tensor(5.0)) + 1e-6).all()
    assert sample(model, tokenizer).behav_entropy is None


@pytest.mark.parametrize("kwargs", [{"group_size": 0}, {"max_new_tokens": 0}, {"temperature": 0.0}, {"top_p": 2.0}])
def test_bad_arguments_raise(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        sample(model, tokenizer, **kwargs)


def test_the_generation_configs_end_of_turn_tokens_stop_by_default(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    """A chat checkpoint's end-of-turn token listed in ``generation_config.eos_token_id`` (but not the tokenizer's
    EOS) ends a response when no ``eos_token_ids`` are passed: the default equals passing EOS + those tokens."""
    import copy

    eos = int(tokenizer.eos_token_id)
    extra = tokenizer.convert_tokens_to_ids(list("0123456789+-=abcdefghij"))
    chat = copy.deepcopy(model)
    chat.generation_config.eos_token_id = [eos, *extra]
    assert stop_token_ids(chat, tokenizer) == [eos, *extra]
    chat.generation_config.eos_token_id = extra[0]  # an int, as many configs write it
    assert stop_token_ids(chat, tokenizer) == [eos, extra[0]]
    chat.generation_config.eos_token_id = None
    assert stop_token_ids(chat, tokenizer) == [eos]
    chat.generation_config.eos_token_id = extra
    by_default = sample(chat, tokenizer, max_new_tokens=6)
    explicit = sample(model, tokenizer, max_new_tokens=6, eos_token_ids=[eos, *extra])
    assert torch.equal(by_default.response_mask, explicit.response_mask) and by_default.texts == explicit.texts
    assert len(set(by_default.response_mask.sum(-1).tolist())) > 1  # the extra tokens ended rows early


#: Stop tokens that make rows of the random test model end at different steps (so compaction happens).
MANY_STOPS = list("0123456789+-=abcdefghij")


def _state_after(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, **kwargs: object):
    g = torch.Generator().manual_seed(5)
    options = {"group_size": G, "max_new_tokens": MAX_NEW, "version": 0, "record_entropy": True} | kwargs
    r = generate(model, tokenizer, PROMPTS, generator=g, **options)
    return r, g.get_state()


def test_row_compaction_draws_the_tokens_of_the_full_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping ended rows from the forward changes neither the tokens, μ, the entropies nor the generator's state."""
    stops = tokenizer.convert_tokens_to_ids(MANY_STOPS)
    monkeypatch.setattr(sampler, "COMPACT_BELOW", 0.0)  # never compact
    full, full_state = _state_after(model, tokenizer, eos_token_ids=stops)
    monkeypatch.setattr(sampler, "COMPACT_BELOW", 1.0)  # compact as soon as one row ended
    forward_rows: list[int] = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature: the sampler reads the cache argument's name from it
    def counting_forward(*args: object, **kwargs: object):
        forward_rows.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting_forward)
    compact, compact_state = _state_after(model, tokenizer, eos_token_ids=stops)
    monkeypatch.undo()
    assert len(set(forward_rows[1:])) > 1, "rows should have left the forward"  # [0] is the prefill
    assert torch.equal(full.response_ids, compact.response_ids)
    assert torch.equal(full.response_mask, compact.response_mask)
    torch.testing.assert_close(compact.behav_logp, full.behav_logp, atol=1e-5, rtol=0)  # smaller batch, other rounding
    torch.testing.assert_close(compact.behav_entropy, full.behav_entropy, atol=1e-5, rtol=0)
    assert torch.equal(full_state, compact_state)
    # ... and μ is still the learner's recompute at T = 1
    logp, _ = sequence_logprobs(model, compact)
    torch.testing.assert_close(logp, compact.behav_logp, atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_preallocated_cache_gives_the_dynamic_caches_tokens(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch, top_p: float
) -> None:
    """The preallocated KV cache (buffers grown from 2 free positions, so they double twice) samples what the
    ``DynamicCache`` samples, with and without compaction."""
    stops = tokenizer.convert_tokens_to_ids(MANY_STOPS[:6])
    dynamic, dynamic_state = _state_after(model, tokenizer, eos_token_ids=stops, top_p=top_p)
    monkeypatch.setattr(sampler, "PREALLOCATE_MIN_NEW_TOKENS", 1)
    monkeypatch.setattr(sampler, "INITIAL_ROOM", 2)
    built: list[Cache] = []
    expand = sampler.expand_prefill_cache

    def recording_expand(*args: object, **kwargs: object) -> Cache:
        built.append(expand(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(sampler, "expand_prefill_cache", recording_expand)
    pre, pre_state = _state_after(model, tokenizer, eos_token_ids=stops, top_p=top_p)
    assert built and all(isinstance(layer, PreallocatedLayer) for layer in built[0].layers)
    assert torch.equal(dynamic.response_ids, pre.response_ids) and torch.equal(dynamic_state, pre_state)
    torch.testing.assert_close(pre.behav_logp, dynamic.behav_logp, atol=1e-5, rtol=0)


def test_preallocated_layer_returns_what_a_dynamic_layer_returns() -> None:
    """Prefill of 2 rows repeated 3 times, 5 single-token updates (growing from 1 free position), a row selection."""
    g = torch.Generator().manual_seed(0)
    prefill_k, prefill_v = torch.randn(2, 2, 4, 8, generator=g), torch.randn(2, 2, 4, 8, generator=g)
    dynamic = DynamicLayer()
    dynamic.update(prefill_k, prefill_v)
    dynamic.batch_repeat_interleave(3)
    source = DynamicLayer()
    source.update(prefill_k, prefill_v)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler, "INITIAL_ROOM", 1)
        layer = PreallocatedLayer.from_prefill(source, repeats=3, capacity=4 + 5)
    assert layer.keys.shape[2] == 5  # the prefill + INITIAL_ROOM, not the capacity
    for step in range(5):
        if step == 3:
            rows = torch.tensor([0, 2, 5])
            dynamic.batch_select_indices(rows)
            layer.batch_select_indices(rows)
        assert layer.get_mask_sizes(1) == dynamic.get_mask_sizes(1)
        k, v = torch.randn(dynamic.keys.shape[0], 2, 1, 8, generator=g), torch.randn(dynamic.keys.shape[0], 2, 1, 8)
        want_k, want_v = dynamic.update(k, v)
        got_k, got_v = layer.update(k, v)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert layer.get_seq_length() == dynamic.get_seq_length() == 4 + step + 1
    assert layer.get_max_length() == 9
    with pytest.raises(RuntimeError, match="KV cache full"):
        layer.update(k, v)


def test_expand_prefill_cache_keeps_a_sliding_window_cache() -> None:
    """Only plain full-attention layers are preallocated; any other layer type keeps the DynamicCache, repeated."""
    keys = torch.randn(2, 1, 3, 4)
    plain = Cache(layers=[DynamicLayer(), DynamicLayer()])
    sliding = Cache(layers=[DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=8)])
    for cache in (plain, sliding):
        for i in range(2):
            cache.update(keys, keys, i)
    expanded = expand_prefill_cache(plain, repeats=2, capacity=10)
    assert all(isinstance(layer, PreallocatedLayer) for layer in expanded.layers)
    assert expanded.get_seq_length() == 3
    kept = expand_prefill_cache(sliding, repeats=2, capacity=10)
    assert kept is sliding and kept.layers[1].keys.shape[0] == 4
    torch.testing.assert_close(kept.layers[0].keys, keys.repeat_interleave(2, dim=0))


@pytest.mark.parametrize(("share_prompts", "preallocate", "compact"), [(False, False, 0.75), (True, True, 1.0)])
def test_float64_behavior_logp_is_the_learner_recompute(
    tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch,
    share_prompts: bool,
    preallocate: bool,
    compact: float,
) -> None:
    """Lag 0 in float64 end to end (transformers' RMSNorm rounds to float32, so it is replaced): the sampler's μ from
    the KV-cache decode (left padding, prefill shared by the group, row compaction, the preallocated cache) equals the
    learner's recompute (one pass, or each distinct prompt once) to 1e-10. So the float32 gap at lag 0
    (docs/scale.md: max 2.9e-5 on SmolLM2) is rounding, not a difference between the two functions."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
    from tests.rollout.test_logprobs import _float64_rms_norm

    monkeypatch.setattr(LlamaRMSNorm, "forward", _float64_rms_norm)
    monkeypatch.setattr(sampler, "PREALLOCATE_MIN_NEW_TOKENS", 1 if preallocate else 10**9)
    monkeypatch.setattr(sampler, "COMPACT_BELOW", compact)
    arch = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    model = build_tiny_model(arch, tokenizer=tokenizer, seed=2).double().eval()
    r = generate(model, tokenizer, PROMPTS, group_size=4, max_new_tokens=40, version=0, temperature=0.8,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert r.behav_logp.dtype == torch.float64
    assert r.response_mask.sum() > 4 * len(r)  # several decode steps per row
    if compact == 1.0:
        assert not r.response_mask.all()  # rows ended, so compaction ran
    with torch.no_grad():
        logp = sequence_logprobs(model, r, temperature=0.8, share_prompts=share_prompts).logp
    torch.testing.assert_close(logp, r.behav_logp, atol=1e-10, rtol=0)
