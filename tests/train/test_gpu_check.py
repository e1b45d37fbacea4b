"""``benchmarks/gpu_check.py`` at its CPU smoke size (``GPU_CHECK_DEVICE=cpu``): warm start, ``steadyrl train`` in
bf16-mixed at lag 0 with micro-batches, every PASS/FAIL item, and the printed and JSON fields (docs/scale.md, "GPU
check"); a deliberately broken resume prints FAIL."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from steadyrl.models import build_char_tokenizer
from tests.benchmark_scripts import load_benchmark

#: Fields that hold a finite number in every run (the GPU-only ones are checked apart).
NUMERIC = (
    "parameters", "warm_start/steps", "warm_start/seconds", "warm_start/accuracy", "rl/seconds", "rl/steps",
    "rl/learner_tokens_per_s", "rl/sampler_tokens_per_s", "rl/step_s_mean", "rl/microbatches_mean",
    "rl/mismatch_kl_k3_mean", "rl/mismatch_kl_k3_max", "rl/mismatch_max_abs_dlogp_mean",
    "rl/mismatch_max_abs_dlogp_max", "rl/eval_acc_first", "rl/eval_acc_last", "wall_seconds",
    "rl/response_len_mean", "rl/truncated_mean",
)  # fmt: skip


def _load_script() -> ModuleType:
    return load_benchmark("gpu_check")


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    return _load_script()


@pytest.fixture(scope="module")
def smoke(gpu_check: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """One CPU smoke run of the whole check: (exit status, what it printed, its folder)."""
    import contextlib
    import io
    import os

    tmp_path = tmp_path_factory.mktemp("gpu_check")
    os.environ["OUT"] = str(tmp_path / "out")  # the device machine's convention: $OUT/gpu_check.json
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            status = gpu_check.main(["--device", "cpu", "--size", "tiny", "--work-dir", str(tmp_path / "work")])
    finally:
        del os.environ["OUT"]
    return status, printed.getvalue(), tmp_path


def test_cpu_smoke_run_prints_and_writes_every_field(gpu_check: ModuleType, smoke: tuple[int, str, Path]) -> None:
    status, printed, tmp_path = smoke
    assert status == 0, printed
    fields = json.loads((tmp_path / "out" / gpu_check.JSON_NAME).read_text())
    for key in NUMERIC:
        assert isinstance(fields[key], (int, float)) and math.isfinite(fields[key]), (key, fields[key])
        assert f"  {key} " in printed, key
    size = gpu_check.SIZES["tiny"]
    assert fields["rl/exit_status"] == 0 and fields["rl/steps"] == size.steps
    assert fields["device"] == "cpu" and fields["precision"] == "bf16-mixed"
    assert fields["rl/peak_memory_gib"] is None and fields["device_name"].startswith("cpu")
    assert fields["parameters"] == 23_840  # hidden 32, 2 layers, MLP 64, 100 tied embeddings
    assert fields["warm_start/history"].split()[0].startswith("0:")  # the accuracy before the first step, then each
    # the budget is below the batch's tokens, so the learner micro-batched; bf16 at lag 0 logs mismatch/* every step
    assert fields["rl/microbatches_mean"] > 1
    assert fields["rl/mismatch_steps"] == size.steps
    assert fields["rl/mismatch_kl_k3_max"] >= fields["rl/mismatch_kl_k3_mean"] >= 0
    assert fields["rl/learner_tokens_per_s"] > 0 and fields["rl/sampler_tokens_per_s"] > 0
    assert (tmp_path / "work" / "model" / "config.json").is_file()
    assert set(fields["items"]) == set(gpu_check.ITEMS)
    for name in gpu_check.ITEMS:
        assert fields["items"][name]["passed"], (name, fields["items"][name])
        assert f"PASS  {name}: " in printed
    assert f"gpu_check: PASS ({len(gpu_check.ITEMS)}/{len(gpu_check.ITEMS)} items passed)" in printed


def test_a_broken_resume_prints_fail(
    gpu_check: ModuleType, smoke: tuple[int, str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The resume item's rule can fail: a learner that forgets AdamW's moments on load continues differently."""
    from steadyrl.train.learner import Learner

    restore = Learner.load_state_dict

    def forget_adam(self: Learner, state: dict) -> None:
        restore(self, {**state, "optimizer": self.optimizer.state_dict()})  # the fresh optimizer, not the saved one

    monkeypatch.setattr(Learner, "load_state_dict", forget_adam)
    model_dir = smoke[2] / "work" / "model"
    result = gpu_check.item_resume(gpu_check.SIZES["tiny"], device="cpu", model_dir=model_dir, work=tmp_path)
    assert not result.passed, result.detail
    assert result.line().startswith("  FAIL  resume: max relative difference")
    assert "final weights and learner state" in result.detail


def test_gpu_size_is_85m_parameters(gpu_check: ModuleType) -> None:
    """The GPU size's count from the Llama formula (no model is built): per layer 4·d² (attention) + 3·d·m (SwiGLU)
    + 2·d (RMSNorms), a final RMSNorm, and the vocabulary's tied embedding."""
    arch = gpu_check.SIZES["gpu"].arch
    d, L, m = arch.hidden_size, arch.num_layers, arch.intermediate_size
    vocab = len(build_char_tokenizer())
    count = L * (4 * d * d + 3 * d * m + 2 * d) + d + vocab * d
    assert (d, L, m, vocab) == (768, 12, 2048, 100) and count == 85_030_656
    assert 50e6 <= count <= 100e6


def test_gpu_size_microbatches_the_batch(gpu_check: ModuleType) -> None:
    """The micro-batch budget is below the batch's padded tokens (rows × at least the 12 sampled tokens)."""
    size = gpu_check.SIZES["gpu"]
    assert size.microbatch_tokens < size.prompts_per_step * size.group_size * 12
    assert size.steps == 30 and size.prompts_per_step == 64 and size.group_size == 8 and size.eval_every == 10


def test_learner_flops_count_each_groups_prompt_once(gpu_check: ModuleType) -> None:
    """6 FLOPs per body parameter per position (a group's prompt once, every response position) plus the output
    layer on response positions: 6·H·V, or 8·H·V with the chunked head's recompute."""
    from types import SimpleNamespace

    from steadyrl.models import TinyArchConfig, build_tiny_model

    arch = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = build_tiny_model(arch, tokenizer=build_char_tokenizer(), seed=0)
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - head.numel()
    rollouts = SimpleNamespace(group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), prompt_ids=torch.zeros(6, 5),
                               response_ids=torch.zeros(6, 7))  # fmt: skip
    V, H = head.shape
    positions = 2 * 5 + 6 * 7
    assert gpu_check.learner_flops(model, rollouts, chunked_head=False) == 6 * body * positions + 6 * H * V * 42
    assert gpu_check.learner_flops(model, rollouts, chunked_head=True) == 6 * body * positions + 8 * H * V * 42


def test_profile_fails_when_the_flop_count_exceeds_the_peak(
    gpu_check: ModuleType, smoke: tuple[int, str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile item's rule can fail: a FLOP count of work not done (here ×1000) puts the share above 1."""
    from steadyrl.base.device import Placement

    real = gpu_check.learner_flops
    monkeypatch.setattr(gpu_check, "learner_flops", lambda *a, **k: 1000 * real(*a, **k))
    placement = Placement.from_names("cpu", gpu_check.PRECISION)
    result = gpu_check.item_profile(gpu_check.SIZES["tiny"], model_dir=smoke[2] / "work" / "model", placement=placement)
    assert not result.passed and "% of a float32 1024x1024 matmul" in result.detail, result.detail
