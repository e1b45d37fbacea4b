"""Two processes running one config write the same metrics (``runtime.deterministic``, docs/results.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from steadyrl.base.device import Placement

NOT_TIMED = ("time/", "_s", "per_s", "tokens_per")


def test_the_setting_holds_inside_and_is_restored_after() -> None:
    before = torch.are_deterministic_algorithms_enabled()
    cpu = Placement(torch.device("cpu"))
    with cpu.runtime(deterministic=True):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before
    with cpu.runtime(deterministic=False):
        assert not torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == before


def _metrics(out: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in NOT_TIMED)} for r in rows]


@pytest.mark.slow
def test_two_processes_with_two_threads_write_the_same_metrics(tmp_path: Path) -> None:
    """16 steps of the main job twice, each in its own process with 2 threads: before runtime.deterministic they
    differed from step 13 on (every time, in five pairs of runs)."""
    runs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(
            [sys.executable, "-m", "steadyrl.cli", "train", "steps=16", "runtime.threads=2", f"out_dir={out}"],
            check=True, env=env, capture_output=True,
        )
        runs.append(_metrics(out))
    assert runs[0] == runs[1]
