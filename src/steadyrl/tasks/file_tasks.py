"""GSM8K- and MATH-style tasks read from local files, verified with math-verify.

GSM8K: Cobbe et al. 2021, arXiv:2110.14168 (solutions end in ``#### <number>``). MATH: Hendrycks et al. 2021,
arXiv:2103.03874 (solutions box the final answer).

Each split is a file the user names (nothing is downloaded). A row gives a question and a worked solution; the
reference answer is extracted from the solution (GSM8K: the number after ``####``; MATH: the last ``\\boxed{...}``),
and a completion is right when ``math_verify.verify(parse(reference), parse(completion))`` holds. The whole file is
checked on first use: a bad row raises :class:`DatasetError` with the file and the 1-based line (or Parquet row).

Prompts. ``prompt_template`` filled with the row's question is the prompt; with ``chat=true`` it is the user message
of a chat prompt rendered by the model tokenizer's chat template, after ``system_prompt`` as a system message
(:func:`steadyrl.tasks.prompts.render_chat`). ``Problem.prompt`` is that final text, so every sampler, the eval and
the learner see the same prompt; ``meta["question"]`` keeps the bare question.

Splits. Eval problems are the eval file's rows in file order (the seed does not change them). Train problems are
the train file's rows in a seeded order, reshuffled each epoch when ``n`` exceeds the file; train rows whose question
also appears in the eval file are skipped. A problem's uid is ``<task>/<split>/<0-based row index>``.
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadyrl.tasks.config import Gsm8kConfig, MathConfig
from steadyrl.tasks.files import Row, read_rows
from steadyrl.tasks.generated import stream_seed
from steadyrl.tasks.prompts import check_chat_tokenizer, render_chat
from steadyrl.tasks.text import clean_completion, fill_template, gsm8k_final_number, last_boxed
from steadyrl.tasks.types import SPLITS, DatasetError, MissingFileError, Problem, Split

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The reference answer is parsed as this LaTeX, so math-verify reads it as the final answer whatever its form.
GOLD_LATEX = "\\boxed{{{answer}}}"


def _text_field(row: Row, field: str, *, path: Path) -> str:
    if field not in row.fields:
        present = ", ".join(repr(k) for k in row.fields) or "none"
        raise DatasetError(path=path, where=row.where, reason=f"missing field {field!r} (fields present: {present})")
    value = row.fields[field]
    if not isinstance(value, str):
        raise DatasetError(path=path, where=row.where, reason=f"field {field!r} is {type(value).__name__}, expected "
                           "a string")
    return value


def _verify_timeout(timeout_s: int) -> int | None:
    """math-verify's time limit uses SIGALRM, which only a main thread may set; elsewhere it runs unlimited."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


class FileTask(ABC):
    """A task over local files of (question, worked solution) rows; subclasses say how to extract the answer."""

    name: str
    #: What a solution must contain, for the error message when it does not.
    answer_description: str

    def __init__(
        self,
        *,
        train_path: Path | None,
        eval_path: Path | None,
        question_field: str,
        answer_field: str,
        prompt_template: str,
        verify_timeout_s: int,
        stop_texts: Sequence[str],
        chat: bool = False,
        system_prompt: str | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """``tokenizer`` renders the chat prompts (needed, with a chat template, when ``chat``; unused otherwise)."""
        if system_prompt is not None and not chat:
            raise ValueError("system_prompt needs chat=true (it is the system message of a chat prompt)")
        self.tokenizer = check_chat_tokenizer(tokenizer, task=self.name) if chat else None
        self.system_prompt = system_prompt
        self.paths: dict[str, Path | None] = {"train": train_path, "eval": eval_path}
        self.question_field = question_field
        self.answer_field = answer_field
        self.prompt_template = prompt_template
        self.verify_timeout_s = verify_timeout_s
        self.stop_texts = tuple(stop_texts)
        self._splits: dict[str, list[Problem]] = {}
        self._gold: dict[str, list[Any]] = {}

    # --- answers ----------------------------------------------------------------------------------------------

    @abstractmethod
    def extract_answer(self, solution: str) -> str | None:
        """The reference answer in a worked solution, or None."""

    def _completion_answer(self, text: str) -> str:
        """The part of a cleaned completion that math-verify should read (all of it unless a subclass narrows it)."""
        return text

    # --- loading ----------------------------------------------------------------------------------------------

    def prompt(self, question: str) -> str:
        """The text fed to the model for ``question``: the filled template, chat-rendered when ``chat`` is on."""
        text = fill_template(self.prompt_template, question=question)
        if self.tokenizer is None:
            return text
        return render_chat(self.tokenizer, text, system_prompt=self.system_prompt)

    def _load(self, split: Split) -> list[Problem]:
        path = self.paths[split]
        if path is None:
            raise ValueError(f"{self.name}: no {split}_path configured")
        try:
            rows = read_rows(path)
        except FileNotFoundError as err:
            raise MissingFileError(
                f"task.{split}_path: no such file {str(path)!r} ({self.name} reads the user's local .jsonl or .parquet "
                f"files, nothing is downloaded): set task.{split}_path=/path/to/{split}.jsonl"
            ) from err
        problems: list[Problem] = []
        for index, row in enumerate(rows):
            question = _text_field(row, self.question_field, path=path)
            solution = _text_field(row, self.answer_field, path=path)
            answer = self.extract_answer(solution)
            if answer is None:
                raise DatasetError(path=path, where=row.where, reason=f"no answer in field {self.answer_field!r}: "
                                   f"expected {self.answer_description}")
            meta = {"question": question, "solution": solution, "path": str(path), "where": row.where}
            problems.append(
                Problem(prompt=self.prompt(question), answer=answer, uid=f"{self.name}/{split}/{index}", meta=meta)
            )
        if not problems:
            raise DatasetError(path=path, where="whole file", reason="no rows")
        return problems

    def _split(self, split: Split) -> list[Problem]:
        if split not in self._splits:
            problems = self._load(split)
            if split == "train" and self.paths["eval"] is not None:
                held_out = {p.meta["question"] for p in self._split("eval")}
                problems = [p for p in problems if p.meta["question"] not in held_out]
                if not problems:
                    raise ValueError(f"{self.name}: every train question is also in the eval file")
            self._splits[split] = problems
        return self._splits[split]

    def _gold_for(self, problem: Problem) -> list[Any]:
        """math-verify's parse of the reference answer (cached); DatasetError when it cannot be parsed."""
        if problem.answer not in self._gold:
            from math_verify import parse

            gold_latex = GOLD_LATEX.format(answer=problem.answer)
            gold = parse(gold_latex, parsing_timeout=_verify_timeout(self.verify_timeout_s))
            if not gold:
                raise DatasetError(path=Path(problem.meta["path"]), where=problem.meta["where"],
                                   reason=f"math-verify cannot parse the reference answer {problem.answer!r}")
            self._gold[problem.answer] = gold
        return self._gold[problem.answer]

    # --- Task protocol ----------------------------------------------------------------------------------------

    def problems(self, split: Split, n: int, *, seed: int) -> list[Problem]:
        """Eval: the first ``n`` eval rows in file order. Train: ``n`` rows in a seeded order, epoch after epoch.

        Every returned problem's reference answer has been parsed by math-verify (else DatasetError).
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rows = self._split(split)
        if split == "eval":
            if n > len(rows):
                raise DatasetError(path=self.paths["eval"], where="whole file",  # type: ignore[arg-type]
                                   reason=f"{len(rows)} eval rows, but {n} eval problems were asked for: set "
                                   f"eval.n <= {len(rows)}")  # fmt: skip
            out = rows[:n]
        else:
            rng = random.Random(stream_seed(task=self.name, split="train", seed=seed))
            out = []
            while len(out) < n:
                order = list(range(len(rows)))
                rng.shuffle(order)
                out.extend(rows[i] for i in order[: n - len(out)])
        for problem in out:
            self._gold_for(problem)
        return out

    def score(self, problem: Problem, completion: str) -> float:
        """1.0 when math-verify finds the cleaned completion's answer equal to the reference, else 0.0."""
        from math_verify import parse, verify

        text = self._completion_answer(clean_completion(completion, stop_texts=self.stop_texts))
        if not text:
            return 0.0
        timeout = _verify_timeout(self.verify_timeout_s)
        predicted = parse(text, parsing_timeout=timeout)
        return 1.0 if verify(self._gold_for(problem), predicted, timeout_seconds=timeout) else 0.0

    def demonstration(self, problem: Problem) -> str:
        """The row's worked solution."""
        return problem.meta["solution"]

    @property
    def alphabet(self) -> str:
        """Every character of the configured splits' prompts and solutions (reads the files)."""
        chars: set[str] = set()
        for split in SPLITS:
            if self.paths[split] is not None:
                for problem in self._split(split):
                    chars.update(problem.prompt)
                    chars.update(self.demonstration(problem))
        return "".join(sorted(chars))


class Gsm8kTask(FileTask):
    """GSM8K-style rows: the final answer is the number after ``####``; see :class:`Gsm8kConfig`."""

    name = "gsm8k"
    answer_description = "a number after '####'"

    def extract_answer(self, solution: str) -> str | None:
        return gsm8k_final_number(solution)

    def _completion_answer(self, text: str) -> str:
        # A completion in GSM8K's own format is read at its marker, not at whatever number it writes last.
        final = gsm8k_final_number(text)
        return text if final is None else final

    @classmethod
    def from_config(cls, cfg: Gsm8kConfig, *, tokenizer: PreTrainedTokenizerBase | None = None) -> Gsm8kTask:
        return cls(**_file_kwargs(cfg), tokenizer=tokenizer)


class MathTask(FileTask):
    """MATH-style rows: the final answer is the solution's last ``\\boxed{...}``; see :class:`MathConfig`."""

    name = "math"
    answer_description = "a \\boxed{...} answer"

    def extract_answer(self, solution: str) -> str | None:
        return last_boxed(solution)

    @classmethod
    def from_config(cls, cfg: MathConfig, *, tokenizer: PreTrainedTokenizerBase | None = None) -> MathTask:
        return cls(**_file_kwargs(cfg), tokenizer=tokenizer)


def _file_kwargs(cfg: Gsm8kConfig | MathConfig) -> dict[str, Any]:
    return {
        "train_path": cfg.train_path,
        "eval_path": cfg.eval_path,
        "question_field": cfg.question_field,
        "answer_field": cfg.answer_field,
        "prompt_template": cfg.prompt_template,
        "verify_timeout_s": cfg.verify_timeout_s,
        "stop_texts": cfg.stop_texts,
        "chat": cfg.chat,
        "system_prompt": cfg.system_prompt,
    }

