"""``steadyrl report``: a self-contained HTML page that parses, embeds the expected plots and holds the table values."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from steadyrl.sweep.config import write_runs
from steadyrl.sweep.entry import report_main
from steadyrl.sweep.report import ReportError, write_report
from steadyrl.sweep.results import fmt, results_rows, summary_rows
from tests.sweep.conftest import fake_run, fake_spec_run, plan

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "headless_shell")


class Page(HTMLParser):
    """Collects images, table cells, scripts and external references of a page; fails on unbalanced tags."""

    VOID = frozenset({"meta", "img", "br", "hr", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str | None]] = []
        self.cells: list[str] = []
        self.stack: list[str] = []
        self.scripts = 0
        self.external: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img":
            self.images.append(a)
        if tag == "script":
            self.scripts += 1
        for key in ("src", "href"):
            if a.get(key) and not str(a[key]).startswith(("data:", "#")):
                self.external.append(str(a[key]))
        if tag in ("td", "th"):
            self._cell = []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"unbalanced </{tag}> (open: {self.stack[-3:]})"
        self.stack.pop()
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    assert page.stack == [], page.stack
    return page


def embedded_pngs(page: Page) -> list[bytes]:
    prefix = "data:image/png;base64,"
    srcs = [str(img["src"]) for img in page.images]
    assert all(s.startswith(prefix) for s in srcs)
    return [base64.b64decode(s[len(prefix):]) for s in srcs]


@pytest.fixture
def sweep_dir(tmp_path: Path) -> Path:
    """A fake sweep: vcpo and seq_tis at lags 4 and 8, grpo at lag 0, seeds 0 and 1 (one seq_tis run missing)."""
    specs = plan(tmp_path, grid={"method": ["vcpo", "seq_tis"], "lag": [4, 8]},
                 include=[{"method": ["grpo"], "lag": [0]}], seeds=[0, 1])
    for i, s in enumerate(specs):
        if s.entry.name != "method=seq_tis,lag=8,seed=1":
            drop = 0.3 if s.entry.method == "seq_tis" and s.entry.lag == 8 else 0.0
            fake_spec_run(s, evals=[0.4, 0.5 + 0.01 * i, 0.55, 0.6 - drop + 0.02 * s.entry.seed],
                          kl=[0.0] * 6 if s.entry.lag == 0 else None)
    write_runs(tmp_path / "sweep", specs)
    return tmp_path / "sweep"


def test_sweep_report_parses_embeds_the_plots_and_holds_the_tables(sweep_dir: Path) -> None:
    report = write_report(sweep_dir)
    assert report.html == sweep_dir / "report.html"
    assert [p.name for p in report.pngs] == ["report_acc_vs_lag.png", "report_curves_lag0.png",
                                             "report_curves_lag4.png", "report_curves_lag8.png"]
    page = parse(report.html)
    assert page.scripts == 0 and page.external == []
    pngs = embedded_pngs(page)
    assert len(pngs) == 4 and [p.read_bytes() for p in report.pngs] == pngs
    assert all(b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) > 5000 for b in pngs)
    assert all(img.get("alt") for img in page.images)
    from steadyrl.sweep.config import read_runs

    entries = read_runs(sweep_dir)
    rows = results_rows(entries, sweep_dir)
    summary = summary_rows(rows, [])
    st8 = next(a for a in summary if a["method"] == "seq_tis" and a["lag"] == 8)
    assert st8["runs"] == "1/2" and st8["final_acc_ci95"] is None
    for agg in summary:  # every summary row's values appear as cells
        assert agg["runs"] in page.cells
        mean, half = fmt(agg["final_acc_mean"]), fmt(agg["final_acc_ci95"])
        assert (f"{mean} ± {half}" if half else mean) in page.cells
    for row in rows:  # and every run's row
        assert row["run"] in page.cells and row["config_hash"] in page.cells
        assert fmt(row["final_acc"]) in page.cells
    assert "missing" in page.cells


def test_run_report_and_cli(tmp_path: Path, capsys) -> None:
    specs = plan(tmp_path, grid={"method": ["seq_tis"]})
    run = fake_spec_run(specs[0], evals=[0.4, 0.6, 0.3, 0.35], alarms=[(3, "warn")])
    out = tmp_path / "elsewhere" / "run.html"
    assert report_main([str(run), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    page = parse(out)
    assert len(embedded_pngs(page)) == 1 and (out.parent / "run_curves.png").is_file()
    cells = dict(zip(page.cells[2::2], page.cells[3::2], strict=False))  # the key/value table comes first
    assert cells["final_acc"] == "0.350" and cells["best_acc"] == "0.600" and cells["collapse_step"] == "4"
    assert cells["status"] == "finished" and cells["guard_alarms"] == "1"
    assert "test" in page.cells  # the alarm's reason
    assert not (run / "report.html").exists()


def test_report_errors_in_plain_words(tmp_path: Path, capsys) -> None:
    assert report_main([str(tmp_path)]) == 2
    assert "neither a run directory (no metrics.jsonl) nor a sweep directory (no runs.json)" in capsys.readouterr().err
    assert report_main([str(tmp_path / "nope")]) == 2
    fake_run(tmp_path / "bare")  # metrics but no config.yaml
    with pytest.raises(ReportError, match=r"cannot read the run's config\.yaml"):
        write_report(tmp_path / "bare")


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@pytest.mark.skipif(_chromium() is None, reason="no headless Chromium binary on PATH (tried: " + ", ".join(
    CHROMIUM_NAMES) + "); install Debian's `chromium` package to run this browser check")
def test_report_renders_in_headless_chromium(sweep_dir: Path, tmp_path: Path) -> None:
    report = write_report(sweep_dir)
    exe = _chromium()
    assert exe is not None
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files",
             f"--user-data-dir={tmp_path / 'profile'}"]
    env = {**os.environ, "HOME": str(tmp_path)}
    dom = subprocess.run([*flags, "--dump-dom", report.html.as_uri()], capture_output=True, text=True, timeout=120,
                         env=env, check=True).stdout
    page = Page()
    page.feed(dom)
    assert len(embedded_pngs(page)) == 4
    shot = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1400,3000", report.html.as_uri()],
                   capture_output=True, timeout=120, env=env, check=True)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[0] >= 1000 and (pixels[..., :3] < 0.5).mean() > 0.005  # plots were drawn, not blank
