"""per_trajectory_grad_sq_norms: ghost and vmap against the one-backward-per-trajectory reference, in float64.

The reference ("naive") runs each trajectory alone with its padding trimmed, so agreement also shows that padding
does not leak between samples of the batched methods. Models: the tiny Llama with tied embeddings, untied, with
biased Linear layers, and a toy LM whose Linear is called twice and whose embedding subclass overrides ``forward``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from steadyrl.models.tiny import TinyArchConfig, build_tiny_model, llama_config
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import TokenBatch
from steadyrl.train.grad_norms import VMAP_ATTENTION, per_trajectory_grad_sq_norms

ARCH = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
#: float64 agreement of the batched methods with the reference (observed: ~1e-15).
RTOL = 1e-10
#: Every batched variant: (method, ghost_strategy).
BATCHED = [("ghost", "auto"), ("ghost", "gram"), ("ghost", "materialize"), ("vmap", "auto")]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def llama(tokenizer: PreTrainedTokenizerFast, *, tied: bool = True, bias: bool = False) -> LlamaForCausalLM:
    """The test Llama in float64 (train mode, dropout 0), optionally untied and with biases on every Linear."""
    if tied and not bias:
        return build_tiny_model(ARCH, tokenizer=tokenizer, seed=0).double()
    config = llama_config(ARCH, tokenizer=tokenizer)
    config.tie_word_embeddings = tied
    config.attention_bias = bias
    config.mlp_bias = bias
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                nn.init.normal_(p, std=0.1)  # nonzero biases, so their gradients are not trivially tied to 0
    return model.double()


def make_batch(*, prompt_lens: list[int], response_lens: list[int], vocab: int, seed: int = 0) -> TokenBatch:
    """Prompts left-padded, responses right-padded; ids include the pad id 0."""
    gen = torch.Generator().manual_seed(seed)
    P, T = max(prompt_lens), max(response_lens)
    p_len, r_len = torch.tensor(prompt_lens), torch.tensor(response_lens)
    prompt_mask = torch.arange(P).flip(0).unsqueeze(0) < p_len.unsqueeze(1)
    response_mask = torch.arange(T).unsqueeze(0) < r_len.unsqueeze(1)
    prompt_ids = torch.randint(0, vocab, (len(prompt_lens), P), generator=gen).masked_fill(~prompt_mask, 0)
    response_ids = torch.randint(0, vocab, (len(prompt_lens), T), generator=gen).masked_fill(~response_mask, 0)
    response_ids[0, 1] = 0  # a real token equal to the padding_idx of the embedding: its row gets no gradient there
    return TokenBatch(prompt_ids, prompt_mask, response_ids, response_mask)


def default_batch(vocab: int) -> TokenBatch:
    return make_batch(prompt_lens=[3, 5, 4, 1, 5], response_lens=[4, 6, 1, 3, 6], vocab=vocab)


def widen(batch: TokenBatch, extra: int, *, pad_id: int = 0) -> TokenBatch:
    """The same tokens with ``extra`` more padding columns left of the prompts and right of the responses."""
    left, right = (extra, 0), (0, extra)
    return TokenBatch(
        F.pad(batch.prompt_ids, left, value=pad_id), F.pad(batch.prompt_mask, left, value=False),
        F.pad(batch.response_ids, right, value=pad_id), F.pad(batch.response_mask, right, value=False),
    )  # fmt: skip


def assert_rel_close(got: Tensor, want: Tensor, rtol: float = RTOL) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (want > 0).all()
    rel = ((got - want).abs() / want).max().item()
    assert rel < rtol, f"max relative difference {rel:.3e} (got {got.tolist()}, want {want.tolist()})"


@pytest.mark.parametrize(("method", "strategy"), BATCHED)
def test_tied_llama_matches_naive(tokenizer: PreTrainedTokenizerFast, method: str, strategy: str) -> None:
    """Tied embedding/lm_head: the per-sample gradient is the sum of both uses (cross terms), not two norms."""
    model = llama(tokenizer)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = default_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    got = per_trajectory_grad_sq_norms(model, batch, method=method, ghost_strategy=strategy)
    assert_rel_close(got, want)


@pytest.mark.parametrize(("method", "strategy"), BATCHED)
def test_untied_and_biased_llamas_match_naive(tokenizer: PreTrainedTokenizerFast, method: str, strategy: str) -> None:
    batch = default_batch(len(tokenizer))
    untied, biased = llama(tokenizer, tied=False), llama(tokenizer, tied=True, bias=True)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    layer = biased.model.layers[0]
    assert layer.mlp.up_proj.bias is not None and layer.self_attn.q_proj.bias is not None
    for model in (untied, biased):
        want = per_trajectory_grad_sq_norms(model, batch, method="naive")
        got = per_trajectory_grad_sq_norms(model, batch, method=method, ghost_strategy=strategy)
        assert_rel_close(got, want)


def test_weights_scale_each_trajectory(tokenizer: PreTrainedTokenizerFast) -> None:
    """‖∇(w_i Σ_t log π)‖² = w_i² ‖∇ Σ_t log π‖² for each method, signs and zeros included.

    (Applied after the norm: putting w_i into the loss would round w_i·∂ℓ through sequence_logprobs' float32
    log-softmax, ~1e-7 relative even for a float64 model.)
    """
    model = llama(tokenizer)
    batch = default_batch(len(tokenizer))
    weights = torch.tensor([0.5, -2.0, 3.0, 0.0, 1.25], dtype=torch.float64)
    unweighted = per_trajectory_grad_sq_norms(model, batch, method="naive")
    want = per_trajectory_grad_sq_norms(model, batch, method="naive", weights=weights)
    assert want[3] == 0
    torch.testing.assert_close(want, weights.square() * unweighted, rtol=1e-12, atol=0)
    for method, strategy in BATCHED:
        got = per_trajectory_grad_sq_norms(model, batch, method=method, weights=weights, ghost_strategy=strategy)
        assert got[3] == 0
        keep = weights != 0
        assert_rel_close(got[keep], want[keep])


def test_token_mask_and_sampling_distribution(tokenizer: PreTrainedTokenizerFast) -> None:
    """A mask inside the response mask selects the summed tokens; temperature is passed to the log-probs."""
    model = llama(tokenizer)
    batch = default_batch(len(tokenizer))
    mask = batch.response_mask.clone()
    mask[1, 2:4] = False
    mask[4, 0] = False
    kwargs = dict(mask=mask, temperature=0.7)
    want = per_trajectory_grad_sq_norms(model, batch, method="naive", **kwargs)
    assert not torch.allclose(want, per_trajectory_grad_sq_norms(model, batch, method="naive"))
    for method, strategy in BATCHED:
        assert_rel_close(per_trajectory_grad_sq_norms(model, batch, method=method, ghost_strategy=strategy, **kwargs),
                         want)  # fmt: skip


def test_extra_padding_changes_nothing(tokenizer: PreTrainedTokenizerFast) -> None:
    """Wider left padding of prompts and right padding of responses: same norms (attention masks the padding)."""
    model = llama(tokenizer)
    batch = default_batch(len(tokenizer))
    tight = per_trajectory_grad_sq_norms(model, batch)
    for method in ("ghost", "vmap"):
        wide = per_trajectory_grad_sq_norms(model, widen(batch, 3), method=method)
        assert_rel_close(wide, tight)


def test_empty_response_gives_zero(tokenizer: PreTrainedTokenizerFast) -> None:
    model = llama(tokenizer)
    batch = make_batch(prompt_lens=[2, 4], response_lens=[3, 0], vocab=len(tokenizer))
    for method in ("naive", "ghost", "vmap"):
        got = per_trajectory_grad_sq_norms(model, batch, method=method)
        assert got[1] == 0 and got[0] > 0


def test_float32(tokenizer: PreTrainedTokenizerFast) -> None:
    model = build_tiny_model(ARCH, tokenizer=tokenizer, seed=0)
    batch = default_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    assert want.dtype == torch.float32
    for method in ("ghost", "vmap"):
        assert_rel_close(per_trajectory_grad_sq_norms(model, batch, method=method), want, rtol=1e-4)


def test_model_is_left_untouched(tokenizer: PreTrainedTokenizerFast) -> None:
    """No .grad is read or written, no hook is left, attention implementation and mode are unchanged."""
    model = llama(tokenizer)
    params = list(model.parameters())
    for p in params[::2]:
        p.grad = torch.full_like(p, 0.25)
    before = [None if p.grad is None else p.grad.clone() for p in params]
    attn = model.config._attn_implementation
    batch = default_batch(len(tokenizer))
    with torch.no_grad():  # also callable where the caller disabled gradients
        for method in ("naive", "ghost", "vmap"):
            assert per_trajectory_grad_sq_norms(model, batch, method=method).min() > 0
    for p, b in zip(params, before, strict=True):
        assert (p.grad is None) if b is None else torch.equal(p.grad, b)
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert model.config._attn_implementation == attn != VMAP_ATTENTION
    assert model.training


class _ScaledEmbedding(nn.Embedding):
    """An Embedding whose forward is overridden: must take the generic (vmap-of-vjp) path, not the fast one."""

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * 1.5


class _ToyLM(nn.Module):
    """A causal toy LM with a Linear called twice, a biased LayerNorm, two embeddings, and a causal masked mean.

    It takes the keyword arguments ``sequence_logprobs`` passes and returns an object with ``logits``.
    """

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.scaled = _ScaledEmbedding(vocab, width)
        self.embed = nn.Embedding(vocab, width, padding_idx=0)
        self.mix = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, *, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int,
                **_: object) -> SimpleNamespace:  # fmt: skip
        m = attention_mask.unsqueeze(-1).to(self.head.weight.dtype)
        x = self.scaled(input_ids) + self.embed(input_ids)
        x = self.mix(torch.tanh(self.mix(x)))  # the same weight used twice: cross terms in its norm
        mean = torch.cumsum(x * m, dim=1) / torch.cumsum(m, dim=1).clamp(min=1.0)  # causal mean over real tokens
        h = self.norm(mean + x)
        return SimpleNamespace(logits=self.head(h[:, -logits_to_keep:]))


@pytest.mark.parametrize(("method", "strategy"), BATCHED)
def test_reused_linear_and_generic_modules(method: str, strategy: str) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _ToyLM(vocab=13, width=6).double()
    batch = make_batch(prompt_lens=[2, 4, 3], response_lens=[5, 2, 4], vocab=13, seed=1)
    weights = torch.tensor([1.0, 0.3, -2.0], dtype=torch.float64)
    want = per_trajectory_grad_sq_norms(model, batch, method="naive", weights=weights)
    got = per_trajectory_grad_sq_norms(model, batch, method=method, ghost_strategy=strategy, weights=weights)
    assert_rel_close(got, want)


def test_ghost_under_activation_checkpointing(tokenizer: PreTrainedTokenizerFast) -> None:
    model = llama(tokenizer)
    batch = default_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_activation_checkpointing
    assert_rel_close(per_trajectory_grad_sq_norms(model, batch), want)


def test_frozen_parameters_are_excluded(tokenizer: PreTrainedTokenizerFast) -> None:
    model = llama(tokenizer)
    for name, p in model.named_parameters():
        p.requires_grad_("mlp" in name)
    batch = default_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    for method in ("ghost", "vmap"):
        assert_rel_close(per_trajectory_grad_sq_norms(model, batch, method=method), want)
    for p in model.parameters():
        p.requires_grad_(False)
    assert (per_trajectory_grad_sq_norms(model, batch) == 0).all()


def test_invalid_arguments(tokenizer: PreTrainedTokenizerFast) -> None:
    model = llama(tokenizer)
    batch = default_batch(len(tokenizer))
    with pytest.raises(ValueError, match="method"):
        per_trajectory_grad_sq_norms(model, batch, method="exact")
    with pytest.raises(ValueError, match="ghost_strategy"):
        per_trajectory_grad_sq_norms(model, batch, ghost_strategy="fast")
    with pytest.raises(ValueError, match="weights"):
        per_trajectory_grad_sq_norms(model, batch, weights=torch.ones(2))
    with pytest.raises(ValueError, match="mask"):
        per_trajectory_grad_sq_norms(model, batch, mask=batch.response_mask[:, :2])
    with pytest.raises(ValueError, match="vmap_chunk_size"):
        per_trajectory_grad_sq_norms(model, batch, method="vmap", vmap_chunk_size=0)


def test_rms_norm_fast_path_is_taken_and_equals_the_per_row_vjp(tokenizer, monkeypatch) -> None:
    """RMSNorm scales: one batched vjp with a per-sample copy of the weight = the generic per-row vjp, exactly."""
    from steadyrl.core import grad_norms as gn

    taken: list[bool] = []
    fast = gn._rms_norm_per_sample

    def spy(call, g):
        out = fast(call, g)
        taken.append(out is not None)
        if out is not None:
            ref = gn._generic_per_sample(call, g)
            assert out[0][0] is ref[0][0]
            torch.testing.assert_close(out[0][1].g, ref[0][1].g, rtol=0, atol=0)
        return out

    monkeypatch.setattr(gn, "_rms_norm_per_sample", spy)
    model = llama(tokenizer)
    per_trajectory_grad_sq_norms(model, default_batch(len(tokenizer)))
    n_norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    assert taken == [True] * n_norms and n_norms >= 3


def test_default_model_ghost_and_fused_match_naive(tokenizer) -> None:
    """The acceptance check on the embedded default architecture (1.06M parameters), float64: ghost norms vs one
    backward per trajectory to 1e-6 relative (in practice ~1e-15)."""
    from steadyrl.train.grad_norms import GhostPass

    model = build_tiny_model(TinyArchConfig(), tokenizer=tokenizer, seed=0).double()
    batch = make_batch(prompt_lens=[6, 4, 7, 5], response_lens=[4, 12, 1, 7], vocab=len(tokenizer), seed=3)
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    assert_rel_close(per_trajectory_grad_sq_norms(model, batch, method="ghost"), want, rtol=1e-6)
    with GhostPass(model, batch) as ghost:
        assert_rel_close(ghost.sq_norms(), want, rtol=1e-6)


@pytest.mark.parametrize(("method", "strategy"), BATCHED)
def test_vocabulary_chunks_leave_every_method_exact(tokenizer, monkeypatch, method: str, strategy: str) -> None:
    """With a default budget so small that every recompute would be chunked (1 token per chunk): "naive" (each row
    alone) runs the chunked head, "ghost" keeps the direct form (its hooks record the output layer's call), "vmap"
    too (``torch.func``); the three still agree to 1e-10, and the ghost pass's batch gradient is the chunked one."""
    import steadyrl.rollout.logprobs as lp_mod
    from steadyrl.train.grad_norms import GhostPass

    real, calls = lp_mod.chunked_log_probs, []
    monkeypatch.setattr(lp_mod, "chunked_log_probs", lambda **kw: calls.append(kw["chunk_tokens"]) or real(**kw))
    monkeypatch.setattr(lp_mod, "DEFAULT_CHUNK_ELEMENTS", 1)
    model, batch = llama(tokenizer), default_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    assert calls == [1] * batch.response_ids.shape[0]  # every row alone, chunked
    got = per_trajectory_grad_sq_norms(model, batch, method=method, ghost_strategy=strategy)
    assert len(calls) == batch.response_ids.shape[0]  # the batched methods: the direct form
    assert_rel_close(got, want)
    if method == "ghost":
        with GhostPass(model, batch) as ghost:
            ghost.backward(batch.response_mask.double())
        ghost_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        lp_mod.sequence_logprobs(model, batch).logp.sum().backward()  # chunked
        for got_g, p in zip(ghost_grads, model.parameters(), strict=True):
            assert float((got_g - p.grad).norm()) <= 1e-10 * float(p.grad.norm()) + 1e-300


@pytest.mark.parametrize("kind", ["tied", "untied", "head_bias"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("strategy", ["auto", "materialize"])
def test_the_output_layer_enters_the_norms_in_vocabulary_chunks(tokenizer, monkeypatch, kind: str, share: bool,
                                                                strategy: str) -> None:
    """The ghost pass never calls the output layer: its part of each norm (and of the assembled gradient) comes from
    the layer's inputs over vocabulary chunks (patched down to 7 vocabulary rows, so every sum spans many chunks),
    with the cross term of a tied embedding and a bias, by the [T, T] kernel (``auto`` at these short responses) or
    the per-sample gradient formed chunk by chunk (``materialize``). In float64, with and without shared prompts, at
    temperature 0.7: the norms equal one backward per trajectory to 1e-10, the assembled gradient equals the pass
    that records the layer's [N, T, V] output to 1e-10, and autograd's to 1e-6 (LlamaRMSNorm rounds its gradient to
    float32, and the two scale the seed differently). The log-normalizer comes from the forward's log-probs, equal to
    the direct one on the scored tokens to 1e-12."""
    import steadyrl.core.grad_norms as core
    import steadyrl.train.grad_norms as grad_norms_mod
    from steadyrl.train.grad_norms import GhostPass

    model = llama(tokenizer, tied=kind == "tied")
    if kind == "head_bias":
        head = nn.Linear(ARCH.hidden_size, len(tokenizer), bias=True).double()
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.copy_(torch.linspace(-0.5, 0.5, len(tokenizer)))
        model.lm_head = head
    batch = make_batch(prompt_lens=[3, 3, 4, 4, 2], response_lens=[4, 6, 1, 3, 6], vocab=len(tokenizer))
    batch = TokenBatch(batch.prompt_ids[[0, 0, 2, 2, 4]], batch.prompt_mask[[0, 0, 2, 2, 4]], batch.response_ids,
                       batch.response_mask)  # fmt: skip  (rows 0–1 and 2–3 share a prompt)
    want = per_trajectory_grad_sq_norms(model, batch, method="naive", temperature=0.7)
    coef = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5], dtype=torch.float64)
    logp = sequence_logprobs(model, batch, temperature=0.7).logp
    objective = (coef * torch.where(batch.response_mask, logp, 0.0).sum(-1)).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(objective, params)
    with monkeypatch.context() as m:  # the pass that records the output layer's call
        m.setattr(grad_norms_mod, "chunkable_head", lambda *_: None)
        with GhostPass(model, batch, temperature=0.7, share_prompts=share) as recorded:
            assert recorded._head is None
            recorded.accumulate_grad(coef)
    assembled = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(core, "_head_chunk", lambda c, width=None: 7)
    direct = []
    real_forward = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward",
                        lambda self, x: (direct.append(1) if self is model.lm_head else None) or real_forward(self, x))
    with GhostPass(model, batch, temperature=0.7, share_prompts=share, strategy=strategy) as ghost:
        assert ghost._head is not None
        heads = [c for _, c in ghost._extra_contributions()]
        assert heads and all(core._head_uses_kernel(c, strategy) == (strategy == "auto" and not c.of_bias)
                             for c in heads)  # fmt: skip
        scored = heads[0].m
        z = (heads[0].h @ model.lm_head.weight.detach().T + (0.0 if kind != "head_bias" else head.bias.detach())) / 0.7
        torch.testing.assert_close(heads[0].lse[scored], z.logsumexp(-1)[scored], rtol=1e-12, atol=0.0)
        torch.testing.assert_close(ghost.sq_norms(), want, rtol=1e-10, atol=0.0)
        ghost.accumulate_grad(coef)
    assert not direct  # no [N, T, V] logits: the layer itself never ran
    for p, a, g in zip(params, assembled, grads, strict=True):
        assert float((p.grad - a).norm()) <= 1e-10 * float(a.norm()) + 1e-300
        assert float((p.grad - g).norm()) <= 1e-6 * float(g.norm()) + 1e-300


def test_an_output_weight_shared_with_a_linear_keeps_the_recorded_head(tokenizer) -> None:
    """The vocabulary-chunk form has cross terms only with an embedding: a head whose weight a Linear also uses (here
    a projection added to the model) takes the recorded form, and the norms stay exact."""
    from steadyrl.train.grad_norms import GhostPass

    model = llama(tokenizer, tied=False)
    model.extra = nn.Linear(ARCH.hidden_size, len(tokenizer), bias=False).double()
    model.extra.weight = model.lm_head.weight
    batch = default_batch(len(tokenizer))
    with GhostPass(model, batch) as ghost:
        assert ghost._head is None
        torch.testing.assert_close(ghost.sq_norms(), per_trajectory_grad_sq_norms(model, batch, method="naive"),
                                   rtol=1e-10, atol=0.0)  # fmt: skip
