"""``benchmarks/step_breakdown.py``'s measured variants compute what they replace (docs/scale.md, "At 48 forced tokens:
what else was measured and tried"), and its pairing helper interleaves: on the tests' tiny Llama, fast."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.sampler import generate
from tests.benchmark_scripts import BENCHMARKS, load_benchmark

ARCH = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their shared ``timing`` module
    return load_benchmark("step_breakdown")


def test_matmul_attention_is_sdpa(script: ModuleType) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g) for n in (1, 6, 6))
    keep = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    keep[0, ..., :2] = False
    torch.testing.assert_close(script.matmul_attention(q, k, v, keep, 0.3),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3))  # fmt: skip


def test_fused_recompute_and_decode_attention_compute_the_same_function(script: ModuleType) -> None:
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tokenizer, seed=0).eval()
    prompts = ["12+34=", "5-7=", "1+2+30-4="]

    def sample() -> object:
        return generate(model, tokenizer, prompts, group_size=3, max_new_tokens=12, version=0,
                        generator=torch.Generator().manual_seed(1))  # fmt: skip

    plain = sample()
    with script.one_token_matmul_attention(model):
        assert model.config._attn_implementation == script.MATMUL_ATTENTION
        matmul = sample()
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(plain.response_ids, matmul.response_ids)
    torch.testing.assert_close(plain.behav_logp, matmul.behav_logp, atol=1e-6, rtol=0)
    with torch.no_grad():
        reference = sequence_logprobs(model, plain).logp
        torch.testing.assert_close(script.fused_logp(model, plain), reference, atol=1e-6, rtol=0)


def test_paired_interleaves_and_ratio_line_reports_per_pair(script: ModuleType) -> None:
    calls: list[str] = []
    pairs = script.paired(lambda: calls.append("a"), lambda: calls.append("b"), pairs=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"] and len(pairs) == 3
    line = script.ratio_line("x", [(1.0, 0.5), (2.0, 1.5)], a="A", b="B")
    assert "ratio 0.62" in line and "pairs 0.50-0.75" in line
