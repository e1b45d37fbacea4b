"""The task interface: a :class:`Problem` to pose, and the :class:`Task` protocol that poses and scores it.

A task knows nothing about RL: it hands out prompts, scores completions, writes a correct completion for warm-start
supervised training, and names the characters its text can contain (so a character tokenizer can be built for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = get_args(Split)


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    ``meta`` is excluded from equality and hashing (it may hold nested dicts), so two problems are equal when
    prompt, answer and uid are. Everything in it is plain data (JSON-like), so a problem pickles to a sampler process.
    """

    prompt: str
    """Exactly the text fed to the model (already formatted; compact for a character-level model)."""
    answer: str
    """The canonical reference answer."""
    uid: str
    """Stable id: task name, split and index (``chain_sum/train/0/17``; file tasks: ``gsm8k/train/42``)."""
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Task-specific data the scorer needs (generator tasks: ``{"entry": <reasoning-gym entry without its question>}``;
    file tasks: ``{"question", "solution", "path", "where"}``, the question as in the file, before any template)."""


class Task(Protocol):
    """A source of problems and their verifier.

    Not ``runtime_checkable`` on purpose: before Python 3.12 ``isinstance`` against a protocol evaluates its
    properties, and a file task's ``alphabet`` reads its files.
    """

    name: str

    def problems(self, split: Split, n: int, *, seed: int) -> list[Problem]:
        """The first ``n`` problems of ``split`` for ``seed``; deterministic, and train never yields an eval prompt."""
        ...

    def score(self, problem: Problem, completion: str) -> float:
        """Reward of ``completion`` for ``problem``: 1.0 right, 0.0 wrong (fractions only where a task allows)."""
        ...

    def demonstration(self, problem: Problem) -> str:
        """A correct completion of ``problem`` (for warm-start supervised training); it scores 1.0."""
        ...

    @property
    def alphabet(self) -> str:
        """Every character that prompts and demonstrations can contain, sorted, each once."""
        ...


class MissingFileError(FileNotFoundError):
    """A file or directory a config key names does not exist; the message names the key and the fix (``steadyrl
    train`` prints it as one line, unlike a ``FileNotFoundError`` from anywhere else, which keeps its traceback)."""


class DatasetError(ValueError):
    """A malformed row in a user's data file: the message names the file and the 1-based line (JSONL) or row
    (Parquet), and what is wrong with it."""

    def __init__(self, *, path: Path, where: str, reason: str) -> None:
        self.path = path
        self.where = where
        self.reason = reason
        super().__init__(f"{path}, {where}: {reason}")
