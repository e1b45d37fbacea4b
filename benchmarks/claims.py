"""The paper-claim tables of docs/results.md, from finished sweeps (``steadyrl sweep claims_lag``, ``claims_masking``).

Reads every run directory under the given sweep directories (names ``method=M,lag=K,seed=S``, possibly with more
grid keys such as ``lr=0.001``: the regime, shown beside the method), and prints markdown tables, one row per
(method, regime, lag), mean ± 95% Student-t interval over seeds:

* claim 1/2 (``claims_lag``): final and best eval accuracy, runs collapsed (eval 0.15 below the run's best so far),
  min per-batch ESS ratio, max mismatch k3, and the onsets: first step with a per-batch ESS ratio below 0.05, first
  step with k3 above 1, first collapsed eval;
* claim 4 (``claims_lag``): mean cos(g_t, g_{t−1}) over steps 20..end, and the fraction of steps with cos > 0.2;
* claim 3 (``claims_masking``): mean and max masked fraction (``geo_mis/masked_frac``, ``m2po/masked_frac`` for
  m2po) over steps, the fraction of steps masking > 90% of tokens, final eval accuracy;
* the learning-rate axis (runs with an ``lr`` grid key, ``regime_lr``): final accuracy per (method, lag) and lr, each
  stale method at the synchronous reference's best lr (grpo at lag 0, best mean final accuracy) and at its own best;
* every table shows the mean response length of its runs (``response/len_mean`` over all steps, in tokens).

    .venv/bin/python benchmarks/claims.py runs/claims_lag runs/claims_masking
    .venv/bin/python benchmarks/claims.py runs/regime_lr --plot-lr docs/img/regime_lr.png
    .venv/bin/python benchmarks/claims.py runs/regime_length
    .venv/bin/python benchmarks/claims.py runs/regime_lr --max-step 200   # the same sweep as if it had run 200 steps
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from steadyrl.sweep.config import REFERENCE_LAG, REFERENCE_METHOD
from steadyrl.sweep.results import collapse_step
from steadyrl.sweep.stats import mean_ci
from steadyrl.train.metrics import METRICS_FILE, read_metrics

MASK_KEYS = {"geo_mis": "geo_mis/masked_frac", "m2po": "m2po/masked_frac"}


def parse_name(name: str) -> dict[str, str]:
    """``method=vcpo,lag=64,seed=0`` → {method: vcpo, lag: 64, seed: 0}."""
    return dict(part.split("=", 1) for part in name.split(",") if "=" in part)


def first_step(records: Sequence[dict[str, Any]], test: Callable[[dict[str, Any]], bool]) -> int | None:
    return next((int(r["step"]) for r in records if "reward/mean" in r and test(r)), None)


def run_stats(records: list[dict[str, Any]], method: str) -> dict[str, Any]:
    train = [r for r in records if "reward/mean" in r]
    evals = [(int(r["step"]), float(r["eval/acc"])) for r in records if r.get("eval/acc") is not None]
    ess = [float(r["is/ess_ratio"]) for r in train if r.get("is/ess_ratio") is not None]
    k3 = [float(r["kl/k3"]) for r in train if r.get("kl/k3") is not None]
    lengths = [float(r["response/len_mean"]) for r in train if r.get("response/len_mean") is not None]
    cos = [float(r["grad/cos_prev"]) for r in train if r.get("grad/cos_prev") is not None and int(r["step"]) >= 20]
    out: dict[str, Any] = {
        "base": evals[0][1] if evals else None,
        "final": evals[-1][1] if evals else None,
        "best": max(a for _, a in evals) if evals else None,
        "collapse": collapse_step(evals),
        "min_ess": min(ess) if ess else None,
        "max_k3": max(k3) if k3 else None,
        "ess_onset": first_step(train, lambda r: r.get("is/ess_ratio") is not None and r["is/ess_ratio"] < 0.05),
        "kl_onset": first_step(train, lambda r: r.get("kl/k3") is not None and r["kl/k3"] > 1.0),
        "cos_mean": statistics.mean(cos) if cos else None,
        "cos_high": sum(c > 0.2 for c in cos) / len(cos) if cos else None,
        "resp_len": statistics.mean(lengths) if lengths else None,
    }
    key = MASK_KEYS.get(method)
    masked = [float(r[key]) for r in train if key and r.get(key) is not None]
    if masked:
        out |= {"mask_mean": statistics.mean(masked), "mask_max": max(masked),
                "mask_90": sum(m > 0.9 for m in masked) / len(masked)}
    return out


def pm(values: Sequence[float | None], digits: int = 3) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    ci = mean_ci(vals)
    return f"{ci.mean:.{digits}f} ± {ci.half_width:.{digits}f}"


def onsets(values: Sequence[int | None]) -> str:
    return ", ".join("-" if v is None else str(v) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="sweep directories")
    parser.add_argument("--max-step", type=int, default=None,
                        help="read every run only up to this step (its eval there is the final one): compares sweeps "
                        "of different lengths at the same step")  # fmt: skip
    parser.add_argument("--plot-lr", type=Path, default=None, help="write the accuracy-against-lr figure here (PNG)")
    args = parser.parse_args()
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for sweep in args.sweeps:
        for run in sorted(p for p in sweep.iterdir() if p.is_dir()):
            keys = parse_name(run.name)
            records = read_metrics(run / METRICS_FILE)
            finished = bool(records) and "reward/mean" not in records[-1] and records[-1].get("eval/acc") is not None
            if args.max_step is not None:  # the run as if it had stopped at that step (its eval there is the final)
                records = [r for r in records if int(r["step"]) < args.max_step or
                           (int(r["step"]) == args.max_step and r.get("eval/acc") is not None)]  # fmt: skip
            if not finished or "method" not in keys:
                continue  # still running, or not a run
            stats = run_stats(records, keys["method"]) | {"seed": int(keys.get("seed", 0))}
            regime = ", ".join(f"{k}={v}" for k, v in keys.items() if k not in ("method", "lag", "seed"))
            groups[keys["method"], regime, int(keys.get("lag", 0))].append(stats)
    lag_rows = sorted(k for k in groups if k[0] not in MASK_KEYS)

    def label(key: tuple[str, str, int]) -> str:
        return f"{key[0]} ({key[1]})" if key[1] else key[0]

    print("### Claims 1 and 2: accuracy, ESS and KL against lag\n")
    print("| method | lag | seeds | resp tokens | base acc | final acc | best acc | collapsed | min ESS ratio | "
          "max k3 | first ESS < 0.05 (per seed) | first k3 > 1 | collapsed at |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in lag_rows:
        runs = sorted(groups[key], key=lambda s: s["seed"])
        print(f"| {label(key)} | {key[2]} | {len(runs)} | {pm([r['resp_len'] for r in runs], 1)} | "
              f"{pm([r['base'] for r in runs])} | {pm([r['final'] for r in runs])} | {pm([r['best'] for r in runs])} | "
              f"{sum(r['collapse'] is not None for r in runs)}/{len(runs)} | "
              f"{pm([r['min_ess'] for r in runs])} | {pm([r['max_k3'] for r in runs], 2)} | "
              f"{onsets([r['ess_onset'] for r in runs])} | {onsets([r['kl_onset'] for r in runs])} | "
              f"{onsets([r['collapse'] for r in runs])} |")
    print("\n### Claim 4: consecutive-gradient cosine, sync vs async\n")
    print("| method | lag | seeds | mean cos(g_t, g_{t−1}), steps ≥ 20 | steps with cos > 0.2 |")
    print("|---|---|---|---|---|")
    for key in lag_rows:
        runs = groups[key]
        print(f"| {label(key)} | {key[2]} | {len(runs)} | {pm([r['cos_mean'] for r in runs])} | "
              f"{pm([r['cos_high'] for r in runs])} |")
    by_lr = lr_table(groups)
    if args.plot_lr is not None and by_lr:
        plot_lr(by_lr, args.plot_lr)
    mask_rows = sorted(k for k in groups if k[0] in MASK_KEYS)
    if mask_rows:
        print("\n### Claim 3: masked fraction against lag\n")
        print("| method | lag | seeds | resp tokens | mean masked fraction | max masked fraction | "
              "steps masking > 90% | final acc | collapsed |")
        print("|---|---|---|---|---|---|---|---|---|")
        for key in mask_rows:
            runs = groups[key]
            print(f"| {label(key)} | {key[2]} | {len(runs)} | {pm([r['resp_len'] for r in runs], 1)} | "
                  f"{pm([r.get('mask_mean') for r in runs])} | "
                  f"{pm([r.get('mask_max') for r in runs])} | {pm([r.get('mask_90') for r in runs])} | "
                  f"{pm([r['final'] for r in runs])} | {sum(r['collapse'] is not None for r in runs)}/{len(runs)} |")


def regime_without(regime: str, key: str) -> tuple[str, str | None]:
    """``"length=worked2, lr=0.001"`` without ``lr`` → (``"length=worked2"``, ``"0.001"``)."""
    parts = [p.split("=", 1) for p in regime.split(", ") if p]
    value = next((v for k, v in parts if k == key), None)
    return ", ".join(f"{k}={v}" for k, v in parts if k != key), value


LrCells = dict[tuple[str, str, int], dict[float, list[float]]]


def lr_table(groups: dict[tuple[str, str, int], list[dict[str, Any]]]) -> LrCells:
    """Final accuracy per lr; each stale (method, lag) at the sync reference's best lr and at its own best lr.
    Returns the final accuracies per (method, rest of the regime, lag) and lr (empty without an lr grid key)."""
    by_cell: LrCells = defaultdict(dict)
    by_seed: dict[tuple[str, str, int], dict[float, dict[int, float]]] = defaultdict(dict)
    for (method, regime, lag), runs in groups.items():
        rest, lr = regime_without(regime, "lr")
        if lr is not None:
            done = sorted((r for r in runs if r["final"] is not None), key=lambda r: r["seed"])
            by_cell[method, rest, lag][float(lr)] = [r["final"] for r in done]
            by_seed[method, rest, lag][float(lr)] = {r["seed"]: r["final"] for r in done}
    if not by_cell:
        return by_cell
    lrs = sorted({lr for cell in by_cell.values() for lr in cell})
    print("\n### Learning rate: final accuracy per lr (mean ± 95% CI over seeds; best lr of each row in bold)\n")
    print("| method | lag | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |")
    print("|---|---|" + "---|" * (len(lrs) + 1))
    best: dict[tuple[str, str, int], float] = {}
    for cell in sorted(by_cell):
        finals = by_cell[cell]
        best[cell] = max(finals, key=lambda lr: statistics.mean(finals[lr]) if finals[lr] else -1.0)
        cells = [(f"**{pm(finals[lr])}**" if lr == best[cell] else pm(finals[lr])) if lr in finals else "-"
                 for lr in lrs]
        name = f"{cell[0]} ({cell[1]})" if cell[1] else cell[0]
        print(f"| {name} | {cell[2]} | " + " | ".join(cells) + f" | {best[cell]:g} |")
    print("\n| method | lag | sync's best lr | sync's final there | method's final at sync's best lr | "
          "method's best lr | method's final there | Δ vs sync's best (own best lr) | Δ per seed (same seed) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cell in sorted(by_cell):
        method, rest, lag = cell
        sync = (REFERENCE_METHOD, rest, REFERENCE_LAG)
        if cell == sync or sync not in best:
            continue
        sync_lr, own_lr = best[sync], best[cell]
        sync_acc = statistics.mean(by_cell[sync][sync_lr])
        at_sync = by_cell[cell].get(sync_lr, [])
        own = by_cell[cell][own_lr]
        name = f"{method} ({rest})" if rest else method
        sync_seeds, own_seeds = by_seed[sync][sync_lr], by_seed[cell][own_lr]
        paired = ", ".join(f"{own_seeds[k] - sync_seeds[k]:+.3f}" for k in sorted(own_seeds) if k in sync_seeds)
        print(f"| {name} | {lag} | {sync_lr:g} | {sync_acc:.3f} | {pm(at_sync)} | {own_lr:g} | {pm(own)} | "
              f"{statistics.mean(own) - sync_acc:+.3f} | {paired or '-'} |")
    return by_cell


def plot_lr(by_cell: LrCells, path: Path) -> None:
    """Final accuracy against lr (log axis), one line per (method, lag): mean ± 95% CI, single seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for i, cell in enumerate(sorted(by_cell)):
        method, rest, lag = cell
        lrs = sorted(lr for lr in by_cell[cell] if by_cell[cell][lr])
        dodge = 1.0 + 0.04 * (i - (len(by_cell) - 1) / 2)  # side by side on the log axis
        cis = [mean_ci(by_cell[cell][lr]) for lr in lrs]
        name = f"{method} lag {lag}" + (f" ({rest})" if rest else "")
        line = ax.errorbar([lr * dodge for lr in lrs], [c.mean for c in cis], yerr=[c.half_width for c in cis],
                           marker="o", capsize=3, label=name)  # fmt: skip
        for lr in lrs:
            ax.scatter([lr * dodge] * len(by_cell[cell][lr]), by_cell[cell][lr], s=9, alpha=0.45,
                       color=line[0].get_color())  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final eval accuracy")
    ax.set_title("Final accuracy against lr: mean ± 95% CI over seeds (dots: single seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
