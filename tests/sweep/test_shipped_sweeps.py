"""Every sweep shipped in steadyrl/configs/sweeps loads, expands into validated runs, and the regime sweeps set what
their comments say (docs/results.md reads their tables)."""

from __future__ import annotations

import pytest

from steadyrl.sweep.config import expand, load_sweep
from steadyrl.sweep.entry import shipped_sweeps


@pytest.mark.parametrize("name", sorted(shipped_sweeps()))
def test_every_shipped_sweep_expands_into_valid_runs(name: str) -> None:
    path = shipped_sweeps()[name]
    runs = expand(load_sweep(path, []), sweep_file=path)
    assert runs, name
    assert len({r.out_dir for r in runs}) == len(runs)


def test_regime_lr_is_a_sync_lr_grid_beside_the_stale_methods() -> None:
    path = shipped_sweeps()["regime_lr"]
    runs = expand(load_sweep(path, []), sweep_file=path)
    cells = {(r.config.method.name, r.config.runtime.lag.k, r.config.lr) for r in runs}
    lrs = {1e-4, 3e-4, 1e-3}
    assert cells == {(m, lag, lr) for m, lag in (("grpo", 0), ("seq_tis", 64), ("vcpo", 64)) for lr in lrs}
    assert {r.config.seed for r in runs} == {0, 1, 2}


def test_regime_length_makes_worked_steps_answers_that_fit_the_token_budget() -> None:
    from steadyrl.tasks import build_task

    path = shipped_sweeps()["regime_length"]
    runs = expand(load_sweep(path, []), sweep_file=path)
    assert {r.config.seed for r in runs} == {0, 1, 2}
    for run in runs:
        assert run.config.task.worked_steps
        task = build_task(run.config.task)
        longest = max(len(task.demonstration(p)) for p in task.problems("eval", 64, seed=0))
        assert 10 <= longest < run.config.rollout.max_new_tokens  # the answer + EOS fits (character tokens)
