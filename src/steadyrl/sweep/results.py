"""A sweep's results: one row per run (``results.csv``) and mean ± 95% CI over seeds (``summary.csv``, ``summary.md``).

Columns of ``results.csv`` (one row per run; empty = not available):

=================  ==============================================================================================
``run``            the run's directory name under the sweep's out_dir
``status``         finished · stopped (the collapse guard ended it early, with a final eval) · partial · missing
``method``         the grid label of ``method`` (a variant's name), else the config's method name
``lag``, ``seed``  the run's policy lag and seed
other grid keys    the label of the run's value of each other grid key
``config_hash``    10 hex digits of SHA-256 over the resolved config (``steadyrl.sweep.config.config_hash``)
``steps_done``     learner steps in metrics.jsonl
``base_acc``       eval accuracy at step 0; ``final_acc`` at the last eval line; ``best_acc`` the highest eval
``final_acc_rel``  final_acc / final_acc of the lag-0 ``grpo`` run of the same seed (and the same values of the other
                   grid keys, if the sweep has several such runs); empty when the sweep has no such run
``min_ess_ratio``  min over steps of ``is/ess_ratio``; ``max_kl_k3``: max over steps of ``kl/k3``
``collapse_step``  the first eval step whose accuracy is more than ``collapse_drop`` (default 0.15) below the best
                   accuracy of the run so far; empty if none
``guard_alarms``   collapse-guard alarms; ``guard_rollbacks``: rollbacks
``steps_per_s``    learner steps / the sum of their ``time/step_s`` (eval included; runs shared the machine)
=================  ==============================================================================================

``summary.csv`` has one row per (method, lag, other grid keys) over the finished and stopped runs: ``n``, ``runs``
(n / planned), ``<metric>_mean`` and ``<metric>_ci95`` (the half-width of the two-sided 95% Student-t interval,
:func:`steadyrl.sweep.stats.mean_ci`; empty when n < 2) for each of :data:`AGGREGATED`, and ``collapsed`` (runs
with a collapse step). ``summary.md`` is the same table in markdown with ``mean ± ci``.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from steadyrl.sweep.config import RunEntry
from steadyrl.sweep.stats import mean_ci
from steadyrl.train.collapse_guard import read_alarms
from steadyrl.train.loop import summarize
from steadyrl.train.metrics import METRICS_FILE, TIMINGS_FILE, read_metrics

RESULTS_FILE = "results.csv"
SUMMARY_CSV = "summary.csv"
SUMMARY_MD = "summary.md"
#: Default of ``collapse_drop`` (absolute accuracy drop below the best so far).
COLLAPSE_DROP = 0.15
#: Metric columns averaged over seeds in the summary, with their markdown headers.
AGGREGATED: tuple[tuple[str, str], ...] = (
    ("final_acc", "final acc"),
    ("best_acc", "best acc"),
    ("final_acc_rel", "final / grpo lag 0"),
    ("min_ess_ratio", "min ESS ratio"),
    ("max_kl_k3", "max k3 KL"),
    ("steps_per_s", "steps/s"),
)
#: Statuses whose metrics enter the summary (the run reached its final eval).
COMPLETE = ("finished", "stopped")
_TRAIN_KEYS = ("reward/mean", "loss")


def is_train_record(record: Mapping[str, Any]) -> bool:
    """A learner-step line (the final line holds only the final evaluation)."""
    return any(k in record for k in _TRAIN_KEYS)


def run_status(records: Sequence[Mapping[str, Any]], steps: int, run_dir: Path) -> str:
    """finished (a final eval line at ``step == steps``), stopped (a final eval line after a guard stop), partial
    (some lines, no final eval) or missing (no metrics)."""
    if not records:
        return "missing"
    last = records[-1]
    if not is_train_record(last) and last.get("eval/acc") is not None:
        if int(last["step"]) == steps:
            return "finished"
        if any(a.get("action") == "stop" for a in read_alarms(run_dir)):
            return "stopped"
    return "partial"


def collapse_step(evals: Sequence[tuple[int, float]], drop: float = COLLAPSE_DROP) -> int | None:
    """The first eval step whose accuracy is more than ``drop`` below the best accuracy before it (None: never)."""
    best = -float("inf")
    for step, acc in evals:
        if acc < best - drop:
            return step
        best = max(best, acc)
    return None


def steps_per_second(records: Sequence[Mapping[str, Any]], timings: Sequence[Mapping[str, Any]]) -> float | None:
    """Learner steps / the sum of their ``time/step_s`` (from metrics.jsonl, or timings.jsonl when separate)."""
    source = [r for r in records if is_train_record(r) and r.get("time/step_s") is not None]
    if not source:
        steps = {int(r["step"]) for r in records if is_train_record(r)}
        source = [r for r in timings if r.get("time/step_s") is not None and int(r["step"]) in steps]
    total = sum(float(r["time/step_s"]) for r in source)
    return len(source) / total if source and total > 0 else None


def run_row(entry: RunEntry, run_dir: Path, *, drop: float = COLLAPSE_DROP) -> dict[str, Any]:
    """The results row of one run, read from its directory (``final_acc_rel`` is filled by :func:`results_rows`)."""
    records = read_metrics(run_dir / METRICS_FILE)
    summary = summarize(records)
    evals = [(int(r["step"]), float(r["eval/acc"])) for r in records if r.get("eval/acc") is not None]
    collapse = collapse_step(evals, drop)
    return {
        "run": entry.name,
        "status": run_status(records, entry.steps, run_dir),
        "method": entry.method,
        "lag": entry.lag,
        "seed": entry.seed,
        **{k: v for k, v in entry.labels.items() if k not in ("method", "lag", "seed")},
        "config_hash": entry.config_hash,
        "steps_done": summary.steps,
        "base_acc": summary.base_acc,
        "final_acc": summary.final_acc,
        "best_acc": summary.best_acc,
        "final_acc_rel": None,
        "min_ess_ratio": summary.min_ess_ratio,
        "max_kl_k3": summary.max_kl_k3,
        "collapse_step": collapse,
        "guard_alarms": summary.alarms,
        "guard_rollbacks": summary.rollbacks,
        "steps_per_s": steps_per_second(records, read_metrics(run_dir / TIMINGS_FILE)),
    }


def grid_keys(entries: Sequence[RunEntry]) -> list[str]:
    """The grid keys other than method, lag and seed, in order of first appearance."""
    keys: list[str] = []
    for e in entries:
        keys += [k for k in e.labels if k not in ("method", "lag", "seed") and k not in keys]
    return keys


def columns(entries: Sequence[RunEntry]) -> list[str]:
    """The columns of ``results.csv`` for these runs."""
    return ["run", "status", "method", "lag", "seed", *grid_keys(entries), "config_hash", "steps_done", "base_acc",
            "final_acc", "best_acc", "final_acc_rel", "min_ess_ratio", "max_kl_k3", "collapse_step", "guard_alarms",
            "guard_rollbacks", "steps_per_s"]


def _reference(row: Mapping[str, Any], refs: Sequence[Mapping[str, Any]], others: Sequence[str]) -> Any:
    same_seed = [r for r in refs if r["seed"] == row["seed"]]
    matching = [r for r in same_seed if all(r.get(k) == row.get(k) for k in others)]
    if len(matching) == 1:
        return matching[0]
    return same_seed[0] if len(same_seed) == 1 else None


def results_rows(entries: Sequence[RunEntry], sweep_dir: Path, *, drop: float = COLLAPSE_DROP) -> list[dict[str, Any]]:
    """One row per entry, in order, with ``final_acc_rel`` against the lag-0 grpo run of the same seed."""
    rows = [run_row(e, sweep_dir / e.name, drop=drop) for e in entries]
    refs = [row for row, e in zip(rows, entries, strict=True) if e.reference and row["status"] in COMPLETE]
    others = grid_keys(entries)
    for row in rows:
        ref = _reference(row, refs, others)
        if ref is not None and row["final_acc"] is not None and ref["final_acc"]:
            row["final_acc_rel"] = row["final_acc"] / ref["final_acc"]
    return rows


def _group_key(row: Mapping[str, Any], keys: Sequence[str]) -> tuple[Any, ...]:
    return tuple(row.get(k) for k in keys)


def summary_rows(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Mean ± 95% CI over seeds of :data:`AGGREGATED`, per (method, lag, other grid keys), complete runs only."""
    group_keys = ["method", "lag", *keys]
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(_group_key(row, group_keys), []).append(row)
    out = []
    for gkey, members in groups.items():
        done = [r for r in members if r["status"] in COMPLETE]
        agg: dict[str, Any] = dict(zip(group_keys, gkey, strict=True))
        agg["n"] = len(done)
        agg["runs"] = f"{len(done)}/{len(members)}"
        for metric, _ in AGGREGATED:
            ci = mean_ci([r[metric] for r in done if r[metric] is not None])
            agg[f"{metric}_mean"], agg[f"{metric}_ci95"] = ci.mean, ci.half_width
        agg["collapsed"] = sum(r["collapse_step"] is not None for r in done)
        out.append(agg)
    return out


def summary_columns(keys: Sequence[str]) -> list[str]:
    """The columns of ``summary.csv``."""
    metric_cols = [c for m, _ in AGGREGATED for c in (f"{m}_mean", f"{m}_ci95")]
    return ["method", "lag", *keys, "n", "runs", *metric_cols, "collapsed"]


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: '' for None, floats with ``digits`` decimals (``digits`` significant digits below 0.01)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.{digits}g}"
    return str(value)


def mean_pm(agg: Mapping[str, Any], metric: str) -> str:
    """``mean ± ci`` (or ``mean`` when there is no interval, '' when no value)."""
    mean, half = agg.get(f"{metric}_mean"), agg.get(f"{metric}_ci95")
    if mean is None:
        return ""
    return fmt(mean) if half is None else f"{fmt(mean)} ± {fmt(half)}"


def summary_markdown(summary: Sequence[Mapping[str, Any]], keys: Sequence[str], *, drop: float) -> str:
    """The summary as a markdown table (mean ± 95% CI half-width over seeds)."""
    head = ["method", "lag", *keys, "runs", *(h for _, h in AGGREGATED), "collapsed"]
    lines = [
        f"Mean ± 95% CI (Student t) over seeds; collapsed = an eval more than {drop:g} below the run's best so far.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for agg in summary:
        cells = [str(agg.get(k, "")) for k in ("method", "lag", *keys)] + [agg["runs"]]
        cells += [mean_pm(agg, m) for m, _ in AGGREGATED] + [f"{agg['collapsed']}/{agg['n']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> Path:
    """Write ``rows`` with columns ``cols`` (atomically: a temporary file, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(cols)
        for row in rows:
            writer.writerow([_csv_cell(row.get(c)) for c in cols])
    tmp.replace(path)
    return path


def write_results(entries: Sequence[RunEntry], sweep_dir: Path, *, drop: float = COLLAPSE_DROP) -> str:
    """Write results.csv, summary.csv and summary.md into ``sweep_dir``; returns the markdown summary."""
    rows = results_rows(entries, sweep_dir, drop=drop)
    keys = grid_keys(entries)
    write_csv(sweep_dir / RESULTS_FILE, rows, columns(entries))
    summary = summary_rows(rows, keys)
    write_csv(sweep_dir / SUMMARY_CSV, summary, summary_columns(keys))
    text = summary_markdown(summary, keys, drop=drop)
    tmp = sweep_dir / f".{SUMMARY_MD}.tmp"
    tmp.write_text(text)
    tmp.replace(sweep_dir / SUMMARY_MD)
    return text

