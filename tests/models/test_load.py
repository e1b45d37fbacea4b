"""ModelConfig validation and loading of non-default models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from steadyrl.models.load import ModelConfig, load_policy
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer

ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)


def test_config_is_strict_and_documented() -> None:
    with pytest.raises(ValidationError, match="extra"):
        ModelConfig(nme="default")
    with pytest.raises(ValidationError, match="arch"):
        ModelConfig(name="/some/dir", arch=ARCH)
    with pytest.raises(ValidationError, match="dtype"):
        ModelConfig(dtype="float64")
    assert all(field.description for field in ModelConfig.model_fields.values())
    assert ModelConfig.model_validate({"name": "default", "warm_start": {"target_accuracy": 0.4}}).warm_start.lr > 0


def test_missing_local_path_says_no_internet(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no internet"):
        load_policy(ModelConfig(name=str(tmp_path / "nope")), None, seed=0)


def test_uncached_hub_id_fails_fast_without_download() -> None:
    with pytest.raises(OSError, match="download=false"):
        load_policy(ModelConfig(name="steadyrl-test-org/not-a-model"), None, seed=0)
    with pytest.raises(ValidationError, match="download"):
        ModelConfig(download=True)


def test_default_needs_a_task() -> None:
    with pytest.raises(ValueError, match="task"):
        load_policy(ModelConfig(), None, seed=0)


def test_local_directory_loads_with_dtype_and_pad(tmp_path: Path) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    policy = load_policy(ModelConfig(name=str(tmp_path), dtype="bfloat16"), None, seed=0)
    assert policy.path == str(tmp_path) and not policy.model.training
    assert next(policy.model.parameters()).dtype == torch.bfloat16
    assert policy.tokenizer.padding_side == "left" and policy.tokenizer.pad_token_id == tok.pad_token_id
