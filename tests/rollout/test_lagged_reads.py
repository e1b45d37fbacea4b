"""The decode loop without a host read per token: :class:`~steadyrl.base.device.LaggedCount` and
``generate(lagged_reads=True)``, the form a GPU runs (a count of running rows one or a few steps old)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.base.device import LaggedCount
from steadyrl.rollout import sampler
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.sampler import generate
from tests.rollout.test_sampler import MANY_STOPS, PROMPTS

G, MAX_NEW = 4, 12


def test_lagged_count_never_waits_and_trails_by_one_push_on_the_cpu() -> None:
    count = LaggedCount(torch.device("cpu"), lagged=True)
    assert count.latest() is None  # nothing pushed yet
    count.push(torch.tensor(7))
    assert count.latest() == 7  # the CPU form's copy is done once latest looks
    count.push(torch.tensor(5))
    count.push(torch.tensor(3))  # dropped: a copy was still in flight
    assert count.latest() == 5 and count.waits == 0
    immediate = LaggedCount(torch.device("cpu"))
    immediate.push(torch.tensor(4))
    assert not immediate.lagged and immediate.latest() == 4


def _sample(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, **kwargs: object):
    stops = tokenizer.convert_tokens_to_ids(MANY_STOPS)
    return generate(model, tokenizer, PROMPTS, group_size=G, max_new_tokens=MAX_NEW, version=0,
                    generator=torch.Generator().manual_seed(3), eos_token_ids=stops, **kwargs)  # fmt: skip


@pytest.mark.parametrize("compact_below", [0.0, 0.5, 1.0])
def test_lagged_reads_sample_the_same_tokens(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch, compact_below: float
) -> None:
    """Rows that ended run on a few steps fed padding, rows leave the forward later, the trailing steps after every
    row ended are dropped: the same rollouts as reading the count at once (μ within float rounding)."""
    monkeypatch.setattr(sampler, "COMPACT_BELOW", compact_below)
    now = _sample(model, tokenizer, lagged_reads=False)
    late = _sample(model, tokenizer, lagged_reads=True)
    assert len(set(now.response_mask.sum(-1).tolist())) > 1  # rows end at different steps
    assert torch.equal(now.response_ids, late.response_ids) and torch.equal(now.response_mask, late.response_mask)
    assert now.texts == late.texts and torch.equal(now.truncated, late.truncated)
    torch.testing.assert_close(late.behav_logp, now.behav_logp, atol=1e-5, rtol=0)
    logp, _ = sequence_logprobs(model, late)
    torch.testing.assert_close(logp, late.behav_logp, atol=1e-5, rtol=0)


@contextlib.contextmanager
def _counted_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every read of a tensor's value on the host (``item``, ``tolist``, ``int``, ``float``, ``bool``), except the
    lagged count's own read of its finished copy (pinned host memory on a GPU: no wait)."""
    reads: list[str] = []
    inside = [False]
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _original=original, _name=name) -> object:
            if not inside[0]:
                reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    latest = LaggedCount.latest

    def own_read(self: LaggedCount) -> int | None:
        inside[0] = True
        try:
            return latest(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(LaggedCount, "latest", own_read)
    yield reads
    monkeypatch.undo()


def test_no_host_read_per_decoded_token(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lagged loop's reads do not grow with the tokens decoded (those of the prefill's mask and the final trim,
    once per call); reading the count at once reads it every step (which is what the rule would catch)."""
    monkeypatch.setattr(sampler, "COMPACT_BELOW", 0.0)  # compaction's row selection is a read of its own
    prompts = sampler.encode_prompts(tokenizer, PROMPTS, device=torch.device("cpu"))
    stops = torch.tensor([tokenizer.eos_token_id])  # rarely drawn by the random model: rows run to the budget
    counts = {}
    for lagged in (True, False):
        for max_new in (4, 16):
            with _counted_reads(monkeypatch) as reads, torch.no_grad():
                steps = sampler._decode(
                    model, prompts=prompts, group_size=G, params=sampler.SamplingParams(), max_new_tokens=max_new,
                    stop_ids=stops, pad_id=int(tokenizer.pad_token_id), generator=torch.Generator().manual_seed(3),
                    use_cache=True, record_entropy=False, before_forward=lambda: 0, lagged_reads=lagged,
                )  # fmt: skip
            counts[lagged, max_new] = (len(reads), len(steps.tokens))
    assert counts[True, 16][1] > counts[True, 4][1] + 8, counts  # more tokens decoded ...
    assert counts[True, 16][0] == counts[True, 4][0] <= 4, counts  # ... no more reads
    assert counts[False, 16][0] - counts[False, 4][0] >= counts[False, 16][1] - counts[False, 4][1], counts
