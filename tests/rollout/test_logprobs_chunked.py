"""The learner's recompute in vocabulary chunks (``chunk_elements`` below N·T·V) against the direct form, on the
tiny Llama: log-probs, entropies, full-vocabulary terms, OTB's Σπ², hidden states and every parameter's gradient,
with and without shared prompts, tool-output tokens, temperature/top-k/top-p; the budget that keeps the direct form
(bit-identical to the formula); the cases that fall back to it; and the bound on what is materialized."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import PreTrainedModel, PreTrainedTokenizerFast
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import steadyrl.rollout.logprobs as lp_mod
from steadyrl.models.tiny import build_tiny_model
from steadyrl.rollout.distribution import SamplingParams, entropy_from_log_probs, sampling_log_probs
from steadyrl.rollout.logprobs import proximal_logprobs, sequence_logprob_terms, sequence_logprobs
from steadyrl.rollout.rollouts import TokenBatch, attention_mask
from steadyrl.rollout.sampler import generate, positions_from_mask
from tests.rollout.conftest import TEST_ARCH

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
#: An element budget of 3 tokens per chunk for the 100-token vocabulary.
SMALL = 300


def rel(a: Tensor, b: Tensor) -> float:
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a)) and torch.equal(a[~finite], b[~finite])
    a, b = a.detach(), b.detach()
    return float((a[finite] - b[finite]).norm() / b[finite].norm().clamp_min(1e-300))


def _float64_rms_norm(self: LlamaRMSNorm, hidden: Tensor) -> Tensor:
    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x


def make_model(tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    if dtype == torch.float64:
        monkeypatch.setattr(LlamaRMSNorm, "forward", _float64_rms_norm)  # transformers' own rounds to float32
    return build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1).to(dtype)


def make_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, *, group_size: int = 3,
               new_tokens: int = 7) -> TokenBatch:  # fmt: skip
    """Two prompts × ``group_size`` sampled responses (ragged, right-padded), two tokens of row 0 marked as tool
    output (attended, not scored)."""
    r = generate(model, tokenizer, ["1+2=", "33-4+5="], group_size=group_size, max_new_tokens=new_tokens, version=0,
                 generator=torch.Generator().manual_seed(0), eos_token_ids=[20, 21, 22]).tokens  # fmt: skip
    tool = torch.zeros_like(r.response_mask)
    tool[0, 1:3] = r.response_mask[0, 1:3]
    assert (r.response_mask.sum(-1) < r.response_mask.shape[1]).any()  # some padding
    return TokenBatch(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask & ~tool, tool)


class Spy:
    """Counts the chunked head's calls and records their chunk sizes and token counts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int]] = []
        real = lp_mod.chunked_log_probs

        def spy(**kwargs):  # type: ignore[no-untyped-def]
            self.calls.append((kwargs["chunk_tokens"], kwargs["hidden"].shape[0]))
            return real(**kwargs)

        monkeypatch.setattr(lp_mod, "chunked_log_probs", spy)


def _grads(model: PreTrainedModel, loss: Tensor) -> list[Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [torch.zeros_like(p) if g is None else g for p, g in
            zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True)]  # fmt: skip


def _loss(logp: Tensor, extra: Tensor | None, coef: Tensor) -> Tensor:
    total = (torch.where(torch.isfinite(logp), logp, 0.0) * coef[0]).sum()
    return total if extra is None else total + (extra * coef[1]).sum()


PARAMS = [SamplingParams(), SamplingParams(temperature=0.7, top_k=12, top_p=0.9)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("params", PARAMS, ids=["plain", "T0.7-k12-p0.9"])
def test_chunked_recompute_equals_direct(
    tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, share: bool,
    params: SamplingParams,
) -> None:  # fmt: skip
    """Log-probs, entropies and the gradient of a loss over both w.r.t. every parameter (tied embedding/output
    layer included): chunks of 3 tokens (the last one ragged) equal the direct form."""
    model = make_model(tokenizer, dtype, monkeypatch)
    batch = make_batch(model, tokenizer)
    kw = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, return_entropy=True,
              share_prompts=share)  # fmt: skip
    coef = torch.randn((2, *batch.response_ids.shape), generator=torch.Generator().manual_seed(3), dtype=dtype)
    direct = sequence_logprobs(model, batch, **kw)
    g_direct = _grads(model, _loss(direct.logp, direct.entropy, coef))
    spy = Spy(monkeypatch)
    chunked = sequence_logprobs(model, batch, chunk_elements=SMALL, **kw)
    M = int(batch.response_mask.sum())
    assert spy.calls == [(3, M)] and M % 3 != 0  # 3 tokens per chunk, the last one ragged
    g_chunked = _grads(model, _loss(chunked.logp, chunked.entropy, coef))
    assert chunked.logp.dtype == dtype and chunked.entropy is not None
    m = batch.response_mask
    assert (chunked.logp[~m] == 0).all() and (chunked.entropy[~m] == 0).all()
    assert rel(chunked.logp, direct.logp) <= TOL[dtype]
    assert rel(chunked.entropy, direct.entropy) <= TOL[dtype]
    for got, want in zip(g_chunked, g_direct, strict=True):
        assert rel(got, want) <= TOL[dtype]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_return_hidden_gives_the_same_states(tokenizer: PreTrainedTokenizerFast, monkeypatch) -> None:
    """The chunked path's hidden states are the trunk's output, the direct path's ``hidden_states[-1]``: equal."""
    model = make_model(tokenizer, torch.float64, monkeypatch)
    batch = make_batch(model, tokenizer)
    direct = sequence_logprobs(model, batch, return_hidden=True)
    spy = Spy(monkeypatch)
    chunked = sequence_logprobs(model, batch, return_hidden=True, chunk_elements=SMALL)
    assert len(spy.calls) == 1
    assert torch.equal(chunked.hidden, direct.hidden)
    assert rel(chunked.logp, direct.logp) <= 1e-12


def test_vocabulary_terms_with_gradient(tokenizer: PreTrainedTokenizerFast, monkeypatch) -> None:
    """Named terms through :func:`sequence_logprob_terms`: an entropy bonus and score centering Σ_v c_{n,t,v} log π_v
    whose constants are looked up by the flat index n·T + t the term receives; chunked = direct (values, gradient)."""
    model = make_model(tokenizer, torch.float64, monkeypatch)
    batch = make_batch(model, tokenizer)
    N, T = batch.response_ids.shape
    c = torch.randn(N * T, 100, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    terms = {
        "entropy": lambda lp, i: entropy_from_log_probs(lp),
        "centered": lambda lp, i: (c[i] * torch.where(torch.isfinite(lp), lp, 0.0)).sum(-1),
    }
    outs, grads = [], []
    for budget in (None, SMALL):
        out = sequence_logprob_terms(model, batch, terms=terms, temperature=0.9, top_k=30, chunk_elements=budget)
        outs.append(out)
        grads.append(_grads(model, out.terms["entropy"].sum() - 0.5 * out.terms["centered"].sum()))
    (direct, chunked), (g_direct, g_chunked) = outs, grads
    m = batch.response_mask
    for name in terms:
        assert (chunked.terms[name][~m] == 0).all()
        assert rel(chunked.terms[name], direct.terms[name]) <= 1e-12
    assert rel(chunked.logp, direct.logp) <= 1e-12
    for got, want in zip(g_chunked, g_direct, strict=True):
        assert rel(got, want) <= 1e-12


def test_proximal_logprobs_chunked(tokenizer: PreTrainedTokenizerFast, monkeypatch) -> None:
    model = make_model(tokenizer, torch.float32, monkeypatch)
    batch = make_batch(model, tokenizer)
    with torch.no_grad():
        direct = proximal_logprobs(model, batch, temperature=0.8)
        spy = Spy(monkeypatch)
        chunked = proximal_logprobs(model, batch, temperature=0.8, chunk_elements=SMALL)
    assert len(spy.calls) == 1
    assert rel(chunked.logp, direct.logp) <= 1e-6 and rel(chunked.sum_p2, direct.sum_p2) <= 1e-6
    assert chunked.sum_p2.dtype == torch.float32 and (chunked.sum_p2[~batch.response_mask] == 0).all()


def test_within_the_budget_the_direct_form_is_bit_identical(tokenizer: PreTrainedTokenizerFast, monkeypatch) -> None:
    """At the default budget the tiny model's batch is one chunk: the direct form runs, and its values are exactly
    those of the formula (one forward with ``logits_to_keep``, ``sampling_log_probs``, gather), bit for bit."""
    model = build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1)
    batch = make_batch(model, tokenizer)
    spy = Spy(monkeypatch)
    params = SamplingParams(temperature=0.7, top_k=12)
    out = sequence_logprobs(model, batch, temperature=0.7, top_k=12, return_entropy=True)
    N, T = batch.response_ids.shape
    assert spy.calls == [] and N * T * 100 <= lp_mod.DEFAULT_CHUNK_ELEMENTS
    mask = attention_mask(batch)
    ids = torch.cat([batch.prompt_ids, batch.response_ids], -1)
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions_from_mask(mask), use_cache=False,
                   logits_to_keep=T + 1).logits[:, :-1]  # fmt: skip
    log_probs = sampling_log_probs(logits, params=params)
    m = batch.response_mask
    want = torch.where(m, log_probs.gather(-1, batch.response_ids[..., None])[..., 0], 0.0)
    assert torch.equal(out.logp, want)
    assert out.entropy is not None and torch.equal(out.entropy, torch.where(m, entropy_from_log_probs(log_probs), 0.0))
    assert len(spy.calls) == 0
    sequence_logprobs(model, batch, chunk_elements=N * T * 100 - 1)
    assert len(spy.calls) == 1  # one element over: chunked


@pytest.fixture
def spied(tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple]:
    model = build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1)
    yield model, make_batch(model, tokenizer), Spy(monkeypatch)


def test_forward_hooks_on_the_output_layer_keep_the_direct_form(spied) -> None:
    """A forward hook on the output layer (the ghost gradient-norm pass records its call) or on the model, or a
    patched ``forward``: the model is called as a whole, so the hook sees the call it expects."""
    model, batch, spy = spied
    seen: list[tuple[int, ...]] = []
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(tuple(out.shape)))
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    handle.remove()
    N, T = batch.response_ids.shape
    assert seen == [(N, T + 1, 100)] and spy.calls == []
    handle = model.register_forward_pre_hook(lambda mod, args: None)
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    handle.remove()
    assert spy.calls == []
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    assert len(spy.calls) == 1  # hooks gone: chunked


def test_models_that_post_process_logits_keep_the_direct_form(spied, monkeypatch: pytest.MonkeyPatch) -> None:
    """A logit soft-cap in the config, a model type not known to be a plain head, an output layer that is not a plain
    Linear, a bf16 plain Linear (it would compute in bf16), autocast on a plain Linear, ``torch.func`` transforms:
    the direct form."""
    model, batch, spy = spied
    monkeypatch.setattr(model.config, "final_logit_softcapping", 30.0, raising=False)
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    monkeypatch.setattr(model.config, "final_logit_softcapping", None)
    monkeypatch.setattr(model.config, "model_type", "gemma2")
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    monkeypatch.setattr(model.config, "model_type", "llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sequence_logprobs(model, batch, chunk_elements=SMALL)
    assert spy.calls == []
    splits: list[object] = []  # under vmap (the "vmap" gradient-norm method traces the recompute): no split
    vmap(lambda x: splits.append(lp_mod._split_output_layer(model, batch, SMALL)) or x)(torch.zeros(2))
    assert splits == [None] and lp_mod._split_output_layer(model, batch, SMALL) is not None

    class Scaled(torch.nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x) * 2.0

    model.lm_head.__class__ = Scaled
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    model.lm_head.__class__ = torch.nn.Linear
    assert spy.calls == []
    sequence_logprobs(model, batch, chunk_elements=SMALL)
    assert len(spy.calls) == 1


def test_float32_output_layer_is_chunked_in_float32(tokenizer: PreTrainedTokenizerFast, monkeypatch) -> None:
    """A placed model (``Float32OutputLinear``) under bf16 autocast: chunked, float32 log-probs close to the direct
    form's (the trunk runs in bf16 in both)."""
    from steadyrl.base.device import Placement

    model = Placement(torch.device("cpu"), "bf16-mixed").place(build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1))
    batch = make_batch(model, tokenizer)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct = sequence_logprobs(model, batch)
        spy = Spy(monkeypatch)
        chunked = sequence_logprobs(model, batch, chunk_elements=SMALL)
    assert len(spy.calls) == 1 and chunked.logp.dtype == torch.float32
    assert rel(chunked.logp, direct.logp) <= 1e-6


class LargestWithVocabAxis(TorchDispatchMode):
    """The largest number of elements of any op output whose last axis is the vocabulary (forward and backward)."""

    def __init__(self, V: int) -> None:
        super().__init__()
        self.V, self.largest = V, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # no new memory (e.g. the weight's transpose [H, V])
            return out
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.dim() and t.shape[-1] == self.V:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("share", [False, True])
def test_the_recompute_never_forms_more_than_one_chunk_of_logits(tokenizer, share: bool) -> None:
    """Through the whole learner recompute (trunk, head, loss, backward into every parameter): no tensor with a
    vocabulary axis above ``chunk_elements``; the direct form forms [N, T, V] (so the check can fail)."""
    model = build_tiny_model(TEST_ARCH, tokenizer=tokenizer, seed=1)
    batch = make_batch(model, tokenizer, group_size=6, new_tokens=12)
    N, T = batch.response_ids.shape
    budget = 800  # 8 tokens × V = 100
    largest = {}
    for name, chunk_elements in (("chunked", budget), ("direct", None)):
        with LargestWithVocabAxis(100) as mode:
            out = sequence_logprobs(model, batch, return_entropy=True, share_prompts=share,
                                    chunk_elements=chunk_elements)  # fmt: skip
            assert out.entropy is not None
            (out.logp.sum() + out.entropy.sum()).backward()
        largest[name] = mode.largest
    assert largest["chunked"] <= budget
    assert largest["direct"] >= N * T * 100 > 10 * budget
