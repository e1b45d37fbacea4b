"""The package's floors: every module imports only from its own floor or below, and no import graph has a circle.

Every ``import`` counts — at module level, inside functions and under ``TYPE_CHECKING`` — because a lazy import is
still a dependency: it only hides the circle from a module-level check. The order is written in
docs/architecture.md; this test holds the code to it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: The floors, lowest first; packages on one floor may import each other (but not in a circle).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("base", "configs"),  # configs: the shipped YAML files (data, no imports)
    ("core",),
    ("methods",),
    ("control",),
    ("tasks", "tools"),
    ("rollout",),
    ("models",),
    ("pool",),
    ("config",),
    ("runtime",),
    ("train",),
    ("integrations", "sweep", "check"),
    ("cli", "demo"),
)
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def modules(root: Path = SRC) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, mods: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every steadyrl import anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != "steadyrl":
                continue
            known = _known(target, mods)
            if known is not None and known != name:
                yield known, node.lineno


def graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module → {imported module: first line}."""
    out: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges: dict[str, int] = {}
        for target, line in imports(name, path, mods):
            edges.setdefault(target, line)
        out[name] = edges
    return out


def floor_of(module: str) -> str | None:
    """The floor's package of ``steadyrl.<package>...`` (None for the package's own ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(edges: dict[str, dict[str, int]], mods: dict[str, Path]) -> list[str]:
    out = []
    for module, targets in sorted(edges.items()):
        own = floor_of(module)
        for target, line in sorted(targets.items()):
            other = floor_of(target)
            if own is None or other is None:
                continue
            if FLOOR[other] > FLOOR[own]:
                out.append(f"{mods[module].relative_to(SRC)}:{line}: {own} imports {target} (floor {other})")
    return out


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


MODULES = modules()
EDGES = graph(MODULES)


def test_every_package_has_a_floor() -> None:
    packages = {floor_of(m) for m in MODULES} - {None}
    assert packages <= set(FLOOR), f"packages without a floor: {sorted(packages - set(FLOOR))}"


def test_imports_only_go_down() -> None:
    bad = upward_imports(EDGES, MODULES)
    assert not bad, "imports from a higher floor:\n" + "\n".join(bad)


def test_no_import_circles() -> None:
    found = circles(EDGES)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize(
    ("source", "upward", "circular"),
    [
        ({"steadyrl/core/a.py": "from steadyrl.train import b\n", "steadyrl/train/b.py": ""}, 1, 0),
        (
            {
                "steadyrl/core/a.py": "def f():\n    from steadyrl.core import b\n",
                "steadyrl/core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
            },
            0,
            1,
        ),
        ({"steadyrl/train/a.py": "from steadyrl.core.b import x\n", "steadyrl/core/b.py": "x = 1\n"}, 0, 0),
    ],
)
def test_the_checks_see_lazy_and_relative_imports(
    tmp_path: Path, source: dict[str, str], upward: int, circular: int
) -> None:
    for rel, text in source.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = modules(tmp_path)
    edges = graph(mods)
    global SRC
    saved, SRC = SRC, tmp_path
    try:
        assert len(upward_imports(edges, mods)) == upward
    finally:
        SRC = saved
    assert len(circles(edges)) == circular
