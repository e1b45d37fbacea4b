"""Every table of measured numbers in the README and docs/ carries its provenance.

A markdown table is *measured* when one of its rows has two or more cells, past the first (the row's label), that
read as a measurement: a number with an interval (``0.55 ± 0.31``), a ratio (``2.2×``), a unit of time, memory, speed
or a percentage (``609 ms``, ``1.4 GiB``, ``8,414 tok/s``, ``19%``), a before → after pair (``0.418 → 0.736``), or a
bare decimal (``0.028``). Option tables (one default per row) and catalogs are not measured.

Its *provenance* is a paragraph that starts with ``Provenance:`` in the same section as the table (the lines between
the nearest heading above the table and the next heading of any level), and states the date (``YYYY-MM-DD``), the
commit (``commit 91aa057``), the machine type (a phrase naming the machine, CPU or GPU) and the command, as a code
span after ``command:``. ``benchmarks/_provenance.py`` prints such a line with a benchmark's results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_NUM = r"-?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?"
_MEASURED = re.compile(
    rf"{_NUM}\s*±|{_NUM}\s*×|{_NUM}\s*(?:ms|s|min|h|GiB|MiB|GB|MB|KiB|tok/s|tokens/s|GFLOP/s|%)(?![\w/])"
    rf"|{_NUM}\s*→\s*{_NUM}|^~?-?\d[\d,]*\.\d+$"
)
_HEADING = re.compile(r"^#{1,6} ")
_BARE = re.compile(r"^~?-?\d[\d,]*\.\d+$")
_PROVENANCE = re.compile(
    r"Provenance: .*?\b\d{4}-\d{2}-\d{2}\b.*?\bcommits? [0-9a-f]{7,40}\b.*?\b(?:machine|CPU|GPU)\b.*?command: `[^`]+`",
    re.S,
)


@dataclass(frozen=True)
class Table:
    """A markdown table: its file, first line (1-based) and whether it holds measured numbers."""

    path: Path
    line: int
    measured: bool


def _cells(line: str) -> list[str]:
    return [c.strip().replace("*", "").replace("`", "").strip() for c in line.strip().strip("|").split("|")]


_ARXIV = re.compile(r"^\d{4}\.\d{4,5}$")


def is_measurement(cell: str) -> bool:
    """Whether a table cell reads as a measured number (see the module docstring); an arXiv id is not one."""
    return bool(_MEASURED.search(cell)) and not _ARXIV.match(cell)


def sections(text: str) -> list[tuple[int, list[str]]]:
    """The markdown's sections outside code fences, each as its first line (1-based) and its lines (code fences blanked
    so that a ``#`` comment in a code block is not a heading)."""
    out: list[tuple[int, list[str]]] = []
    start, current, fenced = 1, [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            current.append("")
            continue
        if not fenced and _HEADING.match(line):
            out.append((start, current))
            start, current = number, []
        current.append("" if fenced else line)
    out.append((start, current))
    return out


def tables(path: Path, lines: list[str], first: int) -> list[Table]:
    """The tables of one section."""
    found: list[Table] = []
    i = 0
    while i < len(lines):
        if lines[i].lstrip().startswith("|") and i + 1 < len(lines) and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1]):
            options = "default" in _cells(lines[i])  # an option table: defaults, not measurements
            j = i + 2
            measured, marked = False, 0
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                cells = _cells(lines[j])[1:]
                measured |= sum(is_measurement(c) for c in cells) >= 2
                marked += sum(is_measurement(c) and not _BARE.match(c) for c in cells)
                j += 1
            measured |= marked >= 2
            found.append(Table(path, first + i, measured and not options))
            i = j
        else:
            i += 1
    return found


def has_provenance(lines: list[str]) -> bool:
    """Whether the section holds a complete provenance paragraph."""
    text = "\n".join(lines)
    for m in re.finditer(r"Provenance: ", text):
        paragraph = text[m.start() :].split("\n\n", 1)[0]
        if _PROVENANCE.match(paragraph):
            return True
    return False


def unprovenanced(path: Path) -> list[Table]:
    """The measured tables of a markdown file whose section has no provenance paragraph."""
    out = []
    for first, lines in sections(path.read_text()):
        if not has_provenance(lines):
            out += [t for t in tables(path, lines, first) if t.measured]
    return out


@pytest.mark.parametrize(
    ("cell", "measured"),
    [("0.555 ± 0.313", True), ("2.2×", True), ("609 ms", True), ("1.4 GiB", True), ("19.4%", True), ("0.028", True),
     ("0.418 → 0.736", True), ("8,414 tok/s", True), ("0.5", True), ("`seq_tis`", False), ("2602.17616", False),
     ("holds", False), ("1e-8", False), ("a cap of 8", False), ("True", False), ("64", False)],
)  # fmt: skip
def test_what_reads_as_a_measurement(cell: str, measured: bool) -> None:
    assert is_measurement(cell) is measured


def test_a_measured_table_needs_a_provenance_paragraph_in_its_section(tmp_path: Path) -> None:
    table = "| method | ms | ratio |\n|---|---|---|\n| grpo | 273 ms | 1.00× |\n| vcpo | 609 ms | 2.23× |\n"
    options = "| option | default | meaning |\n|---|---|---|\n| `eps` | 0.2 | the clip |\n"
    line = "Provenance: 2026-12-03, commit 91aa057, 2-core x86_64 CPU machine · command: `python b.py`\n"
    doc = tmp_path / "doc.md"
    doc.write_text(f"# A\n\n{table}\n## B\n\n{line}\n## C\n\n{options}")
    assert [t.line for t in unprovenanced(doc)] == [3]  # the line sits in another section; options need none
    doc.write_text(f"# A\n\n{table}\n{line.replace(', commit 91aa057', '')}")
    assert len(unprovenanced(doc)) == 1  # no commit: incomplete
    doc.write_text(f"# A\n\n{table}\nProvenance: 2026-12-03, commit 91aa057,\n2-core CPU machine · command: `x`\n")
    assert unprovenanced(doc) == []  # a paragraph may wrap


def test_every_measured_table_in_the_readme_and_docs_has_its_provenance() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = [t for f in files for t in unprovenanced(f)]
    assert not missing, (
        f"{len(missing)} table(s) of measured numbers have no 'Provenance: DATE, commit HASH, MACHINE · command: "
        "`CMD`' paragraph in their section (benchmarks/_provenance.py prints one):\n"
        + "\n".join(f"{t.path.relative_to(ROOT)}:{t.line}" for t in missing)
    )


def test_the_benchmarks_provenance_line_is_what_the_lint_accepts() -> None:
    from tests.benchmark_scripts import load_benchmark

    provenance = load_benchmark("_provenance")
    line = provenance.provenance_line(["benchmarks/learner_step.py", "--methods", "grpo,vcpo"])
    assert _PROVENANCE.match(line), line
    assert line.endswith("command: `python benchmarks/learner_step.py --methods grpo,vcpo`")
    assert re.search(r", commit ([0-9a-f]{7,40}(-dirty)?|unknown), \d+-core ", line), line
