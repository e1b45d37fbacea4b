"""``steadyrl train rollout.engine=vllm`` end to end on the tiny model: it finishes, its metrics have the transformers
engine's schema plus ``mismatch/*``, and ``mismatch/*`` is the lag-free part of ``is/*`` and ``kl/*``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from steadyrl.rollout.vllm_engine import SETUP_HINT, vllm_available
from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(not vllm_available(), reason=f"vLLM is not installed here; {SETUP_HINT}")

#: Keys only the vLLM engine adds (time/mismatch_s goes to timings.jsonl with log.timings=separate).
MISMATCH_KEYS = {"mismatch/ess_ratio", "mismatch/kl_k3", "mismatch/kl_k1", "mismatch/max_abs_dlogp"}
#: One head of 32 (vLLM's CPU attention has no kernel for the head size 16 of tiny_overrides' two heads).
HEAD_32 = "model.arch.num_heads=1"


def test_train_with_vllm_has_the_transformers_schema_and_separates_mismatch_from_lag(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    common = [*tiny_overrides, HEAD_32, "steps=4", "runtime.lag.k=1", "method=seq_tis", "eval.every=2"]
    assert main([*common, f"out_dir={tmp_path / 'hf'}"]) == 0
    assert main([*common, f"out_dir={tmp_path / 'vllm'}", "rollout.engine=vllm"]) == 0
    hf, vl = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("hf", "vllm"))
    assert [r["step"] for r in vl] == [r["step"] for r in hf] == list(range(5))
    for a, b in zip(hf, vl, strict=True):
        assert set(b) - set(a) == (MISMATCH_KEYS if "loss" in b else set())
        assert set(a) <= set(b)
    steps = [r for r in vl if "loss" in r]
    for r in steps:  # float32 engine against the trainer's float32 recompute on the sampling weights
        assert r["mismatch/max_abs_dlogp"] < 1e-3 and abs(r["mismatch/ess_ratio"] - 1) < 1e-3
    first, later = steps[0], steps[1:]
    # step 0 is lag 0: the learner's own diagnostics see exactly the engine's mismatch
    assert first["lag/mean"] == 0
    assert first["kl/k3"] == pytest.approx(first["mismatch/kl_k3"], abs=1e-7)
    assert first["is/ess_ratio"] == pytest.approx(first["mismatch/ess_ratio"], abs=1e-6)
    # at lag 1 the learner's log-ratio adds the staleness; the engine's share stays tiny
    for r in later:
        assert r["lag/mean"] == 1 and r["kl/max_abs_logp_diff"] > 10 * r["mismatch/max_abs_dlogp"]
    assert (tmp_path / "vllm" / "checkpoints").is_dir()


def test_train_score_centering_top_k_with_vllm(tiny_overrides: list[str], tmp_path: Path) -> None:
    """Score centering's top-k form with the behavior distribution's top-k recorded by the vLLM engine."""
    args = [*tiny_overrides, HEAD_32, "steps=2", "runtime.lag.k=1", "eval.every=0", "checkpoint.every=0",
            "rollout.engine=vllm", "method=score_centering", "method.objective.top_k=16",
            f"out_dir={tmp_path}"]  # fmt: skip
    assert main(args) == 0
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert r["train/skipped"] == 0 and r["sc/centering_mean"] < 0 and r["mismatch/max_abs_dlogp"] < 1e-3
