"""``steadyrl check sweep DIR``: are a sweep's arms a fair comparison? (arXiv 2610.02911, checks 2, 5 and 6.)

A sweep directory (written by ``steadyrl sweep``) holds ``runs.json`` (every run's grid labels and seed),
``sweep.yaml`` (the grid) and one directory per run with its resolved ``config.yaml`` and ``metrics.jsonl``.

=================  ================================================================================================
check              verdict
=================  ================================================================================================
``config_diff``    check 2: the resolved configs, flattened to dotted keys. *Varied* keys are the grid's keys and
                   the keys its variants set (with everything under them); ignored are the output and bookkeeping
                   keys that do not change a result (``out_dir``, ``resume``, ``overwrite``, ``log``,
                   ``checkpoint``, ``runtime.threads``) and the seed keys, checked next. FAIL when a *fixed* key
                   differs between runs (names the key, its values and the runs).
``seeds``          check 2: every run's ``seed`` is the seed ``runs.json`` gave it, and every key whose name holds
                   "seed" is equal across the runs of one seed. FAIL otherwise (a seed that never reached an arm).
``data_order``     check 2: the data-order fingerprint of a run is the hash of its sequence of per-step prompt
                   hashes (``data/prompt_hash``, logged by every runtime) over the steps all runs logged. Runs of
                   ``runtime.mode=lag`` that share a seed, task, data settings and prompts per step must share it
                   (the concurrent runtimes batch by arrival, so their batches follow timing). FAIL when one
                   differs.
``paired``         check 6: per arm, the paired per-seed differences of the final eval accuracy from the
                   reference arm (``runs.json``'s lag-0 ``grpo``, else the first arm), with their mean. WARN when
                   an arm has seeds without a reference partner.
``lr_range``       check 5, where the grid has an ``lr`` axis: per method, the lrs at which no seed collapses by
                   the collapse guard's definition (an alarm in ``guard.jsonl`` or ``guard/alarm`` = 1). WARN
                   for a method with no stable lr.
=================  ================================================================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from steadyrl.check.rules import Finding
from steadyrl.config.renamed import RENAMED, move_renamed

RUNS_NAME = "runs.json"
#: What ``steadyrl sweep`` writes at its end: :func:`check_sweep`'s findings, one JSON object each.
ARMS_FILE = "arms_check.json"
SWEEP_NAME = "sweep.yaml"
#: Top-level keys that never change a result (the sweep's own config hash leaves them out too).
IGNORED = ("out_dir", "resume", "overwrite", "log", "checkpoint", "runtime.threads")
#: Keys that decide which prompts a step gets (with the seed).
DATA_KEYS = ("task", "data", "prompts_per_step")


class SweepCheckError(ValueError):
    """The directory is not a readable sweep."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out |= _flatten(v, f"{prefix}{k}.")
        return out
    return {prefix[:-1]: tree}


def _under(key: str, roots: Sequence[str]) -> bool:
    return any(key == r or key.startswith(r + ".") for r in roots)


def _is_seed_key(key: str) -> bool:
    return "seed" in key.rsplit(".", 1)[-1]


class _Run:
    def __init__(self, sweep_dir: Path, entry: Mapping[str, Any]) -> None:
        self.name: str = entry["name"]
        self.labels: dict[str, str] = dict(entry.get("labels", {}))
        self.seed: int = int(entry["seed"])
        self.method: str = str(entry.get("method", ""))
        self.reference: bool = bool(entry.get("reference", False))
        self.dir = sweep_dir / self.name
        cfg_path = self.dir / "config.yaml"
        if not cfg_path.is_file():
            raise SweepCheckError(f"{self.dir}: no config.yaml (has the sweep run?)")
        self.config = _flatten(move_renamed(yaml.safe_load(cfg_path.read_text()) or {}, warn=False))
        metrics = self.dir / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        self.records = [json.loads(ln) for ln in lines if ln.strip()]

    @property
    def arm(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self.labels.items()))

    def prompt_hashes(self) -> dict[int, int]:
        return {int(r["step"]): int(r["data/prompt_hash"]) for r in self.records if "data/prompt_hash" in r}

    def final_acc(self) -> float | None:
        accs = [float(r["eval/acc"]) for r in self.records if r.get("eval/acc") is not None]
        return accs[-1] if accs else None

    def collapsed(self) -> bool:
        guard = self.dir / "guard.jsonl"
        alarms = [ln for ln in guard.read_text().splitlines() if ln.strip()] if guard.is_file() else []
        return bool(alarms) or any(r.get("guard/alarm") == 1 for r in self.records)


def _varied_keys(sweep_dir: Path) -> list[str]:
    path = sweep_dir / SWEEP_NAME
    if not path.is_file():
        raise SweepCheckError(f"{sweep_dir}: no {SWEEP_NAME} (is it a steadyrl sweep directory?)")
    sweep = yaml.safe_load(path.read_text()) or {}
    keys: set[str] = set()
    for grid in [sweep.get("grid") or {}, *(sweep.get("include") or [])]:
        for key, values in grid.items():
            keys.add(key)
            for v in values:
                if isinstance(v, Mapping) and "overrides" in v:
                    keys |= set(_flatten(v["overrides"]))
    return sorted(RENAMED.get(k, k) for k in keys)  # a sweep file may use a key's former name


def load_runs(sweep_dir: Path) -> list[_Run]:
    """The sweep's runs (each with its resolved config and metrics)."""
    path = sweep_dir / RUNS_NAME
    if not path.is_file():
        raise SweepCheckError(f"{sweep_dir}: no {RUNS_NAME} (is it a steadyrl sweep directory?)")
    return [_Run(sweep_dir, e) for e in json.loads(path.read_text())["runs"]]


def config_diff(runs: Sequence[_Run], varied: Sequence[str]) -> Finding:
    """Fixed keys must be equal across every run (the module table)."""
    keys = sorted({k for r in runs for k in r.config})
    bad: list[str] = []
    changing: list[str] = []
    for key in keys:
        if _under(key, IGNORED) or _is_seed_key(key):
            continue
        values = {json.dumps(r.config.get(key), sort_keys=True) for r in runs}
        if len(values) < 2:
            continue
        if _under(key, varied):
            changing.append(key)
            continue
        by_value: dict[str, list[str]] = defaultdict(list)
        for r in runs:
            by_value[json.dumps(r.config.get(key), sort_keys=True)].append(r.name)
        shown = "; ".join(f"{v} in {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                          for v, names in by_value.items())  # fmt: skip
        bad.append(f"{key}: {shown}")
    if bad:
        return Finding("config_diff", "FAIL", None, f"{len(bad)} fixed key(s) differ between runs: " + " | ".join(bad))
    return Finding("config_diff", "PASS", None, f"{len(runs)} runs; varied: {', '.join(changing) or 'none'}; every "
                   "fixed key equal")  # fmt: skip


def seeds(runs: Sequence[_Run]) -> Finding:
    """Each run's seed is its planned seed, and seed keys agree within a seed."""
    for r in runs:
        if r.config.get("seed") != r.seed:
            return Finding("seeds", "FAIL", None, f"{r.name}: config seed {r.config.get('seed')} but the sweep "
                           f"planned seed {r.seed}: the seed never reached this arm")  # fmt: skip
    by_seed: dict[int, list[_Run]] = defaultdict(list)
    for r in runs:
        by_seed[r.seed].append(r)
    for seed, group in sorted(by_seed.items()):
        keys = sorted({k for r in group for k in r.config if _is_seed_key(k) and not _under(k, IGNORED)})
        for key in keys:
            values = {json.dumps(r.config.get(key)) for r in group}
            if len(values) > 1:
                odd = [r.name for r in group if json.dumps(r.config.get(key)) != json.dumps(group[0].config.get(key))]
                return Finding("seeds", "FAIL", None, f"seed {seed}: {key} differs between arms ({', '.join(odd)} vs "
                               f"{group[0].name})")  # fmt: skip
    return Finding("seeds", "PASS", None, f"seeds {sorted(by_seed)} reached every arm")


def data_order_fingerprint(hashes: Mapping[int, int], steps: Sequence[int]) -> str:
    """The hash of a run's per-step prompt hashes over ``steps`` (16 hex digits)."""
    h = hashlib.blake2b(digest_size=8)
    for s in steps:
        h.update(f"{s}:{hashes[s]};".encode())
    return h.hexdigest()


def data_order(runs: Sequence[_Run]) -> Finding:
    """Runs with the same seed and data settings saw the same prompts in the same order."""
    groups: dict[str, list[_Run]] = defaultdict(list)
    for r in runs:
        if r.config.get("runtime.mode", "lag") != "lag":  # concurrent runtimes batch by timing: no fixed order
            continue
        data = {k: v for k, v in r.config.items() if _under(k, DATA_KEYS)}
        groups[json.dumps([r.seed, data], sort_keys=True, default=str)].append(r)
    if not groups:
        return Finding("data_order", "SKIP", None, "no run of runtime.mode=lag (concurrent runtimes batch by timing)")
    lines = []
    for group in groups.values():
        hashes = {r.name: r.prompt_hashes() for r in group}
        if any(not h for h in hashes.values()):
            return Finding("data_order", "SKIP", None, "a run logged no data/prompt_hash")
        common = sorted(set.intersection(*(set(h) for h in hashes.values())))
        prints = {name: data_order_fingerprint(h, common) for name, h in hashes.items()}
        if len(set(prints.values())) > 1:
            ref = group[0].name
            odd = [n for n, p in prints.items() if p != prints[ref]]
            first = next(s for s in common if any(hashes[n][s] != hashes[ref][s] for n in odd))
            return Finding("data_order", "FAIL", first, f"seed {group[0].seed}: {', '.join(odd)} saw other prompts "
                           f"than {ref}")  # fmt: skip
        lines.append(f"seed {group[0].seed}: {next(iter(prints.values()))} ({len(group)} runs, {len(common)} steps)")
    return Finding("data_order", "PASS", None, "; ".join(lines))


def paired(runs: Sequence[_Run]) -> Finding:
    """Paired per-seed final-accuracy differences of each arm from the reference arm."""
    arms: dict[tuple[tuple[str, str], ...], dict[int, _Run]] = defaultdict(dict)
    for r in runs:
        arms[r.arm][r.seed] = r
    ref_arm = next((a for a, rs in arms.items() if any(r.reference for r in rs.values())), next(iter(arms)))
    ref = arms[ref_arm]
    lines, unpaired = [], []
    for arm, by_seed in arms.items():
        if arm == ref_arm:
            continue
        diffs = []
        for seed, r in sorted(by_seed.items()):
            a, b = r.final_acc(), ref[seed].final_acc() if seed in ref else None
            if a is None or b is None:
                unpaired.append(f"{r.name}")
                continue
            diffs.append(a - b)
        name = ",".join(f"{k}={v}" for k, v in arm)
        if diffs:
            mean = statistics.fmean(diffs)
            lines.append(f"{name}: {' '.join(f'{d:+.3f}' for d in diffs)} (mean {mean:+.3f}, n={len(diffs)})")
    ref_name = ",".join(f"{k}={v}" for k, v in ref_arm)
    msg = f"final acc − {ref_name}, per seed: " + ("; ".join(lines) or "no other arm")
    if unpaired:
        return Finding("paired", "WARN", None, f"{msg}; without a reference partner: {', '.join(unpaired)}")
    return Finding("paired", "PASS", None, msg)


def lr_range(runs: Sequence[_Run], varied: Sequence[str]) -> Finding:
    """Per method, the lrs at which no seed collapsed (guard's definition)."""
    if "lr" not in varied:
        return Finding("lr_range", "SKIP", None, "the sweep has no lr axis")
    by_method: dict[str, dict[float, bool]] = defaultdict(dict)
    for r in runs:
        lr = float(r.config["lr"])
        by_method[r.method][lr] = by_method[r.method].get(lr, True) and not r.collapsed()
    lines, empty = [], []
    for method, stable in sorted(by_method.items()):
        ok = sorted(lr for lr, s in stable.items() if s)
        lines.append(f"{method}: {', '.join(f'{lr:g}' for lr in ok) or 'none'} of {len(stable)} lrs")
        if not ok:
            empty.append(method)
    verdict = "WARN" if empty else "PASS"
    return Finding("lr_range", verdict, None, "stable lrs (no seed collapses): " + "; ".join(lines))


def check_sweep(sweep_dir: str | Path) -> list[Finding]:
    """Every check of the module table on the sweep at ``sweep_dir``."""
    path = Path(sweep_dir)
    runs = load_runs(path)
    if not runs:
        raise SweepCheckError(f"{path}: {RUNS_NAME} lists no runs")
    varied = _varied_keys(path)
    return [config_diff(runs, varied), seeds(runs), data_order(runs), paired(runs), lr_range(runs, varied)]


def write_arms_check(sweep_dir: str | Path) -> list[Finding]:
    """:func:`check_sweep`, written to ``ARMS_FILE`` in the sweep's directory (``steadyrl sweep`` calls it when its
    runs end, so every sweep carries the proof that its arms differ only where the grid says)."""
    findings = check_sweep(sweep_dir)
    payload = [dataclasses.asdict(f) for f in findings]
    (Path(sweep_dir) / ARMS_FILE).write_text(json.dumps(payload, indent=1) + "\n")
    return findings
