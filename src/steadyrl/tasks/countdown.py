"""reasoning-gym ``countdown``: combine all given numbers with + - * / to reach a target.

Compact form: prompt ``8,12,4>24:`` (the numbers, ``>``, the target, ``:``); answer and demonstration: one solving
expression without spaces, ``4+12+8``. Scored with reasoning-gym's countdown scorer (right value, every number used
exactly once). That scorer evaluates the text with sympy's ``parse_expr``, which runs Python ``eval``, so a completion
reaches it only when it holds nothing but digits, operators, parentheses and spaces, without ``**``, and is short.

Generation costs about 2 ms a problem (sympy), so each stream is cached as JSONL (:mod:`steadyrl.tasks.stream_cache`),
keyed by the settings, the stream seed and the reasoning-gym version; a stream is extended on demand.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Mapping, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any, ClassVar

from tqdm.auto import tqdm

from steadyrl.tasks.config import CountdownConfig, Operator
from steadyrl.tasks.generated import GeneratedTask, ProblemText, without_question
from steadyrl.tasks.stream_cache import Entry, StreamCache, cache_key, task_cache_dir
from steadyrl.tasks.types import Problem

NUMBER_SEPARATOR = ","
TARGET_MARK = ">"
PROMPT_END = ":"
#: Completions longer than this never reach sympy.
MAX_EXPRESSION_CHARS = 200
#: Show a progress bar when generating at least this many problems (about a second of work).
PROGRESS_MIN = 500
_SAFE_EXPRESSION = re.compile(r"[0-9+\-*/() ]+")
_POWER = "**"


def generate_entries(dataset: Any, *, start: int, stop: int) -> list[Entry]:
    """Entries ``start..stop-1`` of a reasoning-gym countdown dataset, without the question text, as
    JSON-round-tripped plain data.

    Round-tripping makes a freshly generated entry identical to one read back from the cache (tuples become lists).
    """
    out: list[Entry] = []
    for i in tqdm(range(start, stop), desc="countdown problems", disable=stop - start < PROGRESS_MIN, leave=False):
        try:
            entry = dataset[i]
        except ValueError as err:  # reasoning-gym gives up after a fixed number of attempts
            raise ValueError(
                f"countdown: reasoning-gym found no expression for item {i} with a target in range ({err}); widen "
                "min_target..max_target or min_value..max_value"
            ) from err
        out.append(json.loads(json.dumps(without_question(entry))))
    return out


def is_safe_expression(text: str) -> bool:
    """Whether ``text`` may be handed to sympy: short, only digits, ``+ - * /``, parentheses, spaces, and no ``**``."""
    return len(text) <= MAX_EXPRESSION_CHARS and _SAFE_EXPRESSION.fullmatch(text) is not None and _POWER not in text


class CountdownTask(GeneratedTask):
    """reasoning-gym ``countdown``; see :class:`~steadyrl.tasks.config.CountdownConfig`."""

    name: ClassVar[str] = "countdown"
    dataset_name: ClassVar[str] = "countdown"

    def __init__(
        self,
        *,
        min_numbers: int,
        max_numbers: int,
        min_value: int,
        max_value: int,
        min_target: int,
        max_target: int,
        operators: Sequence[Operator],
        cache_dir: Path | None,
        eval_size: int,
        partial_credit: bool,
        stop_texts: Sequence[str],
    ) -> None:
        settings = {
            "min_numbers": min_numbers,
            "max_numbers": max_numbers,
            "min_value": min_value,
            "max_value": max_value,
            "min_target": min_target,
            "max_target": max_target,
            "operators": tuple(operators),
        }
        super().__init__(settings=settings, eval_size=eval_size, partial_credit=partial_credit, stop_texts=stop_texts)
        self.operators = tuple(operators)
        self.cache_dir = task_cache_dir(cache_dir)
        self._caches: dict[int, StreamCache] = {}

    @classmethod
    def from_config(cls, cfg: CountdownConfig) -> CountdownTask:
        return cls(
            min_numbers=cfg.min_numbers,
            max_numbers=cfg.max_numbers,
            min_value=cfg.min_value,
            max_value=cfg.max_value,
            min_target=cfg.min_target,
            max_target=cfg.max_target,
            operators=cfg.operators,
            cache_dir=cfg.cache_dir,
            eval_size=cfg.eval_size,
            partial_credit=cfg.partial_credit,
            stop_texts=cfg.stop_texts,
        )

    def cache_path(self, seed: int) -> Path:
        """The cache file of the stream with reasoning-gym seed ``seed``."""
        key = {"dataset": self.dataset_name, "settings": self.settings, "seed": seed,
               "reasoning_gym": version("reasoning_gym")}
        return self.cache_dir / f"{self.dataset_name}-{cache_key(key)}.jsonl"

    def _entries(self, *, seed: int, start: int, stop: int) -> list[dict[str, Any]]:
        if seed not in self._caches:
            dataset = self._dataset(seed)
            self._caches[seed] = StreamCache(
                path=self.cache_path(seed),
                generate=lambda lo, hi: generate_entries(dataset, start=lo, stop=hi),
            )
        return self._caches[seed].get(start=start, stop=stop)

    def _problem_text(self, entry: Mapping[str, Any]) -> ProblemText:
        meta = entry["metadata"]
        numbers = NUMBER_SEPARATOR.join(str(x) for x in meta["numbers"])
        prompt = f"{numbers}{TARGET_MARK}{meta['target']}{PROMPT_END}"
        return ProblemText(prompt=prompt, answer=entry["answer"].replace(" ", ""))

    def _accepts(self, answer: str) -> bool:
        return is_safe_expression(answer)

    def demonstration(self, problem: Problem) -> str:
        """reasoning-gym's solving expression, without spaces."""
        return problem.answer

    @property
    def alphabet(self) -> str:
        # reasoning-gym falls back to "-" when a "/" finds no exact divisor.
        fallback = "-" if "/" in self.operators else ""
        chars = string.digits + NUMBER_SEPARATOR + TARGET_MARK + PROMPT_END + "()" + "".join(self.operators) + fallback
        return "".join(sorted(set(chars)))
