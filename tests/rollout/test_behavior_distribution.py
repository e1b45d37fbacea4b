"""The sampler's record of the behavior distribution (score centering): the same samples with or without it, the full
record and the top-k one against the sampling distribution, the rollout record through select/concat, and score
centering's top-k form (k = 16) against the exact one on the embedded model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl import resolve_method
from steadyrl.rollout import sampler
from steadyrl.rollout.logprobs import sequence_logprob_terms
from steadyrl.rollout.rollouts import concat
from steadyrl.train.vocab_terms import vocab_terms
from tests.rollout.test_sampler import sample


@pytest.mark.parametrize("params", [{}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}])
def test_recording_changes_no_sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, params: dict) -> None:
    plain = sample(model, tokenizer, **params)
    for k in (0, 16):
        rec = sample(model, tokenizer, record_dist=k, **params)
        assert torch.equal(rec.response_ids, plain.response_ids) and torch.equal(rec.behav_logp, plain.behav_logp)
    assert plain.behav_dist_logp is None and plain.behav_dist_ids is None


def test_full_and_topk_records_are_the_sampling_distribution(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    params = {"temperature": 0.8, "top_p": 0.95}
    full = sample(model, tokenizer, record_dist=0, **params)
    top = sample(model, tokenizer, record_dist=16, **params)
    V = model.get_output_embeddings().weight.shape[0]
    m = full.response_mask
    assert full.behav_dist_ids is None and full.behav_dist_logp.shape == (*m.shape, V)
    torch.testing.assert_close(full.behav_dist_logp.gather(-1, full.response_ids[..., None])[..., 0][m],
                               full.behav_logp[m])  # fmt: skip
    torch.testing.assert_close(full.behav_dist_logp[m].logsumexp(-1), torch.zeros(int(m.sum())), atol=1e-5, rtol=0)
    assert top.behav_dist_logp.shape == top.behav_dist_ids.shape == (*m.shape, 16)
    ref = full.behav_dist_logp[m].topk(16, dim=-1)
    torch.testing.assert_close(top.behav_dist_logp[m], ref.values)
    assert (top.behav_dist_logp[~m] == -torch.inf).all()


def test_a_full_record_of_a_large_vocabulary_is_refused(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler, "EXACT_VOCAB_LIMIT", 50)
    with pytest.raises(ValueError, match=r"allowed up to 50 tokens.*method\.objective\.top_k"):
        sample(model, tokenizer, record_dist=0)
    sample(model, tokenizer, record_dist=16)  # the top-k form is fine


def test_select_and_concat_carry_the_record(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    r = sample(model, tokenizer, record_dist=4)
    parts = [r.select([0, 1, 2]), r.select([5, 4])]
    joined = concat(parts)
    for part, rows in zip(parts, ([0, 1, 2], [5, 4]), strict=True):
        T = part.response_ids.shape[1]
        assert torch.equal(part.behav_dist_logp, r.behav_dist_logp[rows][:, :T])
        assert torch.equal(part.behav_dist_ids, r.behav_dist_ids[rows][:, :T])
    T = joined.response_ids.shape[1]
    assert joined.behav_dist_logp.shape == (5, T, 4)
    m = joined.response_mask
    assert torch.equal(joined.behav_dist_logp[m], torch.cat([p.behav_dist_logp[p.response_mask] for p in parts]))
    assert concat([parts[0], sample(model, tokenizer, prompts=["1="])]).behav_dist_logp is None  # not all record it


def _centering(model: PreTrainedModel, rollouts, top_k: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    method = resolve_method("score_centering", {"objective.top_k": top_k})
    terms = vocab_terms(method, ["centering"], rollouts)
    return sequence_logprob_terms(model, rollouts, terms=terms).terms["centering"]


@pytest.mark.parametrize("chunked", [False, True])
def test_topk_equals_the_exact_form_when_the_head_covers_the_support(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behavior sampled with top-k 16 (its support: 16 tokens), the learner's π_θ a perturbed copy with full
    support: the top-k form with k = 16 gives the exact term, through the direct and the chunked head."""
    from steadyrl.rollout import logprobs

    calls = []
    if chunked:
        monkeypatch.setattr(logprobs, "DEFAULT_CHUNK_ELEMENTS", 64)
        real = logprobs.chunked_log_probs
        monkeypatch.setattr(logprobs, "chunked_log_probs", lambda **kw: calls.append(1) or real(**kw))
    full = sample(model, tokenizer, record_dist=0, top_k=16)
    top = sample(model, tokenizer, record_dist=16, top_k=16)
    learner = copy.deepcopy(model)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    exact, topk = _centering(learner, full, 0).detach(), _centering(learner, top, 16).detach()
    assert float(exact.abs().sum()) > 0 and len(calls) == (2 if chunked else 0)
    torch.testing.assert_close(topk, exact, rtol=1e-5, atol=1e-6)
    # without the sampler's top-k, q has full support: the tail rule approximates it
    full, top = sample(model, tokenizer, record_dist=0), sample(model, tokenizer, record_dist=16)
    exact, topk = _centering(learner, full, 0).detach(), _centering(learner, top, 16).detach()
    m = full.response_mask
    err = float((topk - exact)[m].norm() / exact[m].norm())
    print(f"top-16 vs exact, full-support behavior: {err:.3g} relative")
    assert err < 0.05
