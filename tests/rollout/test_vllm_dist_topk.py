"""The vLLM engine's record of the behavior distribution's top-k, without vLLM: vLLM's per-step log-prob entries (the
sampled token first, then the top-k, the sampled token once) turned into ``[k]`` rows (:func:`dist_topk`), and a whole
batch of such entries assembled into the same ``behav_dist_*`` as the transformers sampler records."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import assemble_rollouts
from steadyrl.rollout.vllm_engine import VLLMEngine, _steps_from_outputs, dist_topk
from tests.rollout.test_sampler import sample

INF = math.inf


def test_the_sampled_token_outside_the_top_k_is_dropped() -> None:
    # step 0: the sampled token (9) ranks below the top-3 → 4 entries, the last of the k + 1 left out
    # step 1: the sampled token (2) is among the top-3 → 3 entries
    entries = [([9, 4, 1, 7], [-3.0, -0.5, -1.0, -2.0]), ([2, 5, 8], [-0.25, -2.5, -1.75])]
    values, ids = dist_topk(entries, 3)
    assert values.dtype == torch.float32 and ids.dtype == torch.int64
    assert ids.tolist() == [[4, 1, 7], [2, 8, 5]]  # descending log-prob
    assert values.tolist() == [[-0.5, -1.0, -2.0], [-0.25, -1.75, -2.5]]


def test_ties_and_masked_tokens() -> None:
    # ties: the lower id first; −inf entries (removed by the sampler's top-k/top-p) last, also by id
    entries = [([6, 3, 8, 1], [-1.0, -1.0, -INF, -INF])]
    values, ids = dist_topk(entries, 3)
    assert ids.tolist() == [[3, 6, 1]] and values.tolist() == [[-1.0, -1.0, -INF]]
    # a k covering the whole vocabulary: every token in id order (as the transformers sampler records it)
    values, ids = dist_topk([([2, 0, 1], [-0.125, -3.0, -2.5])], 3, by_id=True)
    assert ids.tolist() == [[0, 1, 2]] and values.tolist() == [[-3.0, -2.5, -0.125]]


def test_fewer_entries_than_k_are_an_error() -> None:
    with pytest.raises(RuntimeError, match="2 distinct log-prob entries, 3 asked"):
        dist_topk([([1, 1, 2], [-0.1, -0.1, -2.0])], 3)
    with pytest.raises(RuntimeError, match="2 token ids and 1 log-probs"):
        dist_topk([([1, 2], [-0.1])], 1)


def _vllm_outputs(full: Rollouts, k: int) -> list[tuple[list[int], list[float], list[tuple[list[int], list[float]]]]]:
    """What the vLLM server returns for the rollouts' tokens and log μ: per step the sampled token, then the top-k of
    log μ (``torch.topk``, as vLLM's ``Sampler.gather_logprobs``), the sampled token once."""
    out = []
    for row in range(len(full)):
        n = int(full.response_mask[row].sum())
        tokens = full.response_ids[row, :n].tolist()
        entries = []
        for t, y in enumerate(tokens):
            log_mu = full.behav_dist_logp[row, t]
            top = log_mu.topk(k)
            d = {y: float(log_mu[y])} | dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            entries.append((list(d), list(d.values())))
        out.append((tokens, full.behav_logp[row, :n].tolist(), entries))
    return out


@pytest.mark.parametrize("params", [{"temperature": 0.8}, {"temperature": 1.2, "top_k": 5}])
def test_assembled_record_is_the_transformers_samplers(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, params: dict
) -> None:
    """The transformers sampler's full record, sent through the vLLM engine's assembly as vLLM would return it, gives
    the transformers sampler's own top-k record: values, ids (where the log-prob is finite) and padding."""
    k = 16
    full = sample(model, tokenizer, record_dist=0, **params)
    top = sample(model, tokenizer, record_dist=k, **params)
    stop = torch.tensor([tokenizer.eos_token_id])
    steps = _steps_from_outputs(_vllm_outputs(full, k), stop_ids={tokenizer.eos_token_id},
                                pad_id=tokenizer.pad_token_id, version=0, dist_k=k)  # fmt: skip
    r = assemble_rollouts(steps, prompt_ids=full.prompt_ids, prompt_mask=full.prompt_mask, tokenizer=tokenizer,
                          stop_ids=stop, pad_id=tokenizer.pad_token_id, group_size=1)  # fmt: skip
    assert torch.equal(r.response_ids, top.response_ids) and torch.equal(r.response_mask, top.response_mask)
    assert r.behav_dist_logp.shape == r.behav_dist_ids.shape == (*top.response_mask.shape, k)
    assert r.behav_dist_logp.dtype == torch.float32 and r.behav_dist_ids.dtype == torch.int64
    assert torch.equal(r.behav_dist_logp, top.behav_dist_logp)  # −inf at padding, as there
    finite = r.behav_dist_logp > -INF
    assert torch.equal(r.behav_dist_ids[finite], top.behav_dist_ids[finite])
    assert bool((r.behav_dist_ids[~r.response_mask] == 0).all())
    if "top_k" in params:  # a sampler top-k of 5 below the record's 16: the masked tokens are recorded at −inf
        assert bool((finite.sum(-1)[r.response_mask] <= 5).all()) and not bool(finite[r.response_mask].all())


def _engine(vocab_size: int, max_record_dist: int) -> VLLMEngine:
    """An engine object without a server: enough for the checks made before any request."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.vocab_size, engine.max_record_dist = vocab_size, max_record_dist
    return engine


def test_what_the_engine_records_and_refuses() -> None:
    engine = _engine(100, 20)
    assert engine._record_width(None) is None and engine._record_width(16) == 16
    assert _engine(10, 20)._record_width(16) == 10  # the whole vocabulary
    with pytest.raises(ValueError, match=r"top-k only.*method\.objective\.top_k=16"):
        engine._record_width(0)
    with pytest.raises(ValueError, match="record_dist must be"):
        engine._record_width(-1)
    with pytest.raises(ValueError, match="max_record_dist=32"):
        engine._record_width(32)
