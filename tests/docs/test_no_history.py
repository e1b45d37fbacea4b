"""What ships speaks of the product, not of how it was built.

README, docs, sources, tests, benchmarks, examples, scripts and configs may not name the work sessions, the team's
notes folder or its maths notes file, the task statement, "was open" columns or this project's own issue numbers. A
reader has none of those. Citations of other projects ("TRL issue 6945", "verl PR 7245") and URLs stay allowed.

The banned words are built from pieces so that this file does not ban itself.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What is scanned: every text file under these (README.md alone).
SCANNED = ("README.md", "docs", "src", "tests", "benchmarks", "examples", "scripts")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".toml", ".txt", ".cfg", ".ini", ".json", ".html"}

_SESSION = "sess" + "ion"
_NOTES = "sha" + "red/"
_MATHS = "ALGO" + "RITHMS" + r"\.md"
_TASK = "the bri" + "ef"
_WAS_OPEN = r"\(was " + "open" + r"\)"

#: Banned outright (case-insensitive): pattern → what to write instead.
BANNED: dict[str, str] = {
    rf"\b{_SESSION}[- ]\d+": "say what the product does or measured, with a date and commit where it matters",
    rf"(?<![\w.-]){_NOTES}": "docs/ must stand alone: put what the reader needs in the docs",
    rf"(?-i:\b{_MATHS})": "cite docs/algorithms.md or the paper",
    rf"\b{_TASK}\b": "state the requirement itself",
    _WAS_OPEN: "state what holds now",
}

#: Other projects whose issues and pull requests may be cited by number ("TRL issue 6945", "verl PR 7245").
OTHER_PROJECTS = (
    "trl", "verl", "vllm", "openrlhf", "skyrl", "areal", "pytorch", "torch", "transformers", "ray", "deepspeed",
    "hugging ?face", "accelerate", "peft", "safetensors", "reasoning[-_ ]?gym", "slime", "prime-rl", "nemo-rl",
    "megatron", "sglang", r"llama\.cpp", "gguf", "cpython", "python", "numpy", "jax", "triton", "flash-attn",
    "flash ?attention", "beartype", "jaxtyping", "hypothesis", "pytest", "ruff", "wandb", "mlflow", "tensorboard",
)  # fmt: skip
_ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?)\s+#?\d+|(?<![\w&/#])#\d{1,4}\b(?![\w;-])", re.I)
_CITED = re.compile(r"(?:\b(?:" + "|".join(OTHER_PROJECTS) + r")\b|github\.com/|https?://)[^\n]{0,40}$", re.I)


def shipped_files() -> list[Path]:
    """Every scanned text file of the work tree (caches and build outputs left out)."""
    out: list[Path] = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            out.append(path)
            continue
        for file in sorted(path.rglob("*")):
            parts = set(file.relative_to(ROOT).parts)
            skipped = parts & {"__pycache__", ".pytest_cache"} or any(p.endswith(".egg-info") for p in parts)
            if file.is_file() and file.suffix in SUFFIXES and not skipped:
                out.append(file)
    return out


def history_hits(text: str) -> list[tuple[int, str, str]]:
    """(line, what matched, the fix) for every banned phrase and every internal issue number in ``text``."""
    hits: list[tuple[int, str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, fix in BANNED.items():
            for m in re.finditer(pattern, line, re.I):
                hits.append((number, m.group(0), fix))
        for m in _ISSUE.finditer(line):
            if not _CITED.search(line[: m.start()]):
                hits.append((number, m.group(0), "name the other project it belongs to, or state the fact itself"))
    return hits


@pytest.mark.parametrize(
    ("text", "banned"),
    [
        (f"measured in {_SESSION} 11 on this machine", True),
        (f"as {_SESSION}-9 found", True),
        (f"see ../{_NOTES}DESIGN.md", True),
        ("see ALGO" + "RITHMS.md section 3", True),
        (f"as {_TASK} asks", True),
        ("| x | (was " + "open) |", True),
        ("fixed in iss" + "ue 27", True),
        ("tracked as #" + "27", True),
        ("TRL issue 6945 reports it", False),
        ("verl PR 7245 changed the default", False),
        ("vLLM issue 12345", False),
        ("https://github.com/volcengine/verl/issues/2334", False),
        ("a session of training", False),
        ("shared memory", False),
        ("docs/algorithms.md, section 3", False),
        ("colour #1f77b4", False),
        ("color: #222;", False),
        ("| 4 issues |", False),
    ],
)
def test_the_scanner_tells_history_from_citations(text: str, banned: bool) -> None:
    assert bool(history_hits(text)) is banned, history_hits(text)


def test_nothing_shipped_tells_the_development_history() -> None:
    files = shipped_files()
    assert len(files) > 100 and ROOT / "README.md" in files  # the scan sees the tree
    found = [
        f"{file.relative_to(ROOT)}:{line}: {what!r} ({fix})"
        for file in files
        for line, what, fix in history_hits(file.read_text(errors="replace"))
    ]
    assert not found, f"{len(found)} place(s) tell the development history:\n" + "\n".join(found)
