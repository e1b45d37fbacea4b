"""Task configs: strict, bounded, documented; errors name the field; build_task gives a Task for every variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest
from pydantic import BaseModel, ValidationError

from steadyrl.tasks import Task, TaskConfig, build_task, parse_task_config
from steadyrl.tasks.config import ChainSumConfig, CountdownConfig, Gsm8kConfig

CONFIG_CLASSES: tuple[type[BaseModel], ...] = get_args(get_args(TaskConfig)[0])


def _assert_implements_task(task: Task) -> None:
    """The Task protocol's members, checked on the class (so no file is read)."""
    cls = type(task)
    for method in ("problems", "score", "demonstration"):
        assert callable(getattr(cls, method))
    assert isinstance(cls.alphabet, property)
    assert isinstance(task.name, str)


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        parse_task_config(data)
    return str(info.value)


def test_every_field_is_documented() -> None:
    assert {cls.model_fields["name"].default for cls in CONFIG_CLASSES} == {
        "chain_sum", "chain_sum_tool", "basic_arithmetic", "countdown", "gsm8k", "math", "reasoning_gym"
    }
    for cls in CONFIG_CLASSES:
        for field_name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{field_name} has no description"


@pytest.mark.parametrize(
    "data",
    [
        {"name": "chain_sum"},
        {"name": "chain_sum", "worked_steps": True, "max_terms": 6},
        {"name": "chain_sum_tool", "min_digits": 5, "max_digits": 6},
        {"name": "basic_arithmetic", "operators": ["+", "*"]},
        {"name": "countdown", "cache_dir": "/tmp/nowhere", "eval_size": 8},
        {"name": "gsm8k", "train_path": "/data/gsm8k/train.jsonl", "eval_path": "/data/gsm8k/test.parquet"},
        {"name": "math", "eval_path": "math.jsonl", "question_field": "q", "prompt_template": "{question}\n"},
        {"name": "reasoning_gym", "dataset": "gcd", "config": {"max_value": 100}},
    ],
)
def test_valid_configs_build_tasks(data: dict[str, Any]) -> None:
    cfg = parse_task_config(data)
    assert cfg.name == data["name"]
    task = build_task(cfg)
    _assert_implements_task(task)
    assert task.name == data["name"]


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"name": "chain_sum", "max_terms": 0}, ["chain_sum.max_terms"]),
        ({"name": "chain_sum", "bogus": 1}, ["chain_sum.bogus", "Extra inputs"]),
        ({"name": "chain_sum", "min_terms": 4, "max_terms": 3}, ["max_terms (3)", "min_terms (4)"]),
        ({"name": "chain_sum", "min_digits": 2, "max_digits": 1}, ["max_digits", "min_digits"]),
        ({"name": "chain_sum", "eval_size": 0}, ["chain_sum.eval_size"]),
        ({"name": "chain_sum", "stop_texts": ["</s>", ""]}, ["chain_sum.stop_texts"]),
        ({"name": "chain_sum_tool", "min_digits": 6, "max_digits": 5}, ["max_digits (5)", "min_digits (6)"]),
        ({"name": "chain_sum_tool", "worked_steps": True}, ["chain_sum_tool.worked_steps", "Extra inputs"]),
        ({"name": "basic_arithmetic", "operators": ["+", "%"]}, ["basic_arithmetic.operators"]),
        ({"name": "basic_arithmetic", "operators": []}, ["basic_arithmetic.operators"]),
        ({"name": "basic_arithmetic", "operators": ["+", "+"]}, ["operators has duplicates"]),
        ({"name": "countdown", "min_target": 50, "max_target": 10}, ["max_target (10)", "min_target (50)"]),
        ({"name": "countdown", "min_numbers": 1}, ["countdown.min_numbers"]),
        ({"name": "gsm8k"}, ["train_path, eval_path"]),
        ({"name": "gsm8k", "train_path": "train.csv"}, ["gsm8k.train_path", ".jsonl or .parquet"]),
        ({"name": "gsm8k", "eval_path": "e.jsonl", "prompt_template": "Q: "}, ["gsm8k.prompt_template"]),
        ({"name": "math", "eval_path": "e.jsonl", "prompt_template": "{question} {answer}"}, ["math.prompt_template"]),
        ({"name": "math", "eval_path": "e.jsonl", "prompt_template": "{question"}, ["math.prompt_template"]),
        ({"name": "math", "eval_path": "e.jsonl", "verify_timeout_s": 0}, ["math.verify_timeout_s"]),
        ({"name": "math", "eval_path": "e.jsonl", "question_field": ""}, ["math.question_field"]),
        ({"name": "reasoning_gym", "dataset": "sudok"}, ["reasoning_gym.dataset", "'sudoku'"]),
        ({"name": "sudoku"}, ["name", "sudoku"]),
        ({"max_terms": 3}, ["name"]),
    ],
)
def test_bad_configs_name_the_field(data: dict[str, Any], names: list[str]) -> None:
    message = _error(data)
    for name in names:
        assert name in message, message


def test_configs_are_frozen_and_defaults_are_small() -> None:
    cfg = ChainSumConfig()
    with pytest.raises(ValidationError):
        cfg.max_terms = 9  # type: ignore[misc]
    assert (cfg.min_terms, cfg.max_terms, cfg.min_digits, cfg.max_digits, cfg.worked_steps) == (2, 3, 1, 2, False)
    countdown = CountdownConfig()
    assert (countdown.min_numbers, countdown.max_numbers) == (3, 3)
    assert Gsm8kConfig(train_path=Path("t.jsonl")).question_field == "question"
