"""Verifiable tasks: prompt sources and their verifiers. Nothing here knows about RL.

=====================  ==============================================  =================================
task (``name``)        source                                          verifier
=====================  ==============================================  =================================
``chain_sum``          reasoning-gym generator; ``12+3-4=`` → ``11``  reasoning-gym ``score_answer``
``chain_sum_tool``     chain_sum with 4–5 digit terms, answered by     reasoning-gym ``score_answer`` of
                       calling the Python tool (``tool_arithmetic``)   the text after the last fence
``basic_arithmetic``   reasoning-gym generator; ``(2+-8)*4=``          reasoning-gym ``score_answer``
``countdown``          reasoning-gym generator, cached as JSONL        reasoning-gym countdown scorer
``gsm8k``              local JSONL/Parquet (``#### <number>``)         math-verify
``math``               local JSONL/Parquet (last ``\\boxed{}``)        math-verify
``reasoning_gym``      any reasoning-gym dataset by name               the dataset's ``score_answer`` of
                       (``task.dataset``), its own question text       the last ``\\boxed{}`` (or tag)
=====================  ==============================================  =================================

``build_task(cfg, tokenizer)`` turns a validated :data:`TaskConfig` into a :class:`Task` (the model tokenizer renders
the chat prompts of ``gsm8k``/``math``/``reasoning_gym`` with ``chat=true``, :mod:`steadyrl.tasks.prompts`);
``task.problems(split, n, seed=s)`` hands out problems (eval held out from train), ``task.score(problem, completion)``
verifies a completion, ``task.demonstration(problem)`` writes a correct one, and ``task.alphabet`` lists every
character they can contain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)
from steadyrl.tasks.arithmetic import BasicArithmeticTask, ChainSumTask
from steadyrl.tasks.config import (
    BasicArithmeticConfig,
    ChainSumConfig,
    ChainSumToolConfig,
    CountdownConfig,
    Gsm8kConfig,
    MathConfig,
    ReasoningGymTaskConfig,
    TaskConfig,
    parse_task_config,
)
from steadyrl.tasks.countdown import CountdownTask
from steadyrl.tasks.file_tasks import Gsm8kTask, MathTask
from steadyrl.tasks.prompts import ChatTemplateError
from steadyrl.tasks.reasoning_gym_task import ReasoningGymTask
from steadyrl.tasks.tool_arithmetic import ChainSumToolTask, DemoTurn, ToolDemonstrations
from steadyrl.tasks.types import DatasetError, Problem, Split, Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BUILDERS = {
    ChainSumConfig: ChainSumTask.from_config,
    ChainSumToolConfig: ChainSumToolTask.from_config,
    BasicArithmeticConfig: BasicArithmeticTask.from_config,
    CountdownConfig: CountdownTask.from_config,
}
#: Tasks whose prompts may be chat-rendered with the model's tokenizer.
_CHAT_BUILDERS = {
    Gsm8kConfig: Gsm8kTask.from_config,
    MathConfig: MathTask.from_config,
    ReasoningGymTaskConfig: ReasoningGymTask.from_config,
}


def build_task(cfg: TaskConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> Task:
    """The task a validated config describes. Reads no file and generates nothing until problems are asked for.

    ``tokenizer``: the run's model tokenizer. A file or reasoning_gym task with ``chat=true`` renders its prompts with
    its chat template and raises :class:`ChatTemplateError` (naming ``task.chat`` and the model) when it is missing or
    has no template; every other task ignores it.
    """
    if isinstance(cfg, Gsm8kConfig | MathConfig | ReasoningGymTaskConfig):
        return _CHAT_BUILDERS[type(cfg)](cfg, tokenizer=tokenizer)
    return _BUILDERS[type(cfg)](cfg)


__all__ = [
    "BasicArithmeticConfig",
    "BasicArithmeticTask",
    "ChainSumConfig",
    "ChainSumTask",
    "ChainSumToolConfig",
    "ChainSumToolTask",
    "ChatTemplateError",
    "CountdownConfig",
    "CountdownTask",
    "DatasetError",
    "DemoTurn",
    "Gsm8kConfig",
    "Gsm8kTask",
    "MathConfig",
    "MathTask",
    "Problem",
    "ReasoningGymTask",
    "ReasoningGymTaskConfig",
    "Split",
    "Task",
    "TaskConfig",
    "ToolDemonstrations",
    "build_task",
    "parse_task_config",
]
