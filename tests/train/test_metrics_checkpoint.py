"""metrics.jsonl formatting and truncation; atomic checkpoints with fallback past a corrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from steadyrl.train import checkpoint as ckpt
from steadyrl.train.metrics import MetricsWriter, format_record, read_metrics
from steadyrl.train.plot import write_plot


def test_records_have_sorted_keys_rounded_floats_and_null_for_non_finite() -> None:
    line = format_record({"z": 1.0 / 3.0, "step": 3, "a": float("nan"), "b": float("inf"), "flag": True})
    assert line == '{"a": null, "b": null, "flag": 1, "step": 3, "z": 0.33333333}'
    assert json.loads(line)["z"] == 0.33333333


def test_writer_truncates_to_offsets_and_separates_timings(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, separate_timings=True, tensorboard=False)
    w.write({"step": 0, "loss": 1.0, "time/step_s": 0.5})
    mid = w.offsets()
    w.write({"step": 1, "loss": 2.0, "time/step_s": 0.7})
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]
    assert "time/step_s" not in read_metrics(tmp_path / "metrics.jsonl")[0]
    assert read_metrics(tmp_path / "timings.jsonl")[1] == {"step": 1, "time/step_s": 0.7}
    w = MetricsWriter(tmp_path, separate_timings=True, tensorboard=False, start=mid, start_step=1)
    w.write({"step": 1, "loss": 3.0, "time/step_s": 0.9})
    w.close()
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 3.0]
    assert [r["time/step_s"] for r in read_metrics(tmp_path / "timings.jsonl")] == [0.5, 0.9]


def test_tensorboard_events_are_written(tmp_path: Path) -> None:
    w = MetricsWriter(tmp_path, separate_timings=False, tensorboard=True)
    w.write({"step": 0, "reward/mean": 0.5})
    w.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def _state(step: int) -> dict:
    return {
        "step": step,
        "model": {"w": torch.full((3,), float(step))},
        "learner": {},
        "source": {},
        "rng": {"torch": torch.get_rng_state()},
        "metrics": {"lines": step, "bytes": 0, "timing_bytes": 0},
        "config": {},
    }


def test_checkpoints_keep_the_newest_and_load_the_latest(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        ckpt.save_checkpoint(tmp_path, _state(step), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000006.pt", "step_00000004.pt"]
    loaded = ckpt.load_latest(tmp_path)
    assert loaded is not None and loaded.state["step"] == 6 and torch.all(loaded.state["model"]["w"] == 6.0)


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    ckpt.save_checkpoint(tmp_path, _state(2), keep=3)
    ckpt.save_checkpoint(tmp_path, _state(4), keep=3)
    latest = ckpt.checkpoint_path(tmp_path, 4)
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a torn write
    warnings: list[str] = []
    loaded = ckpt.load_latest(tmp_path, warn=warnings.append)
    assert loaded is not None and loaded.state["step"] == 2
    assert len(warnings) == 1 and "step_00000004.pt" in warnings[0]


def test_an_interrupted_save_leaves_the_previous_checkpoints_intact(tmp_path: Path, monkeypatch) -> None:
    ckpt.save_checkpoint(tmp_path, _state(2), keep=2)

    def crash(obj: object, f: object) -> None:
        f.write(b"partial")  # type: ignore[attr-defined]
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, _state(4), keep=2)
    monkeypatch.undo()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002.pt"]
    assert not list(ckpt.checkpoint_dir(tmp_path).glob(".tmp-*"))
    assert ckpt.load_latest(tmp_path).state["step"] == 2


def test_plot_is_a_png_with_missing_panels_marked(tmp_path: Path) -> None:
    records = [{"step": s, "reward/mean": 0.1 * s, "is/ess_ratio": 1.0} for s in range(5)]
    records[0]["eval/acc"] = 0.3
    path = write_plot(records, tmp_path / "plot.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
