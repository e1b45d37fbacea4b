"""steadyrl.per_trajectory_grad_sq_norms on a model of one's own (torch only): ghost against one backward per row.

The toy policy has every kind of module the ghost method handles: an embedding tied to the output layer, biased
Linear layers (one called twice), an RMSNorm scale and a module with its own parameter in a custom ``forward``.
The reference is the definition itself: for each row alone, ``torch.autograd.grad`` of w_i Σ_t m log π, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import steadyrl
from steadyrl.core.grad_norms import GhostPass, per_trajectory_grad_sq_norms


class Scale(nn.Module):
    """A parameter used in a custom forward (the generic per-sample vjp path)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.tanh(self.gain)


class ToyPolicy(nn.Module):
    """A causal toy LM: token embedding + a running mean of the past (no mixing across rows), tied output layer."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.RMSNorm(dim)
        self.scale = Scale(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)  # [B, S, D]
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        h = h.cumsum(dim=1) / steps  # causal: position s sees tokens ≤ s
        h = self.mix(torch.tanh(self.mix(h)))  # the same Linear twice
        return self.head(self.scale(self.norm(h)))  # logits [B, S, V]


def logprobs(model: nn.Module, ids: Tensor) -> Tensor:
    """log π(ids[:, s+1] | ids[:, ≤s]) [B, S−1]: the ``logp_fn`` of the tests."""
    logits = model(ids[:, :-1])
    return torch.gather(F.log_softmax(logits, dim=-1), 2, ids[:, 1:, None]).squeeze(-1)


def setup(seed: int = 0) -> tuple[ToyPolicy, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = ToyPolicy().double()
    ids = torch.randint(0, 11, (5, 7))
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([6, 3, 1, 0, 5]).unsqueeze(1)  # row 3 has no trained token
    return model, ids, mask


def reference(model: nn.Module, ids: Tensor, mask: Tensor, weights: Tensor | None = None) -> Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(ids.shape[0]):
        ell = torch.where(mask[i : i + 1], logprobs(model, ids[i : i + 1]), 0.0).sum()
        if weights is not None:
            ell = ell * weights[i]
        grads = torch.autograd.grad(ell, params, allow_unused=True)
        out.append(sum(g.square().sum() for g in grads if g is not None))
    return torch.stack(out)


@pytest.mark.parametrize("method", ["ghost", "naive"])
@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
def test_matches_one_backward_per_row(method: str, strategy: str) -> None:
    model, ids, mask = setup()
    want = reference(model, ids, mask)
    got = steadyrl.per_trajectory_grad_sq_norms(
        model, lambda m: logprobs(m, ids), mask, method=method, ghost_strategy=strategy
    )
    assert got.dtype == torch.float64 and not got.requires_grad
    assert got[3] == 0 and (want[[0, 1, 2, 4]] > 0).all()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert all(p.grad is None for p in model.parameters())  # .grad untouched


def test_weights_scale_each_row() -> None:
    model, ids, mask = setup(1)
    w = torch.tensor([0.5, -2.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    got = per_trajectory_grad_sq_norms(model, lambda m: logprobs(m, ids), mask, weights=w)
    torch.testing.assert_close(got, reference(model, ids, mask, w), rtol=1e-10, atol=1e-14)


def test_float32_model_and_float_mask() -> None:
    model, ids, mask = setup(2)
    model = model.float()
    got = per_trajectory_grad_sq_norms(model, lambda m: logprobs(m, ids), mask.float())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference(model, ids, mask), rtol=1e-4, atol=1e-7)


def test_ghost_pass_gives_the_batch_gradient_without_another_backward() -> None:
    """accumulate_grad(c) = ∇ Σ_i c_i ℓ_i, and backward(∂L/∂logp) = autograd's gradient of L, both into .grad."""
    model, ids, mask = setup(3)
    c = torch.tensor([1.0, -0.5, 2.0, 0.3, 0.7], dtype=torch.float64)
    objective = (c * torch.where(mask, logprobs(model, ids), 0.0).sum(-1)).sum()  # Σ_i c_i ℓ_i
    want = torch.autograd.grad(objective, list(model.parameters()))
    with GhostPass(model, lambda m: logprobs(m, ids), mask) as ghost:
        torch.testing.assert_close(ghost.sq_norms(), reference(model, ids, mask), rtol=1e-10, atol=1e-14)
        ghost.accumulate_grad(c)
    for p, g in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)
    model.zero_grad(set_to_none=True)
    with GhostPass(model, lambda m: logprobs(m, ids), mask) as ghost:
        ghost.backward(torch.where(mask, c[:, None], 0.0))
    for p, g in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-14)


def test_frozen_model_and_empty_batch_give_zeros() -> None:
    model, ids, mask = setup()
    assert per_trajectory_grad_sq_norms(model, lambda m: logprobs(m, ids[:0]), mask[:0]).shape == (0,)
    model.requires_grad_(False)
    assert (per_trajectory_grad_sq_norms(model, lambda m: logprobs(m, ids), mask) == 0).all()


def test_invalid_arguments() -> None:
    model, ids, mask = setup()
    fn = lambda m: logprobs(m, ids)  # noqa: E731
    with pytest.raises(ValueError, match="method='vmap' is not one of ghost, naive"):
        per_trajectory_grad_sq_norms(model, fn, mask, method="vmap")
    with pytest.raises(ValueError, match="ghost_strategy"):
        per_trajectory_grad_sq_norms(model, fn, mask, ghost_strategy="fast")
    with pytest.raises(ValueError, match="weights has shape"):
        per_trajectory_grad_sq_norms(model, fn, mask, weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"logp_fn returned shape \(5, 6\); the mask is \(5, 4\)"):
        per_trajectory_grad_sq_norms(model, fn, mask[:, :4])
    with pytest.raises(ValueError, match=r"mask must be \[N, T\]"):
        per_trajectory_grad_sq_norms(model, fn, mask[0])


class UntiedPolicy(ToyPolicy):
    """The toy policy with its own output layer: the embedding's gradient is one-hot rows only."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.embed.padding_idx = 0


def test_an_untied_embedding_is_summed_per_token_not_materialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows repeat ids (their gradient rows add up before the square) and hold padding (no gradient). Under ``auto``
    the embedding's norm is a segment sum per (sample, id): neither the [N, V, C] gradient nor an S×S Gram."""
    import steadyrl.core.grad_norms as core

    torch.manual_seed(4)
    vocab = 1000  # S·C + V·C < S²·(C + 1): the cost rule alone would materialize [N, V, C] here
    model = UntiedPolicy(vocab, 4).double()
    ids = torch.randint(1, 6, (4, 40))  # few distinct ids: every row repeats them
    ids[1, :7] = 0  # padding_idx
    mask = torch.arange(39).unsqueeze(0) < torch.tensor([39, 20, 5, 0]).unsqueeze(1)
    want = reference(model, ids, mask)
    embedding = model.embed.weight
    original = core._materialize

    def spy(c):  # type: ignore[no-untyped-def]
        if isinstance(c, core._Outer) and c.indexed:
            raise AssertionError(f"the embedding's [N, {c.rows}, C] gradient was materialized")
        return original(c)

    monkeypatch.setattr(core, "_materialize", spy)
    got = per_trajectory_grad_sq_norms(model, lambda m: logprobs(m, ids), mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    only = per_trajectory_grad_sq_norms(model, lambda m: logprobs(m, ids), mask, ghost_strategy="gram")
    torch.testing.assert_close(only, want, rtol=1e-10, atol=1e-14)
    assert embedding.grad is None


@pytest.mark.parametrize("strategy", ["auto", "gram", "materialize"])
def test_norm_sums_run_in_row_chunks_that_fit_their_budget(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the element budget patched down to nothing, every chunk is one row: each batched product of the sums has
    one sample (no S×S or V×C tensor for the whole batch), and the norms are the reference's."""
    import steadyrl.core.grad_norms as core

    model, ids, mask = setup(5)
    want = reference(model, ids, mask)
    monkeypatch.setattr(core, "NORM_SUM_ELEMENTS", 1)
    samples: list[int] = []
    real_bmm = torch.bmm

    def bmm(a: Tensor, b: Tensor) -> Tensor:
        samples.append(a.shape[0])
        return real_bmm(a, b)

    with GhostPass(model, lambda m: logprobs(m, ids), mask, strategy=strategy) as ghost:
        ghost._record()
        monkeypatch.setattr(torch, "bmm", bmm)
        got = ghost.sq_norms()
        monkeypatch.setattr(torch, "bmm", real_bmm)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert samples and set(samples) == {1}, samples
