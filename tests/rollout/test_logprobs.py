"""sequence_logprobs: gradient, entropy, temperature, padding and the empty case."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.models.tiny import build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import TokenBatch
from steadyrl.rollout.sampler import generate
from tests.rollout.conftest import TEST_ARCH


def batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> TokenBatch:
    r = generate(model, tokenizer, ["1+2=", "33-4+5="], group_size=3, max_new_tokens=6, version=0,
                 generator=torch.Generator().manual_seed(0), eos_token_ids=[20, 21, 22])
    return r.tokens


def test_gradient_equals_a_padding_free_forward(tokenizer: PreTrainedTokenizerFast) -> None:
    """The gradient of one row's summed log-prob equals that of the same row alone, without any padding."""
    model = build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1)
    tokens = batch(model, tokenizer)
    row = 1
    logp, _ = sequence_logprobs(model, tokens)
    assert logp.requires_grad
    logp[row].sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    prompt = tokens.prompt_ids[row][tokens.prompt_mask[row]]
    response = tokens.response_ids[row][tokens.response_mask[row]]
    logits = model(torch.cat([prompt, response]).unsqueeze(0)).logits[0, len(prompt) - 1 : -1]
    torch.log_softmax(logits, -1).gather(-1, response.unsqueeze(-1)).sum().backward()
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in grads)


def test_no_grad_and_padding(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = batch(model, tokenizer)
    with torch.no_grad():
        logp, entropy = sequence_logprobs(model, tokens)
    assert not logp.requires_grad and entropy is None
    assert (logp[~tokens.response_mask] == 0).all() and (logp[tokens.response_mask] < 0).all()


def test_entropy_and_temperature(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = batch(model, tokenizer)
    with torch.no_grad():
        ids = torch.cat([tokens.prompt_ids, tokens.response_ids], dim=-1)
        mask = torch.cat([tokens.prompt_mask, tokens.response_mask], dim=-1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(ids, attention_mask=mask.long(), position_ids=pos).logits.double()
        P = tokens.prompt_ids.shape[1]
        ref = torch.log_softmax(logits[:, P - 1 : -1] / 0.5, dim=-1)
        ref_logp = ref.gather(-1, tokens.response_ids.unsqueeze(-1)).squeeze(-1)
        ref_entropy = -(ref.exp() * ref).sum(-1)
        logp, entropy = sequence_logprobs(model, tokens, temperature=0.5, return_entropy=True)
    m = tokens.response_mask
    assert entropy is not None
    torch.testing.assert_close(logp[m], ref_logp[m].float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy[m], ref_entropy[m].float(), atol=1e-5, rtol=0)
    assert (entropy[~m] == 0).all()


def test_empty_responses(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    tokens = batch(model, tokenizer)
    empty = TokenBatch(tokens.prompt_ids, tokens.prompt_mask, tokens.response_ids[:, :0], tokens.response_mask[:, :0])
    logp, entropy = sequence_logprobs(model, empty, return_entropy=True)
    assert logp.shape == (tokens.prompt_ids.shape[0], 0) and entropy is not None and entropy.shape == logp.shape


def _float64_rms_norm(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x


def test_shared_prompts_give_the_one_pass_log_probs_and_gradient(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each distinct prompt forwarded once, its responses against its cache: float64-equal to the one-pass forward
    (values and gradient), also with tool-output tokens attended inside a response and with ragged prompts."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(LlamaRMSNorm, "forward", _float64_rms_norm)  # transformers' own rounds to float32
    model = build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1).double()
    tokens = batch(model, tokenizer)
    tool = torch.zeros_like(tokens.response_mask)
    tool[0, 1:3] = tokens.response_mask[0, 1:3]  # two "tool" tokens: attended, not scored
    tokens = TokenBatch(tokens.prompt_ids, tokens.prompt_mask, tokens.response_ids,
                        tokens.response_mask & ~tool, tool)  # fmt: skip
    seen: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    shared = sequence_logprobs(model, tokens, share_prompts=True).logp
    hook.remove()
    assert seen == [2, 6]  # 2 distinct prompts forwarded, then the 6 responses
    plain = sequence_logprobs(model, tokens).logp
    torch.testing.assert_close(shared, plain, atol=1e-12, rtol=0)
    weights = torch.randn(plain.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (plain * weights).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (shared * weights).sum().backward()
    for got, p in zip(expected, model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, got, atol=1e-12, rtol=1e-10)
