"""Arithmetic tasks from reasoning-gym, in a compact form a character-level model can read.

* ``chain_sum``: ``12+3-4=`` → ``11``. With ``worked_steps`` the demonstration writes the running partial sums
  first, ``12+3=15,15-4=11;11``, and the answer is what follows the last ``;``.
* ``basic_arithmetic``: ``(2+-8)*4=`` → ``-24`` (parentheses, standard precedence, exact integer division).

Scores come from reasoning-gym's own scorers (``score_answer``) on the cleaned completion.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from steadyrl.tasks.config import DELAYED_REWARD_KEYS, BasicArithmeticConfig, ChainSumConfig, Operator
from steadyrl.tasks.generated import GeneratedTask, ProblemText
from steadyrl.tasks.text import after_last
from steadyrl.tasks.types import Problem

#: Ends every arithmetic prompt.
EQUALS = "="
#: Worked steps: separates one partial sum from the next, and the steps from the final answer.
STEP_SEPARATOR = ","
ANSWER_SEPARATOR = ";"
#: reasoning-gym writes expressions with single spaces between tokens; the compact prompt drops them.
RG_TOKEN_SEPARATOR = " "


def _sorted_chars(*parts: str) -> str:
    return "".join(sorted(set("".join(parts))))


def compact(expression: str) -> str:
    """A reasoning-gym expression without spaces (``"12 + 3 - 4"`` → ``"12+3-4"``)."""
    return expression.replace(RG_TOKEN_SEPARATOR, "")


class WorkedSteps(NamedTuple):
    """The partial sums of a chain sum, written out (``["12+3=15", "15-4=11"]``), and its value (``11``)."""

    steps: list[str]
    value: int


def worked_steps(expression: str) -> WorkedSteps:
    """The running partial sums of a chain sum: ``"12 + 3 - 4"`` → ``WorkedSteps(["12+3=15", "15-4=11"], 11)``."""
    tokens = expression.split(RG_TOKEN_SEPARATOR)
    terms, operators = tokens[0::2], tokens[1::2]
    running = int(terms[0])
    steps: list[str] = []
    for op, term in zip(operators, terms[1:], strict=True):
        value = running + int(term) if op == "+" else running - int(term)
        steps.append(f"{running}{op}{term}{EQUALS}{value}")
        running = value
    return WorkedSteps(steps=steps, value=running)


class ChainSumTask(GeneratedTask):
    """reasoning-gym ``chain_sum`` (sums and differences); see :class:`~steadyrl.tasks.config.ChainSumConfig`."""

    name: ClassVar[str] = "chain_sum"
    dataset_name: ClassVar[str] = "chain_sum"

    def __init__(
        self,
        *,
        min_terms: int,
        max_terms: int,
        min_digits: int,
        max_digits: int,
        allow_negation: bool,
        worked_steps: bool,
        eval_size: int,
        partial_credit: bool,
        stop_texts: Sequence[str],
    ) -> None:
        settings = {
            "min_terms": min_terms,
            "max_terms": max_terms,
            "min_digits": min_digits,
            "max_digits": max_digits,
            "allow_negation": allow_negation,
        }
        super().__init__(settings=settings, eval_size=eval_size, partial_credit=partial_credit, stop_texts=stop_texts)
        self.worked_steps = worked_steps

    @classmethod
    def from_config(cls, cfg: ChainSumConfig) -> ChainSumTask:
        # Every config field but the tag is a constructor argument of the same name.
        return cls(**cfg.model_dump(exclude={"name", *DELAYED_REWARD_KEYS}))

    def _problem_text(self, entry: Mapping[str, Any]) -> ProblemText:
        return ProblemText(prompt=compact(entry["metadata"]["expression"]) + EQUALS, answer=entry["answer"])

    def _final_answer(self, text: str) -> str:
        return after_last(text, separator=ANSWER_SEPARATOR) if self.worked_steps else text

    def demonstration(self, problem: Problem) -> str:
        """The answer; with ``worked_steps``, the partial sums then ``;`` then the answer."""
        if not self.worked_steps:
            return problem.answer
        steps = worked_steps(problem.meta["entry"]["metadata"]["expression"]).steps
        return STEP_SEPARATOR.join(steps) + ANSWER_SEPARATOR + problem.answer

    @property
    def alphabet(self) -> str:
        worked = STEP_SEPARATOR + ANSWER_SEPARATOR if self.worked_steps else ""
        return _sorted_chars(string.digits, "+-", EQUALS, worked)


class BasicArithmeticTask(GeneratedTask):
    """reasoning-gym ``basic_arithmetic``; see :class:`~steadyrl.tasks.config.BasicArithmeticConfig`."""

    name: ClassVar[str] = "basic_arithmetic"
    dataset_name: ClassVar[str] = "basic_arithmetic"

    def __init__(
        self,
        *,
        min_terms: int,
        max_terms: int,
        min_digits: int,
        max_digits: int,
        operators: Sequence[Operator],
        allow_negation: bool,
        eval_size: int,
        partial_credit: bool,
        stop_texts: Sequence[str],
    ) -> None:
        settings = {
            "min_terms": min_terms,
            "max_terms": max_terms,
            "min_digits": min_digits,
            "max_digits": max_digits,
            "operators": tuple(operators),
            "allow_parentheses": True,  # the parenthesis-free generator ignores precedence (config.py)
            "allow_negation": allow_negation,
        }
        super().__init__(settings=settings, eval_size=eval_size, partial_credit=partial_credit, stop_texts=stop_texts)
        self.operators = tuple(operators)

    @classmethod
    def from_config(cls, cfg: BasicArithmeticConfig) -> BasicArithmeticTask:
        # Every config field but the tag is a constructor argument of the same name.
        return cls(**cfg.model_dump(exclude={"name", *DELAYED_REWARD_KEYS}))

    def _problem_text(self, entry: Mapping[str, Any]) -> ProblemText:
        return ProblemText(prompt=compact(entry["metadata"]["expression"]) + EQUALS, answer=entry["answer"])

    def demonstration(self, problem: Problem) -> str:
        """The answer."""
        return problem.answer

    @property
    def alphabet(self) -> str:
        # Terms and answers can be negative whatever the operators, hence "-" always.
        return _sorted_chars(string.digits, "-()", EQUALS, "".join(self.operators))
