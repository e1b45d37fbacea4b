"""Arithmetic with a Python tool: ``chain_sum_tool``, sums of 4–5 digit numbers that a small model cannot add in its
head but can copy into a tool call.

A demonstration is a whole tool-integrated transcript in three turns (SimpleTIR-style fenced blocks, the default
call format of :class:`steadyrl.rollout.multiturn.ToolCallFormat`)::

    ```python               ← model turn 1: the call (the prompt's expression, copied)
    print(48213+9377+51234)
    ```
    ```output               ← tool turn: what the sandbox printed (context, never trained on)
    108824
    ```
    108824                  ← model turn 2: the answer

:meth:`ChainSumToolTask.demonstration_turns` hands the turns out separately so the warm start trains on the model
turns only (the tool turn is masked like in RL). The score reads the text after the last ``` fence, so it is the same
rule on a whole transcript (tools off: the model's own, possibly invented, "output" block does not count, only what
follows it) and on the last model turn that the multi-turn samplers score (tools on).
Confidence: [exact] (a task definition; no paper formula involved).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

from steadyrl.tasks.arithmetic import EQUALS, ChainSumTask, compact
from steadyrl.tasks.config import DELAYED_REWARD_KEYS, ChainSumToolConfig
from steadyrl.tasks.text import after_last
from steadyrl.tasks.types import Problem

#: Call format of the demonstrations (the defaults of ``ToolCallFormat`` and of the ``tools`` config section).
CALL_OPEN = "```python"
CALL_CLOSE = "```"
OUTPUT_TEMPLATE = "\n```output\n{output}\n```\n"
#: The fence that ends a code or output block; the answer is what follows the last one.
FENCE = "```"
#: What the demonstration's code wraps around the expression.
PRINT_CALL = "print({expression})"


class DemoTurn(NamedTuple):
    """One turn of a tool-using demonstration: its text, and whether a tool wrote it (masked in training)."""

    text: str
    tool: bool


@runtime_checkable
class ToolDemonstrations(Protocol):
    """A task whose demonstrations call a tool: the warm start trains on their model turns only."""

    def demonstration_turns(self, problem: Problem) -> list[DemoTurn]:
        """The turns of a correct transcript, in order; joined they give ``demonstration(problem)``."""
        ...


class ChainSumToolTask(ChainSumTask):
    """reasoning-gym ``chain_sum`` answered with the Python tool (:class:`~steadyrl.tasks.config.ChainSumToolConfig`).

    Problems (prompts, answers, the held-out split) are chain_sum's for the same settings, drawn from streams of
    their own (the stream seed hashes this task's name).
    """

    name: ClassVar[str] = "chain_sum_tool"
    dataset_name: ClassVar[str] = "chain_sum"

    def __init__(
        self,
        *,
        min_terms: int,
        max_terms: int,
        min_digits: int,
        max_digits: int,
        allow_negation: bool,
        eval_size: int,
        partial_credit: bool,
        stop_texts: Sequence[str],
    ) -> None:
        super().__init__(
            min_terms=min_terms, max_terms=max_terms, min_digits=min_digits, max_digits=max_digits,
            allow_negation=allow_negation, worked_steps=False, eval_size=eval_size, partial_credit=partial_credit,
            stop_texts=stop_texts,
        )  # fmt: skip

    @classmethod
    def from_config(cls, cfg: ChainSumToolConfig) -> ChainSumToolTask:  # type: ignore[override]
        # Every config field but the tag is a constructor argument of the same name.
        return cls(**cfg.model_dump(exclude={"name", *DELAYED_REWARD_KEYS}))

    def _final_answer(self, text: str) -> str:
        return after_last(text, separator=FENCE)

    def demonstration_turns(self, problem: Problem) -> list[DemoTurn]:
        """Call (model), output (tool), answer (model); see the module docstring."""
        code = PRINT_CALL.format(expression=compact(problem.meta["entry"]["metadata"]["expression"]))
        return [
            DemoTurn(f"{CALL_OPEN}\n{code}\n{CALL_CLOSE}", tool=False),
            DemoTurn(OUTPUT_TEMPLATE.format(output=problem.answer), tool=True),
            DemoTurn(problem.answer, tool=False),
        ]

    def demonstration(self, problem: Problem) -> str:
        """The whole transcript (the turns of :meth:`demonstration_turns`, joined)."""
        return "".join(turn.text for turn in self.demonstration_turns(problem))

    @property
    def alphabet(self) -> str:
        markers = CALL_OPEN + CALL_CLOSE + OUTPUT_TEMPLATE.format(output="") + PRINT_CALL.format(expression="")
        return "".join(sorted(set(string.digits + "+-" + EQUALS + markers)))
