"""``task=reasoning_gym``: any reasoning-gym dataset (Stojanovski et al. 2025, arXiv:2505.24760) by name, posed in
its own words and scored by its own scorer, for instruct models as well as the embedded default.

1. **Problems.** ``reasoning_gym.create_dataset(dataset, seed=s, size=task.size, **task.config)`` builds one stream
   per split. The streams, the held-out eval set and the train filter are :class:`GeneratedTask`'s: each split's
   seed ``s`` is a hash of (task, dataset, split, run seed), the eval set is the first ``eval_size`` items of the
   eval stream, and the train stream skips every problem whose prompt is in it. A stream holds ``task.size`` items
   (some datasets precompute them or refuse an index past the size); asking for more train problems is an error.
2. **Prompt.** The entry's question, then a blank line and the answer format's instruction (``task.instruction``;
   the boxed one is DeepSeek-R1's recommended math prompt, arXiv:2501.12948 and its model card). With
   ``task.chat`` that text is the user message of the tokenizer's chat template
   (:func:`steadyrl.tasks.prompts.render_chat`); without, it is followed by a newline.
3. **Score.** The answer is read from the cleaned completion by ``task.answer_format``: ``boxed``, the argument of
   the last ``\\boxed{...}`` (braces matched; :func:`steadyrl.tasks.text.last_boxed`); ``answer_tag``, the last
   ``<answer>...</answer>`` (reasoning-gym's ``utils.extract_answer``, its own convention); ``plain``, the whole
   completion (how the compact arithmetic tasks read it). No answer found scores 0; otherwise
   ``dataset.score_answer(answer, entry)`` of the dataset that generated the entry, 0/1 unless ``partial_credit``.
   A scorer that raises on a completion scores it 0 (reasoning-gym's scorers expect well-formed answers).
4. **Guard.** Some scorers evaluate the answer as Python (:data:`EVALUATING_SCORERS`); for those an answer reaches
   the scorer only when it passes :func:`safe_for_eval`, a filter against obvious code (not a sandbox).

The demonstration (warm start of the default model) is the reference answer in the answer format; datasets whose
entries carry no reference answer (``boxnet``, ``graph_color``, ``propositional_logic``, ``rubiks_cube``,
``rush_hour``: the scorer checks a solution) can be trained from a pretrained model only.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from steadyrl.tasks.config import DELAYED_REWARD_KEYS, AnswerFormat, ReasoningGymTaskConfig
from steadyrl.tasks.countdown import is_safe_expression
from steadyrl.tasks.generated import FULL_CREDIT, GeneratedTask, ProblemText, stream_seed
from steadyrl.tasks.prompts import check_chat_tokenizer, render_chat
from steadyrl.tasks.text import clean_completion, last_boxed
from steadyrl.tasks.types import Problem, Split

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: The instruction each answer format appends to the question when ``task.instruction`` is None. Boxed: DeepSeek-R1's
#: recommended directive for math (model card, "Usage Recommendations"); answer_tag: reasoning-gym's ``simple``
#: system prompt's last sentence (``reasoning_gym.utils.SYSTEM_PROMPTS``).
DEFAULT_INSTRUCTIONS: dict[str, str] = {
    "boxed": "Please reason step by step, and put your final answer within \\boxed{}.",
    "answer_tag": "Provide your final answer between <answer> and </answer> tags.",
    "plain": "",
}
#: Between the question and the instruction.
INSTRUCTION_SEPARATOR = "\n\n"
#: Ends a prompt without chat template, so the completion starts on a line of its own.
PLAIN_PROMPT_END = "\n"
#: The ``<answer>`` tag of ``answer_format=answer_tag`` (reasoning-gym's ``extract_answer`` default).
ANSWER_TAG = "answer"
#: How the demonstration writes the reference answer in each format.
DEMONSTRATION_FORMATS: dict[str, str] = {
    "boxed": "\\boxed{{{answer}}}",
    "answer_tag": f"<{ANSWER_TAG}>{{answer}}</{ANSWER_TAG}>",
    "plain": "{answer}",
}
#: The alphabet is read off this many problems of each split (seed :data:`ALPHABET_SEED`): the generators' texts
#: cannot be enumerated, so it is a sample (the character tokenizer maps a character outside it to ``<unk>``).
ALPHABET_PROBLEMS = 64
ALPHABET_SEED = 0

#: reasoning-gym 0.1.25 scorers that hand the answer to Python ``eval`` (string_insertion, spiral_matrix,
#: binary_matrix, n_queens) or to sympy's ``parse_expr``, which evaluates Python with the builtin functions in scope
#: (countdown, puzzle24, simple_integration, intermediate_integration, polynomial_multiplication); found by reading
#: every ``score_answer`` for ``eval(``, ``exec(``, ``parse_expr`` and ``sympify``.
EVALUATING_SCORERS: frozenset[str] = frozenset({
    "binary_matrix", "countdown", "intermediate_integration", "n_queens", "polynomial_multiplication", "puzzle24",
    "simple_integration", "spiral_matrix", "string_insertion",
})  # fmt: skip
#: Of those, the ones whose answer is an arithmetic expression: held to countdown's character whitelist.
EXPRESSION_SCORERS: frozenset[str] = frozenset({"countdown", "puzzle24"})
#: Builtins an answer may name (harmless numeric functions a sympy expression can contain).
HARMLESS_BUILTINS: frozenset[str] = frozenset({"abs", "complex", "divmod", "float", "int", "max", "min", "pow",
                                               "round", "sum"})  # fmt: skip
#: Answers longer than this never reach an evaluating scorer.
MAX_EVAL_ANSWER_CHARS = 10_000
_DUNDER = "__"
_BUILTIN_NAME = re.compile(
    r"(?<![A-Za-z0-9_])(?:"
    + "|".join(sorted(n for n in dir(builtins) if n.isidentifier() and n not in HARMLESS_BUILTINS))
    + r")(?![A-Za-z0-9_])"
)
_ANSWER_TAG = re.compile(f"<{ANSWER_TAG}>\\s?(.*?)\\s?</{ANSWER_TAG}>", flags=re.DOTALL)


def safe_for_eval(answer: str) -> bool:
    """Whether ``answer`` may reach a scorer that evaluates it as Python: short, no ``__`` (no dunder escape), and no
    builtin name but a few numeric ones (``open``, ``exec``, ``getattr`` ... are refused however they are called)."""
    return len(answer) <= MAX_EVAL_ANSWER_CHARS and _DUNDER not in answer and _BUILTIN_NAME.search(answer) is None


def extract_answer(text: str, answer_format: AnswerFormat) -> str | None:
    """The answer in a cleaned completion: the last ``\\boxed{}``'s argument, the last ``<answer>`` tag's content
    (stripped; reasoning-gym's ``utils.extract_answer``) or the whole text; None when the format finds none."""
    if answer_format == "boxed":
        return last_boxed(text)
    if answer_format == "answer_tag":
        matches = _ANSWER_TAG.findall(text)
        return matches[-1].strip() if matches else None
    return text or None


class ReasoningGymTask(GeneratedTask):
    """Any reasoning-gym dataset, natural-language prompts; see :class:`~steadyrl.tasks.config.ReasoningGymTaskConfig`
    and the module docstring."""

    name: ClassVar[str] = "reasoning_gym"

    def __init__(
        self,
        *,
        dataset: str,
        config: Mapping[str, Any],
        size: int,
        answer_format: AnswerFormat,
        instruction: str | None,
        chat: bool,
        system_prompt: str | None,
        eval_size: int,
        partial_credit: bool,
        stop_texts: Sequence[str],
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """``tokenizer`` renders the chat prompts (needed, with a chat template, when ``chat``; unused otherwise)."""
        if system_prompt is not None and not chat:
            raise ValueError("system_prompt needs chat=true (it is the system message of a chat prompt)")
        super().__init__(settings=config, eval_size=eval_size, partial_credit=partial_credit, stop_texts=stop_texts)
        self.dataset_name = dataset  # type: ignore[misc]  # per instance here, a ClassVar in the fixed tasks
        self.size = size
        self.answer_format = answer_format
        self.instruction = DEFAULT_INSTRUCTIONS[answer_format] if instruction is None else instruction
        self.system_prompt = system_prompt
        self.tokenizer = (
            check_chat_tokenizer(tokenizer, task=f"reasoning_gym {dataset}",
                                 no_chat_hint="set task.chat=false (the prompt is then the plain question text)")
            if chat else None
        )  # fmt: skip

    @classmethod
    def from_config(
        cls, cfg: ReasoningGymTaskConfig, *, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> ReasoningGymTask:
        # Every config field but the tag is a constructor argument of the same name.
        return cls(**cfg.model_dump(exclude={"name", *DELAYED_REWARD_KEYS}), tokenizer=tokenizer)

    # --- generation -------------------------------------------------------------------------------------------

    def _stream_key(self) -> str:
        return f"{self.name}/{self.dataset_name}"

    def _stream_seed(self, split: Split, seed: int) -> int:
        # Per dataset: two datasets of one run draw from unrelated seeds.
        return stream_seed(task=self._stream_key(), split=split, seed=seed)

    def _dataset(self, seed: int) -> Any:
        if seed not in self._datasets:
            import reasoning_gym

            try:
                dataset = reasoning_gym.create_dataset(self.dataset_name, seed=seed, size=self.size, **self.settings)
            except (AssertionError, ValueError, TypeError) as err:
                raise ValueError(
                    f"task.config / task.size: reasoning-gym could not build {self.dataset_name} with size="
                    f"{self.size} and options {self.settings}: {err or type(err).__name__}"
                ) from err
            self._datasets[seed] = dataset
        return self._datasets[seed]

    def _entries(self, *, seed: int, start: int, stop: int) -> list[dict[str, Any]]:
        """Entries ``start..stop-1`` (at most up to ``size``) of a stream, question included (a scorer may read it)."""
        if start >= self.size:
            raise ValueError(
                f"reasoning_gym {self.dataset_name}: the train stream's {self.size} items (task.size) ran out before "
                "enough train problems were found outside the eval set; raise task.size or lower data.train_pool"
            )
        dataset = self._dataset(seed)
        return [dict(dataset[i]) for i in range(start, min(stop, self.size))]

    def prompt(self, question: str) -> str:
        """The text fed to the model: question and instruction, chat-rendered when ``chat`` is on."""
        user = question.rstrip() + (INSTRUCTION_SEPARATOR + self.instruction if self.instruction else "")
        if self.tokenizer is None:
            return user + PLAIN_PROMPT_END
        return render_chat(self.tokenizer, user, system_prompt=self.system_prompt)

    def _problem_text(self, entry: Mapping[str, Any]) -> ProblemText:
        answer = entry["answer"]
        return ProblemText(prompt=self.prompt(entry["question"]), answer="" if answer is None else str(answer))

    def _problem(self, entry: Mapping[str, Any], *, split: Split, seed: int, index: int) -> Problem:
        text = self._problem_text(entry)
        uid = f"{self._stream_key()}/{split}/{seed}/{index}"
        meta = {"entry": entry, "rg_seed": self._stream_seed(split, seed), "has_answer": entry["answer"] is not None}
        return Problem(prompt=text.prompt, answer=text.answer, uid=uid, meta=meta)

    # --- scoring ----------------------------------------------------------------------------------------------

    def _accepts(self, answer: str) -> bool:
        if self.dataset_name in EXPRESSION_SCORERS:
            return is_safe_expression(answer)
        return self.dataset_name not in EVALUATING_SCORERS or safe_for_eval(answer)

    def score(self, problem: Problem, completion: str) -> float:
        """reasoning-gym's score of the answer the format reads; 0 when there is none, the guard refuses it, or the
        scorer raises. 0/1 unless ``partial_credit``."""
        answer = extract_answer(clean_completion(completion, stop_texts=self.stop_texts), self.answer_format)
        if answer is None or not self._accepts(answer):
            return 0.0
        try:
            raw = float(self._dataset(problem.meta["rg_seed"]).score_answer(answer, problem.meta["entry"]))
        except Exception:  # a scorer that chokes on a malformed completion: not an answer
            return 0.0
        if self.partial_credit:
            return raw
        return 1.0 if raw >= FULL_CREDIT else 0.0

    def demonstration(self, problem: Problem) -> str:
        """The reference answer in the answer format (``\\boxed{42}``); ValueError for an entry without one."""
        if not problem.meta["has_answer"]:
            raise ValueError(
                f"reasoning_gym {self.dataset_name} has no reference answer (its scorer checks a solution), so there "
                "is no demonstration to warm-start the default model on: use a pretrained model (model.name=...)"
            )
        return DEMONSTRATION_FORMATS[self.answer_format].format(answer=problem.answer)

    @property
    def alphabet(self) -> str:
        """The characters of the first :data:`ALPHABET_PROBLEMS` problems of each split (prompts and
        demonstrations) and of the answer format: a sample, since a generator's texts cannot be enumerated."""
        n = min(ALPHABET_PROBLEMS, self.eval_size)
        problems = self.problems("eval", n, seed=ALPHABET_SEED) + self.problems("train", n, seed=ALPHABET_SEED)
        chars = set(DEMONSTRATION_FORMATS[self.answer_format].format(answer=""))
        for problem in problems:
            chars.update(problem.prompt)
            if problem.meta["has_answer"]:
                chars.update(self.demonstration(problem))
        return "".join(sorted(chars))


__all__ = ["ReasoningGymTask", "extract_answer", "safe_for_eval"]
