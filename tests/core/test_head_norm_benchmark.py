"""``benchmarks/head_norm.py`` at a tiny size: both forms of the output layer's norm agree, and ``auto`` takes the
kernel for responses shorter than the hidden size and the materialized form for longer ones."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import BENCHMARKS, load_benchmark


def test_tiny_run_agrees_and_switches_at_the_hidden_size(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their shared ``timing`` module
    bench = load_benchmark("head_norm")
    assert bench.main(["--tokens", "4,64", "--vocab", "300", "--hidden", "16", "--threads", "1", "--repeats", "1"]) == 0
    rows = {int(line.split()[0]): line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0].isdigit()}  # fmt: skip
    assert rows[4][4] == "kernel" and rows[64][4] == "materialized"
    assert float(rows[4][5]) < 1e-5 and float(rows[64][5]) < 1e-5  # relative difference of the two forms
