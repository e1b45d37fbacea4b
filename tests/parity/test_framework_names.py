"""Every framework-qualified name (``verl:vanilla``, ``trl:dapo``, ...; ``steadyrl.methods.frameworks``) against the
framework's own function.

For each row of the table, and each aggregation setting it follows (``method.agg=...`` on the name), the
framework's function as its trainer runs it (its defaults plus the row's settings) and ``compute_loss`` of the
resolved name on ``steadyrl check losses``' fixed float64 batches (an empty row, clipped and dual-clipped tokens):
same value and gradient w.r.t. log π_θ (rtol 1e-6, atol 1e-9) and a per-sequence gradient scale of 1. The cases are
built from the table, so a row cannot be added without this comparison; each row must also name parity tests that
exist (the hypothesis tests that establish the mapping), and docs/integrations.md must list it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from steadyrl.check.losses import CALLS, REQUIRES, LossCase, compare, row_cases
from steadyrl.methods.frameworks import FRAMEWORK_LOSSES, FRAMEWORK_LOSSES_BY_NAME, FRAMEWORKS, FrameworkLoss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

PARITY = Path(__file__).resolve().parent
ROOT = PARITY.parents[1]
CASES = [case for row in FRAMEWORK_LOSSES for case in row_cases(row)]


def _installed(case: LossCase) -> None:
    for module in case.requires:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed ({FRAMEWORKS[case.framework].version} in requirements)")


@pytest.mark.parametrize("case", CASES, ids=[f"{c.framework}:{c.name}" for c in CASES])
def test_qualified_name_equals_the_framework(case: LossCase) -> None:
    _installed(case)
    finding = compare(case)
    assert finding.verdict == "PASS", finding.message


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@pytest.mark.parametrize("row", FRAMEWORK_LOSSES, ids=[r.qualified for r in FRAMEWORK_LOSSES])
def test_every_row_names_parity_tests_that_exist(row: FrameworkLoss) -> None:
    assert row.tests, f"{row.qualified} names no parity test"
    for test_id in row.tests:
        file, _, name = test_id.partition("::")
        path = PARITY / file
        assert path.is_file(), f"{row.qualified}: no file tests/parity/{file}"
        assert name in _test_functions(path), f"{row.qualified}: tests/parity/{file} has no test {name!r}"


def test_the_table_is_well_formed() -> None:
    """Unique names, a known framework with a caller, and the documented options spelled as the spec spells them."""
    assert len(FRAMEWORK_LOSSES_BY_NAME) == len(FRAMEWORK_LOSSES)
    assert set(FRAMEWORKS) == set(CALLS) == set(REQUIRES)
    from steadyrl import resolve_method

    for row in FRAMEWORK_LOSSES:
        assert row.framework in FRAMEWORKS
        resolve_method(row.qualified)
        for agg in row.reductions:
            assert resolve_method(row.qualified, {"agg": agg}).agg == agg


def test_docs_list_every_qualified_name_and_its_tests() -> None:
    text = (ROOT / "docs" / "integrations.md").read_text()
    for row in FRAMEWORK_LOSSES:
        assert f"`{row.qualified}`" in text, f"docs/integrations.md does not list {row.qualified}"
        for test_id in row.tests:
            assert test_id in text, f"docs/integrations.md does not name {test_id} for {row.qualified}"


@pytest.mark.parametrize(
    ("name", "agg", "wrong"),
    [
        ("verl:vanilla", None, {"objective.dual_clip": None}),  # verl's dual clip acts on the last batch
        ("verl:vanilla", "seq-mean-token-mean", {"objective.empty_rows": "skip"}),  # verl's trainer counts them
        ("trl:grpo", None, {"objective.empty_rows": "skip"}),
        ("trl:dr_grpo", None, {"norm_len": None}),  # max_completion_length, not the padded length
        ("skyrl:rollout_is", None, {"denominator": "kept"}),
    ],
)
def test_the_batches_tell_the_options_apart(name: str, agg: str | None, wrong: dict) -> None:
    """Not vacuous: each of these options changes the loss on the fixed batches, so the comparison would fail
    without it."""
    row = FRAMEWORK_LOSSES_BY_NAME[name]
    (case,) = [c for c in row_cases(row) if c.options.get("agg") == agg]
    _installed(case)
    finding = compare(dataclasses.replace(case, options={**case.options, **wrong}))
    assert finding.verdict == "FAIL", finding.message
