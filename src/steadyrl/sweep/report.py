"""``steadyrl report``: one self-contained HTML page (PNG plots embedded as base64, no scripts) plus the PNGs beside it.

For a **sweep** directory (it has ``runs.json``):

1. the summary table: mean ± 95% CI over seeds per (method, lag, other grid keys) (:mod:`steadyrl.sweep.results`);
2. accuracy against lag, one line per method: final and best eval accuracy, mean ± 95% CI over seeds;
3. per lag, curves against the learner step of eval accuracy, batch reward, ESS ratio (``is/ess_ratio``), mismatch
   KL (``kl/k3``), gradient norm (``grad/norm``) and gradient cosine (``grad/cos_prev``): one colour per method,
   thin lines for single seeds, a thick line for their mean; per-step signals are smoothed with a centred moving
   average over ``max(1, steps // 60)`` steps; in the accuracy panel the lag-0 grpo reference (when the sweep has
   one) is a dashed grey line;
4. the per-run table (``results.csv``'s rows).

For a single **run** directory (it has ``metrics.jsonl``): its curves, its results row, and its collapse-guard alarms.

The PNGs are written next to the HTML file as ``<stem>_<plot>.png``; matplotlib draws off-screen (Agg), without
pyplot's global state.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from steadyrl.config.io import ConfigError, read_yaml
from steadyrl.sweep.config import RUNS_FILE, SWEEP_FILE, RunEntry, entry_of_run, read_runs
from steadyrl.sweep.results import (
    AGGREGATED,
    COLLAPSE_DROP,
    COMPLETE,
    columns,
    fmt,
    grid_keys,
    is_train_record,
    mean_pm,
    results_rows,
    run_row,
    summary_rows,
)
from steadyrl.train.collapse_guard import read_alarms
from steadyrl.train.metrics import METRICS_FILE, read_metrics

REPORT_FILE = "report.html"
#: (metric key, panel title, y scale) of the curve panels.
CURVE_PANELS: tuple[tuple[str, str, str], ...] = (
    ("eval/acc", "held-out accuracy [eval/acc]", "linear"),
    ("reward/mean", "batch reward [reward/mean]", "linear"),
    ("is/ess_ratio", "ESS ratio [is/ess_ratio]", "log"),
    ("kl/k3", "mismatch KL, k3 [kl/k3]", "log"),
    ("grad/norm", "gradient norm [grad/norm]", "log"),
    ("grad/cos_prev", "cos(g_t, g_t−1) [grad/cos_prev]", "linear"),
)
#: Smoothing window of per-step curves: steps // SMOOTH_DIV steps.
SMOOTH_DIV = 60
DPI = 100
CURVES_SIZE = (13.0, 7.5)
LAG_SIZE = (11.0, 4.2)
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.9em; color: #555; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
"""


class ReportError(ValueError):
    """The directory is neither a run nor a sweep, or its files cannot be read."""


@dataclass(frozen=True)
class Plot:
    """One plot: its file name stem, caption and PNG bytes."""

    slug: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Report:
    """What :func:`write_report` wrote."""

    html: Path
    pngs: tuple[Path, ...]


# ------------------------------------------------------------------------------------------------ plotting
def _figure(size: tuple[float, float]) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=size, dpi=DPI)


def _colors(names: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key``: learner-step lines only, except eval accuracy (which has a final line too)."""
    pts = [(int(r["step"]), float(r[key])) for r in records
           if r.get(key) is not None and (key == "eval/acc" or is_train_record(r))]
    if not pts:
        return np.zeros(0), np.zeros(0)
    xs, ys = zip(*pts, strict=True)
    return np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)


def smooth(ys: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` points (shorter at the ends); NaNs are skipped."""
    if window <= 1 or ys.size == 0:
        return ys
    half = window // 2
    out = np.empty_like(ys)
    for i in range(ys.size):
        chunk = ys[max(0, i - half): i + half + 1]
        finite = chunk[np.isfinite(chunk)]
        out[i] = finite.mean() if finite.size else np.nan
    return out


def _mean_curve(curves: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Mean over runs at each step that any run has (runs missing a step do not count there)."""
    by_step: dict[float, list[float]] = {}
    for xs, ys in curves:
        for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
            if math.isfinite(y):
                by_step.setdefault(x, []).append(y)
    steps = sorted(by_step)
    return np.asarray(steps), np.asarray([float(np.mean(by_step[s])) for s in steps])


def curves_plot(groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], *, title: str,
                reference: Sequence[Sequence[Mapping[str, Any]]] = (), alarms: Sequence[int] = ()) -> bytes:
    """The curve panels for ``groups`` (label -> the records of each seed's run); PNG bytes. ``reference``: runs
    drawn dashed in the accuracy panel; ``alarms``: steps marked by a dotted red line in every panel."""
    fig = _figure(CURVES_SIZE)
    axes = fig.subplots(2, 3, sharex=True).flat
    colors = _colors(list(groups))
    steps = max((int(r["step"]) for runs in groups.values() for recs in runs for r in recs), default=1)
    window = max(1, steps // SMOOTH_DIV)
    for ax, (key, panel, scale) in zip(axes, CURVE_PANELS, strict=True):
        drawn = False
        for name, runs in groups.items():
            curves = []
            for recs in runs:
                xs, ys = _series(recs, key)
                if xs.size == 0:
                    continue
                if key != "eval/acc":
                    ys = smooth(ys, window)
                curves.append((xs, ys))
            if not curves:
                continue
            drawn = True
            marker = "o" if key == "eval/acc" else None
            if len(curves) > 1:
                for xs, ys in curves:
                    ax.plot(xs, ys, color=colors[name], linewidth=0.6, alpha=0.35)
            mx, my = _mean_curve(curves)
            ax.plot(mx, my, color=colors[name], linewidth=1.8, marker=marker, markersize=3, label=name)
        if key == "eval/acc" and reference:
            curves = [c for c in (_series(recs, key) for recs in reference) if c[0].size]
            if curves:
                mx, my = _mean_curve(curves)
                ax.plot(mx, my, color="0.5", linestyle="--", linewidth=1.2, label="grpo, lag 0")
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif scale == "log" and any(np.any(line.get_ydata() > 0) for line in ax.get_lines()):
            ax.set_yscale("log", nonpositive="mask")
        for i, step in enumerate(alarms):
            ax.axvline(step, color="tab:red", linestyle=":", linewidth=1, label="guard alarm" if i == 0 else None)
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3)
    axes_list = list(fig.axes)
    for ax in axes_list[3:]:
        ax.set_xlabel("learner step")
    handles, labels = axes_list[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=9, frameon=False)
    note = f"; per-step signals: moving average over {window} steps" if window > 1 else ""
    fig.suptitle(f"{title}{note}", fontsize=11)
    fig.tight_layout(rect=(0, 0.06 if handles else 0, 1, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _line_name(row: Mapping[str, Any], keys: Sequence[str]) -> str:
    return ", ".join([str(row["method"]), *(f"{k}={row[k]}" for k in keys if row.get(k) is not None)])


def lag_plot(summary: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> bytes:
    """Final and best eval accuracy against lag, one line per method (and other grid values): mean ± 95% CI over
    seeds, each seed a small dot. Lags are equally spaced categories; methods are dodged sideways at each lag; the
    lag-0 grpo mean (when present) is a dashed grey line across the panel."""
    fig = _figure(LAG_SIZE)
    axes = fig.subplots(1, 2, sharey=True)
    lines: dict[str, list[Mapping[str, Any]]] = {}
    for agg in summary:
        lines.setdefault(_line_name(agg, keys), []).append(agg)
    colors = _colors(list(lines))
    lags = sorted({int(a["lag"]) for a in summary})
    pos = {lag: i for i, lag in enumerate(lags)}
    at_lag = {lag: [n for n, aggs in lines.items() if any(int(a["lag"]) == lag for a in aggs)] for lag in lags}

    def x(name: str, lag: int) -> float:  # dodge the lines present at this lag around its position
        names = at_lag[lag]
        width = 0.7 / max(1, len(names))
        return pos[lag] + (names.index(name) - (len(names) - 1) / 2) * width

    ref = [a for a in summary if a["method"] == "grpo" and int(a["lag"]) == 0]
    for ax, (metric, title) in zip(axes, (("final_acc", "final eval accuracy"), ("best_acc", "best eval accuracy")),
                                   strict=True):
        if len(ref) == 1 and ref[0][f"{metric}_mean"] is not None:
            ax.axhline(ref[0][f"{metric}_mean"], color="0.5", linestyle="--", linewidth=1, label="grpo, lag 0 (mean)")
        for name, aggs in lines.items():
            pts = sorted((x(name, int(a["lag"])), a[f"{metric}_mean"], a[f"{metric}_ci95"]) for a in aggs
                         if a[f"{metric}_mean"] is not None)
            if not pts:
                continue
            err = [p[2] if p[2] is not None else 0.0 for p in pts]
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=err, color=colors[name], marker="o",
                        markersize=5, capsize=3, linewidth=1.2, label=name)
            seeds = [(x(name, int(r["lag"])), r[metric]) for r in rows
                     if _line_name(r, keys) == name and r[metric] is not None and r["status"] in COMPLETE]
            if seeds:
                ax.scatter(*zip(*seeds, strict=True), s=10, color=colors[name], alpha=0.5, zorder=3)
        ax.set_xticks(range(len(lags)), [str(x) for x in lags])
        ax.set_xlim(-0.5, len(lags) - 0.5)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("policy lag k")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (intervals clipped to the panel)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.suptitle("Eval accuracy against policy lag: mean ± 95% CI (Student t) over seeds; dots = single seeds",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


# ----------------------------------------------------------------------------------------------------- HTML
def _table(rows: Sequence[Sequence[Any]], head: Sequence[str], *, left: int = 1) -> str:
    """An HTML table; the first ``left`` columns are left-aligned text."""
    def cell(tag: str, i: int, value: Any) -> str:
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{html.escape(str(value))}</{tag}>"

    out = ["<table>", "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(head)) + "</tr>"]
    out += ["<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows]
    return "\n".join([*out, "</table>"])


def _img(plot: Plot, src_name: str) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    cap = html.escape(plot.caption)
    return (f'<figure id="{html.escape(plot.slug)}"><img src="data:image/png;base64,{data}" alt="{cap}">'
            f"<figcaption>{cap} (also <code>{html.escape(src_name)}</code>)</figcaption></figure>")


def _page(title: str, parts: Sequence[str]) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>", f"<style>{_STYLE}</style>", "</head>", "<body>",
        f"<h1>{html.escape(title)}</h1>", f"<p>Generated by <code>steadyrl report</code>, {stamp}.</p>", *parts,
        "</body>", "</html>", "",
    ])


def _results_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str]) -> str:
    return _table([[fmt(r.get(c)) for c in cols] for r in rows], cols, left=3)


def _summary_table(summary: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str:
    head = ["method", "lag", *keys, "runs", *(h for _, h in AGGREGATED), "collapsed"]
    rows = [[*(a.get(k, "") for k in ("method", "lag", *keys)), a["runs"], *(mean_pm(a, m) for m, _ in AGGREGATED),
             f"{a['collapsed']}/{a['n']}"] for a in summary]
    return _table(rows, head, left=1)


def _pre(title: str, path: Path) -> str:
    if not path.is_file():
        return ""
    return f"<details><summary>{html.escape(title)}</summary><pre>{html.escape(path.read_text())}</pre></details>"


# --------------------------------------------------------------------------------------------------- build
def _sweep_parts(src: Path) -> tuple[str, list[str], list[Plot]]:
    entries = read_runs(src)
    drop = COLLAPSE_DROP
    if (src / SWEEP_FILE).is_file():
        with contextlib.suppress(ConfigError, TypeError, ValueError):
            drop = float(read_yaml(src / SWEEP_FILE).get("collapse_drop", drop))
    rows = results_rows(entries, src, drop=drop)
    keys = grid_keys(entries)
    summary = summary_rows(rows, keys)
    plots = [Plot("acc_vs_lag", "Eval accuracy against policy lag, per method: mean ± 95% CI over seeds",
                  lag_plot(summary, rows, keys))]
    records = {e.name: read_metrics(src / e.name / METRICS_FILE) for e in entries}
    refs = [records[e.name] for e, r in zip(entries, rows, strict=True) if e.reference and r["status"] in COMPLETE]
    for lag in sorted({e.lag for e in entries}):
        groups: dict[str, list[list[dict[str, Any]]]] = {}
        for e in entries:
            if e.lag == lag and records[e.name]:
                label = ", ".join([e.method, *(f"{k}={e.labels[k]}" for k in keys if k in e.labels)])
                groups.setdefault(label, []).append(records[e.name])
        if groups:
            plots.append(Plot(f"curves_lag{lag}", f"Curves at lag {lag}: one colour per method, thin lines = seeds",
                              curves_plot(groups, title=f"lag {lag}", reference=refs if lag != 0 else ())))
    parts = [
        f"<p>Sweep directory <code>{html.escape(str(src.resolve()))}</code>: {len(entries)} runs planned, "
        f"{sum(r['status'] in COMPLETE for r in rows)} complete. Collapse = an eval more than {drop:g} below the "
        "run's best so far.</p>",
        "<h2>Summary</h2>", _summary_table(summary, keys),
        *_arms_section(src),
    ]
    return f"steadyrl sweep report: {src.resolve().name}", [*parts, "<h2>Plots</h2>", "{plots}",
                                                          "<h2>Runs</h2>", _results_table(rows, columns(entries)),
                                                          _pre("sweep.yaml", src / SWEEP_FILE)], plots


def _run_parts(src: Path) -> tuple[str, list[str], list[Plot]]:
    from steadyrl.config.io import load_config
    from steadyrl.config.train import TrainConfig
    from steadyrl.train.loop import CONFIG_FILE

    try:
        cfg = load_config(TrainConfig, path=src / CONFIG_FILE)
    except ConfigError as err:
        raise ReportError(f"{src}: cannot read the run's {CONFIG_FILE}: {err}") from None
    entry: RunEntry = entry_of_run(src.resolve(), cfg)
    row = run_row(entry, src)
    records = read_metrics(src / METRICS_FILE)
    title = f"{cfg.task.name} · {cfg.method.name} · lag {cfg.runtime.lag.k} · seed {cfg.seed}"
    alarms = read_alarms(src)
    curves = curves_plot({cfg.method.name: [records]}, title=title, alarms=[int(a["step"]) for a in alarms])
    plots = [Plot("curves", f"Curves of the run ({title}); dotted red lines: collapse-guard alarms", curves)]
    parts = [f"<p>Run directory <code>{html.escape(str(src.resolve()))}</code>.</p>", "<h2>Summary</h2>"]
    cols = [c for c in columns([entry]) if c != "final_acc_rel"]
    parts += [_table([[c, fmt(row.get(c))] for c in cols], ["key", "value"], left=1), "<h2>Curves</h2>", "{plots}"]
    if alarms:
        parts += ["<h2>Collapse-guard alarms</h2>",
                  _table([[a.get("step"), a.get("action"), a.get("reason")] for a in alarms],
                         ["step", "action", "reason"], left=0)]
    parts.append(_pre("config.yaml", src / CONFIG_FILE))
    return f"steadyrl run report: {src.resolve().name}", parts, plots


def _arms_section(src: Path) -> list[str]:
    """Whether the arms are a fair comparison (``steadyrl check sweep``'s findings: the resolved-config diff, the
    seeds, the data order, paired per-seed differences, each method's stable lr range)."""
    from steadyrl.check.sweep import SweepCheckError, check_sweep

    try:
        findings = check_sweep(src)
    except (OSError, SweepCheckError) as err:
        return ["<h2>Fair comparison</h2>", f"<p>Not checked: {html.escape(str(err))}</p>"]
    rows = [[f.rule, f.verdict, f.message] for f in findings]
    return ["<h2>Fair comparison</h2>", _table(rows, ["check", "verdict", "finding"], left=3)]


def write_report(src: Path, out: Path | None = None) -> Report:
    """Write the HTML report of a sweep or run directory ``src`` (default ``<src>/report.html``) and its PNGs."""
    src = Path(src)
    if (src / RUNS_FILE).is_file():
        title, parts, plots = _sweep_parts(src)
    elif (src / METRICS_FILE).is_file():
        title, parts, plots = _run_parts(src)
    elif src.is_dir():
        raise ReportError(f"{src} is neither a run directory (no {METRICS_FILE}) nor a sweep directory (no "
                          f"{RUNS_FILE})")
    else:
        raise ReportError(f"{src} does not exist or is not a directory")
    out = Path(out) if out is not None else src / REPORT_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    pngs = []
    figures = []
    for plot in plots:
        path = out.parent / f"{out.stem}_{plot.slug}.png"
        path.write_bytes(plot.png)
        pngs.append(path)
        figures.append(_img(plot, path.name))
    body = [("\n".join(figures) if p == "{plots}" else p) for p in parts if p]
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(_page(title, body), encoding="utf-8")
    tmp.replace(out)
    return Report(out, tuple(pngs))
