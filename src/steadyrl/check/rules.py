"""The run checks of ``steadyrl check run``: pure functions over a metrics table, one verdict per rule.

A *table* is the run's metric rows in the order they were logged, under steadyrl's key names (other frameworks' logs
are renamed first, :mod:`steadyrl.check.keymaps`). Each rule returns a :class:`Finding`: a verdict (``PASS``,
``WARN``, ``FAIL``, or ``SKIP`` when the run did not log what the rule reads), the step where the problem began, and
a sentence. FAIL marks a harness fault that makes a comparison unsound; WARN marks what a reader should look at.

=================  ================================================================================================
rule               verdict
=================  ================================================================================================
``idle_clip``      arXiv 2610.02911, check 1. FAIL: k3 KL(μ ‖ π_old) > 0.05 nat/token on a step whose ratio to
                   π_old is idle (max |log π_θ − log π_old| ≤ 1e-6; where only the clip fraction is logged, the
                   series form: clip fraction exactly 0 while the KL grows) in a run whose method claims a trust
                   region and has no correction against μ. WARN: where both out-of-clip fractions are logged, the
                   one against π_old below 0.1× the one against μ while the KL is over 0.05. PASS for methods that
                   correct against μ and for runs without staleness.
``ess``            ours (``is/ess_ratio``, else ``is/ess_ratio_weights``). FAIL: an ESS ratio outside [0, 1] (a
                   broken metric). WARN: the collapse onset, the first of ``patience`` consecutive steps with the
                   ESS ratio below the collapse guard's ``ess_floor``.
``kl_spikes``      ours, the collapse guard's spike rule: WARN at the first step after the guard's ``warmup``
                   whose k3 mismatch KL exceeds max(``kl_factor`` × the median of the ``window`` steps before it,
                   ``kl_min``).
``batch_reuse``    arXiv 2610.02911, check 3. FAIL when a batch fingerprint (or ``data/max_reuse``) is consumed more
                   times than allowed (once, unless told otherwise); reports updates against distinct batches.
``staleness``      ours. FAIL when the lag (``lag/max``, or ``data/age_max``) exceeds the configured bound.
``nan``            ours. FAIL at the first step with a non-finite (or, in steadyrl's JSONL, null) loss, gradient,
                   KL, importance or reward metric; WARN for steps the learner skipped (``train/skipped``).
``counters``       ours. FAIL when ``step`` goes backwards, or ``version`` or ``data/distinct_batches`` go backwards
                   without a collapse-guard rollback (a resume that reset its counters).
=================  ================================================================================================
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from steadyrl.config.guard import GuardConfig
from steadyrl.train.ledger import IDLE_CLIP_KL, IDLE_RATIO_TOL, OUT_OF_CLIP_FACTOR

Verdict = Literal["PASS", "WARN", "FAIL", "SKIP"]
Table = Sequence[Mapping[str, Any]]

#: Severity order of the verdicts (the run's verdict is the worst of its rules').
SEVERITY: dict[str, int] = {"SKIP": 0, "PASS": 1, "WARN": 2, "FAIL": 3}

# steadyrl's key names, the vocabulary every framework's log is renamed to.
STEP, VERSION = "step", "version"
KL_K3 = "kl/k3"
"""k3 estimate of KL(μ ‖ π_old) per token (the sampler against the learner's ratio anchor)."""
KL_K1 = "kl/k1"
"""k1 estimate of the same KL, read where a framework logs no k3 (OpenRLHF's ``vllm_kl``)."""
MAX_ABS_LOG_RATIO = "check/max_abs_log_ratio"
"""max |log π_θ − log π_old| over tokens (logged by some frameworks; steadyrl logs ``loss/ratio_max``)."""
RATIO_MAX = "loss/ratio_max"
CLIP_FRAC = "loss/clip_frac"
"""Fraction of tokens whose ratio to π_old is out of the clip range."""
CLIP_FRAC_SAMPLER = "check/clip_frac_vs_sampler"
"""Fraction of tokens whose ratio π_θ/μ is out of the clip range."""
ESS = "is/ess_ratio"
ESS_WEIGHTS = "is/ess_ratio_weights"
"""ESS / N of the applied (truncated) weights: read where a framework logs no sequence ESS (verl)."""
LAG_MAX, AGE_MAX = "lag/max", "data/age_max"
BATCH_HASH, DISTINCT, MAX_REUSE = "data/batch_hash", "data/distinct_batches", "data/max_reuse"
SKIPPED = "train/skipped"
ROLLBACKS = "guard/rollbacks"
#: Key prefixes whose non-finite values make a NaN step.
NAN_PREFIXES = ("loss", "grad/", "kl/", "is/", "reward")


@dataclass(frozen=True)
class RunFacts:
    """What the checks need to know about the run beyond its metrics (None: unknown)."""

    corrects_behavior: bool | None = None
    """The method corrects against μ (importance sampling to the sampler, or a ratio taken to μ)."""
    trust_region: bool | None = None
    """The method's objective clips its ratio to π_old."""
    stale: bool | None = None
    """The sampler can lag the learner (False: lag 0, synchronous)."""
    staleness_bound: int | None = None
    """The most versions a batch may lag the learner (None: no bound configured)."""
    allowed_reuse: int = 1
    """How many times one batch may be consumed (several epochs over a batch are one consumption each step)."""


@dataclass(frozen=True)
class Finding:
    """One rule's verdict on a run."""

    rule: str
    verdict: Verdict
    step: int | None
    """The step where the problem began (None: none, or not applicable)."""
    message: str

    def format(self) -> str:
        """One line: verdict, rule, step, message."""
        at = f" (from step {self.step})" if self.step is not None else ""
        return f"{self.verdict:<4}  {self.rule:<12} {self.message}{at}"


def _num(row: Mapping[str, Any], key: str) -> float | None:
    """``row[key]`` as a float (None when absent or not a number; JSON null stays None)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _step(row: Mapping[str, Any], index: int) -> int:
    value = _num(row, STEP)
    return int(value) if value is not None else index


def merge_by_step(table: Table) -> list[dict[str, Any]]:
    """One row per step, in order of first appearance (later rows of a step add their keys: eval lines, TRL's
    separate log entries)."""
    merged: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(table):
        merged.setdefault(_step(row, i), {}).update(row)
    return list(merged.values())


def _series(table: Table, key: str) -> list[tuple[int, float]]:
    return [(_step(r, i), v) for i, r in enumerate(table) if (v := _num(r, key)) is not None]


# ---------------------------------------------------------------------------------------------------- rules
def idle_clip(table: Table, facts: RunFacts) -> Finding:
    """Check 1 of arXiv 2610.02911 (the module table)."""
    name = "idle_clip"
    kl = _series(table, KL_K3) or _series(table, KL_K1)
    if not kl:
        return Finding(name, "SKIP", None, f"no mismatch KL ({KL_K3} or {KL_K1}) logged")
    over = [(s, v) for s, v in kl if v > IDLE_CLIP_KL]
    if not over:
        return Finding(
            name, "PASS", None, f"mismatch KL never over {IDLE_CLIP_KL} nat/token (max {max(v for _, v in kl):.3g})"
        )
    if facts.stale is False:
        return Finding(name, "PASS", None, "run without staleness (lag 0)")
    if facts.corrects_behavior:
        return Finding(name, "PASS", None, "the method corrects against the sampler μ")
    if facts.trust_region is False:
        return Finding(name, "PASS", None, "the method claims no trust region (no clipped ratio)")
    rows = {_step(r, i): r for i, r in enumerate(table)}
    first_kl = kl[0][1]
    idle_steps: list[int] = []
    for step, value in over:
        row = rows[step]
        gap, ratio_max, clip = _num(row, MAX_ABS_LOG_RATIO), _num(row, RATIO_MAX), _num(row, CLIP_FRAC)
        if gap is not None:
            idle = gap <= IDLE_RATIO_TOL
        elif ratio_max is not None:
            idle = ratio_max > 0 and abs(math.log(ratio_max)) <= IDLE_RATIO_TOL and clip in (None, 0.0)
        elif clip is not None:  # the series form: the clip never acts while the KL grows
            idle = clip == 0.0 and value > first_kl
        else:
            continue
        if idle:
            idle_steps.append(step)
    unknown = "" if facts.corrects_behavior is False else " (correction against μ unknown: assumed none)"
    if idle_steps:
        peak = max(v for _, v in over)
        return Finding(
            name, "FAIL", idle_steps[0],
            f"ratio to π_old idle on {len(idle_steps)} step(s) while KL(μ‖π_old) reached {peak:.3g} nat/token > "
            f"{IDLE_CLIP_KL}: the clip never acts{unknown}",
        )  # fmt: skip
    for step, _ in over:
        row = rows[step]
        own, sampler = _num(row, CLIP_FRAC), _num(row, CLIP_FRAC_SAMPLER)
        if own is not None and sampler is not None and own < OUT_OF_CLIP_FACTOR * sampler:
            return Finding(
                name, "WARN", step,
                f"out-of-clip fraction against π_old {own:.3g} < {OUT_OF_CLIP_FACTOR} × the fraction against μ "
                f"{sampler:.3g}: the clip barely sees the staleness",
            )  # fmt: skip
    if not any(k in row for row in table for k in (MAX_ABS_LOG_RATIO, RATIO_MAX, CLIP_FRAC)):
        return Finding(name, "SKIP", None, "KL over the threshold but no ratio or clip metric logged")
    return Finding(name, "PASS", None, "the ratio to π_old moves where the KL is over the threshold")


def ess(table: Table, guard: GuardConfig) -> Finding:
    """ESS ratio out of [0, 1] (FAIL) and the collapse onset (WARN), see the module table."""
    name = "ess"
    series = _series(table, ESS) or _series(table, ESS_WEIGHTS)
    if not series:
        return Finding(name, "SKIP", None, f"no ESS ratio ({ESS}) logged")
    bad = [(s, v) for s, v in series if not 0.0 <= v <= 1.0 + 1e-6]
    if bad:
        return Finding(name, "FAIL", bad[0][0], f"ESS ratio {bad[0][1]:.4g} outside [0, 1]: the metric is wrong")
    run = 0
    for i, (_, v) in enumerate(series):
        run = run + 1 if v < guard.ess_floor else 0
        if run >= guard.patience:
            onset = series[i - run + 1][0]
            return Finding(name, "WARN", onset, f"ESS collapse: ratio below {guard.ess_floor} for {run} steps")
    return Finding(name, "PASS", None, f"ESS ratio min {min(v for _, v in series):.3g}, no collapse")


def kl_spikes(table: Table, guard: GuardConfig) -> Finding:
    """The first mismatch-KL spike by the collapse guard's rule (WARN)."""
    name = "kl_spikes"
    series = [(s, v) for s, v in _series(table, KL_K3) if math.isfinite(v)]
    if not series:
        return Finding(name, "SKIP", None, f"no mismatch KL ({KL_K3}) logged")
    for i, (step, v) in enumerate(series):
        if i < guard.warmup:  # the guard's warm-up steps seed the baseline, never spike
            continue
        before = [x for _, x in series[max(0, i - guard.window) : i]]
        base = statistics.median(before) if before else 0.0
        limit = max(guard.kl_factor * base, guard.kl_min)
        if before and v > limit:
            return Finding(name, "WARN", step, f"mismatch KL {v:.3g} > {limit:.3g} (= max({guard.kl_factor} × "
                           f"median before, {guard.kl_min}))")  # fmt: skip
    return Finding(name, "PASS", None, f"no spike (max {max(v for _, v in series):.3g})")


def batch_reuse(table: Table, facts: RunFacts) -> Finding:
    """Check 3 of arXiv 2610.02911: distinct batches against updates."""
    name = "batch_reuse"
    hashes = [(s, int(v)) for s, v in _series(table, BATCH_HASH)]
    if hashes:
        seen: dict[int, int] = {}
        onset = None
        for step, h in hashes:
            seen[h] = seen.get(h, 0) + 1
            if seen[h] > facts.allowed_reuse and onset is None:
                onset = step
        summary = f"{len(hashes)} updates on {len(seen)} distinct batches, max reuse {max(seen.values())}"
        return Finding(name, "FAIL" if onset is not None else "PASS", onset, summary)
    reuse = _series(table, MAX_REUSE)
    if reuse:
        over = [(s, v) for s, v in reuse if v > facts.allowed_reuse]
        distinct = _series(table, DISTINCT)
        summary = f"{len(reuse)} updates on {int(distinct[-1][1]) if distinct else '?'} distinct batches, " \
                  f"max reuse {int(max(v for _, v in reuse))}"  # fmt: skip
        return Finding(name, "FAIL" if over else "PASS", over[0][0] if over else None, summary)
    return Finding(name, "SKIP", None, f"no batch fingerprint ({BATCH_HASH}) or {MAX_REUSE} logged")


def staleness(table: Table, facts: RunFacts) -> Finding:
    """Lag beyond the configured bound (FAIL)."""
    name = "staleness"
    series = _series(table, LAG_MAX) or _series(table, AGE_MAX)
    if not series:
        return Finding(name, "SKIP", None, f"no lag ({LAG_MAX} or {AGE_MAX}) logged")
    peak = max(v for _, v in series)
    if facts.staleness_bound is None:
        return Finding(name, "SKIP", None, f"no staleness bound configured (max lag {peak:g})")
    over = [(s, v) for s, v in series if v > facts.staleness_bound]
    if over:
        return Finding(name, "FAIL", over[0][0], f"lag {over[0][1]:g} > the bound {facts.staleness_bound}")
    return Finding(name, "PASS", None, f"max lag {peak:g} within the bound {facts.staleness_bound}")


def nan_steps(table: Table) -> Finding:
    """Non-finite metrics (FAIL) and skipped learner steps (WARN)."""
    name = "nan"
    checked = 0
    bad: list[tuple[int, str]] = []
    skipped: list[int] = []
    for i, row in enumerate(table):
        for key, value in row.items():
            if not key.startswith(NAN_PREFIXES):
                continue
            checked += 1
            if value is None or (isinstance(value, float) and not math.isfinite(value)):
                bad.append((_step(row, i), key))
        if (_num(row, SKIPPED) or 0.0) > 0:
            skipped.append(_step(row, i))
    if bad:
        steps = sorted({s for s, _ in bad})
        return Finding(name, "FAIL", steps[0], f"non-finite {bad[0][1]} (and {len(bad) - 1} more values) on "
                       f"{len(steps)} step(s)")  # fmt: skip
    if skipped:
        return Finding(name, "WARN", skipped[0], f"the learner skipped {len(skipped)} step(s) for non-finite values")
    if not checked:
        return Finding(name, "SKIP", None, "no loss, gradient, KL, importance or reward metric logged")
    return Finding(name, "PASS", None, "every loss, gradient, KL, importance and reward value is finite")


def counters(table: Table) -> Finding:
    """Counters going backwards (FAIL): the raw table, before rows are merged by step."""
    name = "counters"
    last: dict[str, float] = {}
    last_rollbacks = 0.0
    checked = False
    for i, row in enumerate(table):
        rollbacks = _num(row, ROLLBACKS)
        rolled = rollbacks is not None and rollbacks > last_rollbacks
        if rollbacks is not None:
            last_rollbacks = max(last_rollbacks, rollbacks)
        for key in (STEP, VERSION, DISTINCT):
            value = _num(row, key)
            if value is None:
                continue
            checked = True
            if key in last and value < last[key] and not (rolled and key != STEP):
                return Finding(name, "FAIL", _step(row, i), f"{key} went back from {last[key]:g} to {value:g} "
                               "(a resume that reset its counters?)")  # fmt: skip
            last[key] = value
    if not checked:
        return Finding(name, "SKIP", None, "no step, version or batch counter logged")
    return Finding(name, "PASS", None, "step, version and batch counters never go back")


#: The rules in report order.
RULES: tuple[str, ...] = ("idle_clip", "ess", "kl_spikes", "batch_reuse", "staleness", "nan", "counters")


def check_table(table: Table, facts: RunFacts, *, guard: GuardConfig | None = None) -> list[Finding]:
    """Every rule's finding on ``table`` (raw rows, in logged order)."""
    g = guard or GuardConfig()
    rows = merge_by_step(table)
    run: dict[str, Callable[[], Finding]] = {
        "idle_clip": lambda: idle_clip(rows, facts),
        "ess": lambda: ess(rows, g),
        "kl_spikes": lambda: kl_spikes(rows, g),
        "batch_reuse": lambda: batch_reuse(rows, facts),
        "staleness": lambda: staleness(rows, facts),
        "nan": lambda: nan_steps(rows),
        "counters": lambda: counters(table),
    }
    return [run[r]() for r in RULES]


def worst(findings: Sequence[Finding]) -> Verdict:
    """The most severe verdict among ``findings`` (PASS for none)."""
    verdicts: list[Verdict] = [f.verdict for f in findings] or ["PASS"]
    return max(verdicts, key=lambda v: SEVERITY[v])
