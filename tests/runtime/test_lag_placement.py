"""Where the lag runtime keeps its sampler and snapshots: the model's device first, a bf16 sampler under
bf16-mixed that samples bit for bit what a float32 copy under autocast samples, and no copy at all at lag 0."""

from __future__ import annotations

import copy

import pytest
import torch

from steadyrl.base.device import Float32OutputLinear, Placement
from steadyrl.config.train import RolloutConfig
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.sampler import generate
from steadyrl.runtime.lag import LagSampler, LagSchedule, SnapshotRing

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["12+7=", "3-9=", "40+2="]


@pytest.fixture
def model() -> torch.nn.Module:
    return Placement(torch.device("cpu")).place(build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0))


def _sample(model: torch.nn.Module, seed: int = 0):
    return generate(model, build_char_tokenizer(), PROMPTS, group_size=4, max_new_tokens=8,
                    generator=torch.Generator().manual_seed(seed), version=0)  # fmt: skip


def test_bf16_mixed_sampler_holds_bf16_linears_and_samples_the_same(model) -> None:
    placement = Placement(torch.device("cpu"), "bf16-mixed")
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # float32 weights, cast by autocast every step
    sampler = placement.sampler_copy(model)
    linears = [m for m in sampler.modules() if type(m) is torch.nn.Linear]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)
    head = sampler.get_output_embeddings()
    assert isinstance(head, Float32OutputLinear) and head.weight.dtype == torch.float32
    with torch.no_grad(), placement.autocast():
        a, b = _sample(reference), _sample(sampler)
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.behav_logp, b.behav_logp)
    sampler.load_state_dict(model.state_dict())  # later weight loads are cast the same way
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)


def test_lag_zero_samples_with_the_learner_model_and_copies_nothing(model, tmp_path) -> None:
    lag0 = LagSampler(model=model, tokenizer=build_char_tokenizer(), schedule=LagSchedule(kind="pipeline", lag=0),
                      sampling=RolloutConfig(max_new_tokens=8), group_size=4, seed=0,
                      snapshot_budget_bytes=1 << 30, snapshot_dir=tmp_path)  # fmt: skip
    assert lag0.shared and lag0.sampler is model
    model.train()
    lag0.publish(step=0, version=0, model=model)
    assert lag0.ring.get(0).state == {}  # no copy of the weights
    got = lag0.sample(step=0, prompts=PROMPTS)
    assert model.training and all(p.requires_grad for p in model.parameters())  # as the learner left it
    lag1 = LagSampler(model=model, tokenizer=build_char_tokenizer(), schedule=LagSchedule(kind="pipeline", lag=1),
                      sampling=RolloutConfig(max_new_tokens=8), group_size=4, seed=0)  # fmt: skip
    assert not lag1.shared and lag1.sampler is not model
    lag1.publish(step=0, version=0, model=model)
    want = lag1.sample(step=0, prompts=PROMPTS)  # step 0 of lag 1 samples the same weights, from a copy
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.behav_logp, want.behav_logp)


def test_snapshots_fill_the_device_tier_first_then_cpu(model) -> None:
    """With two device slots (``meta`` standing for a GPU), steps 0–1 are held on the device and 2–3 on the CPU; a
    freed device slot is reused by the next snapshot."""
    meta = torch.device("meta")
    ring = SnapshotRing(LagSchedule(kind="pipeline", lag=3), device=meta, device_slots=2)
    for step in range(4):
        ring.publish(step=step, version=step, model=model)
    def home(step: int) -> str:
        state = ring.get(step + 3).state  # the snapshot of `step` samples step + 3
        assert isinstance(state, dict)
        return next(iter(state.values())).device.type

    assert [home(s) for s in range(4)] == ["meta", "meta", "cpu", "cpu"]
    ring.publish(step=4, version=4, model=model)  # drops step 0: its device slot is free again
    assert home(4) == "meta"


def test_snapshot_homes_fit_the_gpu_budget(monkeypatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (11 * gib, 16 * gib))
    gpu = Placement(torch.device("cuda:0"))
    homes = gpu.snapshot_homes(copy_bytes=gib, copies=17)  # 0.25 × (11 − 3 GiB) = 2 GiB: two copies on the GPU
    assert homes.device_slots == 2 and homes.pinned
    assert gpu.snapshot_homes(copy_bytes=gib, copies=3, budget_bytes=100 * gib).device_slots == 3
    cpu = Placement(torch.device("cpu")).snapshot_homes(copy_bytes=gib, copies=17)
    assert cpu.device_slots == 0 and not cpu.pinned
