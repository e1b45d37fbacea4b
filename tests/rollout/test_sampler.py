"""generate(): behavior log-probs, KV cache, determinism, EOS and masks, left padding."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.sampler import generate, stop_token_ids
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
