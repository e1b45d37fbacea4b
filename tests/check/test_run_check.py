"""``steadyrl check run`` on real ``steadyrl train`` runs of the tiny model: the uncorrected method at lag (its clip
idle against its own recompute) fails, its corrected counterpart on the same data passes; the run-time ledger and
alarm are in metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadyrl.check.logs import read_run
from steadyrl.check.rules import check_table
from steadyrl.cli import main

STEPS, LAG = 6, 3

pytestmark = pytest.mark.slow  # two real runs (about 20 s on an idle 2-core machine, the warm start included)


@pytest.fixture(scope="module")
def runs(tiny_overrides: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for method in ("grpo", "seq_tis"):
        d = tmp_path_factory.mktemp(method)
        args = ["train", *tiny_overrides, f"method={method}", f"runtime.lag.k={LAG}", f"steps={STEPS}", "lr=3e-2",
                "eval.every=0",
                "eval.n=16", "checkpoint.every=0", f"out_dir={d}"]  # fmt: skip
        assert main(args) == 0
        out[method] = d
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_uncorrected_method_at_lag_fails_idle_clip(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["check", "run", str(runs["grpo"])]) == 1
    out = capsys.readouterr().out
    assert "FAIL  idle_clip" in out and "(from step 1)" in out
    rows = [r for r in records(runs["grpo"]) if "loss" in r]
    assert [r["check/idle_clip"] for r in rows] == [0] + [1] * (STEPS - 1)  # step 0 is on-policy (KL 0)


def test_corrected_method_on_the_same_data_passes(runs: dict[str, Path]) -> None:
    assert main(["check", "run", str(runs["seq_tis"])]) == 0
    log = read_run(runs["seq_tis"])
    verdicts = {f.rule: f.verdict for f in check_table(log.rows, log.facts)}
    assert verdicts["idle_clip"] == verdicts["batch_reuse"] == verdicts["staleness"] == "PASS"
    assert log.facts.staleness_bound == LAG


def test_the_ledger_in_metrics(runs: dict[str, Path]) -> None:
    a, b = ([r for r in records(runs[m]) if "loss" in r] for m in ("grpo", "seq_tis"))
    assert [r["data/distinct_batches"] for r in a] == list(range(1, STEPS + 1))
    assert {r["data/max_reuse"] for r in a} == {1}
    assert [r["data/age_max"] for r in a] == [min(t, LAG) for t in range(STEPS)]
    # the same seed: the same prompts in the same order whatever the method (the data-order fingerprint)
    assert [r["data/prompt_hash"] for r in a] == [r["data/prompt_hash"] for r in b]
    # step 0 is on-policy (the same update for both), so their samplers' weights differ from step 2's on
    assert a[LAG + 1]["data/batch_hash"] == b[LAG + 1]["data/batch_hash"]
    assert a[LAG + 2]["data/batch_hash"] != b[LAG + 2]["data/batch_hash"]
