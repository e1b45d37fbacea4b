"""benchmarks/docs_numbers.py: the README's results table checked against a run (fake README, fake metrics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.sweep.conftest import fake_run

docs_numbers = load_benchmark("docs_numbers")

README = """# project

Some prose with 0.999 → 0.111 that is not the table.

| command | base → final eval acc | min ESS ratio | max KL k3 |
|---|---|---|---|
| `steadyrl train` (the default) | 0.40 → **0.55** | 0.70 | 0.03 |
| `steadyrl train method=grpo` (no correction) | 0.40 → 0.36 at step 4 (peak 0.58) | 0.002 | 9.0 |

After the table.
"""


@pytest.fixture()
def run(tmp_path: Path) -> Path:
    """A finished fake run: evals 0.4, 0.5, 0.6, 0.55 at steps 0, 2, 4, 6; ESS 1 − 0.01 t, k3 0.01 t (t < 6)."""
    return fake_run(tmp_path / "run", evals=(0.4, 0.5, 0.6, 0.55))


def _main(tmp_path: Path, run: Path, readme: str, *overrides: str) -> int:
    path = tmp_path / "README.md"
    path.write_text(readme)
    return docs_numbers.main(["--readme", str(path), "--run", str(run), *overrides])


def test_a_row_that_states_the_runs_numbers_passes(tmp_path: Path, run: Path, capsys) -> None:
    readme = README.replace("0.70", "0.95").replace("| 0.03 |", "| 0.05 |")  # min ESS 0.95, max k3 0.05
    assert _main(tmp_path, run, readme) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["ok"] * 4
    assert out[1].endswith("README.md:7 (`steadyrl train`): final eval accuracy 0.55 (measured 0.55)")


def test_a_stale_number_fails_naming_it_and_the_measured_value(tmp_path: Path, run: Path, capsys) -> None:
    assert _main(tmp_path, run, README) == 1
    captured = capsys.readouterr()
    stale = [line for line in captured.out.splitlines() if line.startswith("STALE")]
    assert stale == [
        f"STALE  {tmp_path / 'README.md'}:7 (`steadyrl train`): min ESS ratio says 0.70, the run measured 0.95",
        f"STALE  {tmp_path / 'README.md'}:7 (`steadyrl train`): max KL k3 says 0.03, the run measured 0.05",
    ]
    assert "2 number(s)" in captured.err and "stale for `steadyrl train`" in captured.err


def test_the_overrides_pick_the_row_and_its_step_and_peak_are_checked(tmp_path: Path, run: Path) -> None:
    records = docs_numbers.read_metrics(run / "metrics.jsonl")
    checks = docs_numbers.check(README, records, "steadyrl  train method=grpo")
    by = {c.stated.key: c for c in checks}
    assert [c.stated.key for c in checks] == ["base_acc", "final_acc", "final_step", "best_acc", "min_ess_ratio",
                                              "max_kl_k3"]
    assert by["base_acc"].ok and not by["final_acc"].ok  # 0.40 holds; 0.36 is not the measured 0.55
    assert by["final_step"].measured == 6 and not by["final_step"].ok  # "at step 4" is stale
    assert by["best_acc"].measured == 0.6 and not by["best_acc"].ok  # "(peak 0.58)" is stale
    assert not by["min_ess_ratio"].ok and not by["max_kl_k3"].ok


def test_no_row_or_no_run_is_a_usage_error(tmp_path: Path, run: Path, capsys) -> None:
    assert _main(tmp_path, run, README, "runtime.lag.k=99") == 2
    assert "has no row for `steadyrl train runtime.lag.k=99`" in capsys.readouterr().err
    assert _main(tmp_path, tmp_path / "nowhere", README) == 2
    assert "no metrics in" in capsys.readouterr().err
    assert docs_numbers.table_rows("no table here\n") == []


def test_precision_is_the_one_written() -> None:
    stated = docs_numbers.Stated("min ESS ratio", "min_ess_ratio", "0.07", 1)
    assert docs_numbers.Check(stated, 0.0712).ok and docs_numbers.Check(stated, 0.0749).ok
    assert not docs_numbers.Check(stated, 0.0751).ok and not docs_numbers.Check(stated, None).ok


CPU_README = """| command | CPU kernels | base → final eval acc | min ESS ratio | max KL k3 |
|---|---|---|---|---|
| `steadyrl train` (the default) | `AVX512` (2026-11-30) | 0.40 → **0.11** | 0.95 | 0.05 |
| `steadyrl train` (the default) | `AVX2` | 0.40 → **0.55** | 0.95 | 0.05 |
| `steadyrl train method=grpo` | `AVX512` | 0.40 → 0.55 | 0.95 | 0.05 |
"""


def test_only_the_rows_of_this_machines_cpu_are_checked(tmp_path: Path, run: Path, capsys) -> None:
    assert _main(tmp_path, run, CPU_README, "--cpu", "AVX2") == 0  # the AVX512 row's 0.11 is not this machine's
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["ok"] * 4 and all(":4 " in line for line in out)
    assert _main(tmp_path, run, CPU_README, "--cpu", "AVX512") == 1  # on an AVX512 machine it is stale
    assert "final eval accuracy says 0.11, the run measured 0.55" in capsys.readouterr().out


def test_a_command_without_a_row_for_this_cpu_is_reported_not_checked(tmp_path: Path, run: Path, capsys) -> None:
    assert _main(tmp_path, run, CPU_README, "--cpu", "AVX2", "method=grpo") == 0
    out = capsys.readouterr().out
    assert out.startswith("NOT CHECKED") and "CPU (AVX2)" in out and "0.400 → 0.550" in out
    assert docs_numbers.cpu_capability()  # this machine's, as torch reports it


def test_every_main_job_row_of_the_readme_says_its_cpu() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows = [c for _, c in docs_numbers.table_rows(readme) if docs_numbers.row_command(c) == "steadyrl train"]
    assert rows and all(docs_numbers.row_cpu(c) for c in rows)  # every main-job row says its CPU
