"""Held-out eval split and determinism of the generator tasks (chain_sum stands in for all of them)."""

from __future__ import annotations

import pytest

from steadyrl.tasks import ChainSumConfig, build_task
from steadyrl.tasks.generated import stream_seed

#: 2 one-digit terms: 10 * 10 * 2 = 200 distinct prompts, so train and eval streams collide often.
SMALL = ChainSumConfig(min_terms=2, max_terms=2, min_digits=1, max_digits=1, eval_size=100)


def test_deterministic_for_a_seed() -> None:
    a, b = build_task(SMALL), build_task(SMALL)
    for split, n in (("train", 150), ("eval", 100)):
        assert a.problems(split, n, seed=7) == b.problems(split, n, seed=7)
        assert [p.meta for p in a.problems(split, n, seed=7)] == [p.meta for p in b.problems(split, n, seed=7)]
    assert a.problems("train", 50, seed=7) != a.problems("train", 50, seed=8)
    assert a.problems("eval", 50, seed=7) != a.problems("eval", 50, seed=8)


def test_shorter_request_is_a_prefix() -> None:
    task = build_task(SMALL)
    assert task.problems("train", 120, seed=1)[:40] == task.problems("train", 40, seed=1)
    assert task.problems("eval", 100, seed=1)[:30] == task.problems("eval", 30, seed=1)


def test_train_never_yields_an_eval_prompt() -> None:
    task = build_task(SMALL)
    held_out = {p.prompt for p in task.problems("eval", SMALL.eval_size, seed=0)}
    train = task.problems("train", 400, seed=0)
    assert len(train) == 400
    assert not held_out & {p.prompt for p in train}
    # The filter did work: the raw train stream hit the eval set (indices were skipped).
    indices = [int(p.uid.rsplit("/", 1)[1]) for p in train]
    assert indices[-1] + 1 > len(train)
    assert indices == sorted(set(indices))


def test_uids_name_task_split_seed_and_index() -> None:
    task = build_task(SMALL)
    assert task.problems("eval", 2, seed=5)[1].uid == "chain_sum/eval/5/1"
    assert task.problems("train", 1, seed=5)[0].uid.startswith("chain_sum/train/5/")


def test_split_streams_are_separate() -> None:
    seeds = {stream_seed(task="chain_sum", split=split, seed=s) for split in ("train", "eval") for s in range(100)}
    assert len(seeds) == 200
    assert stream_seed(task="chain_sum", split="eval", seed=3) == stream_seed(task="chain_sum", split="eval", seed=3)


def test_request_errors() -> None:
    task = build_task(SMALL)
    with pytest.raises(ValueError, match="eval_size is 100"):
        task.problems("eval", 101, seed=0)
    with pytest.raises(ValueError, match="split"):
        task.problems("test", 1, seed=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be"):
        task.problems("train", -1, seed=0)
    assert task.problems("train", 0, seed=0) == []


def test_exhausted_train_stream_raises() -> None:
    # One one-digit term: 10 prompts, all of them in an eval set of 100.
    task = build_task(ChainSumConfig(min_terms=1, max_terms=1, min_digits=1, max_digits=1, eval_size=100))
    with pytest.raises(ValueError, match="too few distinct prompts"):
        task.problems("train", 1, seed=0)
