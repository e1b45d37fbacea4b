"""In-flight weight updates during generation (``before_forward``), and the flat weight layout the runtimes ship."""

from __future__ import annotations

import copy

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.rollout.sampler import generate
from steadyrl.runtime.weight_sync import FlatLayout


def _perturbed(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return other


def test_tokens_record_the_version_of_the_forward_that_produced_them(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    sampler = copy.deepcopy(model)
    new = _perturbed(model, 1)
    layout = FlatLayout(model)
    flat_new = layout.flatten(new)
    calls = []

    def before_forward() -> int:  # prefill = call 1; the update lands before the 3rd forward
        calls.append(1)
        if len(calls) == 3:
            layout.load_into(sampler, flat_new)
        return 7 if len(calls) >= 3 else 6

    kw = {"group_size": 3, "max_new_tokens": 6, "version": 6}
    switched = generate(sampler, tokenizer, ["12+3=", "7="], generator=torch.Generator().manual_seed(0),
                        before_forward=before_forward, eos_token_ids=[10_000], **kw)  # fmt: skip
    plain = generate(model, tokenizer, ["12+3=", "7="], generator=torch.Generator().manual_seed(0),
                     eos_token_ids=[10_000], **kw)  # fmt: skip
    assert switched.versions.tolist() == [[6, 6, 7, 7, 7, 7]] * 6  # token t comes from forward t+1
    # tokens 0 and 1 came from the old weights: identical draws and log-probs to a run that never switched
    assert torch.equal(switched.response_ids[:, :2], plain.response_ids[:, :2])
    assert torch.allclose(switched.behav_logp[:, :2], plain.behav_logp[:, :2])
    # token 2 was drawn from the new weights' distribution (same uniform draws, other probabilities)
    assert not torch.allclose(switched.behav_logp[:, 2:], plain.behav_logp[:, 2:])
    assert torch.equal(layout.flatten(sampler), flat_new)


def test_flat_layout_round_trips_and_keeps_tied_weights_tied(model: PreTrainedModel) -> None:
    layout = FlatLayout(model)
    assert layout.numel == sum(p.numel() for p in model.parameters())  # a tied embedding counted once
    other = _perturbed(model, 2)
    layout.load_into(other, layout.flatten(model))
    for (n, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    if model.config.tie_word_embeddings:
        assert other.get_output_embeddings().weight.data_ptr() == other.get_input_embeddings().weight.data_ptr()
