"""Every preset ``steadyrl train`` accepts trains end to end with several optimizer steps per batch.

Each preset of the catalog runs 3 learner steps of the tiny job (``tiny_overrides``) at lag 2 with
``optim.updates_per_batch=2 optim.minibatches=2``: 2 passes × 2 minibatches = 4 optimizer steps per learner step, so
π_prox is recomputed before the first of them (the learner's rule for more than one update) and every method sees
π_θ ≠ π_prox from its second optimizer step on. Checked per preset: a finite loss on every step, no skipped optimizer
step (``train/skipped`` = 0), and the version advancing by exactly 4 per learner step (after BRACE's critic-only
warm-up steps, which leave the policy and its version alone).

Presets the config refuses are skipped with the config's own error as the reason; none is refused now (``otb`` runs
since the learner hands it ``sum_p2``, Σ_v π_v² of the proximal distribution).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import TrainConfig
from steadyrl.methods import PRESETS, resolve_method
from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics

STEPS = 3
UPDATES, MINIBATCHES = 2, 2
FAST = ["eval.every=0", "eval.n=16", "checkpoint.every=0", "runtime.lag.k=2", f"steps={STEPS}"]
MULTI = [f"optim.updates_per_batch={UPDATES}", f"optim.minibatches={MINIBATCHES}"]


@pytest.mark.parametrize("name", [p.name for p in PRESETS])
def test_every_preset_trains_with_several_updates(name: str, tiny_overrides: list[str], tmp_path: Path) -> None:
    args = [*tiny_overrides, *FAST, *MULTI, f"method={name}", f"out_dir={tmp_path / name}"]
    try:
        load_config(TrainConfig, overrides=args)
    except ConfigError as err:  # the reason: the config's per-field lines, without the echo of every override
        reason = " ".join(line.strip() for line in str(err).splitlines()[1:])
        pytest.skip(f"`steadyrl train` refuses method={name}: {reason}")
    assert main(args) == 0
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    steps, final = records[:-1], records[-1]
    assert [r["step"] for r in steps] == list(range(STEPS))
    for r in steps:
        assert math.isfinite(r["loss"]), (r["step"], r["loss"])
        assert r["train/skipped"] == 0, r["step"]
    per_step = UPDATES * MINIBATCHES
    warm = getattr(resolve_method(name).advantage, "critic_warmup", 0)  # BRACE: critic-only steps leave θ alone
    assert [r["version"] for r in records] == [max(0, per_step * t - warm) for t in range(STEPS + 1)]
    assert final["version"] == per_step * STEPS - warm


def test_vaco_gets_its_phase_policy_with_one_update_per_batch(tiny_overrides: list[str], tmp_path: Path) -> None:
    """One optimizer step per batch: π_prox reaches VACO's re-alignment only through the preset's recompute_prox."""
    args = [*tiny_overrides, *FAST, "method=vaco", f"out_dir={tmp_path / 'vaco'}"]
    assert main(args) == 0
    steps = read_metrics(tmp_path / "vaco" / "metrics.jsonl")[:-1]
    assert [r["version"] for r in steps] == list(range(STEPS))
    for r in steps:
        assert math.isfinite(r["loss"]) and r["train/skipped"] == 0
        assert {"adv/realign_shift", "adv/rho_clipped_frac", "vaco/tv"} <= r.keys()
