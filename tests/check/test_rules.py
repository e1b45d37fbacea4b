"""The run rules of ``steadyrl check run`` on planted metric tables: each trap caught at the step it began, the
healthy table passing (the tables hold the keys steadyrl's runtimes log)."""

from __future__ import annotations

import math

import pytest

from steadyrl.check.rules import RunFacts, batch_reuse, check_table, counters, idle_clip, nan_steps, staleness, worst
from steadyrl.config.guard import GuardConfig

UNCORRECTED = RunFacts(corrects_behavior=False, trust_region=True, stale=True, staleness_bound=4)


def healthy(n: int = 20) -> list[dict]:
    """A stale run whose ratio to π_old moves (several updates per batch), fresh batches, bounded lag."""
    return [{"step": t, "version": t, "kl/k3": 0.3 + 0.01 * t, "loss/ratio_max": 1.05, "loss/clip_frac": 0.02,
             "is/ess_ratio": 0.6, "lag/max": min(t, 4), "data/batch_hash": 1000 + t, "loss/policy": 0.1,
             "grad/norm": 1.0, "reward/mean": 0.5} for t in range(n)]  # fmt: skip


def idle(n: int = 20) -> list[dict]:
    """One update per batch against the learner's own recompute: the ratio is 1 on every token."""
    rows = healthy(n)
    for r in rows:
        r |= {"loss/ratio_max": 1.0, "loss/clip_frac": 0.0, "kl/k3": 0.0 if r["step"] < 3 else 0.2 * r["step"]}
    return rows


def test_healthy_table_passes_every_rule() -> None:
    findings = check_table(healthy(), UNCORRECTED)
    assert worst(findings) == "PASS", [f.format() for f in findings]


def test_idle_clip_fails_at_the_first_idle_step_over_the_kl_threshold() -> None:
    f = idle_clip(idle(), UNCORRECTED)
    assert f.verdict == "FAIL" and f.step == 3  # KL 0.6 > 0.05 from step 3 (steps 0-2 are on-policy)


@pytest.mark.parametrize(
    ("facts", "why"),
    [(RunFacts(corrects_behavior=True, trust_region=True, stale=True), "corrects"),
     (RunFacts(corrects_behavior=False, trust_region=True, stale=False), "lag 0"),
     (RunFacts(corrects_behavior=False, trust_region=False, stale=True), "trust region")],
)  # fmt: skip
def test_idle_clip_passes_corrected_methods_lag0_and_unclipped_objectives(facts: RunFacts, why: str) -> None:
    f = idle_clip(idle(), facts)
    assert f.verdict == "PASS" and why in f.message


def test_idle_clip_kl_under_threshold_passes() -> None:
    rows = [r | {"kl/k3": 0.05} for r in idle()]  # at the threshold, not over it
    assert idle_clip(rows, UNCORRECTED).verdict == "PASS"


def test_idle_clip_max_abs_log_ratio_form() -> None:
    rows = [{"step": t, "kl/k3": 0.5, "check/max_abs_log_ratio": 1e-7} for t in range(3)]
    assert idle_clip(rows, UNCORRECTED).verdict == "FAIL"
    rows = [r | {"check/max_abs_log_ratio": 2e-6} for r in rows]
    assert idle_clip(rows, UNCORRECTED).verdict == "PASS"


def test_idle_clip_series_form_needs_a_growing_kl() -> None:
    """Only a clip fraction logged: exactly 0 while the KL grows fails; a constant KL does not."""
    growing = [{"step": t, "kl/k3": 0.1 * (t + 1), "loss/clip_frac": 0.0} for t in range(5)]
    f = idle_clip(growing, UNCORRECTED)
    assert f.verdict == "FAIL" and f.step == 1
    flat = [r | {"kl/k3": 0.3} for r in growing]
    assert idle_clip(flat, UNCORRECTED).verdict == "PASS"


def test_idle_clip_warns_when_the_clip_sees_a_tenth_of_the_sampler_side() -> None:
    rows = [r | {"check/clip_frac_vs_sampler": 0.5, "loss/clip_frac": 0.04} for r in healthy()]
    f = idle_clip(rows, UNCORRECTED)
    assert f.verdict == "WARN" and f.step == 0
    rows = [r | {"loss/clip_frac": 0.05} for r in rows]  # exactly 0.1×: not below
    assert idle_clip(rows, UNCORRECTED).verdict == "PASS"


def test_stuck_batch_is_caught_with_updates_and_distinct_batches() -> None:
    """A replay queue that hands batch 0 back for steps 5..9: 20 updates on 15 distinct batches."""
    rows = healthy()
    for r in rows[5:10]:
        r["data/batch_hash"] = 1000
    f = batch_reuse(rows, UNCORRECTED)
    assert f.verdict == "FAIL" and f.step == 5
    assert "20 updates on 15 distinct batches, max reuse 6" in f.message
    assert batch_reuse(rows, RunFacts(allowed_reuse=6)).verdict == "PASS"


def test_batch_reuse_from_the_ledger_counters() -> None:
    rows = [{"step": t, "data/max_reuse": 1 if t < 3 else 2, "data/distinct_batches": min(t + 1, 3)} for t in range(6)]
    f = batch_reuse(rows, UNCORRECTED)
    assert f.verdict == "FAIL" and f.step == 3


def test_staleness_beyond_the_bound() -> None:
    rows = healthy()
    rows[12]["lag/max"] = 7
    f = staleness(rows, UNCORRECTED)
    assert f.verdict == "FAIL" and f.step == 12
    assert staleness(rows, RunFacts()).verdict == "SKIP"  # no bound configured


def test_nan_step_and_null_from_jsonl() -> None:
    rows = healthy()
    rows[7]["grad/norm"] = math.nan
    assert (nan_steps(rows).verdict, nan_steps(rows).step) == ("FAIL", 7)
    rows = healthy()
    rows[4]["loss/policy"] = None  # steadyrl writes NaN as null
    assert (nan_steps(rows).verdict, nan_steps(rows).step) == ("FAIL", 4)
    rows = healthy()
    rows[2]["train/skipped"] = 1.0
    assert nan_steps(rows).verdict == "WARN"


def test_counters_reset_by_a_resume() -> None:
    rows = healthy(10)
    resumed = rows[:8] + [r | {"step": r["step"] - 4} for r in rows[8:]]  # a resume from an old checkpoint
    f = counters(resumed)
    assert f.verdict == "FAIL" and f.step == 4
    reset = [r | ({"version": 0} if r["step"] == 6 else {}) for r in rows]
    assert counters(reset).verdict == "FAIL"
    rolled = [r | {"guard/rollbacks": int(r["step"] >= 6)} | ({"version": 2} if r["step"] == 6 else {}) for r in rows]
    assert counters(rolled).verdict == "PASS"  # a collapse-guard rollback restores an older version


def test_ess_out_of_range_and_collapse_onset() -> None:
    g = GuardConfig()
    rows = healthy()
    rows[3]["is/ess_ratio"] = 1.2
    f = check_table(rows, UNCORRECTED)[1]
    assert (f.rule, f.verdict, f.step) == ("ess", "FAIL", 3)
    rows = healthy()
    for r in rows[10:]:
        r["is/ess_ratio"] = 0.01
    f = check_table(rows, UNCORRECTED, guard=g)[1]
    assert (f.verdict, f.step) == ("WARN", 10)


def test_kl_spike_after_the_warmup() -> None:
    rows = healthy(30)
    rows[20]["kl/k3"] = 5.0
    f = check_table(rows, UNCORRECTED)[2]
    assert (f.rule, f.verdict, f.step) == ("kl_spikes", "WARN", 20)


def test_missing_metrics_skip_instead_of_passing() -> None:
    findings = check_table([{"step": 0}, {"step": 1}], RunFacts())
    assert {f.rule: f.verdict for f in findings} == {
        "idle_clip": "SKIP", "ess": "SKIP", "kl_spikes": "SKIP", "batch_reuse": "SKIP", "staleness": "SKIP",
        "nan": "SKIP", "counters": "PASS",
    }  # fmt: skip
