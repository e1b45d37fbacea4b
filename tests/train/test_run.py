"""``steadyrl train`` end to end on a tiny model: reward rises, outputs, determinism, resume equivalence, Ctrl-C."""

from __future__ import annotations

import os
import signal
import statistics
from pathlib import Path
from typing import Any

import pytest

from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.train.entry import lag_source, main
from steadyrl.train.loop import StopFlag, train
from steadyrl.train.metrics import read_metrics

#: Keys every learner-step line carries.
REQUIRED = {
    "step", "version", "reward/mean", "lr", "loss", "grad/norm", "grad/cos_prev", "is/ess_ratio", "is/weight_max",
    "kl/k3", "lag/mean", "lag/max", "time/step_s",
}  # fmt: skip


def test_tiny_run_end_to_end_reward_rises(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    args = [*tiny_overrides, f"out_dir={out}", "steps=60", "method=grpo", "runtime.lag.k=0", "log.timings=metrics"]
    assert main(args) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(61))
    steps, final = records[:-1], records[-1]
    for r in steps:
        assert r.keys() >= REQUIRED, REQUIRED - r.keys()
        assert r["lag/mean"] == 0 and r["train/skipped"] == 0
    assert [r["step"] for r in records if "eval/acc" in r] == [0, 10, 20, 30, 40, 50, 60]
    assert set(final) >= {"step", "version", "eval/acc"} and final["version"] == 60
    rewards = [r["reward/mean"] for r in steps]
    assert statistics.mean(rewards[-15:]) > statistics.mean(rewards[:15]) + 0.05
    assert (out / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert load_config(TrainConfig, path=out / "config.yaml") == load_config(TrainConfig, overrides=args)
    assert (out / "checkpoints").is_dir()
    text = capsys.readouterr().out
    assert "base 0." in text and "-> final 0." in text and str(out / "plot.png") in text
    assert main(args) == 2  # out_dir now holds a run: refuse to clobber it
    assert "resume=true" in capsys.readouterr().err


def test_same_seed_gives_byte_identical_metrics(tiny_overrides: list[str], tmp_path: Path) -> None:
    common = [*tiny_overrides, "steps=12", "runtime.lag.k=3", "method=seq_tis"]
    assert main([*common, f"out_dir={tmp_path / 'a'}"]) == 0
    assert main([*common, f"out_dir={tmp_path / 'b'}"]) == 0
    a, b = (tmp_path / "a" / "metrics.jsonl").read_bytes(), (tmp_path / "b" / "metrics.jsonl").read_bytes()
    assert a == b and len(a.splitlines()) == 13
    first = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["lag/mean"] for r in first[:6]] == [0, 1, 2, 3, 3, 3]  # lag k = 3 once t >= 3
    assert [r["sample/version"] for r in first[:6]] == [0, 0, 0, 0, 1, 2]
    c = tmp_path / "c"
    assert main([*common, f"out_dir={c}", "seed=1"]) == 0
    assert (c / "metrics.jsonl").read_bytes() != a


def test_periodic_schedule_refreshes_the_sampler_every_l_steps(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "oapl"
    overrides = ["steps=7", "runtime.lag.k=0", "method=oapl", "runtime.lag.schedule=periodic",
                 "runtime.lag.refresh_every=3"]
    assert main([*tiny_overrides, *overrides, f"out_dir={out}"]) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert [r["sample/version"] for r in steps] == [0, 0, 0, 3, 3, 3, 6]
    assert [r["lag/mean"] for r in steps] == [0, 1, 2, 0, 1, 2, 0]


class _StopAt:
    """A rollout source that presses Ctrl-C (the StopFlag) while sampling ``step``."""

    def __init__(self, inner: Any, stop: StopFlag, step: int) -> None:
        self.inner, self.stop, self.step = inner, stop, step

    def next_batch(self, *, step: int) -> Any:
        if step == self.step:
            self.stop.request()
        return self.inner.next_batch(step=step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.slow
def test_interrupted_and_resumed_runs_write_the_same_metrics(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:
    common = [*tiny_overrides, "runtime.lag.k=4", "method=seq_tis+gac"]
    straight = tmp_path / "straight"
    assert main([*common, "steps=20", f"out_dir={straight}"]) == 0
    want = (straight / "metrics.jsonl").read_bytes()

    # stopped by steps=10 (final checkpoint at 10), resumed to 20
    split = tmp_path / "split"
    assert main([*common, "steps=10", f"out_dir={split}"]) == 0
    assert main([*common, "steps=20", f"out_dir={split}", "resume=true"]) == 0
    assert (split / "metrics.jsonl").read_bytes() == want
    assert main([*common, "steps=30", "runtime.lag.k=5", f"out_dir={split}", "resume=true"]) == 2  # not the same run
    assert "cannot resume" in capsys.readouterr().err and (split / "metrics.jsonl").read_bytes() == want

    # Ctrl-C during step 12: checkpoint at 13, resumed to 20
    cut = tmp_path / "cut"
    cfg = load_config(TrainConfig, overrides=[*common, "steps=20", f"out_dir={cut}"])
    stop = StopFlag()

    def factory(cfg: TrainConfig, **kw: Any) -> Any:
        return _StopAt(lag_source(cfg, **kw), stop, 12)

    result = train(cfg, make_source=factory, stop=stop)
    assert result.interrupted and result.steps_done == 13
    assert len(read_metrics(cut / "metrics.jsonl")) == 13
    assert main([*common, "steps=20", f"out_dir={cut}", "resume=true"]) == 0
    assert (cut / "metrics.jsonl").read_bytes() == want
    assert [r["step"] for r in read_metrics(cut / "timings.jsonl")] == list(range(21))


@pytest.mark.slow
def test_a_muon_run_resumes_to_the_same_metrics(tiny_overrides: list[str], tmp_path: Path) -> None:
    """optim.name=muon (Muon + AdamW, two optimizer states in the checkpoint): stopped at step 3 and resumed to 6, the
    metrics are those of the straight run."""
    common = [*tiny_overrides, "runtime.lag.k=2", "method=grpo", "optim.name=muon", "optim.muon.lr=0.02",
              "eval.every=3",
              "eval.n=16", "checkpoint.every=3"]  # fmt: skip
    straight = tmp_path / "straight"
    assert main([*common, "steps=6", f"out_dir={straight}"]) == 0
    split = tmp_path / "split"
    assert main([*common, "steps=3", f"out_dir={split}"]) == 0
    assert main([*common, "steps=6", f"out_dir={split}", "resume=true"]) == 0
    assert (split / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    records = read_metrics(straight / "metrics.jsonl")
    assert records[-1]["version"] == 6 and all(r["train/skipped"] == 0 for r in records[:-1])


def test_first_ctrl_c_sets_the_flag_and_second_raises() -> None:
    # A test run launched in the background inherits SIGINT ignored; this test stands for an interactive terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _first_ctrl_c_then_second()
    finally:
        signal.signal(signal.SIGINT, previous)


def _first_ctrl_c_then_second() -> None:
    with StopFlag() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
