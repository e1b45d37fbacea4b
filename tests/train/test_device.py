"""Device and precision (steadyrl.base.device): where the learner runs, and that every log-prob in a ratio is fp32.

bf16 autocast runs on the CPU, so every precision is tested here; a CUDA device is tested only where one exists.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch

from steadyrl.base.device import AutocastSpansStepsError, DeviceError, Float32OutputLinear, Placement, resolve_device
from steadyrl.base.seeding import generator
from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import OptimConfig, TrainConfig
from steadyrl.control import build_controllers
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train import learner as learner_module
from steadyrl.train.entry import main
from steadyrl.train.learner import Learner
from steadyrl.train.metrics import read_metrics

ARCH = TinyArchConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
PROMPTS = ["1+2=", "13+4-5=", "7-3=", "22+9="]


def _model() -> torch.nn.Module:
    return build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)


def test_auto_is_the_cpu_without_a_gpu_and_bad_devices_are_refused() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="not one of auto, cpu, cuda, cuda:N"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA GPU is visible"):
            resolve_device("cuda:0")
    with pytest.raises(ConfigError, match="device"):
        load_config(TrainConfig, overrides=["device=tpu"])
    with pytest.raises(ConfigError, match="precision"):
        load_config(TrainConfig, overrides=["precision=fp16"])


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_placed_models_compute_fp32_logits_and_log_probs(precision: str) -> None:
    placement = Placement.from_names("cpu", precision)
    model = placement.place(_model())
    assert {p.dtype for p in model.parameters()} == {placement.param_dtype}
    assert type(model.lm_head) is Float32OutputLinear
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying survives the swap
    seen: dict[str, torch.dtype] = {}
    hooks = [
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.update(trunk=o.dtype)),
        model.lm_head.register_forward_hook(lambda m, i, o: seen.update(logits=o.dtype)),
    ]
    tok = build_char_tokenizer()
    with torch.no_grad(), placement.autocast():
        rollouts = generate(model, tok, PROMPTS, group_size=2, max_new_tokens=5,
                            generator=generator(0, device=placement.device), version=0)  # fmt: skip
        logp = sequence_logprobs(model, rollouts).logp
    for h in hooks:
        h.remove()
    assert seen["trunk"] == (torch.float32 if precision == "fp32" else torch.bfloat16)
    assert seen["logits"] == torch.float32
    assert rollouts.behav_logp.dtype == torch.float32 and logp.dtype == torch.float32
    if precision == "fp32":  # the same weights, one pass against the KV-cache decode: equal to float32 rounding
        m = rollouts.response_mask
        assert torch.allclose(logp[m], rollouts.behav_logp[m], atol=1e-5)


def test_a_placed_model_pickles_and_copies_with_its_fp32_output_layer() -> None:
    model = Placement.from_names("cpu", "bf16-mixed").place(_model())
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(other.lm_head) is Float32OutputLinear
        assert other.state_dict().keys() == model.state_dict().keys()


def _bf16_model_and_rollouts(placement: Placement) -> tuple[torch.nn.Module, Rollouts]:
    """The tiny model placed under ``placement`` and 4 samples of each prompt drawn from it."""
    model = placement.place(_model())
    with torch.no_grad(), placement.autocast():
        rollouts = generate(model, build_char_tokenizer(), PROMPTS, group_size=4, max_new_tokens=5,
                            generator=generator(0, device=placement.device), version=0)  # fmt: skip
    return model, rollouts


@pytest.mark.parametrize("method", ["seq_tis", "vcpo", "copc"])
def test_the_learner_sees_fp32_log_probs_under_bf16_mixed(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log-probs handed to the loss (π_θ, π_prox, μ) are float32; the step trains (weights move, finite)."""
    placement = Placement.from_names("cpu", "bf16-mixed")
    model, rollouts = _bf16_model_and_rollouts(placement)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS))
    seen: list[dict[str, torch.dtype]] = []
    real = learner_module.compute_loss

    def spy(spec, batch, **kwargs):  # type: ignore[no-untyped-def]
        seen.append({k: batch[k].dtype for k in ("logp", "behav_logp", "prox_logp") if k in batch})
        return real(spec, batch, **kwargs)

    monkeypatch.setattr(learner_module, "compute_loss", spy)
    spec = resolve_method(method)
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2,
                      optim=OptimConfig(updates_per_batch=2), placement=placement, log=lambda _: None)  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    out = learner.step(rollouts, rewards)
    assert out.skipped == 0 and out.applied == 2
    assert seen and all(d == {k: torch.float32 for k in d} for d in seen) and "prox_logp" in seen[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # master weights stay fp32
    assert all(s["exp_avg"].dtype == torch.float32 for s in learner.optimizer.state.values())


def test_bf16_mixed_trains_end_to_end_and_logs_the_lag0_mismatch(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    args = [*tiny_overrides, "precision=bf16-mixed", "device=cpu", "runtime.lag.k=0", "steps=6", "eval.every=3",
            "checkpoint.every=0", "optim.microbatch_tokens=64", f"out_dir={out}"]  # fmt: skip
    assert main(args) == 0
    records = read_metrics(out / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 6 and all(r["train/skipped"] == 0 for r in steps)
    assert all(r["train/microbatches"] > 1 for r in steps)
    # the bf16 KV-cache decode against the learner's bf16 recompute of the same weights: small, logged, not zero lag
    assert all(abs(r["mismatch/kl_k3"]) < 0.05 and r["mismatch/ess_ratio"] > 0.9 for r in steps)
    assert all(0 <= r["mismatch/max_abs_dlogp"] < 0.5 for r in steps)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_learner_runs_on_the_gpu(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "cuda"
    assert main([*tiny_overrides, "device=cuda", "precision=bf16-mixed", "steps=3", "runtime.lag.k=1",
                 f"out_dir={out}"]) == 0
    assert len([r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]) == 3


def test_a_prompt_plus_budget_past_the_models_positions_is_one_line_before_step_0(
    tiny_overrides: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny model has 512 positions; chain_sum prompts are ~6 characters: a 510-token budget cannot fit."""
    out = tmp_path / "long"
    code = main([*tiny_overrides, "rollout.max_new_tokens=510", "steps=1", f"out_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "exceeds the model's max_position_embeddings (512)" in err and "rollout.max_new_tokens" in err
    assert not (out / "metrics.jsonl").exists()


def test_an_unavailable_gpu_is_one_line(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    assert main([*tiny_overrides, "device=cuda", "steps=1", f"out_dir={tmp_path / 'gpu'}"]) == 2
    assert "no CUDA GPU is visible to PyTorch here; use device=cpu or auto" in capsys.readouterr().err


def test_gpu_runtime_sets_its_device_the_cublas_workspace_and_full_fp32_matmuls(monkeypatch) -> None:
    """A run on cuda:1 makes cuda:1 the current device, sets the cuBLAS workspace deterministic GEMMs need (when the
    environment has none) and keeps float32 matmuls at full precision; everything is restored afterwards."""
    import os

    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")  # as a user's TF32 setting
    precisions: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", precisions.append)
    before = torch.are_deterministic_algorithms_enabled()
    with Placement(torch.device("cuda:1")).runtime(deterministic=True):
        assert calls == [torch.device("cuda:1")]
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert precisions == ["highest"] and torch.are_deterministic_algorithms_enabled()
    assert precisions == ["highest", "high"] and torch.are_deterministic_algorithms_enabled() == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting is kept
    with Placement(torch.device("cuda:0")).runtime(deterministic=True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_device_cuda_without_an_index_names_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``device=cuda`` (and ``auto`` on a GPU machine) resolves to ``cuda:<current>``: ``torch.cuda.set_device``
    refuses a device without an index (``steadyrl train device=cuda`` would stop there), and tensors
    on a GPU always carry one, so ``tensor.device == placement.device`` holds."""

    def set_device(device: torch.device | int) -> None:  # torch's own check, without a GPU
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        calls.append(device)

    calls: list[torch.device | int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    assert resolve_device("cuda") == torch.device("cuda:1") == resolve_device("auto")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    placement = Placement.from_names("cuda", "bf16-mixed")
    with placement.runtime(deterministic=False):
        pass
    assert calls == [torch.device("cuda:1")]


def test_gpu_slots_spread_children_and_share_with_a_warning(monkeypatch) -> None:
    from steadyrl.base.device import GpuSlots

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # the parent's own GPUs: children get those ids
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    slots = GpuSlots()
    assert [slots.acquire(), slots.acquire()] == ["3", "5"]
    with pytest.warns(UserWarning, match="more parallel runs than GPUs"):
        assert slots.acquire() == "3"
    slots.release("5")
    assert slots.acquire() == "5"
    assert GpuSlots.env({"A": "1"}, "5") == {"A": "1", "CUDA_VISIBLE_DEVICES": "5"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert GpuSlots().acquire() is None


def test_concurrent_samplers_go_where_runtime_sampler_device_says(monkeypatch) -> None:
    from steadyrl.base.device import sampler_placement

    learner = Placement(torch.device("cpu"), "bf16-mixed")
    assert sampler_placement("cpu", learner=learner) == Placement(torch.device("cpu"), "fp32")  # the old default
    assert sampler_placement("learner", learner=learner) is learner
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert sampler_placement("cuda:1", learner=learner) == Placement(torch.device("cuda:1"), "bf16-mixed")
    with pytest.raises(DeviceError, match="2 GPU"):
        sampler_placement("cuda:2", learner=learner)


def test_a_learner_step_inside_an_autocast_region_is_refused() -> None:
    """Autocast keeps its bf16 copy of each weight until the outermost region closes: a region around the learner's
    steps would run every update after the first on the first update's weights. The step refuses, before any update."""
    placement = Placement.from_names("cpu", "bf16-mixed")
    model, rollouts = _bf16_model_and_rollouts(placement)
    spec = resolve_method("seq_tis")
    learner = Learner(model=model, method=spec, controllers=build_controllers(spec), lr=1e-2, optim=OptimConfig(),
                      placement=placement, log=lambda _: None)  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    with placement.autocast(), pytest.raises(AutocastSpansStepsError, match=r"Learner\.step"):
        learner.step(rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert learner.step(rollouts, torch.tensor([1.0, 0.0, 0.0, 1.0] * len(PROMPTS))).applied == 1  # outside: trains


def test_the_autocast_check_passes_a_device_autocast_does_not_know() -> None:
    from steadyrl.base.device import refuse_outer_autocast

    refuse_outer_autocast(torch.device("meta"), "Learner.step", "")  # no region can be open on meta: no error
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AutocastSpansStepsError):
        refuse_outer_autocast(torch.device("cpu"), "Learner.step", "")
