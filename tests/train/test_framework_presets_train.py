"""``steadyrl train`` runs each method added from the installed frameworks (verl's DRO, RLOO, REINFORCE++ and its
baseline variant, ``token-sum`` aggregation) for two steps on the tiny task: finite loss and gradient on every line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics

RUNS = {
    "dro": ["method=dro"],
    "rloo": ["method=rloo"],
    "reinforce_pp": ["method=reinforce_pp"],
    "reinforce_pp_baseline": ["method=reinforce_pp_baseline"],
    "token_sum": ["method=grpo", "method.agg=token-sum"],
    "rollout_is": ["method=rollout_is"],
    "ipo": ["method=ipo"],
    "prob_diff": ["method=prob_diff", "method.prob_diff.level=segment"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_two_steps_train(name: str, tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / name
    assert main([*tiny_overrides, f"out_dir={out}", "steps=2", "runtime.lag.k=1", "eval.every=0", *RUNS[name]]) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert len(steps) == 2
    for r in steps:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad/norm"])
