"""ModelConfig validation and loading of non-default models."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from steadyrl.models import load as load_module
from steadyrl.models.load import OFFLINE_ENV, ModelConfig, load_policy
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


def test_missing_local_path_says_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"does not exist.*or a Hugging Face hub id"):
        load_policy(ModelConfig(name=str(tmp_path / "nope")), None, seed=0)


@pytest.mark.parametrize("variable", OFFLINE_ENV)
def test_uncached_hub_id_with_hf_hub_offline_fails_fast_naming_the_variable(variable: str, monkeypatch) -> None:
    for v in OFFLINE_ENV:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(variable, "1")
    start = time.monotonic()
    with pytest.raises(OSError, match=rf"'steadyrl-test-org/not-a-model'.* {variable}=1 is set, so only the local hub"):
        load_policy(ModelConfig(name="steadyrl-test-org/not-a-model"), None, seed=0)
    assert time.monotonic() - start < 5


def test_download_false_reads_the_cache_only() -> None:
    with pytest.raises(OSError, match=r"model\.download=false"):
        load_policy(ModelConfig(name="steadyrl-test-org/not-a-model", download=False), None, seed=0)
    with pytest.raises(ValidationError, match="download"):
        ModelConfig(download=True)


@pytest.mark.parametrize(("download", "env", "local_only"), [
    (None, None, False), (None, "1", True), (None, "0", False), (False, None, True), (True, "1", False),
])  # fmt: skip
def test_a_hub_id_goes_to_from_pretrained_as_it_would_by_hand(download, env, local_only, monkeypatch) -> None:
    """model.name=<hub id> is handed to from_pretrained, which downloads unless HF_HUB_OFFLINE or download=false."""
    tok = build_char_tokenizer()
    calls: list[tuple[str, str, dict]] = []

    def fake(kind, made):
        def from_pretrained(path, **kwargs):
            calls.append((kind, path, kwargs))
            return made

        return from_pretrained

    monkeypatch.setattr(load_module.AutoTokenizer, "from_pretrained", fake("tokenizer", tok))
    monkeypatch.setattr(load_module.AutoModelForCausalLM, "from_pretrained",
                        fake("model", build_tiny_model(ARCH, tokenizer=tok, seed=0)))  # fmt: skip
    for v in OFFLINE_ENV:
        monkeypatch.delenv(v, raising=False)
    if env is not None:
        monkeypatch.setenv("HF_HUB_OFFLINE", env)
    policy = load_policy(ModelConfig(name="HuggingFaceTB/SmolLM2-135M", download=download), None, seed=0)
    assert policy.path == "HuggingFaceTB/SmolLM2-135M" and not policy.model.training
    assert [(kind, path, kw["local_files_only"]) for kind, path, kw in calls] == [
        ("tokenizer", "HuggingFaceTB/SmolLM2-135M", local_only), ("model", "HuggingFaceTB/SmolLM2-135M", local_only),
    ]  # fmt: skip


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
