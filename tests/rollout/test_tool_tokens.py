"""Tool-output tokens through the learner path: attention and positions of the recompute, trimming, the learner's loss
and ESS, and per-trajectory gradient norms, all on multi-turn rollouts sampled from a real (float64) transformer.

The model is the tiny Llama with a bias on its output layer that makes the call markers ``@`` (open) and ``~`` (close)
likely, so that random trajectories call the tool often; the tool is a stub runner (the sandbox has its own tests).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers
from steadyrl.methods import resolve_method
from steadyrl.models.tiny import build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.multiturn import ToolCallFormat, generate_multiturn
from steadyrl.rollout.rollouts import PAD_VERSION, Rollouts, TokenBatch, concat, trim_padding
from steadyrl.rollout.tool_metrics import tool_metrics_from_rollouts
from steadyrl.tools import ToolResult
from steadyrl.train.grad_norms import GRAD_NORM_METHODS, per_trajectory_grad_sq_norms
from steadyrl.train.learner import Learner
from tests.rollout.conftest import TEST_ARCH

#: Single-character call markers, made likely by the output bias below.
FORMAT = ToolCallFormat(open="@", close="~", output_template="[{output}]")
#: Logit bias of the markers (probability about 1/8 each at a random init) and of EOS (rare: long trajectories).
MARKER_BIAS, EOS_BIAS = 2.5, -2.0
PROMPTS = ["1+2=", "13+4-5=", "7=", "22+9="]
G = 4


class StubTool:
    """Answers every call with a fixed output (no sandbox)."""

    def map(self, codes: Sequence[str]) -> list[ToolResult]:
        return [ToolResult("31\n", "", False, 0, None, 0.0, "stub") for _ in codes]


def biased_model(tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype = torch.float64) -> PreTrainedModel:
    model = build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=3).to(dtype)
    head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)  # untie: a fresh copy of the (tied) embedding
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids(["@", "~"])] = MARKER_BIAS
        head.bias[tokenizer.eos_token_id] = EOS_BIAS
    model.lm_head = head
    return model.eval()


def sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **kw: object) -> Rollouts:
    out = generate_multiturn(
        model, tokenizer, PROMPTS, group_size=G, sandbox=StubTool(), max_turns=3, max_total_tokens=40,
        tool_format=FORMAT, generator=torch.Generator().manual_seed(seed), version=0, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    r = out.rollouts
    assert r.tool_mask is not None and int(r.tool_mask.any(-1).sum()) >= len(r) // 2, "too few rows called the tool"
    sampled_after_tool = r.response_mask & (r.tool_mask.cumsum(-1) > 0)
    assert sampled_after_tool.any(), "no model token after a tool turn"
    return r


@pytest.fixture(scope="module")
def model(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    return biased_model(tokenizer)


@pytest.fixture(scope="module")
def rollouts(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> Rollouts:
    return sample(model, tokenizer)


def reference_logp(model: PreTrainedModel, r: Rollouts, *, attend_tools: bool = True) -> torch.Tensor:
    """log π(y_t) of every sampled token, each row alone and unpadded: prompt + every response token (tool output
    included unless ``attend_tools`` is False), positions 0, 1, 2, … [N, T] float64, 0 off the response mask."""
    out = torch.zeros(r.response_ids.shape, dtype=torch.float64)
    for i in range(len(r)):
        keep = r.response_mask[i] | (r.tool_mask[i] if attend_tools else torch.zeros_like(r.response_mask[i]))
        cols = keep.nonzero().flatten()
        prompt = r.prompt_ids[i][r.prompt_mask[i]]
        ids = torch.cat([prompt, r.response_ids[i, cols]])
        logits = model(ids.unsqueeze(0)).logits[0].double()
        log_probs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # position of y predicts y
        token = log_probs.gather(-1, r.response_ids[i, cols].unsqueeze(-1)).squeeze(-1)
        out[i, cols] = torch.where(r.response_mask[i, cols], token, torch.zeros_like(token))
    return out


def test_default_tool_mask_is_all_false_and_old_records_load(model: PreTrainedModel,
                                                             tokenizer: PreTrainedTokenizerFast) -> None:  # fmt: skip
    r = sample(model, tokenizer)
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "tool_mask"}
    old = Rollouts(**fields)  # a caller (or a checkpointed record) from before tool turns
    assert old.tool_mask is not None and old.tool_mask.dtype == torch.bool and not old.tool_mask.any()
    assert old.tokens.tool_mask is not None and not old.tokens.tool_mask.any()


def test_recompute_equals_behavior_logp_at_lag_0(model: PreTrainedModel, rollouts: Rollouts) -> None:
    """The learner's forward attends tool output and counts it in the positions, as the sampler did (KV cache)."""
    r = rollouts
    with torch.no_grad():
        logp = sequence_logprobs(model, r).logp
        ref = reference_logp(model, r)
        wrong = reference_logp(model, r, attend_tools=False)  # tool tokens treated as padding
    m = r.response_mask
    assert logp.dtype == torch.float64
    torch.testing.assert_close(logp[m], r.behav_logp[m].double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(logp, ref, atol=1e-10, rtol=0)
    assert (logp[~m] == 0).all()
    after_tool = m & (r.tool_mask.cumsum(-1) > 0)
    assert (wrong[after_tool] - ref[after_tool]).abs().max() > 1e-3  # the test can fail: padding-as-tool is wrong


def test_recompute_equals_behavior_logp_without_kv_cache(model: PreTrainedModel,
                                                         tokenizer: PreTrainedTokenizerFast) -> None:  # fmt: skip
    r = sample(model, tokenizer, seed=1, use_cache=False, temperature=0.7)
    with torch.no_grad():
        logp = sequence_logprobs(model, r, temperature=0.7).logp
    torch.testing.assert_close(logp[r.response_mask], r.behav_logp[r.response_mask].double(), atol=1e-6, rtol=0)


def test_select_concat_and_trim_keep_every_model_token(model: PreTrainedModel, rollouts: Rollouts) -> None:
    r = rollouts
    lengths = r.response_mask.sum(-1)
    # the row whose last attended token is furthest right, and rows with fewer sampled tokens than that width
    rows = [int(i) for i in torch.argsort(lengths)[: len(r) // 2]]
    picked = r.select(rows)
    assert torch.equal(picked.response_mask.sum(-1), lengths[rows])  # no sampled token cut
    assert torch.equal(picked.tool_mask.sum(-1), r.tool_mask[rows].sum(-1))
    for k, i in enumerate(rows):
        n = picked.response_ids.shape[1]
        assert torch.equal(picked.response_ids[k], r.response_ids[i, :n])
        assert not (r.response_mask[i, n:] | r.tool_mask[i, n:]).any()  # only shared padding was trimmed
        torch.testing.assert_close(picked.behav_logp[k], r.behav_logp[i, :n])
    with torch.no_grad():
        torch.testing.assert_close(sequence_logprobs(model, picked).logp[picked.response_mask],
                                   picked.behav_logp[picked.response_mask].double(), atol=1e-6, rtol=0)  # fmt: skip
    both = concat([picked, r.select([0])])
    assert torch.equal(both.response_mask.sum(-1)[:-1], lengths[rows])
    assert torch.equal(both.tool_mask.sum(-1), torch.cat([r.tool_mask[rows].sum(-1), r.tool_mask[:1].sum(-1)]))
    assert (both.versions[~(both.response_mask | both.tool_mask)] == PAD_VERSION).all()
    # trim_padding of the token batch: keeps the columns up to the last attended one
    tokens = TokenBatch(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask & r.tool_mask.cumsum(-1).eq(0),
                        r.tool_mask)  # fmt: skip
    trimmed = trim_padding(tokens)
    last = int(((tokens.response_mask | r.tool_mask).any(0)).nonzero().max()) + 1
    assert trimmed.response_ids.shape[1] == last


def _learner(model: nn.Module, method: str) -> Learner:
    spec = resolve_method(method)
    return Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(),
                   log=lambda _: None)  # fmt: skip


REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("method", ["seq_tis", "vcpo", "token_tis"])
def test_learner_loss_and_ess_ignore_tool_tokens(method: str, model: PreTrainedModel, rollouts: Rollouts) -> None:
    """Through the learner's real forward: garbage behavior log-probs, versions and entropies at the tool tokens
    change neither the loss, nor the ESS, nor the gradient; the loss equals the one of the padding-free reference."""
    r = dataclasses.replace(rollouts, behav_logp=rollouts.behav_logp - 0.2 * rollouts.response_mask)  # a mismatch
    tool = r.tool_mask
    g = torch.Generator().manual_seed(1)
    garbage = dataclasses.replace(
        r, behav_logp=torch.where(tool, -50 * torch.rand(r.behav_logp.shape, generator=g), r.behav_logp),
        versions=torch.where(tool, 1000, r.versions),
    )  # fmt: skip
    outs = []
    for batch in (r, garbage):
        learner = _learner(copy.deepcopy(model).train(), method)
        out = learner.step(batch, REWARDS)
        outs.append((out.metrics, [p.detach().clone() for p in learner.model.parameters()]))
    (m1, w1), (m2, w2) = outs
    assert m1["loss"] == m2["loss"] and m1["is/ess_ratio"] == m2["is/ess_ratio"]
    assert m1["grad/norm"] == m2["grad/norm"]
    assert all(torch.equal(a, b) for a, b in zip(w1, w2, strict=True))
    assert m1["is/ess_ratio"] < 1.0  # the mismatch is seen (the test can fail)


def test_learner_ess_is_one_at_lag_0(model: PreTrainedModel, rollouts: Rollouts) -> None:
    out = _learner(copy.deepcopy(model).train(), "seq_tis").step(rollouts, REWARDS)
    assert out.metrics["is/ess_ratio"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("method", GRAD_NORM_METHODS)
def test_grad_norms_with_tool_tokens(method: str, model: PreTrainedModel, rollouts: Rollouts) -> None:
    """n_i = ‖∇θ Σ_t m log π(y_t)‖² of each row equals a float64 reference that runs the row alone, unpadded, with
    its tool output in context."""
    r = rollouts.select(list(range(6)))
    params = [p for p in model.parameters() if p.requires_grad]
    ref = []
    for i in range(len(r)):
        loss = reference_logp(model, r.select([i])).sum()
        grads = torch.autograd.grad(loss, params)
        ref.append(sum(float(gr.double().square().sum()) for gr in grads))
    got = per_trajectory_grad_sq_norms(model, r, method=method)
    torch.testing.assert_close(got, torch.tensor(ref, dtype=got.dtype), rtol=1e-9, atol=0)


def test_tool_metrics_from_masks_match_the_sampler(model: PreTrainedModel,
                                                   tokenizer: PreTrainedTokenizerFast) -> None:  # fmt: skip
    out = generate_multiturn(
        model, tokenizer, PROMPTS, group_size=G, sandbox=StubTool(), max_turns=3, max_total_tokens=40,
        tool_format=FORMAT, generator=torch.Generator().manual_seed(0), version=0,
    )  # fmt: skip
    derived, summary = tool_metrics_from_rollouts(out.rollouts), out.summary()
    for key, value in derived.items():
        assert value == pytest.approx(summary[key], abs=1e-12), key
