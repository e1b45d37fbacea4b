"""Token-budget micro-batching: the accumulated gradient equals the full-batch gradient for every catalog method.

float64 tiny model, an off-policy batch (μ = the sampler's log-probs plus noise, so every correction acts), two
budgets: one row per micro-batch (every group cut into single rows) and a middle budget (micro-batches of mixed
lengths that cut some groups and keep others). The learner's raw gradient (before controllers and clipping) must
match the one-pass gradient to 1e-10 relative; activation checkpointing must not change it either.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from steadyrl.config.train import OptimConfig
from steadyrl.control import build_controllers
from steadyrl.methods import PRESETS, resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train.learner import Learner
from steadyrl.train.microbatch import plan_microbatches, row_widths

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9+31="]
G = 4


def _rms_norm_in_input_dtype(self: LlamaRMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm computed in float64 for a float64 input (transformers' own rounds every input to float32, which
    would cap this file's float64 comparisons at float32 accuracy)."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    x = hidden.to(dtype)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(hidden.dtype)


@pytest.fixture(scope="module", autouse=True)
def _float64_norms() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LlamaRMSNorm, "forward", _rms_norm_in_input_dtype)
        yield


@pytest.fixture(scope="module")
def model64() -> torch.nn.Module:
    return build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0).double()


@pytest.fixture(scope="module")
def batch(model64: torch.nn.Module) -> tuple[Rollouts, torch.Tensor]:
    tok = build_char_tokenizer()
    rollouts = generate(
        model64, tok, PROMPTS, group_size=G, max_new_tokens=7, generator=torch.Generator().manual_seed(0),
        version=0, record_entropy=True, record_dist=0,  # the behavior distribution: score centering
    )  # fmt: skip
    noise = torch.randn(rollouts.behav_logp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    behav = torch.where(rollouts.response_mask, rollouts.behav_logp.double() + 0.05 * noise, 0.0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0] * 2, dtype=torch.float64)
    return dataclasses.replace(rollouts, behav_logp=behav), rewards


def _raw_grad(
    model: torch.nn.Module, method: str, batch: tuple[Rollouts, torch.Tensor], **optim: object
) -> tuple[torch.Tensor, dict[str, float]]:
    """The learner's raw gradient (before controllers and clipping) of one step from a copy of ``model``."""
    model = copy.deepcopy(model)
    spec = resolve_method(method)
    if getattr(spec.advantage, "critic_warmup", 0):  # BRACE trains its critic alone first: no policy gradient yet
        spec = resolve_method(method, {"advantage.critic_warmup": 0})
    ref = copy.deepcopy(model).eval().requires_grad_(False) if spec.kl.type != "none" else None
    learner = Learner(
        model=model, method=spec, controllers=build_controllers(spec), lr=1e-3, optim=OptimConfig(**optim),
        ref_model=ref, log=lambda _: None,
    )  # fmt: skip
    out = learner.step(*batch)
    assert out.skipped == 0, out.reasons
    grad = learner.prev_grad  # per parameter; GAC's own copy when GAC keeps the raw one
    assert grad is not None
    return torch.cat([g.reshape(-1) for g in grad]), out.metrics


def _budgets(rollouts: Rollouts) -> dict[str, int]:
    prompt, response = row_widths(rollouts)
    longest = max(p + r for p, r in zip(prompt, response, strict=True))
    return {"one_row": 1, "mixed": 5 * longest}


#: Presets whose micro-batches run the values pass on this batch: OPOB's norms or a critic's hidden states (never
#: one forward a micro-batch), or a loss whose ∂L/∂logp at a row reads other rows' values (found and corrected at the
#: first step: a batch-normalized weight, a kept-token denominator, group statistics of π's values).
VALUES_PASS = {"vcpo", "opob", "copc", "brace", "geo_mis", "kl_in_reward", "otb", "rollout_is"}


@pytest.mark.parametrize("name", [p.name for p in PRESETS])
def test_microbatched_gradient_equals_the_full_batch_gradient(name: str, model64, batch) -> None:
    full, full_metrics = _raw_grad(model64, name, batch)
    assert float(full.norm()) > 0
    for label, budget in _budgets(batch[0]).items():
        micro, metrics = _raw_grad(model64, name, batch, microbatch_tokens=budget)
        assert metrics["train/microbatches"] > 1, label
        assert metrics["train/values_pass"] == float(name in VALUES_PASS), label  # one forward a micro-batch else
        rel = float((micro - full).norm() / full.norm())
        assert rel < 1e-10, (label, rel)
        assert metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-10, abs=1e-12), label


@pytest.mark.parametrize("name", ["grpo", "seq_tis", "vcpo", "copc", "gmc_grpo"])
def test_activation_checkpointing_gives_the_same_gradient(name: str, model64, batch) -> None:
    full, _ = _raw_grad(model64, name, batch)
    for extra in ({}, {"microbatch_tokens": _budgets(batch[0])["mixed"]}):
        ckpt, _ = _raw_grad(model64, name, batch, activation_checkpointing=True, **extra)
        assert float((ckpt - full).norm() / full.norm()) < 1e-10, extra


@pytest.mark.parametrize("name", [p.name for p in PRESETS])
def test_vocabulary_chunks_give_the_one_pass_gradient(name: str, model64, batch, monkeypatch) -> None:
    """Every recompute in vocabulary chunks of 3 tokens (the default element budget patched down to 300 logits;
    π_θ with gradient, π_prox, OTB's Σπ², COPC's hidden states, shared prompts, VCPO's ghost pass): the learner's raw
    gradient and loss equal the direct form's to 1e-10, alone and with micro-batches."""
    import steadyrl.rollout.logprobs as lp_mod

    full, full_metrics = _raw_grad(model64, name, batch)
    real, calls = lp_mod.chunked_log_probs, []
    monkeypatch.setattr(lp_mod, "chunked_log_probs", lambda **kw: calls.append(kw["chunk_tokens"]) or real(**kw))
    monkeypatch.setattr(lp_mod, "DEFAULT_CHUNK_ELEMENTS", 300)
    for extra in ({}, {"microbatch_tokens": _budgets(batch[0])["mixed"]}):
        calls.clear()
        chunked, metrics = _raw_grad(model64, name, batch, **extra)
        assert set(calls) == {3}, extra
        rel = float((chunked - full).norm() / full.norm())
        assert rel < 1e-10, (extra, rel)
        assert metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-10, abs=1e-12), extra


def _counting_forwards(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the learner's micro-batch forwards (values pass and gradient pass alike)."""
    calls: list[int] = []
    real = Learner._micro_forward
    monkeypatch.setattr(Learner, "_micro_forward", lambda self, mb, **kw: calls.append(1) or real(self, mb, **kw))
    return calls


@pytest.mark.parametrize("name", ["grpo", "seq_tis+ess_lr", "m2po", "adaptive_entropy", "score_centering"])
def test_a_loss_that_reads_each_row_alone_skips_the_values_pass(name: str, model64, batch, monkeypatch) -> None:
    """GRPO, the default method, M2PO on this batch (its second moment stays under τ, so no token is masked), an
    entropy bonus and score centering (vocabulary terms with gradient): each micro-batch is forwarded once, its
    ∂L/∂logp (and ∂L/∂term) taken with the rows not forwarded yet at μ (terms at 0), and the gradient and the loss
    are the one-pass ones to 1e-10."""
    full, full_metrics = _raw_grad(model64, name, batch)
    calls = _counting_forwards(monkeypatch)
    micro, metrics = _raw_grad(model64, name, batch, microbatch_tokens=_budgets(batch[0])["mixed"])
    assert metrics["train/values_pass"] == 0.0
    assert len(calls) == metrics["train/microbatches"] > 1  # one forward a micro-batch, not two
    assert float((micro - full).norm() / full.norm()) < 1e-10
    assert metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-10, abs=1e-12)


def test_a_loss_that_mixes_rows_is_corrected_then_runs_the_values_pass(model64, batch, monkeypatch) -> None:
    """rollout_is divides its weights by their batch mean, so a row's ∂L/∂logp depends on the other rows' values: the
    speculative micro-batches are found wrong at the step's first read, the difference is backpropagated (the
    gradient is still the one-pass one to 1e-10), and the learner's later steps run the values pass."""
    name, budget = "rollout_is", _budgets(batch[0])["mixed"]
    full, _ = _raw_grad(model64, name, batch)
    calls = _counting_forwards(monkeypatch)
    spec = resolve_method(name)
    learner = Learner(model=copy.deepcopy(model64), method=spec, controllers=build_controllers(spec), lr=1e-3,
                      optim=OptimConfig(microbatch_tokens=budget), log=lambda _: None)  # fmt: skip
    out = learner.step(*batch)
    M = int(out.metrics["train/microbatches"])
    assert out.metrics["train/values_pass"] == 1.0 and not learner._speculate
    assert M < len(calls) <= 2 * M  # one forward a micro-batch, then one more for each corrected one
    assert learner.prev_grad is not None
    micro = torch.cat([g.reshape(-1) for g in learner.prev_grad])
    assert float((micro - full).norm() / full.norm()) < 1e-10
    calls.clear()
    assert learner.step(*batch).metrics["train/values_pass"] == 1.0
    assert len(calls) == 2 * M  # the values pass, then the gradient pass
    resumed = Learner(model=copy.deepcopy(model64), method=spec, controllers=build_controllers(spec), lr=1e-3,
                      optim=OptimConfig(microbatch_tokens=budget), log=lambda _: None)  # fmt: skip
    resumed.load_state_dict(learner.state_dict())
    assert not resumed._speculate  # a resumed run keeps the verdict, so its steps are the uninterrupted run's


def test_a_budget_that_fits_the_batch_runs_one_pass(model64, batch) -> None:
    N = batch[0].response_ids.shape[0]
    width = batch[0].prompt_ids.shape[1] + batch[0].response_ids.shape[1]
    _, metrics = _raw_grad(model64, "grpo", batch, microbatch_tokens=N * width)
    assert "train/microbatches" not in metrics


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=20),
    budget=st.integers(1, 120),
)
def test_a_plan_covers_every_row_once_within_the_budget(lengths: list[tuple[int, int]], budget: int) -> None:
    N, P, T = len(lengths), 9, 9
    prompt_mask = torch.tensor([[False] * (P - p) + [True] * p for p, _ in lengths])
    response_mask = torch.tensor([[True] * r + [False] * (T - r) for _, r in lengths])
    rollouts = Rollouts(
        prompt_ids=torch.ones(N, P, dtype=torch.long), prompt_mask=prompt_mask,
        response_ids=torch.ones(N, T, dtype=torch.long), response_mask=response_mask,
        behav_logp=torch.zeros(N, T), versions=torch.zeros(N, T, dtype=torch.long),
        group_ids=torch.arange(N), truncated=torch.zeros(N, dtype=torch.bool), texts=[""] * N, pad_id=0,
    )  # fmt: skip
    plan = plan_microbatches(rollouts, budget)
    rows = torch.cat(plan).tolist()
    assert sorted(rows) == list(range(N))
    for part in plan:
        width = max(lengths[i][0] for i in part.tolist()) + max(lengths[i][1] for i in part.tolist())
        assert len(part) == 1 or len(part) * width <= budget


def test_a_critic_that_trains_the_trunk_gets_its_hidden_state_gradient_through_the_micro_batches(
    model64, batch
) -> None:  # type: ignore[no-untyped-def]
    """COPC with ``critic.trunk_grad``: ∂L/∂hidden flows back through pass 2 (a random head, so it is not zero)."""
    from steadyrl.config.critic import CriticConfig

    def grad(trunk: bool, **optim: object) -> torch.Tensor:
        model = copy.deepcopy(model64)
        spec = resolve_method("copc")
        learner = Learner(
            model=model, method=spec, controllers=build_controllers(spec), lr=1e-3, optim=OptimConfig(**optim),
            critic=CriticConfig(trunk_grad=trunk), log=lambda _: None,
        )  # fmt: skip
        assert learner.critic is not None
        with torch.no_grad():  # the head starts at zero (V ≡ 0): give it weights so ∂L_V/∂hidden ≠ 0
            for p in learner.critic.head.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3), dtype=p.dtype))
        assert learner.step(*batch).skipped == 0
        assert learner.prev_grad is not None
        return torch.cat([g.reshape(-1) for g in learner.prev_grad])

    full, detached = grad(True), grad(False)
    assert float((full - detached).norm() / full.norm()) > 0.1  # the trunk term is there
    for budget in _budgets(batch[0]).values():
        assert float((grad(True, microbatch_tokens=budget) - full).norm() / full.norm()) < 1e-10


@pytest.mark.parametrize("optim", [{}, {"microbatch_tokens": 10_000}])
def test_opobs_norm_pass_is_split_where_its_logits_pass_the_budget(model64, batch, monkeypatch, optim) -> None:
    """Where the output layer cannot run in vocabulary chunks (patched so here), the ghost pass holds its whole
    [n, T, V] output: with ``optim.norm_pass_logits`` at three rows' worth it runs per micro-batch of at most that many
    logits (rows × width × V), while the rest of the step keeps one pass (or the user's micro-batches); the gradient
    equals the one-pass gradient to 1e-10."""
    import steadyrl.train.grad_norms as grad_norms_mod
    import steadyrl.train.learner as learner_mod

    monkeypatch.setattr(grad_norms_mod, "chunkable_head", lambda *_: None)
    monkeypatch.setattr(learner_mod, "chunkable_head", lambda *_: None)

    full, _ = _raw_grad(model64, "vcpo", batch)
    vocab = model64.get_output_embeddings().weight.shape[0]
    width = batch[0].prompt_ids.shape[1] + batch[0].response_ids.shape[1]
    budget = 3 * width * vocab  # three full-width rows
    seen: list[int] = []
    real = grad_norms_mod.GhostPass.__init__

    def spy(self, model, mb, **kw):  # type: ignore[no-untyped-def]
        seen.append(mb.response_ids.shape[0] * (mb.prompt_ids.shape[1] + mb.response_ids.shape[1]) * vocab)
        real(self, model, mb, **kw)

    monkeypatch.setattr(grad_norms_mod.GhostPass, "__init__", spy)
    split, metrics = _raw_grad(model64, "vcpo", batch, norm_pass_logits=budget, **optim)
    n = batch[0].response_ids.shape[0]
    assert len(seen) >= n // 3 and max(seen) <= budget, seen
    assert metrics["train/norm_microbatches"] == len(seen) and metrics["train/microbatches"] == 1
    assert float((split - full).norm() / full.norm()) < 1e-10
