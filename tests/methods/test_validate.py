"""compute_loss's input checks (``validate=True``, the default of a direct call): each bad input, named by its key.

The suite's conftest turns the default off for its synthetic batches, so every call here passes ``validate``
itself; ``test_direct_calls_validate_by_default`` checks the real default in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from steadyrl import compute_loss
from steadyrl.methods.batch import LOGP_TOLERANCE
from tests.methods._batch import make_batch

NAN, INF = float("nan"), float("inf")


def valid_batch() -> dict[str, torch.Tensor]:
    """make_batch with log-probs that are log-probabilities (its synthetic μ and π_ref may exceed 0)."""
    b = make_batch(seed=3)
    for key in ("behav_logp", "ref_logp"):
        b[key] = b[key].clamp(max=0.0)
    return b


def planted(key: str, value: float, *, padding: bool = False) -> dict[str, torch.Tensor]:
    """A valid batch with ``value`` at one element of ``key`` (a trained token, or padding with ``padding=True``)."""
    b = valid_batch()
    x = b[key].detach().clone()
    if x.dim() == 1:
        x[5] = value
    else:
        rows, cols = (~b["mask"]).nonzero(as_tuple=True) if padding else b["mask"].nonzero(as_tuple=True)
        x[rows[0], cols[0]] = value
    b[key] = x.requires_grad_(key == "logp")
    return b


@pytest.mark.parametrize(
    ("method", "key"),
    [("seq_tis", "logp"), ("seq_tis", "behav_logp"), ("decoupled_ppo", "prox_logp"), ("kl_in_loss", "ref_logp"),
     ("grpo", "rewards"), ("vcpo", "grad_sq_norms"), ("copc", "values"), ("estr", "behav_entropy"), ("otb", "sum_p2")],
)  # fmt: skip
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_non_finite_input_is_an_error_naming_its_key(method: str, key: str, value: float) -> None:
    what = "NaN" if value != value else "±inf"
    with pytest.raises(ValueError, match=rf"^'{key}' holds {what} at 1 of \d+ (trained tokens|rows), the first at row"):
        compute_loss(method, planted(key, value), validate=True)


@pytest.mark.parametrize(("method", "key"), [("seq_tis", "logp"), ("seq_tis", "behav_logp"),
                                             ("decoupled_ppo", "prox_logp"), ("kl_in_loss", "ref_logp")])  # fmt: skip
def test_positive_log_probs_are_an_error_naming_their_key(method: str, key: str) -> None:
    with pytest.raises(ValueError, match=rf"^'{key}' holds log-probabilities > 0.0001 at 1 of \d+ trained tokens"):
        compute_loss(method, planted(key, 0.3), validate=True)


def test_rounding_above_zero_passes() -> None:
    """A log-softmax rounded just above 0 (float32) or by a bfloat16's coarser step is not an error."""
    compute_loss("seq_tis", planted("behav_logp", LOGP_TOLERANCE / 2), validate=True)
    b = valid_batch()
    b["logp"] = b["logp"].detach().bfloat16().clone()
    b["logp"][0, 0] = 0.0625  # half of 16 bfloat16 epsilons
    b["behav_logp"] = b["behav_logp"].bfloat16()
    b["logp"].requires_grad_(True)
    compute_loss("seq_tis", b, validate=True)


def test_padding_may_hold_anything() -> None:
    """[B, T] inputs are checked on trained tokens only: NaN or a positive value at padding is ignored (the loss does
    not read it: it stays finite)."""
    for key, value in [("behav_logp", NAN), ("logp", INF), ("ref_logp", 5.0)]:
        loss, _ = compute_loss("kl_in_loss", planted(key, value, padding=True), validate=True)
        assert torch.isfinite(loss)


def test_validate_false_skips_the_checks() -> None:
    loss, _ = compute_loss("seq_tis", planted("behav_logp", NAN), validate=False)
    assert torch.isnan(loss)
    compute_loss("seq_tis", planted("logp", 0.3), validate=False)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize(("B", "T", "what"), [(0, 5, r"no response \(B = 0\)"), (4, 0, r"no token position \(T = 0\)")])
def test_an_empty_batch_is_a_clear_error_either_way(B: int, T: int, what: str, validate: bool) -> None:
    batch = {
        "logp": torch.zeros(B, T, requires_grad=True), "behav_logp": torch.zeros(B, T),
        "mask": torch.ones(B, T, dtype=torch.bool), "rewards": torch.zeros(B), "group_ids": torch.zeros(B).long(),
    }  # fmt: skip
    with pytest.raises(ValueError, match=rf"^empty batch: 'logp' has shape \[{B}, {T}\], {what}"):
        compute_loss("grpo", batch, validate=validate)


def test_direct_calls_validate_by_default() -> None:
    """Outside this suite (a fresh interpreter, plain ``import steadyrl``): the checks are on, and ``steadyrl.control``
    is an attribute of the package."""
    code = textwrap.dedent(
        """
        import torch, steadyrl
        assert [type(c).__name__ for c in steadyrl.control.build_controllers("vcpo")] == ["EssStepSizeController"]
        b = {"logp": -torch.rand(2, 3), "behav_logp": torch.full((2, 3), float("nan")),
             "mask": torch.ones(2, 3, dtype=torch.bool), "rewards": torch.ones(2), "group_ids": torch.zeros(2).long()}
        try:
            steadyrl.compute_loss("seq_tis", b)
        except ValueError as e:
            print(e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.startswith("'behav_logp' holds NaN at 6 of 6 trained tokens, the first at row 0, token 0;")
