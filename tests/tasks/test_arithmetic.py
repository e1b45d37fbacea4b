"""chain_sum and basic_arithmetic: compact prompts, reasoning-gym scoring, worked steps, alphabet coverage."""

from __future__ import annotations

import pickle

import pytest

from steadyrl.tasks import BasicArithmeticConfig, ChainSumConfig, Problem, build_task
from steadyrl.tasks.arithmetic import ChainSumTask, WorkedSteps, worked_steps


def _chain_sum(**overrides: object) -> ChainSumTask:
    task = build_task(ChainSumConfig(**overrides))
    assert isinstance(task, ChainSumTask)
    return task


def _hand_problem(expression: str, answer: str) -> Problem:
    """A problem written by hand, shaped like a reasoning-gym entry (what the scorer and demonstration read)."""
    entry = {"answer": answer, "metadata": {"expression": expression}}
    return Problem(prompt=expression.replace(" ", "") + "=", answer=answer, uid="hand/0", meta={"entry": entry})


TWELVE_PLUS = _hand_problem("12 + 3 - 4", "11")


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("11", 1.0),
        ("  11\n", 1.0),
        ("11</s>", 1.0),
        ("11<eos><pad><pad>", 1.0),
        ("011", 1.0),  # reasoning-gym tolerates leading zeros and a trailing ".0"
        ("11.0", 1.0),
        ("12", 0.0),
        ("-11", 0.0),  # reasoning-gym gives 2/3 here (substring credit); binary by default
        ("111", 0.0),
        ("", 0.0),
        ("</s>11", 0.0),
        ("1 1", 0.0),
    ],
)
def test_chain_sum_score(completion: str, score: float) -> None:
    assert _chain_sum().score(TWELVE_PLUS, completion) == score


def test_partial_credit_passes_reasoning_gym_fraction_through() -> None:
    task = _chain_sum(partial_credit=True)
    assert task.score(TWELVE_PLUS, "-11") == pytest.approx(2 / 3, abs=1e-12)
    assert task.score(TWELVE_PLUS, "11") == 1.0
    assert task.score(TWELVE_PLUS, "12") == 0.0


def test_worked_steps_demonstration_by_hand() -> None:
    task = _chain_sum(worked_steps=True)
    assert task.demonstration(TWELVE_PLUS) == "12+3=15,15-4=11;11"
    assert task.demonstration(_hand_problem("-5 + -3", "-8")) == "-5+-3=-8;-8"
    assert worked_steps("30 - 28 - 44") == WorkedSteps(steps=["30-28=2", "2-44=-42"], value=-42)
    assert _chain_sum().demonstration(TWELVE_PLUS) == "11"


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("12+3=15,15-4=11;11", 1.0),
        ("12+3=15,15-4=11;11</s>", 1.0),
        ("12+3=15,15-4=11; 11 \n", 1.0),
        ("garbage steps;11", 1.0),  # outcome reward: only the final answer is checked
        ("11", 1.0),  # no ";": the whole completion is the answer
        ("12+3=15,15-4=11;12", 0.0),
        ("12+3=15;15-4=11", 0.0),
        ("12+3=15,15-4=11", 0.0),
        ("12+3=15,15-4=11;", 0.0),
    ],
)
def test_worked_steps_score(completion: str, score: float) -> None:
    assert _chain_sum(worked_steps=True).score(TWELVE_PLUS, completion) == score


def test_basic_arithmetic_score() -> None:
    task = build_task(BasicArithmeticConfig())
    problem = _hand_problem("( 2 + -8 ) * 4", "-24")
    assert problem.prompt == "(2+-8)*4="
    assert task.demonstration(problem) == "-24"
    assert task.score(problem, " -24</s>") == 1.0
    assert task.score(problem, "24") == 0.0
    assert task.score(problem, "-240") == 0.0
    assert task.score(problem, "") == 0.0


@pytest.mark.parametrize(
    "cfg",
    [
        ChainSumConfig(),
        ChainSumConfig(worked_steps=True),
        ChainSumConfig(worked_steps=True, allow_negation=True, min_terms=3, max_terms=6),
        BasicArithmeticConfig(),
        BasicArithmeticConfig(operators=("+", "*"), allow_negation=True),
    ],
    ids=lambda cfg: cfg.name,
)
def test_generated_problems_alphabet_and_demonstrations(cfg: ChainSumConfig | BasicArithmeticConfig) -> None:
    task = build_task(cfg.model_copy(update={"eval_size": 64}))
    problems = task.problems("train", 300, seed=3) + task.problems("eval", 64, seed=3)
    used = set()
    for problem in problems:
        demo = task.demonstration(problem)
        used.update(problem.prompt + demo)
        assert task.score(problem, demo) == 1.0, (problem, demo)
        assert problem.prompt.endswith("=") and " " not in problem.prompt
    assert used <= set(task.alphabet)
    assert task.alphabet == "".join(sorted(set(task.alphabet)))


def test_chain_sum_prompt_is_the_compact_expression() -> None:
    task = _chain_sum(eval_size=4)
    for problem in task.problems("train", 50, seed=0):
        expression = problem.meta["entry"]["metadata"]["expression"]
        assert problem.prompt == expression.replace(" ", "") + "="
        assert problem.answer == str(eval(expression))  # hand check of reasoning-gym's answer


def test_basic_arithmetic_answers_follow_precedence() -> None:
    task = build_task(BasicArithmeticConfig(eval_size=4))
    for problem in task.problems("train", 200, seed=1):
        value = eval(problem.prompt[:-1])  # exact: every "/" divides evenly
        assert value == int(value) and str(int(value)) == problem.answer, problem


def test_problems_pickle_and_hash() -> None:
    task = _chain_sum(eval_size=4, worked_steps=True)
    problems = task.problems("train", 5, seed=0)
    assert pickle.loads(pickle.dumps(problems)) == problems
    assert len(set(problems)) == len(problems)
    assert task.demonstration(pickle.loads(pickle.dumps(problems[0]))) == task.demonstration(problems[0])
