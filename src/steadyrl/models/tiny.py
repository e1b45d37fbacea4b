"""The embedded default model: a small Llama-architecture causal LM, randomly initialized from a seed.

It is a stock :class:`transformers.LlamaForCausalLM` (no custom code), so once warm-started and saved with
``save_pretrained`` it loads through ``AutoModelForCausalLM.from_pretrained`` exactly like a 0.5B–7B checkpoint.
With the defaults (hidden 128, 4 layers, 4 heads, MLP 512, tied embeddings, 100-token vocabulary) it has 1.06M
parameters.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase


class TinyArchConfig(BaseModel):
    """Architecture of the embedded default model (a Llama; sizes only, the vocabulary comes from the tokenizer)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    hidden_size: int = Field(128, ge=8, le=4096)
    """Width of the residual stream (embedding size; tied with the output layer)."""
    num_layers: int = Field(4, ge=1, le=64)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1, le=64)
    """Attention heads per block (also the key/value heads: plain multi-head attention). Must divide hidden_size."""
    intermediate_size: int = Field(512, ge=8, le=16384)
    """Hidden width of the SwiGLU MLP."""
    max_position_embeddings: int = Field(512, ge=16, le=131072)
    """Longest prompt + response the model is meant for (RoPE; informational for Llama, used by samplers)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""
    init_std: float = Field(0.02, gt=0, le=1.0)
    """Standard deviation of the normal initialization of every weight matrix (Llama's ``initializer_range``)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyArchConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        return self


def llama_config(arch: TinyArchConfig, *, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig:
    """The ``LlamaConfig`` of ``arch`` for ``tokenizer``'s vocabulary and special-token ids (tied embeddings)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_heads,
        intermediate_size=arch.intermediate_size,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta},
        initializer_range=arch.init_std,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_model(arch: TinyArchConfig, *, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """A randomly initialized Llama for ``tokenizer`` (float32, train mode); the same ``seed`` gives the same weights.

    Initialization draws from a forked RNG, so the caller's global torch RNG state is left untouched.
    """
    config = llama_config(arch, tokenizer=tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model
