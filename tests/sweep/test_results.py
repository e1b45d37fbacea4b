"""results.csv and summary.*: per-run metrics from fake runs, the collapse rule, the grpo-lag-0 ratio, mean ± CI."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest

from steadyrl.sweep.results import (
    RESULTS_FILE,
    SUMMARY_CSV,
    SUMMARY_MD,
    collapse_step,
    columns,
    results_rows,
    run_status,
    write_results,
)
from steadyrl.sweep.stats import t_quantile
from steadyrl.train.metrics import read_metrics
from tests.sweep.conftest import fake_run, fake_spec_run, plan


def test_collapse_is_the_first_eval_more_than_drop_below_the_best_so_far() -> None:
    assert collapse_step([(0, 0.4), (10, 0.6), (20, 0.46), (30, 0.44), (40, 0.1)]) == 30
    assert collapse_step([(0, 0.4), (10, 0.6), (20, 0.45)]) is None  # exactly 0.15 below: not more
    assert collapse_step([(0, 0.5), (10, 0.2)], drop=0.4) is None
    assert collapse_step([]) is None


def test_status_of_a_run_directory(tmp_path: Path) -> None:
    done = fake_run(tmp_path / "a", evals=[0.1, 0.2, 0.3])
    assert run_status(read_metrics(done / "metrics.jsonl"), 4, done) == "finished"
    assert run_status(read_metrics(done / "metrics.jsonl"), 6, done) == "partial"  # final line, but steps=6
    part = fake_run(tmp_path / "b", evals=[0.1, 0.2, 0.3], finished=False)
    assert run_status(read_metrics(part / "metrics.jsonl"), 4, part) == "partial"
    stopped = fake_run(tmp_path / "c", evals=[0.1, 0.2], alarms=[(1, "stop")])
    assert run_status(read_metrics(stopped / "metrics.jsonl"), 100, stopped) == "stopped"
    warned = fake_run(tmp_path / "d", evals=[0.1, 0.2], alarms=[(1, "warn")])
    assert run_status(read_metrics(warned / "metrics.jsonl"), 100, warned) == "partial"
    assert run_status([], 4, tmp_path / "none") == "missing"


def test_results_rows_columns_and_values(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": ["vcpo", "seq_tis"], "lr": [1e-3]}, include=[{"method": ["grpo"],
                 "lag": [0], "lr": [1e-3]}], seeds=[0, 1])
    accs = {  # final accuracies; steps 0..6, eval every 2: evals at 0, 2, 4 and the final line at 6
        ("vcpo", 0): [0.40, 0.60, 0.44, 0.50], ("vcpo", 1): [0.30, 0.50, 0.52, 0.55],
        ("seq_tis", 0): [0.40, 0.45, 0.46, 0.47], ("grpo", 0): [0.40, 0.50, 0.60, 0.625], ("grpo", 1): [0.3, 0.4,
                                                                                                      0.5, 0.5],
    }  # fmt: skip
    for s in specs:
        key = (s.entry.method, s.entry.seed)
        if key in accs:
            ess = [0.9, 0.5, 0.2, 0.7, 0.8, 0.6] if key == ("vcpo", 0) else None
            fake_spec_run(s, evals=accs[key], ess=ess, step_s=0.25)
        elif key == ("seq_tis", 1):
            fake_spec_run(s, evals=[0.4, 0.41, 0.42, 0.43], finished=False, steps_done=3)
    entries = [s.entry for s in specs]
    assert columns(entries) == [
        "run", "status", "method", "lag", "seed", "lr", "config_hash", "steps_done", "base_acc", "final_acc",
        "best_acc", "final_acc_rel", "min_ess_ratio", "max_kl_k3", "collapse_step", "guard_alarms",
        "guard_rollbacks", "steps_per_s",
    ]  # fmt: skip
    rows = {(r["method"], r["seed"]): r for r in results_rows(entries, tmp_path / "sweep")}
    v0 = rows["vcpo", 0]
    assert v0["status"] == "finished" and v0["lag"] == 16 and v0["lr"] == "0.001"
    assert (v0["base_acc"], v0["final_acc"], v0["best_acc"]) == (0.40, 0.50, 0.60)
    assert v0["collapse_step"] == 4 and rows["vcpo", 1]["collapse_step"] is None
    assert v0["final_acc_rel"] == pytest.approx(0.50 / 0.625)
    assert rows["vcpo", 1]["final_acc_rel"] == pytest.approx(0.55 / 0.5)
    assert rows["grpo", 0]["final_acc_rel"] == pytest.approx(1.0)
    assert v0["min_ess_ratio"] == 0.2 and v0["max_kl_k3"] == pytest.approx(0.05)
    assert v0["steps_done"] == 6 and v0["steps_per_s"] == pytest.approx(4.0)
    assert v0["config_hash"] == specs[0].entry.config_hash
    assert rows["seq_tis", 1]["status"] == "partial" and rows["seq_tis", 1]["steps_done"] == 3


def test_written_results_and_summary(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": ["vcpo", "seq_tis"]}, include=[{"method": ["grpo"], "lag": [0]}],
                 seeds=[0, 1, 2])
    finals = {"vcpo": [0.5, 0.55, 0.62], "seq_tis": [0.3, 0.1, 0.2], "grpo": [0.6, 0.65, 0.7]}
    for s in specs:
        final = finals[s.entry.method][s.entry.seed]
        if (s.entry.method, s.entry.seed) != ("seq_tis", 2):
            fake_spec_run(s, evals=[0.4, 0.5, 0.6, final])
    sweep = tmp_path / "sweep"
    text = write_results([s.entry for s in specs], sweep)
    with open(sweep / RESULTS_FILE) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and rows[0]["run"] == "method=vcpo,seed=0" and rows[0]["collapse_step"] == ""
    assert rows[1]["final_acc"] == "0.55" and rows[3]["collapse_step"] == "6"  # seq_tis seed 0: 0.6 -> 0.3
    assert rows[5]["status"] == "missing" and rows[5]["final_acc"] == ""
    with open(sweep / SUMMARY_CSV) as f:
        summary = {r["method"]: r for r in csv.DictReader(f)}
    assert list(summary) == ["vcpo", "seq_tis", "grpo"]
    vcpo = summary["vcpo"]
    xs = finals["vcpo"]
    half = t_quantile(0.975, 2) * statistics.stdev(xs) / math.sqrt(3)
    assert float(vcpo["final_acc_mean"]) == pytest.approx(statistics.fmean(xs), rel=1e-5)
    assert float(vcpo["final_acc_ci95"]) == pytest.approx(half, rel=1e-5)
    rel = [x / g for x, g in zip(xs, finals["grpo"], strict=True)]
    assert float(vcpo["final_acc_rel_mean"]) == pytest.approx(statistics.fmean(rel), rel=1e-5)
    assert (vcpo["n"], vcpo["runs"], vcpo["collapsed"]) == ("3", "3/3", "0")
    st = summary["seq_tis"]
    assert (st["n"], st["runs"], st["collapsed"]) == ("2", "2/3", "2")
    assert float(st["final_acc_mean"]) == pytest.approx(0.2)
    assert (sweep / SUMMARY_MD).read_text() == text
    assert f"| vcpo | 16 | 3/3 | {statistics.fmean(xs):.3f} ± {half:.3f} |" in text
    assert "| seq_tis | 16 | 2/3 |" in text and "| 2/2 |" in text
