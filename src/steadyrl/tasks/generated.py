"""Tasks drawn from a reasoning-gym generator (Stojanovski et al. 2025, arXiv:2505.24760), with a held-out eval split.

Seed streams. reasoning-gym builds item ``i`` of a dataset with seed ``s`` from ``random.Random(s + i)``, so the
datasets of seeds ``s`` and ``s + 1`` are the same sequence shifted by one. Each split therefore draws from its own
stream seed, a 32-bit hash of (task, split, seed) (:func:`stream_seed`), so a split's streams for nearby seeds and
the two splits of one seed overlap as index ranges only by chance (and the held-out filter covers that chance).

Held-out eval. The eval set of a seed is the first ``eval_size`` problems of its eval stream, as drawn (a
prompt may repeat, like in the task's distribution). The train stream of the
same seed skips every problem whose prompt is in that set (small settings repeat prompts often, so index-disjoint
streams alone would not keep them apart). ``problems(split, n, seed=s)`` is deterministic, and its result for ``n`` is
a prefix of its result for any larger ``n``. Use one seed for both splits of a run: the guarantee is per seed.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from steadyrl.tasks.text import clean_completion
from steadyrl.tasks.types import SPLITS, Problem, Split

#: reasoning-gym datasets have a nominal length; items are generated on index, so any large value works.
RG_VIRTUAL_SIZE = 2**31
#: Stream seeds are this many bits of a hash.
STREAM_SEED_BYTES = 4
#: Train problems are generated in chunks of at least this many (rejections against the eval set need slack).
MIN_CHUNK = 16
#: Give up when this many train draws in a row all land in the eval set (the settings have too few prompts).
MAX_CONSECUTIVE_REJECTS = 10_000
#: The key of reasoning-gym's natural-language question in an entry; dropped (the compact prompt replaces it), which
#: keeps problems small to send to samplers and countdown's cache small on disk.
RG_QUESTION_KEY = "question"
#: reasoning-gym scorers do not depend on the dataset seed; this one builds the dataset used for scoring.
SCORER_SEED = 0
#: A reasoning-gym scorer's full-credit value.
FULL_CREDIT = 1.0


def without_question(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A reasoning-gym entry without its natural-language question (``answer`` and ``metadata`` stay)."""
    return {key: value for key, value in entry.items() if key != RG_QUESTION_KEY}


class ProblemText(NamedTuple):
    """What a task makes of one generated entry: the prompt and the reference answer."""

    prompt: str
    answer: str


def stream_seed(*, task: str, split: Split, seed: int) -> int:
    """The reasoning-gym seed of one (task, split, seed) stream: the first 32 bits of a BLAKE2b hash."""
    digest = hashlib.blake2b(f"{task}/{split}/{seed}".encode(), digest_size=STREAM_SEED_BYTES).digest()
    return int.from_bytes(digest, "big")


def rg_dataset(name: str, *, seed: int, settings: Mapping[str, Any]) -> Any:
    """A reasoning-gym dataset (imported on first use: importing reasoning-gym takes about a second)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=RG_VIRTUAL_SIZE, seed=seed, **settings)


class GeneratedTask(ABC):
    """Base of the reasoning-gym tasks: streams, the held-out split, and scoring through reasoning-gym's scorer.

    A subclass sets ``name``, ``dataset_name`` and ``settings`` (the reasoning-gym config keywords), and writes
    :meth:`_problem_text` (prompt and answer of an entry), :meth:`demonstration` and :attr:`alphabet`.
    """

    name: ClassVar[str]
    dataset_name: ClassVar[str]

    def __init__(
        self,
        *,
        settings: Mapping[str, Any],
        eval_size: int,
        partial_credit: bool,
        stop_texts: Sequence[str],
    ) -> None:
        self.settings = dict(settings)
        self.eval_size = eval_size
        self.partial_credit = partial_credit
        self.stop_texts = tuple(stop_texts)
        self._datasets: dict[int, Any] = {}
        self._eval_sets: dict[int, list[Problem]] = {}

    # --- generation -------------------------------------------------------------------------------------------

    def _dataset(self, seed: int) -> Any:
        if seed not in self._datasets:
            self._datasets[seed] = rg_dataset(self.dataset_name, seed=seed, settings=self.settings)
        return self._datasets[seed]

    def _entries(self, *, seed: int, start: int, stop: int) -> list[dict[str, Any]]:
        """Entries ``start..stop-1`` of the stream with reasoning-gym seed ``seed``, without the question text
        (countdown caches these)."""
        dataset = self._dataset(seed)
        return [without_question(dataset[i]) for i in range(start, stop)]

    @abstractmethod
    def _problem_text(self, entry: Mapping[str, Any]) -> ProblemText:
        """Prompt and answer of a reasoning-gym entry."""

    def _problem(self, entry: Mapping[str, Any], *, split: Split, seed: int, index: int) -> Problem:
        text = self._problem_text(entry)
        uid = f"{self.name}/{split}/{seed}/{index}"
        return Problem(prompt=text.prompt, answer=text.answer, uid=uid, meta={"entry": entry})

    # --- splits -----------------------------------------------------------------------------------------------

    def _stream_seed(self, split: Split, seed: int) -> int:
        """The reasoning-gym seed of ``split``'s stream for run seed ``seed`` (:func:`stream_seed` of the task)."""
        return stream_seed(task=self.name, split=split, seed=seed)

    def _eval_set(self, seed: int) -> list[Problem]:
        if seed not in self._eval_sets:
            entries = self._entries(seed=self._stream_seed("eval", seed), start=0, stop=self.eval_size)
            self._eval_sets[seed] = [
                self._problem(entry, split="eval", seed=seed, index=i) for i, entry in enumerate(entries)
            ]
        return self._eval_sets[seed]

    def _train(self, n: int, *, seed: int) -> list[Problem]:
        held_out = {problem.prompt for problem in self._eval_set(seed)}
        rg_seed = self._stream_seed("train", seed)
        out: list[Problem] = []
        index = 0
        rejects_in_a_row = 0
        while len(out) < n:
            chunk = self._entries(seed=rg_seed, start=index, stop=index + max(n - len(out), MIN_CHUNK))
            for entry in chunk:
                problem = self._problem(entry, split="train", seed=seed, index=index)
                index += 1
                if problem.prompt in held_out:
                    rejects_in_a_row += 1
                    if rejects_in_a_row >= MAX_CONSECUTIVE_REJECTS:
                        raise ValueError(
                            f"{self.name}: {rejects_in_a_row} train draws in a row were all in the eval set; these "
                            f"settings have too few distinct prompts for eval_size={self.eval_size}"
                        )
                    continue
                rejects_in_a_row = 0
                out.append(problem)
                if len(out) == n:
                    break
        return out

    def problems(self, split: Split, n: int, *, seed: int) -> list[Problem]:
        """The first ``n`` problems of ``split`` for ``seed`` (see the module docstring for the streams).

        Raises ValueError for an unknown split, a negative ``n``, or more eval problems than ``eval_size``.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if split == "eval":
            if n > self.eval_size:
                raise ValueError(f"{self.name}: asked for {n} eval problems but eval_size is {self.eval_size}")
            return self._eval_set(seed)[:n]
        return self._train(n, seed=seed)

    # --- scoring ----------------------------------------------------------------------------------------------

    def _final_answer(self, text: str) -> str:
        """The part of a cleaned completion that holds the answer (all of it unless a subclass says otherwise)."""
        return text

    def _accepts(self, answer: str) -> bool:
        """Whether ``answer`` may reach reasoning-gym's scorer (countdown refuses what sympy should not evaluate)."""
        return True

    def score(self, problem: Problem, completion: str) -> float:
        """reasoning-gym's score of the cleaned completion's final answer; 0/1 unless ``partial_credit``."""
        answer = self._final_answer(clean_completion(completion, stop_texts=self.stop_texts))
        if not self._accepts(answer):
            return 0.0
        entry = problem.meta["entry"]
        raw = float(self._dataset(SCORER_SEED).score_answer(answer, entry))
        if self.partial_credit:
            return raw
        return 1.0 if raw >= FULL_CREDIT else 0.0

    @abstractmethod
    def demonstration(self, problem: Problem) -> str:
        """A correct completion of ``problem``."""

    @property
    @abstractmethod
    def alphabet(self) -> str:
        """Every character prompts and demonstrations can contain, sorted."""
