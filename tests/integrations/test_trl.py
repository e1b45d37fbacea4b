"""The TRL adapter against the real TRL 1.16.0 ``GRPOTrainer``, on a tiny local Llama and a character tokenizer, CPU.

(1) on one real TRL micro-batch, with a simulated stale sampler (μ and π_prox injected the way TRL hands them over
    from vLLM), the adapter's loss equals ``steadyrl.compute_loss`` on a batch built here independently (rewards
    recomputed from the decoded completions, groups from the prompt rows) to 1e-6;
(2) a few real ``GRPOTrainer`` steps: finite loss, steadyrl metrics in TRL's log history, the ESS step size scaling
    the lr of its step and restoring it, GAC logging its cosine;
(3) refusals with messages naming the method or the GRPOConfig field; ``import steadyrl`` imports no TRL.
No download: the model and tokenizer are built here and saved with ``save_pretrained``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl", reason="the TRL adapter tests need trl==1.16.0 (requirements.lock)")
datasets = pytest.importorskip("datasets", reason="TRL's trainer needs datasets")

from steadyrl import compute_loss, resolve_method  # noqa: E402
from steadyrl.integrations import trl as strl  # noqa: E402
from steadyrl.methods import PRESETS  # noqa: E402
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model  # noqa: E402
from steadyrl.models.tokenizer import build_char_tokenizer  # noqa: E402
from steadyrl.rollout.logprobs import sequence_logprobs  # noqa: E402
from steadyrl.rollout.rollouts import TokenBatch  # noqa: E402
from steadyrl.train.grad_norms import per_trajectory_grad_sq_norms  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' own deprecations inside TRL

PROMPTS = ["1+1=", "22+3=", "4+4=", "5+1111="]  # distinct, different lengths (left padding)
G = 4
TEMPERATURE = 0.9
ARCH = TinyArchConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def digits_reward(completions: list[str], **_: Any) -> list[float]:
    """A reward that varies across a random model's completions: the number of digits."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = build_char_tokenizer()
    path = tmp_path_factory.mktemp("trl-model")
    build_tiny_model(ARCH, tokenizer=tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_trainer(
    model_dir: Path, tmp_path: Path, *, method: str = "grpo", cls: type = strl.GRPOTrainer, model: Any = None,
    adapter: dict[str, Any] | None = None, **config: Any,
) -> strl.GRPOTrainer:  # fmt: skip
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    base = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=G, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
        temperature=TEMPERATURE, learning_rate=1e-3, seed=0,
    )  # fmt: skip
    args = trl.GRPOConfig(**{**base, **config})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return cls(
            method=method, model=model if model is not None else str(model_dir), reward_funcs=digits_reward,
            args=args, train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=build_char_tokenizer(), **(adapter or {}),
        )  # fmt: skip


def trl_logp(trainer: strl.GRPOTrainer, inputs: dict[str, Any]) -> torch.Tensor:
    """π_θ's log-probs through TRL's own forward (the tensor the adapter's loss differentiates)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, inputs["completion_ids"].size(1))
    return logp


def one_micro_batch(trainer: strl.GRPOTrainer) -> dict[str, Any]:
    """A real TRL micro-batch, with a stale sampler injected: π_prox = logp0 + δ₁, μ = logp0 + δ₂ (as from vLLM)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this test does not run
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        logp0 = trl_logp(trainer, inputs)
    g = torch.Generator().manual_seed(1)
    m = inputs["completion_mask"].to(logp0.dtype)
    inputs["old_per_token_logps"] = logp0 + 0.2 * torch.randn(logp0.shape, generator=g, dtype=logp0.dtype) * m
    inputs["sampling_per_token_logps"] = logp0 + 0.5 * torch.randn(logp0.shape, generator=g, dtype=logp0.dtype) * m
    return inputs


def reference_batch(trainer: strl.GRPOTrainer, inputs: dict[str, Any], logp: torch.Tensor) -> dict[str, Any]:
    """The steadyrl batch built here from TRL's tensors, without the adapter's helpers."""
    tok = trainer.processing_class
    mask = inputs["completion_mask"].bool()
    ids = inputs["completion_ids"]
    texts = [tok.decode(row[m], skip_special_tokens=True) for row, m in zip(ids, mask, strict=True)]
    rows = [tuple(r.tolist()) for r in inputs["prompt_ids"]]
    first = {r: i for i, r in reversed(list(enumerate(rows)))}
    order = {r: k for k, r in enumerate(sorted(set(rows), key=first.__getitem__))}
    B, T = logp.shape
    return {
        "logp": logp,
        "behav_logp": inputs["sampling_per_token_logps"],
        "prox_logp": inputs["old_per_token_logps"],
        "mask": mask,
        "rewards": torch.tensor(digits_reward(texts), dtype=logp.dtype),
        "group_ids": torch.tensor([order[r] for r in rows]),
        "versions": torch.zeros(B, T, dtype=torch.long),
        "learner_version": 0,
    }


# ---------------------------------------------------------------------------------------------------- (1) same loss
@pytest.mark.parametrize("method", ["grpo", "seq_tis", "token_tis", "m2po", "gmc_grpo", "icepop+gac", "vcpo", "oapl"])
def test_loss_equals_compute_loss(model_dir: Path, tmp_path: Path, method: str) -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0).double()  # float64 weights: OPOB's norms to ~1e-15
    trainer = make_trainer(model_dir, tmp_path, method=method, model=model)
    inputs = one_micro_batch(trainer)
    loss = trainer.compute_loss(trainer.model, inputs)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(strl.METRIC_PREFIX)}

    with torch.no_grad():
        logp = trl_logp(trainer, inputs)
    batch = reference_batch(trainer, inputs, logp)
    assert torch.equal(batch["rewards"], inputs["steadyrl_rewards"].to(logp.dtype)), "rewards differ from TRL's"
    if "grad_sq_norms" in strl.required_inputs(resolve_method(method)):
        tb = TokenBatch(inputs["prompt_ids"], inputs["prompt_mask"].bool(), inputs["completion_ids"], batch["mask"])
        batch["grad_sq_norms"] = per_trajectory_grad_sq_norms(model, tb, method="naive", temperature=TEMPERATURE)
    ref_loss, ref_metrics = compute_loss(method, batch)

    loss = loss.detach()
    assert math.isfinite(float(loss))
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6, rel=0)
    assert float(ref_metrics["is/ess_ratio"]) < 0.999, "the injected staleness must show (else the test is vacuous)"
    for key in ("is/ess_ratio", "kl/k3", "is/weight_max", "loss/policy"):
        assert logged[strl.METRIC_PREFIX + key] == pytest.approx(float(ref_metrics[key]), abs=1e-6)


@pytest.mark.filterwarnings("ignore:method 'grpo' has step-level controllers")
@pytest.mark.parametrize("config", [{"entropy_coef": 0.02}, {"entropy_coef": 0.02, "use_adaptive_entropy": True,
                                                            "entropy_target": 100.0}])  # fmt: skip
def test_trl_entropy_options_become_the_methods_bonus(model_dir: Path, tmp_path: Path, config: dict) -> None:
    """GRPOConfig's entropy_coef (and adaptive control) map onto the method: the adapter's loss is compute_loss with
    TRL's entropies (token mean over the completion mask) and the coefficient the controller applies."""
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0).double()
    trainer = make_trainer(model_dir, tmp_path, method="grpo", model=model, **config)
    spec = trainer.steadyrl_method
    assert (spec.entropy.coef, spec.entropy.agg, spec.entropy.mask) == (0.02, "token-mean", "input")
    adaptive = config.get("use_adaptive_entropy", False)
    assert [c.type for c in spec.controllers] == (["adaptive_entropy"] if adaptive else [])
    inputs = one_micro_batch(trainer)
    loss = trainer.compute_loss(trainer.model, inputs).detach()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith(strl.METRIC_PREFIX)}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, att, inputs["completion_ids"].size(1), compute_entropy=True
        )
    batch = {**reference_batch(trainer, inputs, logp), "entropy": entropy}
    if adaptive:
        batch["entropy_coef"] = 0.0  # the first step applies nothing (TRL: the last entropy starts at +inf)
    method = "grpo+adaptive_entropy" if adaptive else "grpo"
    ref_loss, ref_metrics = compute_loss(method, batch, overrides={"entropy.coef": 0.02, "entropy.agg": "token-mean"})
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-9, rel=0)
    m = inputs["completion_mask"].bool()
    # TRL's log holds float32 values
    assert logged["steadyrl/entropy/mean"] == pytest.approx(float(entropy[m].mean()), rel=1e-6)
    assert logged["steadyrl/entropy/coef"] == pytest.approx(0.0 if adaptive else 0.02, abs=1e-9)  # adaptive: 0 first
    assert float(ref_metrics["loss/entropy_bonus"]) == pytest.approx(logged["steadyrl/loss/entropy_bonus"], rel=1e-6)


def test_adaptive_entropy_state_goes_through_trls_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    """use_adaptive_entropy: c moves once per optimizer step (target above the entropy: +δ), TRL's own
    entropy_ctrl_state.json holds the controller's state, and a run resumed from it applies the saved c."""
    import json

    # two micro-batches per optimizer step (TRL's advantages then)
    config = {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0, "entropy_coef_delta": 0.005,
              "save_strategy": "steps", "save_steps": 2, "gradient_accumulation_steps": 2,
              "per_device_train_batch_size": 4}  # fmt: skip
    trainer = make_trainer(model_dir, tmp_path, adapter={"advantages": "trl"}, **config)
    trainer.train()
    rows = _history(trainer)
    assert [r["steadyrl/entropy/adaptive_coef"] for r in rows] == pytest.approx([0.015, 0.02], abs=1e-12)
    assert [r["steadyrl/entropy/coef"] for r in rows] == pytest.approx([0.0, 0.015], abs=1e-8)  # logged in float32
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "entropy_ctrl_state.json").read_text())
    assert state["entropy_coef"] == pytest.approx(0.02, abs=1e-12) and state["last_world_entropy"] < 100.0

    resumed = make_trainer(model_dir, tmp_path, adapter={"advantages": "trl"}, **{**config, "max_steps": 3})
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    last = _history(resumed)[-1]
    assert last["steadyrl/entropy/coef"] == pytest.approx(0.02, abs=1e-8)  # the restored c, applied
    assert last["steadyrl/entropy/adaptive_coef"] == pytest.approx(0.025, abs=1e-12)


def test_trl_logps_match_steadyrl_forward(model_dir: Path, tmp_path: Path) -> None:
    """TRL's log-prob forward scores the same tokens at the same temperature as steadyrl's learner (alignment)."""
    trainer = make_trainer(model_dir, tmp_path)
    inputs = one_micro_batch(trainer)
    with torch.no_grad():
        logp = trl_logp(trainer, inputs)
        m = inputs["completion_mask"].bool()
        tb = TokenBatch(inputs["prompt_ids"], inputs["prompt_mask"].bool(), inputs["completion_ids"], m)
        ours = sequence_logprobs(trainer.model, tb, temperature=TEMPERATURE).logp
    assert (logp - ours)[m].abs().max() < 1e-5


def test_trl_advantages_mode_is_given_advantage(model_dir: Path, tmp_path: Path) -> None:
    """advantages='trl' passes TRL's advantages as advantage.type=given; here with micro-batches of split groups."""
    trainer = make_trainer(
        model_dir, tmp_path, method="seq_tis", adapter={"advantages": "trl"}, steps_per_generation=2,
        per_device_train_batch_size=4,
    )  # fmt: skip
    assert trainer.steadyrl_method.advantage.type == "given"
    inputs = one_micro_batch(trainer)
    loss = trainer.compute_loss(trainer.model, inputs).detach()
    with torch.no_grad():
        logp = trl_logp(trainer, inputs)
    batch = {k: v for k, v in reference_batch(trainer, inputs, logp).items() if k not in ("rewards", "group_ids")}
    batch["advantages"] = inputs["advantages"]
    ref = compute_loss(resolve_method("seq_tis", {"advantage.type": "given"}), batch).loss
    assert float(loss) == pytest.approx(float(ref), abs=1e-6, rel=0)


def test_unscorable_rewards_take_their_group_mean() -> None:
    nan = math.nan
    rpf = torch.tensor([[1.0, 2.0], [nan, nan], [3.0, nan], [0.0, 1.0], [nan, nan], [nan, nan]], dtype=torch.float64)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    out = strl.group_filled_rewards(rpf, w, 3)
    # by hand: group 0 scorable rewards 1 + 1 = 2 and 3 → unscorable row gets 2.5; group 1: 0.5, then no scorable → 0.5
    torch.testing.assert_close(out, torch.tensor([2.0, 2.5, 3.0, 0.5, 0.5, 0.5], dtype=torch.float64))


# ---------------------------------------------------------------------------------------------------- (2) training
def _history(trainer: strl.GRPOTrainer) -> list[dict[str, float]]:
    return [row for row in trainer.state.log_history if "loss" in row]


def test_trains_end_to_end_with_stale_batches(model_dir: Path, tmp_path: Path) -> None:
    """seq_tis, num_iterations=2: the second step reuses the batch (lag 1, π_prox = the generating policy)."""
    trainer = make_trainer(model_dir, tmp_path, method="seq_tis", num_iterations=2, per_device_train_batch_size=4)
    trainer.train()
    rows = _history(trainer)
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["loss"])
        for key in ("is/ess_ratio", "kl/k3", "is/weight_mean", "seq_tis/weight_max", "adv/std", "lag/mean"):
            assert strl.METRIC_PREFIX + key in row, key
    assert [row["steadyrl/lag/mean"] for row in rows] == [0.0, 1.0]
    assert rows[1]["steadyrl/loss/ratio_max"] != 1.0, "the reused batch must see π_θ ≠ π_prox"


class _StaleSampler(strl.GRPOTrainer):
    """Simulates a sampler that lags the trainer (what vLLM hands TRL): μ = π_prox + noise on every batch."""

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        with torch.no_grad():
            old = trl_logp(self, out)
        m = out["completion_mask"].to(old.dtype)
        g = torch.Generator().manual_seed(self.state.global_step)
        out["old_per_token_logps"] = old
        out["sampling_per_token_logps"] = old + 0.5 * torch.randn(old.shape, generator=g, dtype=old.dtype) * m
        return out


def test_ess_step_size_scales_and_restores_the_lr(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path, method="vcpo", cls=_StaleSampler, max_steps=3)
    trainer.train()
    rows = _history(trainer)
    assert len(rows) == 3
    for row in rows:
        assert math.isfinite(row["loss"])
        scale = row["steadyrl/vcpo/ess_scale"]
        assert 0.0 < scale < 1.0
        # the step ran at the scheduled lr (TRL logs it after the step) times the ESS scale
        assert row["steadyrl/lr"] == pytest.approx(row["learning_rate"] * scale, rel=1e-6)
        assert "steadyrl/adv/opob_ess_frac" in row
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0], rel=1e-12)


def test_gac_runs_as_a_step_hook(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path, method="gac", num_iterations=2, max_steps=3)
    trainer.train()
    rows = _history(trainer)
    assert all(math.isfinite(row["loss"]) for row in rows)
    assert rows[0]["steadyrl/gac/cos"] == 0.0  # no previous gradient at the first step
    assert all(row["steadyrl/gac/skipped"] in (0.0, 1.0) for row in rows)
    assert any(row["steadyrl/gac/cos"] != 0.0 for row in rows[1:])


HOSTED = [p.name for p in PRESETS if strl.supported(p.name)[0]]


@pytest.mark.parametrize("method", HOSTED)
def test_every_hosted_preset_trains(model_dir: Path, tmp_path: Path, method: str) -> None:
    """The table of docs/integrations.md: each preset it marks as working takes two real steps (one reusing a batch)."""
    beta = {"beta": 0.01} if "ref_logp" in strl.required_inputs(resolve_method(method)) else {}
    trainer = make_trainer(
        model_dir, tmp_path, method=method, num_iterations=2, per_device_train_batch_size=4, **beta
    )  # fmt: skip
    trainer.train()
    rows = _history(trainer)
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
    assert all("steadyrl/is/ess_ratio" in row and "steadyrl/loss/total" in row for row in rows)


# ---------------------------------------------------------------------------------------------------- (3) refusals
@pytest.mark.parametrize(
    ("method", "adapter", "config", "match"),
    [
        ("estr", {}, {}, "needs 'behav_entropy'"),
        ("otb", {}, {}, "needs 'sum_p2'"),
        ("copc", {}, {}, "needs 'values'"),
        ("kl_in_loss", {}, {}, "GRPOConfig.beta"),
        ("grpo", {}, {"top_entropy_quantile": 0.5}, "GRPOConfig.top_entropy_quantile"),
        ("grpo", {}, {"steps_per_generation": 2, "per_device_train_batch_size": 4}, "steps_per_generation must be 1"),
        ("vcpo", {"advantages": "trl"}, {}, "advantage.type='opob'"),
        ("gmc_grpo", {"advantages": "trl"}, {}, "couples the completions"),
        ("grpo", {"advantages": "verl"}, {}, "advantages='verl' is not one of"),
        ("grpo", {"grad_norms": "exact"}, {}, "grad_norms='exact' is not one of"),
        ("grpo+adaptive_entropy", {}, {"entropy_coef": 0.01}, "set it in one place"),
        ("grpo", {"method_overrides": {"entropy.coef": 0.1}}, {"use_adaptive_entropy": True}, "set it in one place"),
    ],
)
def test_refusals_name_the_cause(
    model_dir: Path, tmp_path: Path, method: str, adapter: dict, config: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_trainer(model_dir, tmp_path, method=method, adapter=adapter, **config)


def test_supported_table() -> None:
    assert strl.supported("seq_tis") == (True, "")
    assert not strl.supported("estr")[0]
    assert strl.supported("grpo", advantages="trl")[0] and not strl.supported("vcpo", advantages="trl")[0]


def test_import_steadyrl_imports_no_trl() -> None:
    code = "import sys, steadyrl, steadyrl.integrations; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_trl_is_a_one_line_error() -> None:
    code = (
        "import sys; sys.modules['trl'] = None\n"
        "try:\n    import steadyrl.integrations.trl\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "steadyrl.integrations.trl needs TRL: pip install 'steadyrl[trl]' (tested with trl==1.16.0)"


def test_per_trajectory_norms_refuse_sharded_weights() -> None:
    """OPOB/VCPO's norms run on the unwrapped model of each process: under FSDP or ZeRO-3 that model holds a shard,
    so the trainer refuses them with the fix named; ZeRO-2 (whole weights on every process) is allowed."""
    from types import SimpleNamespace

    def trainer(method: str, **flags: Any) -> SimpleNamespace:
        spec = resolve_method(method)
        zero = flags.pop("zero_stage", None)
        accel = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero)))
        return SimpleNamespace(
            args=SimpleNamespace(beta=0.04), steadyrl_method=spec, steadyrl_needs=strl.required_inputs(spec),
            accelerator=accel, steadyrl_advantages="trl", **flags,
        )  # fmt: skip

    assert strl.sharding_reason(trainer("vcpo", is_fsdp_enabled=True)) == "FSDP"
    assert strl.sharding_reason(trainer("vcpo", is_deepspeed_enabled=True, zero_stage=3)) == "DeepSpeed ZeRO-3"
    assert strl.sharding_reason(trainer("vcpo", is_deepspeed_enabled=True, zero_stage=2)) is None
    for flags in ({"is_fsdp_enabled": True}, {"is_deepspeed_enabled": True, "zero_stage": 3}):
        with pytest.raises(ValueError, match=r"per-trajectory gradient norms.*DDP or ZeRO-1/2"):
            strl.GRPOTrainer._check_config(trainer("vcpo", **flags))
