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
=====================  ==============================================  =================================

``build_task(cfg)`` turns a validated :data:`TaskConfig` into a :class:`Task`; ``task.problems(split, n, seed=s)``
hands out problems (eval held out from train), ``task.score(problem, completion)`` verifies a completion,
``task.demonstration(problem)`` writes a correct one, and ``task.alphabet`` lists every character they can contain.
"""

from __future__ import annotations

from steadyrl.tasks.arithmetic import BasicArithmeticTask, ChainSumTask
from steadyrl.tasks.config import (
    BasicArithmeticConfig,
    ChainSumConfig,
    ChainSumToolConfig,
    CountdownConfig,
    Gsm8kConfig,
    MathConfig,
    TaskConfig,
    parse_task_config,
)
from steadyrl.tasks.countdown import CountdownTask
from steadyrl.tasks.file_tasks import Gsm8kTask, MathTask
from steadyrl.tasks.tool_arithmetic import ChainSumToolTask, DemoTurn, ToolDemonstrations
from steadyrl.tasks.types import DatasetError, Problem, Split, Task

_BUILDERS = {
    ChainSumConfig: ChainSumTask.from_config,
    ChainSumToolConfig: ChainSumToolTask.from_config,
    BasicArithmeticConfig: BasicArithmeticTask.from_config,
    CountdownConfig: CountdownTask.from_config,
    Gsm8kConfig: Gsm8kTask.from_config,
    MathConfig: MathTask.from_config,
}


def build_task(cfg: TaskConfig) -> Task:
    """The task a validated config describes. Reads no file and generates nothing until problems are asked for."""
    return _BUILDERS[type(cfg)](cfg)


__all__ = [
    "BasicArithmeticConfig",
    "BasicArithmeticTask",
    "ChainSumConfig",
    "ChainSumTask",
    "ChainSumToolConfig",
    "ChainSumToolTask",
    "CountdownConfig",
    "CountdownTask",
    "DatasetError",
    "DemoTurn",
    "Gsm8kConfig",
    "Gsm8kTask",
    "MathConfig",
    "MathTask",
    "Problem",
    "Split",
    "Task",
    "TaskConfig",
    "ToolDemonstrations",
    "build_task",
    "parse_task_config",
]
