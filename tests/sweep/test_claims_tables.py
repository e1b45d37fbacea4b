"""benchmarks/claims.py: the regime tables from fake sweep directories (the lr axis: each stale method at the
synchronous reference's best lr and at its own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.sweep.conftest import fake_run

claims = load_benchmark("claims")

#: Final accuracy per (method, lag, lr) for seeds 0 and 1: grpo at lag 0 is best at lr 3e-4, vcpo at lag 64 at 1e-4.
FINALS = {
    ("grpo", 0, "0.0001"): (0.50, 0.52),
    ("grpo", 0, "0.0003"): (0.70, 0.72),
    ("vcpo", 64, "0.0001"): (0.60, 0.64),
    ("vcpo", 64, "0.0003"): (0.40, 0.44),
}


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    for (method, lag, lr), finals in FINALS.items():
        for seed, final in enumerate(finals):
            fake_run(tmp_path / f"method={method},lag={lag},lr={lr},seed={seed}", evals=(0.3, final))
    fake_run(tmp_path / "method=vcpo,lag=64,lr=0.001,seed=0", evals=(0.3, 0.9), finished=False)  # still running
    return tmp_path


def test_regime_without_splits_off_one_key() -> None:
    assert claims.regime_without("length=worked2, lr=0.001", "lr") == ("length=worked2", "0.001")
    assert claims.regime_without("length=worked2", "lr") == ("length=worked2", None)


def test_lr_table_compares_at_syncs_best_lr_and_at_the_methods_own(sweep: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["claims.py", str(sweep)])
    claims.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| vcpo | 64 | 0.0003")]
    assert len(rows) == 1, out  # the comparison row: sync's best lr is 3e-4
    row = rows[0].split(" | ")
    # sync's final at its best lr (mean of 0.70, 0.72); vcpo there (0.42 ± t·s/√2); vcpo's own best lr 1e-4 (0.62)
    assert row[3] == "0.710"
    assert row[4].startswith("0.420 ± ")
    assert row[5] == "0.0001"
    assert row[6].startswith("0.620 ± ")
    assert row[7] == "-0.090"
    assert row[8].strip(" |") == "-0.100, -0.080"  # per seed: 0.60 − 0.70, 0.64 − 0.72
    assert "lr 0.001" not in out  # the unfinished run is not counted
    assert "**0.710 ± " in out and "**0.620 ± " in out  # each row's best lr in bold


def test_plot_lr_writes_a_png(sweep: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "img" / "lr.png"
    monkeypatch.setattr("sys.argv", ["claims.py", str(sweep), "--plot-lr", str(out)])
    claims.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_max_step_reads_each_run_as_if_it_had_stopped_there(sweep: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["claims.py", str(sweep), "--max-step", "0"])
    claims.main()
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| grpo | 0 | "))
    assert row.count("0.300") == 2  # every final is the step-0 eval (0.3), at both lrs
