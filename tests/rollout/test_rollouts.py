"""Rollouts: shape checks, select (trim, dense group ids) and concat (re-padding, group offsets)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts, TokenBatch, concat, trim_padding
from steadyrl.rollout.sampler import generate


def sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str], seed: int) -> Rollouts:
    return generate(model, tokenizer, prompts, group_size=2, max_new_tokens=5, version=seed,
                    generator=torch.Generator().manual_seed(seed), eos_token_ids=[4, 5, 6, 20, 21, 22, 23, 24])


def test_shape_mismatch_is_rejected(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer, ["1+1="], 0)
    with pytest.raises(ValueError, match="behav_logp"):
        dataclasses.replace(r, behav_logp=r.behav_logp[:, :1].clone().repeat(1, 9))
    with pytest.raises(ValueError, match="texts"):
        dataclasses.replace(r, texts=r.texts[:1])


def test_concat_repads_and_keeps_logprobs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    a = sample(model, tokenizer, ["1+1=", "23+45-6="], 0)
    b = sample(model, tokenizer, ["7="], 1)
    both = concat([a, b])
    assert len(both) == len(a) + len(b)
    assert both.prompt_ids.shape[1] == max(a.prompt_ids.shape[1], b.prompt_ids.shape[1])
    assert both.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.versions[len(a):][both.response_mask[len(a):]].eq(1).all()
    # Extra left padding of prompts and right padding of responses changes no log-prob.
    logp, _ = sequence_logprobs(model, both)
    T_b = b.response_ids.shape[1]
    torch.testing.assert_close(logp[len(a):, :T_b], sequence_logprobs(model, b).logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(logp, both.behav_logp, atol=1e-5, rtol=0)


def test_select_trims_and_relabels_groups(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer, ["12345678+1=", "2=", "3="], 2)
    picked = r.select([5, 2, 4])
    assert picked.group_ids.tolist() == [1, 0, 1]  # groups 2, 1, 2 relabelled densely, order kept
    assert picked.texts == [r.texts[5], r.texts[2], r.texts[4]]
    assert picked.prompt_mask[:, 0].any()  # the long prompt's padding column is gone
    assert picked.response_mask[:, -1].any()
    torch.testing.assert_close(sequence_logprobs(model, picked).logp, picked.behav_logp, atol=1e-5, rtol=0)


def test_to_moves_every_tensor(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer, ["1+1="], 0)
    moved = r.to("meta")
    assert all(getattr(moved, f).device.type == "meta" for f in ("prompt_ids", "behav_logp", "group_ids", "truncated"))
    assert moved.texts == r.texts and moved.pad_id == r.pad_id


def test_concat_needs_parts() -> None:
    with pytest.raises(ValueError, match="at least one"):
        concat([])


def test_trim_padding_drops_only_shared_padding() -> None:
    tokens = TokenBatch(
        prompt_ids=torch.tensor([[0, 0, 1, 5], [0, 1, 6, 7]]),
        prompt_mask=torch.tensor([[False, False, True, True], [False, True, True, True]]),
        response_ids=torch.tensor([[8, 2, 0, 0], [9, 0, 0, 0]]),
        response_mask=torch.tensor([[True, True, False, False], [True, False, False, False]]),
    )
    trimmed = trim_padding(tokens)
    assert trimmed.prompt_ids.tolist() == [[0, 1, 5], [1, 6, 7]]
    assert trimmed.response_ids.tolist() == [[8, 2], [9, 0]]
    assert trimmed.response_mask.tolist() == [[True, True], [True, False]]
