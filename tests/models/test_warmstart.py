"""Warm start: a very small model trained for a few steps into a temporary cache, reused, loaded back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import steadyrl.models.warmstart as warmstart_mod
from steadyrl.base.device import AutocastSpansStepsError, Placement
from steadyrl.models.load import ModelConfig, load_policy
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.models.warmstart import (
    METADATA_FILE,
    WarmStartConfig,
    demonstration_batch,
    read_warm_start_metadata,
    warm_start,
)
from steadyrl.rollout.sampler import generate
from steadyrl.tasks import ChainSumConfig, Task, build_task

ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
FEW_STEPS = WarmStartConfig(
    batch_size=8, train_problems=64, max_steps=3, eval_every=2, eval_problems=8, target_accuracy=1.0, warmup_steps=1
)


@pytest.fixture(scope="module")
def task() -> Task:
    return build_task(ChainSumConfig(eval_size=16))


def test_demonstration_batch_trains_on_completion_and_eos(task: Task) -> None:
    tok = build_char_tokenizer()
    problems = task.problems("train", 4, seed=0)
    batch = demonstration_batch(tok, task=task, problems=problems)
    for i, p in enumerate(problems):
        response = batch.response_ids[i][batch.response_mask[i]].tolist()
        assert response == [*tok(task.demonstration(p), add_special_tokens=False)["input_ids"], tok.eos_token_id]
        assert batch.prompt_ids[i][batch.prompt_mask[i]].tolist() == tok(p.prompt)["input_ids"]


def test_warm_start_lowers_the_loss_and_reports(task: Task) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0)
    batch = demonstration_batch(tok, task=task, problems=task.problems("train", 64, seed=0))
    nll_before = _nll(model, batch)
    report = warm_start(model, tok, task=task, cfg=FEW_STEPS.model_copy(update={"max_steps": 20, "eval_every": 10}),
                        seed=0, progress=False)
    assert _nll(model, batch) < nll_before
    assert report.steps == 20 and not report.reached_target
    assert [p.step for p in report.history] == [0, 10, 20]
    assert report.accuracy == report.history[-1].accuracy and report.seconds > 0


def test_stops_as_soon_as_the_target_is_reached(task: Task) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0)
    report = warm_start(model, tok, task=task, cfg=FEW_STEPS.model_copy(update={"target_accuracy": 0.0}), seed=0,
                        progress=False)
    assert report.steps == 0 and report.reached_target


def _nll(model: torch.nn.Module, batch: object) -> float:
    from steadyrl.core.masking import masked_mean
    from steadyrl.rollout.logprobs import sequence_logprobs

    with torch.no_grad():
        logp, _ = sequence_logprobs(model, batch)
    return -masked_mean(logp, batch.response_mask).item()


def test_cached_build_reuse_and_from_pretrained(task: Task, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = ModelConfig(arch=ARCH, warm_start=FEW_STEPS, cache_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="max_steps"):
        policy = load_policy(cfg, task, seed=0, progress=False)
    path = Path(policy.path)
    assert path.parent == tmp_path and path.name.startswith("chain_sum-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", METADATA_FILE):
        assert (path / name).is_file(), name
    meta = read_warm_start_metadata(path)
    assert meta["seed"] == 0 and meta["report"]["steps"] == 3 and meta["warm_start"]["max_steps"] == 3
    assert json.loads((path / METADATA_FILE).read_text())["arch"]["hidden_size"] == 16
    # The loaded model is the saved one, through the standard from_pretrained path.
    again = AutoModelForCausalLM.from_pretrained(path)
    for a, b in zip(policy.model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    r = generate(policy.model, policy.tokenizer, ["1+2="], group_size=2, max_new_tokens=3, version=0,
                 generator=torch.Generator().manual_seed(0))
    assert r.response_ids.shape[0] == 2
    # Reuse: a second load trains nothing.
    monkeypatch.setattr(warmstart_mod, "warm_start", _must_not_train)
    assert load_policy(cfg, task, seed=0, progress=False).path == str(path)
    # A different seed is a different entry; an interrupted build leaves no entry behind.
    with pytest.raises(KeyboardInterrupt):
        load_policy(cfg, task, seed=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [path.name]


def _must_not_train(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt  # stands for a build interrupted mid-training


def test_a_bf16_mixed_warm_start_trains_each_step_on_the_current_weights(
    task: Task, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``bf16-mixed`` each forward gets its own autocast region (``autocast=``), so the held-out NLL follows the
    fp32 run's. The rule can fail: one region around the whole warm start (the refusal switched off here), where
    autocast keeps the first cast of every weight until the region closes, ends well above it."""
    arch = TinyArchConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=64)
    cfg = WarmStartConfig(batch_size=32, train_problems=2048, max_steps=30, eval_every=1000, eval_problems=8,
                          warmup_steps=5, target_accuracy=1.0)  # fmt: skip
    tok = build_char_tokenizer()
    held = demonstration_batch(tok, task=task, problems=task.problems("eval", 16, seed=0))

    def trained_nll(precision: str, *, one_outer_region: bool = False) -> float:
        placement = Placement.from_names("cpu", precision)
        model = placement.place(build_tiny_model(arch, tokenizer=tok, seed=0))
        if one_outer_region:
            with monkeypatch.context() as m, placement.autocast():
                m.setattr(warmstart_mod, "refuse_outer_autocast", lambda *args: None)
                warm_start(model, tok, task=task, cfg=cfg, seed=0, progress=False)
        else:
            warm_start(model, tok, task=task, cfg=cfg, seed=0, progress=False, autocast=placement.autocast)
        return _nll(model, held)

    fp32, bf16 = trained_nll("fp32"), trained_nll("bf16-mixed")
    assert fp32 < 3.0  # it learned (4.6 at initialization)
    assert bf16 == pytest.approx(fp32, rel=0.01)
    assert trained_nll("bf16-mixed", one_outer_region=True) > 1.05 * fp32


def test_a_warm_start_inside_an_autocast_region_is_refused(task: Task) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(AutocastSpansStepsError, match="autocast="):
        warm_start(model, tok, task=task, cfg=FEW_STEPS, seed=0, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing trained
