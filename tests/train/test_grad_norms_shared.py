"""The ghost pass on the shared-prompt forward (``GhostPass(share_prompts=True)``) against the per-row forms, float64.

Rows of a group read their prompt's keys and values from one forward, so one backward of Σ_i ℓ_i would only give the
group's summed output gradients at the prompt; the pass backpropagates each row's cotangent through the prompt
separately, and the norms must equal the one-backward-per-trajectory reference and the unshared ghost pass; the
gradient it assembles must equal the unshared pass's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.logprobs import _split_to_the_usual_count
from steadyrl.rollout.rollouts import TokenBatch
from steadyrl.rollout.sampler import generate
from steadyrl.train.grad_norms import GhostPass, per_trajectory_grad_sq_norms
from steadyrl.train.learner import Learner

from .test_grad_norms import assert_rel_close, llama, make_batch

#: Row → prompt: groups of 3, 2, 1 and 2 rows, interleaved (the pass must not assume sorted or equal groups).
GROUPS = [0, 1, 0, 3, 1, 0, 2, 3]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def grouped_batch(vocab: int, *, response_lens: list[int] | None = None) -> TokenBatch:
    """Four prompts of lengths 3, 5, 1, 4 (left-padded), each repeated per GROUPS, with their own responses."""
    prompts = make_batch(prompt_lens=[3, 5, 1, 4], response_lens=[2] * 4, vocab=vocab, seed=1)
    lens = response_lens or [4, 6, 1, 3, 6, 2, 5, 4]
    responses = make_batch(prompt_lens=[1] * len(GROUPS), response_lens=[max(n, 2) for n in lens], vocab=vocab, seed=2)
    T, rows = max(lens), torch.tensor(GROUPS)
    mask = responses.response_mask[:, :T] & (torch.arange(T) < torch.tensor(lens)[:, None])
    return TokenBatch(prompts.prompt_ids[rows], prompts.prompt_mask[rows], responses.response_ids[:, :T], mask)


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float = 1e-12) -> None:
    for g, w in zip(got, want, strict=True):
        assert float((g - w).norm()) <= rtol * float(w.norm()) + 1e-300


@pytest.mark.parametrize("kind", ["tied", "untied", "biased"])
def test_shared_prompt_norms_and_gradient_equal_the_per_row_forms(tokenizer, kind: str) -> None:
    model = llama(tokenizer, tied=kind != "untied", bias=kind == "biased")
    batch = grouped_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    coef = torch.linspace(-1.0, 2.0, len(GROUPS), dtype=torch.float64)
    with GhostPass(model, batch) as plain:
        plain_norms = plain.sq_norms()
        plain.accumulate_grad(coef)
    plain_grad = grads(model)
    with GhostPass(model, batch, share_prompts=True) as shared:
        assert shared._prefill is not None  # the forward did share: 4 prompts for 8 rows
        assert_rel_close(shared.sq_norms(), want)
        assert_rel_close(shared.sq_norms(), plain_norms)
        shared.accumulate_grad(coef)  # Σ_i c_i ∇ℓ_i from the stored pieces (shared inputs summed per group)
        assembled = grads(model)
        shared.backward(batch.response_mask.double() * coef[:, None])  # the same through the kept graph
        backpropagated = grads(model)
    assert_grads_close(assembled, plain_grad)
    assert_grads_close(backpropagated, plain_grad, rtol=1e-6)  # the recompute's log-softmax runs in float32
    got = per_trajectory_grad_sq_norms(model, batch, share_prompts=True, weights=coef)
    assert_rel_close(got, want * coef.square())


def test_single_token_responses_share_the_prompt_only_through_its_last_output(tokenizer) -> None:
    """T = 1: no key/value crosses from the prompt to the rows, only the prefill's last logits."""
    model = llama(tokenizer)
    batch = grouped_batch(len(tokenizer), response_lens=[1] * len(GROUPS))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    with GhostPass(model, batch, share_prompts=True) as shared:
        assert shared._prefill is not None
        assert_rel_close(shared.sq_norms(), want)


def test_shared_prompts_under_activation_checkpointing(tokenizer) -> None:
    """Checkpointing in training mode turns the KV cache off: the pass takes the one-pass forward, still exact."""
    model = llama(tokenizer)
    batch = grouped_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    with GhostPass(model, batch, share_prompts=True) as ghost:
        assert ghost._prefill is None
        assert_rel_close(ghost.sq_norms(), want)


SRC = str(Path(__import__("steadyrl").__file__).parent)


def _count_host_reads(monkeypatch: pytest.MonkeyPatch, num_layers: int) -> list[str]:
    """Host reads (``.item()``, ``.tolist()``, ``float``/``int``/``bool`` of a tensor, ``torch.equal``) from
    steadyrl's code during one VCPO learner step with the shared fused norm pass."""
    arch = TinyArchConfig(hidden_size=16, num_layers=num_layers, num_heads=2, intermediate_size=32)
    model = build_tiny_model(arch, tokenizer=build_char_tokenizer(), seed=0)
    spec = resolve_method("vcpo")
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(),
                      log=lambda _: None, grad_norms="fused_shared")  # fmt: skip
    rollouts = generate(model, build_char_tokenizer(), ["1+2=", "7-3="], group_size=4, max_new_tokens=5,
                        generator=torch.Generator().manual_seed(0), version=0)  # fmt: skip
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * 2)
    learner.step(rollouts, rewards)
    calls: list[str] = []

    def counted(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(SRC):
                calls.append(f"{name} in {Path(caller.co_filename).name}:{caller.co_name}")
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, read)

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        counted(torch.Tensor, name)
    counted(torch, "equal")
    learner.step(rollouts, rewards)
    monkeypatch.undo()
    return calls


def test_host_reads_of_a_vcpo_step_do_not_grow_with_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """No read per module: a 3-layer model's step reads to the host as often as a 1-layer one's."""
    one, three = _count_host_reads(monkeypatch, 1), _count_host_reads(monkeypatch, 3)
    assert sorted(one) == sorted(three), (one, three)
    assert len(one) <= 8, one


def test_learner_fused_shared_matches_fused(tokenizer) -> None:
    """The learner's ``fused_shared`` mode: the same per-trajectory norms and update as ``fused`` (float32 rounding)."""
    rollouts = generate(build_tiny_model(TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2,
                                                        intermediate_size=32), tokenizer=tokenizer, seed=0),
                        tokenizer, ["1+2=", "7-3="], group_size=4, max_new_tokens=5,
                        generator=torch.Generator().manual_seed(0), version=0)  # fmt: skip
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * 2)
    out = {}
    for mode in ("fused", "fused_shared"):
        model = build_tiny_model(TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                                 tokenizer=tokenizer, seed=0)  # fmt: skip
        spec = resolve_method("vcpo")
        learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2,
                          optim=OptimConfig(), log=lambda _: None, grad_norms=mode)  # fmt: skip
        step = learner.step(rollouts, rewards)
        out[mode] = (step, [p.detach().clone() for p in model.parameters()])
    (a, pa), (b, pb) = out["fused"], out["fused_shared"]
    assert a.metrics["grad/per_traj_norm_mean"] == pytest.approx(b.metrics["grad/per_traj_norm_mean"], rel=1e-5)
    for x, y in zip(pa, pb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_a_prompt_drawn_by_two_groups_is_backpropagated_as_two_copies(tokenizer) -> None:
    """Rows 0–1 and 4–5 share a prompt (two groups that drew one problem): as one prompt of 4 rows the pass would take
    4 backwards through all prompts; cut into copies of the usual 2 rows it takes 2, and the norms stay exact."""
    model = llama(tokenizer)
    batch = grouped_batch(len(tokenizer))
    rows = torch.tensor([0, 0, 1, 1, 0, 0])
    batch = TokenBatch(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.response_ids[:6],
                       batch.response_mask[:6])  # fmt: skip
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    with GhostPass(model, batch, share_prompts=True) as shared:
        assert shared._prefill is not None
        per_copy = torch.bincount(shared._prefill.inverse)
        assert per_copy.tolist() == [2, 2, 2]  # three copies of two rows: two rank backwards, not four
        assert_rel_close(shared.sq_norms(), want)


def test_prompt_copies_keep_rows_with_their_prompt() -> None:
    inverse = torch.tensor([0, 1, 0, 0, 1, 2, 2, 0, 1, 2, 0])  # counts 5, 3, 3: the usual count is 3
    copies, n = _split_to_the_usual_count(inverse, 3)
    assert n == 4 and sorted(set(copies.tolist())) == list(range(4))  # prompt 0 as copies of 3 and 2 rows
    assert int(torch.bincount(copies).max()) == 3
    owner = {int(c): int(u) for c, u in zip(copies, inverse, strict=True)}
    assert all(owner[int(c)] == int(u) for c, u in zip(copies, inverse, strict=True))  # a copy holds one prompt
    same, n = _split_to_the_usual_count(torch.tensor([1, 0, 1, 0]), 2)
    assert n == 2 and same.tolist() == [1, 0, 1, 0]  # nothing above the usual count: unchanged


def test_the_learner_shares_prompts_in_its_norm_pass_when_it_shares_them_in_its_forward() -> None:
    model = build_tiny_model(TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                             tokenizer=build_char_tokenizer(), seed=0)  # fmt: skip
    spec = resolve_method("vcpo")
    modes = [Learner(model=model, method=spec, controllers=[], lr=0.0, optim=OptimConfig(share_prompts=share),
                     log=lambda _: None).grad_norms for share in (True, False)]  # fmt: skip
    assert modes == ["fused_shared", "fused"]


def test_shared_prompt_norms_in_row_chunks(tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row a chunk (budget patched down): the shared prompts' Gram matrices are taken per chunk, the row map
    sliced with them, and the norms stay the per-row reference's."""
    import steadyrl.core.grad_norms as core

    model = llama(tokenizer, tied=False)
    batch = grouped_batch(len(tokenizer))
    want = per_trajectory_grad_sq_norms(model, batch, method="naive")
    monkeypatch.setattr(core, "NORM_SUM_ELEMENTS", 1)
    with GhostPass(model, batch, share_prompts=True) as shared:
        assert shared._prefill is not None
        assert_rel_close(shared.sq_norms(), want)
