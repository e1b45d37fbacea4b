"""Loss aggregation (``masking.aggregate``, the spec's ``agg`` / ``norm_len`` / ``empty_rows``) against the frameworks.

verl 0.9.1 ``agg_loss`` (bare, i.e. ``dp_size=1`` and no global totals, and with the values its trainer passes for one
process), OpenRLHF 0.11.2 ``aggregate_loss``, SkyRL 0.3.0's reduction (``apply_loss_reduction_to_advantages_minibatch``
then ``reduce_loss``, applied to a per-token loss) and TRL 1.16.0's normalizations per ``loss_type`` (through
``GRPOTrainer._compute_loss`` on-policy, where its per-token loss is −A): same value, same gradient w.r.t. the
per-token loss, on heavy-tailed losses with garbage at padding and all-masked rows.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.core.masking import aggregate
from tests.parity._parity import Case, assert_close, cases, grad, leaf

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations inside TRL's config

ROW_MEANS = ("seq-mean-token-mean", "seq-mean-token-sum")
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def ours(case: Case, mode: str, *, norm_len: float | None = None, empty_rows: str = "skip") -> tuple[Any, Any]:
    """steadyrl's reduction of the batch's heavy-tailed token values (NaN/inf off the mask) and its gradient."""
    x = leaf(case.ours(case.adv_tok))
    nl = None if norm_len is None else float(norm_len)
    out = aggregate(x, case.mask, mode, norm_len=nl, empty_rows=empty_rows)  # type: ignore[arg-type]
    return out, grad(out, x)


def check(case: Case, ours_out: tuple[Any, Any], theirs: torch.Tensor, g: torch.Tensor, rtol: float = 1e-9) -> None:
    value, g_ours = ours_out
    if not case.mask.any() and not torch.isfinite(theirs):  # a framework's 0/0; steadyrl's exact 0
        assert float(value.detach()) == 0.0 and torch.equal(g_ours, torch.zeros_like(g_ours))
        return
    assert_close(value, theirs, rtol=rtol, atol=1e-9)
    assert_close(g_ours, torch.where(case.mask, g, 0.0), rtol=rtol, atol=1e-12)
    assert torch.equal(g[~case.mask], torch.zeros_like(g[~case.mask]))  # their gradient is 0 off the mask too


# ------------------------------------------------------------------------------------------------------- verl
@settings(max_examples=50, deadline=None)
@given(case=cases(), mode=st.sampled_from(AGGS), trainer=st.booleans())
def test_verl_agg_loss(case: Case, mode: str, trainer: bool) -> None:
    """Bare ``agg_loss`` (no global totals): steadyrl's defaults, except ``seq-mean-token-sum-norm``, which verl then
    divides by |N| · T (ours: B · T). With the trainer's values (``batch_num_tokens`` = Σ m, ``global_batch_size`` = B,
    ``loss_scale_factor``): ``empty_rows='count'`` for the sequence means, ``norm_len = loss_scale_factor``."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl==0.9.1")
    B, T = case.mask.shape
    x = leaf(case.adv_tok)
    info = {"dp_size": 1, "batch_num_tokens": int(case.mask.sum()), "global_batch_size": B, "loss_scale_factor": T + 5}
    theirs = core_algos.agg_loss(x, case.mask, mode, **(info if trainer else {}))
    rows = "count" if trainer and mode in ROW_MEANS else "skip"
    mine = ours(case, mode, norm_len=T + 5 if trainer else None, empty_rows=rows)
    if mode == "seq-mean-token-sum-norm" and not trainer:
        n_rows = max(int(case.mask.any(-1).sum()), 1)
        mine = (mine[0] * B / n_rows, mine[1] * B / n_rows)  # verl's bare divisor |N|·T against our B·T
    check(case, mine, theirs, grad(theirs, x), rtol=1e-7)  # verl adds 1e-8 to the row lengths


# --------------------------------------------------------------------------------------------------- OpenRLHF
@pytest.fixture(scope="module")
def openrlhf_loss() -> Any:
    pytest.importorskip("openrlhf", reason="openrlhf==0.11.2")
    pytest.importorskip("deepspeed", reason="openrlhf/models/loss.py imports deepspeed")
    from tests.parity._parity import openrlhf_module

    return openrlhf_module("openrlhf.models.loss")


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("global_totals", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_openrlhf_aggregate_loss(openrlhf_loss: Any, token_level: bool, global_totals: bool, seed: int) -> None:
    """token level → ``token-mean``; per sample → ``seq-mean-token-mean``, skipping empty rows, or counting them with
    ``global_batch_size`` = B."""
    from tests.parity._parity import make_case

    case = make_case(seed, [4, 0, 2, 1, 0, 3][: 2 + seed % 5], 4, log_scale=1.0)
    m = case.mask.to(case.adv_tok.dtype)
    x = leaf(case.adv_tok)
    totals = {"batch_num_tokens": float(m.sum()), "global_batch_size": float(m.shape[0])} if global_totals else {}
    theirs = openrlhf_loss.aggregate_loss(x, m, token_level_loss=token_level, **totals)
    mode = "token-mean" if token_level else "seq-mean-token-mean"
    rows = "count" if global_totals and not token_level else "skip"
    check(case, ours(case, mode, empty_rows=rows), theirs, grad(theirs, x), rtol=1e-7)


def test_openrlhf_all_masked_is_nan_where_ours_is_zero(openrlhf_loss: Any) -> None:
    """The one documented difference: OpenRLHF's masked mean of an all-masked batch is 0/0."""
    from tests.parity._parity import make_case

    case = make_case(0, [0, 0], 3, log_scale=1.0)
    theirs = openrlhf_loss.aggregate_loss(case.adv_tok, case.mask.double(), token_level_loss=True)
    assert math.isnan(float(theirs)) and float(ours(case, "token-mean")[0].detach()) == 0.0


# ------------------------------------------------------------------------------------------------------ SkyRL
SKYRL = {"token_mean": ("token-mean", "skip"), "sequence_mean": ("seq-mean-token-mean", "count"),
         "seq_mean_token_sum_norm": ("seq-mean-token-sum-norm", "skip")}  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(case=cases(), reduction=st.sampled_from(sorted(SKYRL)))
def test_skyrl_loss_reduction(case: Case, reduction: str) -> None:
    """SkyRL scales the advantages so that a plain masked sum is the reduction; applied to a per-token loss it is
    ``token-mean``, ``seq-mean-token-mean`` over all B rows, or ``seq-mean-token-sum-norm`` with ``max_seq_len``."""
    pytest.importorskip("skyrl", reason="skyrl==0.3.0")
    from tests.parity._parity import skyrl_ppo_utils

    ppo = skyrl_ppo_utils()
    B, T = case.mask.shape
    m = case.mask.to(case.adv_tok.dtype)
    x = leaf(case.adv_tok)
    scaled = ppo.apply_loss_reduction_to_advantages_minibatch(
        advantages=x * m, loss_mask=m, loss_reduction=reduction, micro_batch_size=B, max_seq_len=T + 1
    )
    theirs = ppo.reduce_loss(scaled, m)
    mode, rows = SKYRL[reduction]
    check(case, ours(case, mode, norm_len=T + 1, empty_rows=rows), theirs, grad(theirs, x))


# --------------------------------------------------------------------------------------------------------- TRL
TRL = {"grpo": ("seq-mean-token-mean", "count"), "bnpo": ("token-mean", "skip"),
       "dr_grpo": ("seq-mean-token-sum-norm", "skip"), "dapo": ("token-mean", "skip")}  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(case=cases(), loss_type=st.sampled_from(sorted(TRL)))
def test_trl_normalizations(case: Case, loss_type: str) -> None:
    """On-policy (π_prox = π_θ, ratio 1) TRL's per-token loss is −A: the loss is the reduction of −A, and its
    gradient w.r.t. A is minus the reduction's weights."""
    pytest.importorskip("trl", reason="trl==1.16.0")
    from tests.parity._parity import trl_loss

    T = case.mask.shape[1]
    adv = leaf(-case.adv_tok)  # −A = the per-token values being reduced
    inputs = {"completion_mask": case.mask.long(), "advantages": adv, "old_per_token_logps": case.theta,
              "num_items_in_batch": case.mask.sum()}  # fmt: skip
    theirs, _ = trl_loss(case.theta.clone(), inputs, loss_type=loss_type, max_completion_length=T + 2, beta=0.0)
    mode, rows = TRL[loss_type]
    check(case, ours(case, mode, norm_len=T + 2, empty_rows=rows), theirs, -grad(theirs, adv))


# ---------------------------------------------------------------------------------------------------- options
def test_count_is_refused_where_there_are_no_rows_to_count() -> None:
    """``empty_rows='count'`` rescales a mean over sequences; token-mean and the B·norm_len mode have none to count."""
    from tests.parity._parity import make_case

    case = make_case(0, [2, 0], 3, log_scale=1.0)
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match="empty_rows"):
            aggregate(case.adv_tok, case.mask, mode, empty_rows="count")
    skip, _ = ours(case, "seq-mean-token-sum")
    count, _ = ours(case, "seq-mean-token-sum", empty_rows="count")
    assert float(count.detach()) == pytest.approx(float(skip.detach()) / 2, rel=1e-12)  # one of the two rows is empty
