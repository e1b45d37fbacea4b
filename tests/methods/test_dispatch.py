"""The dispatch tables of ``compute_loss`` cover every spec class, and every declared input is a batch key."""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, get_args, get_origin

import pytest

from steadyrl.methods import compose
from steadyrl.methods import spec as S
from steadyrl.methods.batch import KEY_DOCS, LossBatch


def members(union: object) -> tuple[type, ...]:
    """The classes of a discriminated ``Annotated[A | B | ..., Field(...)]`` union."""
    assert get_origin(union) is Annotated
    return get_args(get_args(union)[0])


TABLES = [
    (S.AdvantageSpec, compose.ADVANTAGES),
    (S.CorrectionSpec, compose.CORRECTIONS),
    (S.ObjectiveSpec, compose.OBJECTIVES),
]


@pytest.mark.parametrize(("union", "table"), TABLES, ids=["advantages", "corrections", "objectives"])
def test_every_spec_class_has_exactly_one_table_entry(union: object, table: dict[type, object]) -> None:
    assert set(members(union)) == set(table), set(members(union)) ^ set(table)


@pytest.mark.parametrize(
    "cls", [c for u in (S.AdvantageSpec, S.CorrectionSpec, S.ObjectiveSpec, S.KLSpec) for c in members(u)]
)
def test_declared_inputs_are_batch_keys(cls: type[S._Strict]) -> None:
    batch_keys = {f.name for f in fields(LossBatch)}
    assert set(cls().needs()) <= batch_keys and set(cls().needs()) <= set(KEY_DOCS), cls
