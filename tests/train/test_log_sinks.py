"""The experiment trackers beside metrics.jsonl: W&B (offline) and MLflow (local sqlite store), read back after a
tiny run and its resume; key mapping; the one-line error of a missing package."""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from steadyrl.train import checkpoint as ckpt
from steadyrl.train.entry import main
from steadyrl.train.log_sinks import MLFLOW_STATE, WANDB_STATE, closing_status, flatten_config, mlflow_key, scalars
from steadyrl.train.metrics import MetricsWriter, read_metrics

#: The leveldb-log framing of a .wandb file: a 7-byte file header, 32 KiB blocks, 7-byte chunk headers
#: (crc32, length, type; type 1 = a whole record, 2/3/4 = first/middle/last piece).
WANDB_HEADER, WANDB_BLOCK, CHUNK_HEADER = 7, 32768, 7


def test_mlflow_key_keeps_steadyrl_keys_and_maps_rejected_characters() -> None:
    for key in ("reward/mean", "is/ess_ratio", "grad/per_traj_norm_mean", "time/step_s", "eval/acc", "lr"):
        assert mlflow_key(key) == key
    assert mlflow_key("eval/pass@k=4") == "eval/pass_k_4"
    assert mlflow_key("a:b(c)[d]") == "a_b_c__d_"  # ':' too: Windows' MLflow rejects it
    assert mlflow_key("a//b") == "a/_/b" and mlflow_key("/a/./b/..") == "_/a/_/b/_"
    assert mlflow_key("ü/x") == "_/x"
    assert len(mlflow_key("k" * 300)) == 250


def test_trackers_get_finite_numbers_and_flattened_config() -> None:
    record = {"step": 3, "loss": float("nan"), "reward/mean": 0.5, "train/skipped": True, "note": "x", "lr": 1}
    assert scalars(record) == {"reward/mean": 0.5, "train/skipped": 1.0, "lr": 1.0}
    flat = flatten_config({"a": {"b": 1, "c": [1, 2], "d": None, "e": {}}, "f": "x", "g": True})
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "a.d": "null", "a.e": "{}", "f": "x", "g": "true"}


class _Sink:
    """A tracker that records its calls and the status a close would report; ``fail`` makes its close raise."""

    def __init__(self, calls: list[str], name: str, *, fail: bool = False) -> None:
        self.calls, self.name, self.fail = calls, name, fail

    def write(self, record: Any) -> None:
        self.calls.append(f"{self.name}.write {record['step']}")

    def sync(self) -> None:
        self.calls.append(f"{self.name}.sync")

    def close(self) -> None:
        self.calls.append(f"{self.name}.close {closing_status()}")
        if self.fail:
            raise OSError(f"{self.name} could not close")


def test_every_sink_is_called_alike_and_closed_failed_when_the_run_raises(tmp_path: Path) -> None:
    calls: list[str] = []
    writer = MetricsWriter(tmp_path, separate_timings=False, tensorboard=False,
                           trackers=[_Sink(calls, "a", fail=True), _Sink(calls, "b")])  # fmt: skip
    writer.write({"step": 0, "loss": 1.0})
    writer.sync()
    with pytest.raises(RuntimeError, match="step 1 failed"):
        try:
            raise RuntimeError("step 1 failed")
        finally:  # the training loop's cleanup path
            with pytest.raises(OSError, match="a could not close"):  # raised after b was closed too
                writer.close()
    assert calls == ["a.write 0", "b.write 0", "a.sync", "b.sync", "a.close FAILED", "b.close FAILED"]
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"loss": 1.0, "step": 0}]
    assert closing_status() == "FINISHED"
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert closing_status() == "KILLED"


@pytest.mark.parametrize("flag", ["log.wandb=true", "log.mlflow=true"])
def test_a_missing_tracker_package_is_one_line_naming_the_install(flag: str, tmp_path: Path, monkeypatch,
                                                                  capsys) -> None:  # fmt: skip
    module = flag.split(".")[1].split("=")[0]
    monkeypatch.setitem(sys.modules, module, None)  # import (and find_spec) now fail as if not installed
    assert main([f"out_dir={tmp_path / 'run'}", flag]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} needs the {module} package" in err
    assert f"pip install 'steadyrl[{module}]'" in err and "requirements/logging.txt" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _run_crash_resume(tiny_overrides: list[str], out: Path, flag: str) -> list[dict[str, Any]]:
    """Two steps with a checkpoint after each, the newest checkpoint removed (as if the run died after logging step 1
    and the final line but before checkpointing them), then resumed from step 1 to 3 steps; metrics.jsonl's records."""
    common = [*tiny_overrides, f"out_dir={out}", flag, "checkpoint.every=1", "checkpoint.keep=3"]
    assert main([*common, "steps=2"]) == 0
    newest = ckpt.list_checkpoints(out)[0]
    assert newest.name.endswith("02.pt")
    newest.unlink()
    assert main([*common, "steps=3", "resume=true"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    return records


#: The first run's final-eval line at step 2, which the resumed run's metrics.jsonl replaces by learner step 2 (no
#: eval there); a tracker keeps what it was sent.
FIRST_FINAL_EVAL = {("eval/acc", 2), ("eval/len_mean", 2)}


def _expected(records: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """(key, step) → value of every finite number metrics.jsonl holds (the re-run wall-clock keys differ, so none)."""
    return {(k, r["step"]): v for r in records for k, v in scalars(r).items()}


def _wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a .wandb file, read with wandb's own Record message."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pieces = path.read_bytes(), WANDB_HEADER, b""
    assert data[:4] == b":W&B"
    while pos + CHUNK_HEADER <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        pieces += data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch) -> Iterator[None]:
    """Quiet offline W&B with its settings and caches in tmp_path; its service process is stopped afterwards."""
    wandb = pytest.importorskip("wandb", reason="wandb is in requirements/logging.txt (bash scripts/setup_extras.sh)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    yield
    wandb.teardown()


def test_wandb_offline_logs_every_step_and_a_resume_continues_the_run(tiny_overrides: list[str], tmp_path: Path,
                                                                      wandb_offline: None) -> None:  # fmt: skip
    out = tmp_path / "run"
    records = _run_crash_resume(tiny_overrides, out, "log.wandb=true")
    run_id = json.loads((out / WANDB_STATE).read_text())["run_id"]
    segments = sorted((out / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and all(s.name.endswith(f"-{run_id}") for s in segments)
    logged: dict[tuple[str, int], list[float]] = {}
    config: dict[str, Any] = {}
    for segment in segments:
        (file,) = segment.glob("run-*.wandb")
        for rec in _wandb_records(file):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                assert rec.run.run_id == run_id and rec.run.display_name == "run" and rec.run.project == "steadyrl"
                config |= {item.key: json.loads(item.value_json) for item in rec.run.config.update}
            elif kind == "history":
                step = rec.history.step.num
                for item in rec.history.item:
                    key = item.key or "/".join(item.nested_key)  # a key with '/' comes as nested_key
                    if not key.startswith("_"):  # _step, _runtime, _timestamp: wandb's own
                        logged.setdefault((key, step), []).append(json.loads(item.value_json))
    # the resolved config, updated by the resume
    assert config["steps"] == 3 and config["log"]["wandb"]["enabled"] is True
    assert all(len(v) == 1 for v in logged.values()), {k: v for k, v in logged.items() if len(v) > 1}
    want = _expected(records)
    assert set(want) <= set(logged)
    assert {k for k in set(logged) - set(want) if not k[0].startswith("time/")} == FIRST_FINAL_EVAL
    for (key, step), value in want.items():
        if not key.startswith("time/"):
            assert math.isclose(logged[key, step][0], value, rel_tol=1e-7), (key, step)


def test_mlflow_logs_params_and_one_value_per_step_and_a_resume_continues_the_run(tiny_overrides: list[str],
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    pytest.importorskip("mlflow", reason="mlflow-skinny is in requirements/logging.txt (bash scripts/setup_extras.sh)")
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    records = _run_crash_resume(tiny_overrides, out, "log.mlflow=true")
    state = json.loads((out / MLFLOW_STATE).read_text())
    uri = f"sqlite:///{(out / 'mlflow.db').resolve()}"
    assert state["extra"]["tracking_uri"] == uri
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("steadyrl").experiment_id])
    assert run.info.run_id == state["run_id"] and run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["steps"] == "2" and run.data.params["log.mlflow.enabled"] == "true"
    assert run.data.tags["resume/steps"] == "3" and run.data.tags["resume/resume"] == "true"
    want = _expected(records)
    keys = {k for k, _ in want if not k.startswith("time/")}
    assert set(run.data.metrics) >= keys
    for key in keys:
        history = client.get_metric_history(run.info.run_id, mlflow_key(key))
        steps = sorted(m.step for m in history)
        kept = sorted(step for k, step in FIRST_FINAL_EVAL if k == key)
        assert steps == sorted([*(step for k, step in want if k == key), *kept]), key  # once per step: no duplicate
        for m in history:
            if (key, m.step) not in FIRST_FINAL_EVAL:
                assert math.isclose(m.value, want[key, m.step], rel_tol=1e-7), (key, m.step)
