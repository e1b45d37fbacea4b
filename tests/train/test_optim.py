"""optim.name=muon: Muon on the hidden 2-D weight matrices only (never the embeddings or the output layer), AdamW on the
rest, its own lr, and a learner state that saves and restores both optimizers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from steadyrl.config.train import OptimConfig
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.sampler import generate
from steadyrl.train.learner import Learner
from steadyrl.train.optim import MuonAdamW, split_params

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]


def _model() -> nn.Module:
    return build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)


def _batch(model: nn.Module):  # type: ignore[no-untyped-def]
    r = generate(model, build_char_tokenizer(), PROMPTS, group_size=4, max_new_tokens=5, version=0,
                 generator=torch.Generator().manual_seed(0))  # fmt: skip
    return r, torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS))


def _learner(model: nn.Module, **optim: object) -> Learner:
    spec = resolve_method("grpo")
    return Learner(model=model, method=spec, controllers=[], lr=1e-2, optim=OptimConfig(**optim), log=lambda _: None)


def test_muon_gets_the_hidden_matrices_and_never_the_embeddings_or_the_output_layer() -> None:
    model = _model()
    muon, adamw = split_params(model)
    names = {id(p): n for n, p in model.named_parameters()}
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed is head  # tied in the embedded model
    assert id(embed) not in {id(p) for p in muon}
    assert all(p.dim() == 2 for p in muon) and len(muon) == ARCH.num_layers * 7  # q, k, v, o, gate, up, down
    assert all("proj" in names[id(p)] for p in muon)
    assert all(p.dim() == 1 or p is embed for p in adamw)  # norms (and biases), and the embeddings/output layer
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())  # an untied output layer
    muon2, adamw2 = split_params(untied)
    assert any(p is untied.lm_head.weight for p in adamw2) and all(p is not untied.lm_head.weight for p in muon2)


def test_a_muon_step_moves_the_matrices_with_muon_and_the_rest_with_adamw() -> None:
    model = _model()
    learner = _learner(model, name="muon", muon={"lr": 0.02})
    assert isinstance(learner.optimizer, MuonAdamW)
    out = learner.step(*_batch(model))
    assert out.applied == 1 and out.metrics["lr"] == pytest.approx(1e-2)  # the metric is AdamW's (the run's) lr
    muon_state, adamw_state = learner.optimizer.muon.state, learner.optimizer.adamw.state  # type: ignore[union-attr]
    embed = model.get_input_embeddings().weight
    assert embed in adamw_state and "exp_avg" in adamw_state[embed] and embed not in muon_state
    assert all("momentum_buffer" in s for s in muon_state.values()) and len(muon_state) == ARCH.num_layers * 7
    assert [g["lr"] for g in learner.optimizer.muon.param_groups] == [pytest.approx(0.02)]


def test_muon_lr_follows_the_warm_up() -> None:
    model = _model()
    learner = _learner(model, name="muon", muon={"lr": 0.05}, warmup_steps=4)
    learner.step(*_batch(model))
    groups = learner.optimizer.param_groups
    assert groups[0]["lr"] == pytest.approx(1e-2 / 4) and groups[-1]["lr"] == pytest.approx(0.05 / 4)


def test_the_default_optimizer_is_still_adamw() -> None:
    learner = _learner(_model())
    assert type(learner.optimizer) is torch.optim.AdamW


def test_learner_state_saves_and_restores_both_optimizers() -> None:
    """Two steps straight against one step, a state round trip into a fresh learner, one more step: same weights."""
    model_a = _model()
    batch = _batch(model_a)
    a = _learner(model_a, name="muon")
    a.step(*batch)
    state = copy.deepcopy(a.state_dict())
    weights = copy.deepcopy(model_a.state_dict())
    a.step(*batch)
    model_b = _model()
    model_b.load_state_dict(weights)
    b = _learner(model_b, name="muon")
    b.load_state_dict(state)
    b.step(*batch)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="not Muon"):
        _learner(_model(), name="muon").optimizer.load_state_dict(_learner(_model()).optimizer.state_dict())
