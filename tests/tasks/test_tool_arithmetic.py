"""chain_sum_tool: demonstrations as tool-using transcripts, scoring after the last fence, the warm start's masked
tool turns, and one call format shared with the sampler and the config."""

from __future__ import annotations

import pytest

from steadyrl.config.train import ToolsConfig
from steadyrl.models import build_char_tokenizer
from steadyrl.models.tokenizer import CHARSET
from steadyrl.models.warmstart import demonstration_batch
from steadyrl.rollout.multiturn import ToolCallFormat
from steadyrl.tasks import ChainSumConfig, ChainSumToolConfig, ChainSumToolTask, Problem, ToolDemonstrations, build_task
from steadyrl.tasks import tool_arithmetic as ta


def _task(**overrides: object) -> ChainSumToolTask:
    task = build_task(ChainSumToolConfig(**overrides))
    assert isinstance(task, ChainSumToolTask) and isinstance(task, ToolDemonstrations)
    return task


def _hand_problem(expression: str, answer: str) -> Problem:
    entry = {"answer": answer, "metadata": {"expression": expression}}
    return Problem(prompt=expression.replace(" ", "") + "=", answer=answer, uid="hand/0", meta={"entry": entry})


BIG = _hand_problem("48213 + 9377 - 51234", "6356")


def test_demonstration_by_hand() -> None:
    task = _task()
    turns = task.demonstration_turns(BIG)
    assert turns == [
        ta.DemoTurn("```python\nprint(48213+9377-51234)\n```", tool=False),
        ta.DemoTurn("\n```output\n6356\n```\n", tool=True),
        ta.DemoTurn("6356", tool=False),
    ]
    assert task.demonstration(BIG) == "".join(t.text for t in turns)
    assert ToolCallFormat().find_call(turns[0].text) == "print(48213+9377-51234)"


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("6356", 1.0),  # the last model turn (what the multi-turn samplers score)
        ("```python\nprint(48213+9377-51234)\n```\n```output\n6356\n```\n6356", 1.0),  # a whole transcript
        ("```python\nprint(1)\n```\n```output\n6356\n```\n17", 0.0),  # the answer follows the last fence only
        ("```python\nprint(48213+9377-51234)\n```", 0.0),  # a call and no answer
        ("6356<eos>", 1.0),
        ("6357", 0.0),
        ("", 0.0),
    ],
)
def test_score_reads_after_the_last_fence(completion: str, score: float) -> None:
    assert _task().score(BIG, completion) == score


def test_generated_problems_are_big_and_demonstrations_score() -> None:
    task = _task()
    problems = task.problems("train", 64, seed=0) + task.problems("eval", 64, seed=0)
    for p in problems:
        terms = p.prompt[:-1].replace("-", "+").split("+")
        assert 2 <= len(terms) <= 3 and all(4 <= len(t) <= 5 for t in terms)
        assert task.score(p, task.demonstration(p)) == 1.0
        assert task.score(p, task.demonstration_turns(p)[-1].text) == 1.0
        assert set(p.prompt + task.demonstration(p)) <= set(task.alphabet)
    assert set(task.alphabet) <= set(CHARSET) and task.alphabet == "".join(sorted(set(task.alphabet)))
    # a stream of its own: not chain_sum's prompts for the same settings
    plain = build_task(ChainSumConfig(min_digits=4, max_digits=5)).problems("train", 64, seed=0)
    assert [p.prompt for p in plain] != [p.prompt for p in task.problems("train", 64, seed=0)]


def test_one_call_format_everywhere() -> None:
    fmt, cfg = ToolCallFormat(), ToolsConfig()
    assert (fmt.open, fmt.close, fmt.output_template) == (ta.CALL_OPEN, ta.CALL_CLOSE, ta.OUTPUT_TEMPLATE)
    assert cfg.call_format() == fmt


def test_warm_start_batch_masks_the_tool_turn() -> None:
    tok = build_char_tokenizer()
    task = _task()
    batch = demonstration_batch(tok, task=task, problems=[BIG, _hand_problem("1000 + 2000", "3000")])
    assert batch.tool_mask is not None
    for i, p in enumerate([BIG, _hand_problem("1000 + 2000", "3000")]):
        call, output, answer = (t.text for t in task.demonstration_turns(p))
        model_text = tok.decode(batch.response_ids[i][batch.response_mask[i]].tolist())
        assert model_text == call + answer + "<eos>"
        assert tok.decode(batch.response_ids[i][batch.tool_mask[i]].tolist()) == output
        assert not (batch.response_mask[i] & batch.tool_mask[i]).any()
        n = len(call + output + answer) + 1
        assert (batch.response_mask[i] | batch.tool_mask[i])[:n].all() and not batch.response_mask[i, n:].any()
    plain = demonstration_batch(tok, task=build_task(ChainSumConfig()), problems=task.problems("train", 4, seed=0))
    assert plain.tool_mask is None  # a task without tool turns: the batch of before
