"""Fixtures of the rollout tests: the character tokenizer and a tiny randomly initialized Llama (hidden 32)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer

#: A model small enough that every test runs in well under a second.
TEST_ARCH = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    return build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=0).eval()
