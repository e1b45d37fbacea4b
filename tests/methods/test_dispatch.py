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


def test_return_details_gives_the_weights_mask_and_advantages_the_objective_saw() -> None:
    import torch

    from steadyrl import compute_loss
    from tests.methods._batch import make_batch

    batch = make_batch()
    plain = compute_loss("token_tis+token_mis", batch)
    d = compute_loss("token_tis+token_mis", batch, return_details=True)
    assert torch.equal(plain.loss, d.loss)
    ell = torch.where(batch["mask"], batch["prox_logp"] - batch["behav_logp"], 0.0)
    kept = batch["mask"] & (ell.exp() >= 0.5) & (ell.exp() <= 2.0)
    assert torch.equal(d.mask, kept)
    # token_tis's min(r, 2) times token_mis's kept ratio r, on kept tokens; 0 elsewhere
    expected = torch.where(kept, ell.exp().clamp(max=2.0) * ell.exp(), 0.0)
    torch.testing.assert_close(d.weights, expected, rtol=1e-12, atol=0)
    assert not d.weights.requires_grad and not d.advantages.requires_grad
    assert torch.equal(d.advantages == 0, ~batch["mask"] | (d.advantages == 0))
    unweighted = compute_loss("grpo", batch, return_details=True)
    assert torch.equal(unweighted.weights, batch["mask"].double())
