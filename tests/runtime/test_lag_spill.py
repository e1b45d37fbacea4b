"""The lag ring past its RAM budget: snapshots spilled to memory-mapped safetensors files, and the up-front error."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from steadyrl.runtime import lag as lag_module
from steadyrl.runtime.lag import (
    DiskState,
    LagSchedule,
    SnapshotMemoryError,
    SnapshotRing,
    snapshot_ram_slots,
    state_bytes,
)
from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics


class Tied(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3, dtype=dtype)
        self.out = nn.Linear(3, 5, bias=False, dtype=dtype)
        self.out.weight = self.emb.weight


def _set(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spilled_snapshots_serve_the_same_weights_in_the_models_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    schedule = LagSchedule(kind="pipeline", lag=3)
    ring = SnapshotRing(schedule, ram_slots=1, spill_dir=tmp_path)
    model = Tied(dtype)
    for t in range(8):
        _set(model, float(t))
        ring.publish(step=t, version=t, model=model)
        snap = ring.get(t)
        state = snap.tensors()
        assert state["emb.weight"].dtype == dtype
        assert torch.all(state["emb.weight"] == float(schedule.source_step(t)))
        assert state["emb.weight"].data_ptr() == state["out.weight"].data_ptr()  # tied: stored once, shared again
        files = list(tmp_path.glob("*.safetensors"))
        assert len(files) == len(ring) - 1 <= schedule.capacity - 1  # one in RAM, the rest on disk
    assert sum(isinstance(s.state, DiskState) for s in ring._items.values()) == 3  # steps 4..7: one in RAM
    restored = SnapshotRing(schedule, ram_slots=0, spill_dir=tmp_path / "other")
    restored.load_state_dict(ring.state_dict())
    assert restored.steps == ring.steps
    assert torch.equal(restored.get(7).tensors()["emb.weight"], ring.get(7).tensors()["emb.weight"])
    ring.close()
    restored.close()
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_ring_that_fits_neither_ram_nor_disk_is_refused_up_front_with_the_arithmetic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy_bytes = state_bytes(Tied())
    schedule = LagSchedule(kind="pipeline", lag=7)
    assert snapshot_ram_slots(copy_bytes=copy_bytes, schedule=schedule, budget_bytes=8 * copy_bytes,
                              spill_dir=tmp_path) is None  # fmt: skip
    assert snapshot_ram_slots(copy_bytes=copy_bytes, schedule=schedule, budget_bytes=3 * copy_bytes,
                              spill_dir=tmp_path) == 3  # fmt: skip
    monkeypatch.setattr(lag_module.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, copy_bytes))
    with pytest.raises(SnapshotMemoryError, match=r"lag\+1 = 8 copies of the weights.*3 fit.*other 5 need"):
        snapshot_ram_slots(copy_bytes=copy_bytes, schedule=schedule, budget_bytes=3 * copy_bytes, spill_dir=tmp_path)


def test_a_run_with_every_snapshot_on_disk_equals_the_run_in_ram(
    tiny_overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved: list[Path] = []
    real_save = DiskState.save.__func__  # type: ignore[attr-defined]

    def save(cls: type[DiskState], state: dict[str, torch.Tensor], path: Path) -> DiskState:
        saved.append(path)
        return real_save(cls, state, path)

    monkeypatch.setattr(DiskState, "save", classmethod(save))
    common = [*tiny_overrides, "runtime.lag.k=2", "steps=4", "eval.every=2", "checkpoint.every=0"]
    assert main([*common, f"out_dir={tmp_path / 'ram'}"]) == 0
    spill = tmp_path / "spill"
    assert main([*common, f"out_dir={tmp_path / 'disk'}", "runtime.lag.snapshot_memory_gb=1e-9",
                 f"runtime.lag.snapshot_dir={spill}"]) == 0  # fmt: skip
    assert read_metrics(tmp_path / "ram" / "metrics.jsonl") == read_metrics(tmp_path / "disk" / "metrics.jsonl")
    assert len(saved) >= 5 and all(p.parent == spill for p in saved)  # every published snapshot went to disk
    assert not list(spill.glob("*.safetensors"))  # deleted when the run closed
