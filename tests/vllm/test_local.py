"""``runtime.mode=local`` with ``rollout.engine=vllm``: each sampler process owns a vLLM server and updates it in place.

Slow (a sampler process, then its vLLM server, start: about 50 s on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from steadyrl.rollout.vllm_engine import SETUP_HINT, vllm_available
from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics

pytestmark = [
    pytest.mark.skipif(not vllm_available(), reason=f"vLLM is not installed here; {SETUP_HINT}"),
    pytest.mark.slow,
]


def test_local_runtime_samples_with_vllm_and_updates_its_weights(tiny_overrides: list[str], tmp_path: Path) -> None:
    args = [
        *tiny_overrides, "model.arch.num_heads=1", "steps=4", "runtime.lag.k=0", "runtime.mode=local",
        "runtime.concurrent.inflight=false",
        "pool.policy=max_staleness", "pool.max_staleness=1", "rollout.engine=vllm", f"out_dir={tmp_path}",
    ]  # fmt: skip
    assert main(args) == 0
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 4 and max(r["lag/max"] for r in steps) <= 1
    assert max(r["sample/version"] for r in steps) >= 1  # batches sampled after a weight update


def test_local_runtime_records_the_behavior_top_k_with_vllm(tiny_overrides: list[str], tmp_path: Path) -> None:
    """Score centering's top-k form: each sampler process's engine records μ's top-k, which travels in the records."""
    args = [
        *tiny_overrides, "model.arch.num_heads=1", "steps=2", "runtime.lag.k=0", "runtime.mode=local",
        "runtime.concurrent.inflight=false", "pool.policy=max_staleness", "pool.max_staleness=1", "eval.every=0",
        "rollout.engine=vllm", "method=score_centering", "method.objective.top_k=16", f"out_dir={tmp_path}",
    ]  # fmt: skip
    assert main(args) == 0
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(r["sc/centering_mean"] < 0 for r in steps)
