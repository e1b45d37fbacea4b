"""The tiny Llama: size, tied embeddings, seeded initialization, strict config."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import LlamaForCausalLM

from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer


def test_default_size_and_tied_embeddings() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyArchConfig(), tokenizer=tok, seed=0)
    assert isinstance(model, LlamaForCausalLM)
    # 100·128 embedding (tied) + 4 blocks × (4·128² attention + 3·128·512 MLP + 2·128 norms) + 128 final norm
    assert sum(p.numel() for p in model.parameters()) == 100 * 128 + 4 * (4 * 128**2 + 3 * 128 * 512 + 256) + 128
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    cfg = model.config
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (100, 0, 1, 2)


def test_seeded_init_leaves_global_rng_alone() -> None:
    tok = build_char_tokenizer()
    arch = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(arch, tokenizer=tok, seed=5)
    assert torch.equal(torch.rand(1), before)
    b = build_tiny_model(arch, tokenizer=tok, seed=5)
    c = build_tiny_model(arch, tokenizer=tok, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))


def test_config_is_strict() -> None:
    with pytest.raises(ValidationError, match="must divide"):
        TinyArchConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValidationError, match="extra"):
        TinyArchConfig(hiden_size=64)
