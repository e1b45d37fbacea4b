"""``benchmarks/loss_head_memory.py`` at a tiny size: both forms run in their own processes, the chunked one with the
chunk size of its budget, the same loss, and the JSON carries the command, date, commit and machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark


def test_tiny_run_writes_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("loss_head_memory")
    out = tmp_path / "head.json"
    argv = ["--tokens", "256", "--vocab", "512", "--hidden", "16", "--chunk-elements", "20000", "--threads", "1",
            "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["command"].endswith(" ".join(argv)) and data["date"] and len(data["commit"].split("-")[0]) == 40
    assert {"platform", "cpu_capability", "cpus", "torch"} <= set(data["machine"])
    direct, chunked = data["cases"]
    assert (direct["form"], chunked["form"]) == ("direct", "chunked")
    assert direct["tokens"] == chunked["tokens"] == 256 and chunked["chunk_tokens"] == 20000 // 512
    assert chunked["loss"] == pytest.approx(direct["loss"], rel=1e-5)
    assert all(c["peak_rss_mib"] >= c["rss_before_mib"] > 0 for c in data["cases"])
    assert "256" in capsys.readouterr().out
