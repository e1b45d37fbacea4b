"""Typed, strict configuration of the tasks: one pydantic model per task, joined in :data:`TaskConfig`, a union
discriminated on ``name``.

Unknown keys are rejected, every field is bounded and documented, and cross-field rules are named validators that
raise (naming the fields) instead of rewriting a value. Validation reads no file and needs no hardware.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator, model_validator

from steadyrl.tasks.text import DEFAULT_STOP_TEXTS, TEMPLATE_FIELD, template_fields

Operator = Literal["+", "-", "*", "/"]
ALL_OPERATORS: tuple[Operator, ...] = ("+", "-", "*", "/")

#: Upper bounds that keep a generator's problems within reach of a small model and its context.
MAX_TERMS = 12
MAX_DIGITS = 9
MAX_EVAL_SIZE = 1_000_000
MAX_VERIFY_TIMEOUT_S = 300
#: Items per reasoning-gym stream of ``task=reasoning_gym`` (its ``size``): every dataset but acre and word_ladder
#: builds at this size in under a second (measured on reasoning-gym 0.1.25), and it exceeds the warm start's default
#: pool of 131,072 train problems.
RG_DEFAULT_SIZE = 2**20
#: reasoning-gym sizes are ints that some datasets hand to ``random`` APIs; keep them within 31 bits.
RG_MAX_SIZE = 2**31 - 1

#: File suffixes the file tasks read.
JSONL_SUFFIXES: tuple[str, ...] = (".jsonl",)
PARQUET_SUFFIXES: tuple[str, ...] = (".parquet",)


#: Task options read by the runtime (the delayed reward), not by the task itself: kept out of a task's constructor.
DELAYED_REWARD_KEYS: tuple[str, ...] = ("reward_delay", "proxy_reward", "proxy_flip")


class _TaskConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stop_texts: tuple[str, ...] = Field(
        DEFAULT_STOP_TEXTS,
        description="Texts that end a completion before scoring (EOS/padding a decoder may leave in): the completion "
        "is cut at the first occurrence of any of them, then stripped of whitespace.",
    )

    reward_delay: int = Field(
        0, ge=0, le=1_000_000,
        description="Δ: the verifier's (true, slow) reward of a batch arrives this many learner steps after the batch "
        "was trained on; until then the batch trains on a fast proxy reward (proxy_reward), and on arrival the "
        "learner applies Retroactive Advantage Correction (the rac section; arXiv 2606.27580). 0: the true reward at "
        "once (no proxy). runtime.mode=lag only.",
    )  # fmt: skip
    proxy_reward: Literal["noisy", "zero"] = Field(
        "noisy", description="reward_delay > 0: the fast reward b_i a batch trains on: noisy (the true reward r "
        "replaced by 1 − r with probability proxy_flip, a cheap judge; seeded per step) | zero (b = 0). Ours."
    )
    proxy_flip: float = Field(0.2, ge=0, le=1, description="proxy_reward=noisy: flip probability (ours).")

    @field_validator("stop_texts")
    @classmethod
    def _stop_texts_non_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not text for text in value):
            raise ValueError("stop_texts must not contain an empty string")
        return value


class _GeneratedTaskConfig(_TaskConfigBase):
    eval_size: int = Field(
        512,
        ge=1,
        le=MAX_EVAL_SIZE,
        description="Size of the held-out eval set: the first eval_size problems of the eval stream. The train stream "
        "skips every prompt among them, and asking for more eval problems than this is an error.",
    )
    partial_credit: bool = Field(
        False,
        description="Pass reasoning-gym's fractional scores through (e.g. countdown's 0.05 for a well-formed wrong "
        "expression). When False a score is 1.0 if reasoning-gym's scorer gives 1.0, else 0.0.",
    )


def _check_range(low: int, high: int, *, low_name: str, high_name: str) -> None:
    if high < low:
        raise ValueError(f"{high_name} ({high}) must be >= {low_name} ({low})")


def _check_unique(values: tuple[str, ...], *, field: str) -> None:
    if len(set(values)) != len(values):
        raise ValueError(f"{field} has duplicates: {values}")


class ChainSumConfig(_GeneratedTaskConfig):
    """reasoning-gym ``chain_sum``: sums and differences of integers; prompt ``12+3-4=``, answer ``11``."""

    name: Literal["chain_sum"] = Field("chain_sum", description="Task: reasoning-gym chain_sum.")
    min_terms: int = Field(2, ge=1, le=MAX_TERMS, description="Fewest terms in an expression.")
    max_terms: int = Field(3, ge=1, le=MAX_TERMS, description="Most terms in an expression.")
    min_digits: int = Field(1, ge=1, le=MAX_DIGITS, description="Fewest digits per term (all terms of one problem "
                            "share a digit count).")
    max_digits: int = Field(2, ge=1, le=MAX_DIGITS, description="Most digits per term.")
    allow_negation: bool = Field(False, description="Allow negative terms (written `12+-5=`).")
    worked_steps: bool = Field(
        False,
        description="Demonstrations write the running partial sums before the answer (`12+3=15,15-4=11;11`) and "
        "scoring takes what follows the last `;`. Makes responses long, to stress sequence-level importance weights.",
    )

    @model_validator(mode="after")
    def _ranges_ordered(self) -> ChainSumConfig:
        _check_range(self.min_terms, self.max_terms, low_name="min_terms", high_name="max_terms")
        _check_range(self.min_digits, self.max_digits, low_name="min_digits", high_name="max_digits")
        return self


class ChainSumToolConfig(_GeneratedTaskConfig):
    """chain_sum with numbers too large to add reliably without a tool (prompt ``48213+9377+51234=``): the
    demonstration calls the Python tool (`` ```python\nprint(48213+9377+51234)\n``` ``), reads its output turn, then
    writes the answer. Scoring takes the text after the last ``` fence (docs/tools.md)."""

    name: Literal["chain_sum_tool"] = Field("chain_sum_tool", description="Task: chain_sum with the Python tool.")
    min_terms: int = Field(2, ge=1, le=MAX_TERMS, description="Fewest terms in an expression.")
    max_terms: int = Field(3, ge=1, le=MAX_TERMS, description="Most terms in an expression.")
    min_digits: int = Field(4, ge=1, le=MAX_DIGITS, description="Fewest digits per term (all terms of one problem "
                            "share a digit count).")
    max_digits: int = Field(5, ge=1, le=MAX_DIGITS, description="Most digits per term.")
    allow_negation: bool = Field(False, description="Allow negative terms (written `12+-5=`).")

    @model_validator(mode="after")
    def _ranges_ordered(self) -> ChainSumToolConfig:
        _check_range(self.min_terms, self.max_terms, low_name="min_terms", high_name="max_terms")
        _check_range(self.min_digits, self.max_digits, low_name="min_digits", high_name="max_digits")
        return self


class BasicArithmeticConfig(_GeneratedTaskConfig):
    """reasoning-gym ``basic_arithmetic`` with parentheses and standard precedence; prompt ``(2+-8)*4=``.

    reasoning-gym's parenthesis-free mode evaluates left to right (it would pose ``34+17*23`` with answer 1173), so
    it is not offered. Its terms can be negative whatever ``allow_negation`` says.
    """

    name: Literal["basic_arithmetic"] = Field("basic_arithmetic", description="Task: reasoning-gym basic_arithmetic.")
    min_terms: int = Field(2, ge=1, le=MAX_TERMS, description="Fewest terms in an expression.")
    max_terms: int = Field(3, ge=1, le=MAX_TERMS, description="Most terms in an expression.")
    min_digits: int = Field(1, ge=1, le=MAX_DIGITS, description="Fewest digits per term.")
    max_digits: int = Field(2, ge=1, le=MAX_DIGITS, description="Most digits per term.")
    operators: tuple[Operator, ...] = Field(
        ALL_OPERATORS, min_length=1, description="Operators to draw from (`/` is exact integer division)."
    )
    allow_negation: bool = Field(False, description="Allow negated parenthesized groups (`-(3+4)`).")

    @model_validator(mode="after")
    def _ranges_ordered(self) -> BasicArithmeticConfig:
        _check_range(self.min_terms, self.max_terms, low_name="min_terms", high_name="max_terms")
        _check_range(self.min_digits, self.max_digits, low_name="min_digits", high_name="max_digits")
        _check_unique(self.operators, field="operators")
        return self


class CountdownConfig(_GeneratedTaskConfig):
    """reasoning-gym ``countdown``: reach a target with all given numbers; prompt ``3,5,7>15:``, answer ``3*7-5-...``.

    Generation is slow (sympy), so the generated streams are cached as JSONL, keyed by the settings, the stream seed
    and the reasoning-gym version.
    """

    name: Literal["countdown"] = Field("countdown", description="Task: reasoning-gym countdown.")
    min_numbers: int = Field(3, ge=2, le=MAX_TERMS, description="Fewest source numbers.")
    max_numbers: int = Field(3, ge=2, le=MAX_TERMS, description="Most source numbers.")
    min_value: int = Field(1, ge=1, description="Smallest source number.")
    max_value: int = Field(20, ge=1, description="Largest source number.")
    min_target: int = Field(10, ge=1, description="Smallest target.")
    max_target: int = Field(100, ge=1, description="Largest target.")
    operators: tuple[Operator, ...] = Field(ALL_OPERATORS, min_length=1, description="Operators to draw from.")
    cache_dir: Path | None = Field(
        None,
        description="Directory of the generated-problem cache. None: $STEADYRL_CACHE/tasks when that variable is "
        "set, else ~/.cache/steadyrl/tasks.",
    )

    @model_validator(mode="after")
    def _ranges_ordered(self) -> CountdownConfig:
        _check_range(self.min_numbers, self.max_numbers, low_name="min_numbers", high_name="max_numbers")
        _check_range(self.min_value, self.max_value, low_name="min_value", high_name="max_value")
        _check_range(self.min_target, self.max_target, low_name="min_target", high_name="max_target")
        _check_unique(self.operators, field="operators")
        return self


class _FileTaskConfig(_TaskConfigBase):
    train_path: Path | None = Field(
        None, description="Train split: a .jsonl file (one JSON object a line) or a .parquet file (needs pyarrow)."
    )
    eval_path: Path | None = Field(
        None,
        description="Held-out eval split, same formats. Train rows whose prompt also appears here are skipped.",
    )
    verify_timeout_s: int = Field(
        5,
        ge=1,
        le=MAX_VERIFY_TIMEOUT_S,
        description="Seconds math-verify may spend parsing or comparing one answer. Enforced with SIGALRM, so only "
        "in a process's main thread; elsewhere scoring runs without a time limit.",
    )
    chat: bool = Field(
        False,
        description="Render each prompt with the model tokenizer's chat template (instruct models): the filled "
        "prompt_template is the user message, system_prompt (if set) a system message before it, and the "
        "generation prompt is appended; a BOS the template writes is dropped when encoding adds one. Needs a model "
        "whose tokenizer has a chat template (not model.name=default).",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        description="System message of the chat prompt (only with chat=true; e.g. the tool instructions of "
        "steadyrl.tasks.prompts). Taken literally (no placeholder). Without chat, write instructions into "
        "prompt_template instead.",
    )

    @field_validator("train_path", "eval_path")
    @classmethod
    def _known_suffix(cls, value: Path | None) -> Path | None:
        if value is not None and value.suffix.lower() not in JSONL_SUFFIXES + PARQUET_SUFFIXES:
            raise ValueError(f"{value}: expected a {' or '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)} file")
        return value

    @field_validator("prompt_template", check_fields=False)
    @classmethod
    def _template_has_question(cls, value: str) -> str:
        try:
            fields = template_fields(value)
        except ValueError as err:  # unbalanced braces
            raise ValueError(f"not a valid format template ({err}); write literal braces as {{{{ and }}}}") from err
        if fields.count(TEMPLATE_FIELD) != 1 or len(fields) != 1:
            raise ValueError(
                f"must contain the placeholder {{{TEMPLATE_FIELD}}} exactly once and no other, got {fields}"
            )
        return value

    @model_validator(mode="after")
    def _some_split(self) -> _FileTaskConfig:
        if self.train_path is None and self.eval_path is None:
            raise ValueError("set train_path, eval_path or both")
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_chat(self) -> _FileTaskConfig:
        # A plain-text prompt has no system slot: prepending the text with some separator would be a format of our
        # own that no chat model was trained on; one way to write instructions without chat is prompt_template.
        if self.system_prompt is not None and not self.chat:
            raise ValueError(
                "system_prompt is the system message of a chat prompt: set chat=true (the model's chat template "
                "renders it), or put the instructions into prompt_template for a model without a chat template"
            )
        return self


class Gsm8kConfig(_FileTaskConfig):
    """GSM8K-style word problems from local files; the reference's final number follows ``####``."""

    name: Literal["gsm8k"] = Field("gsm8k", description="Task: GSM8K-style files.")
    question_field: str = Field("question", min_length=1, description="Row field holding the question.")
    answer_field: str = Field(
        "answer", min_length=1, description="Row field holding the worked solution, ending in `#### <number>`."
    )
    prompt_template: str = Field(
        "Question: {question}\nAnswer: ",
        description="Prompt text with one `{question}` placeholder (literal braces doubled).",
    )


class MathConfig(_FileTaskConfig):
    """MATH-style problems from local files; the reference answer is the solution's last ``\\boxed{...}``."""

    name: Literal["math"] = Field("math", description="Task: MATH-style files.")
    question_field: str = Field("problem", min_length=1, description="Row field holding the problem.")
    answer_field: str = Field(
        "solution", min_length=1, description="Row field holding the worked solution, with a final `\\boxed{...}`."
    )
    prompt_template: str = Field(
        "Problem: {question}\nSolution: ",
        description="Prompt text with one `{question}` placeholder (literal braces doubled).",
    )


AnswerFormat = Literal["boxed", "answer_tag", "plain"]


class ReasoningGymTaskConfig(_GeneratedTaskConfig):
    """Any reasoning-gym dataset by name, posed with its natural-language question and scored by its own scorer
    (``dataset.score_answer(answer, entry)``); for instruct models (``chat=true``) as well as the default model.

    List the datasets and their options with ``python -m steadyrl.tasks.rg_catalog``. The prompt is the question,
    then (after a blank line) the answer format's instruction; with ``chat`` that text is the user message of the
    model's chat template, else it is followed by a newline (docs/tasks.md).
    """

    name: Literal["reasoning_gym"] = Field("reasoning_gym", description="Task: any reasoning-gym dataset by name.")
    dataset: str = Field(
        ..., min_length=1, description="reasoning-gym dataset name (gsm_symbolic, basic_arithmetic, countdown, gcd, "
        "...; list them with `python -m steadyrl.tasks.rg_catalog`)."
    )
    size: int = Field(
        RG_DEFAULT_SIZE,
        ge=1,
        le=RG_MAX_SIZE,
        description="reasoning-gym dataset size: items per stream (the train and the eval stream each index "
        "0..size-1; asking for more train problems than the stream holds is an error). acre builds all its items "
        "up front (size=1000 takes about 0.5 s) and word_ladder refuses large sizes: lower it for those.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The dataset's options, passed as create_dataset(dataset, seed=..., size=task.size, **config) "
        "(e.g. task.config.min_digits=3); reasoning-gym's own validation checks them. seed and size are set by "
        "the task.",
    )
    answer_format: AnswerFormat = Field(
        "boxed",
        description="Where the answer is read: boxed = the argument of the completion's last \\boxed{...} "
        "(nested braces matched; none: score 0); answer_tag = the last <answer>...</answer> (reasoning-gym's own "
        "convention; none: score 0); plain = the whole completion, as the compact arithmetic tasks read it.",
    )
    instruction: str | None = Field(
        None,
        description="Text after the question (a blank line between). None: the answer format's default (boxed: "
        "'Please reason step by step, and put your final answer within \\boxed{}.'; answer_tag: 'Provide your "
        "final answer between <answer> and </answer> tags.'; plain: none). An empty string: no instruction.",
    )
    chat: bool = Field(
        False,
        description="Render each prompt with the model tokenizer's chat template (instruct models), generation "
        "prompt appended; system_prompt (if set) as a system message. Needs a model whose tokenizer has a chat "
        "template: with model.name=default (no template) the config is refused.",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        description="System message of the chat prompt (only with chat=true; e.g. reasoning-gym's "
        "SYSTEM_PROMPTS['default'] with answer_format=answer_tag). Taken literally.",
    )

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: str) -> str:
        from steadyrl.tasks.rg_catalog import check_dataset_name

        return check_dataset_name(value)

    @field_validator("config")
    @classmethod
    def _options_accepted(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        from steadyrl.tasks.rg_catalog import check_dataset_options

        if "dataset" in info.data and "size" in info.data:  # else their own errors are reported
            check_dataset_options(info.data["dataset"], value, size=info.data["size"])
        return value

    @model_validator(mode="after")
    def _eval_set_fits_the_stream(self) -> ReasoningGymTaskConfig:
        if self.eval_size > self.size:
            raise ValueError(f"eval_size ({self.eval_size}) must be <= size ({self.size}), the items of a stream")
        return self

    @model_validator(mode="after")
    def _system_prompt_needs_chat(self) -> ReasoningGymTaskConfig:
        # As for the file tasks: a plain-text prompt has no system slot; instructions go into task.instruction.
        if self.system_prompt is not None and not self.chat:
            raise ValueError(
                "system_prompt is the system message of a chat prompt: set chat=true (the model's chat template "
                "renders it), or put the instructions into instruction for a model without a chat template"
            )
        return self


TaskConfig = Annotated[
    ChainSumConfig
    | BasicArithmeticConfig
    | CountdownConfig
    | Gsm8kConfig
    | MathConfig
    | ChainSumToolConfig
    | ReasoningGymTaskConfig,
    Field(discriminator="name"),
]
"""Any task's configuration; ``name`` selects the task."""

_TASK_CONFIG_ADAPTER: TypeAdapter[TaskConfig] = TypeAdapter(TaskConfig)


def parse_task_config(data: Mapping[str, Any]) -> TaskConfig:
    """Validate a mapping (e.g. a YAML section) into the task config its ``name`` selects.

    Raises ``pydantic.ValidationError``; each error's location names the task and the field (``chain_sum.max_terms``).
    """
    return _TASK_CONFIG_ADAPTER.validate_python(dict(data))
