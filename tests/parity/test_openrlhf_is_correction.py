"""OpenRLHF 0.11.2's named train/rollout IS corrections (``PolicyLoss`` with ``is_correction_level/mode/gating/
threshold``; its CLI names TIS = token clip, ICEPOP = token mask, seq-mask-tis = sequence mask) against steadyrl's
existing corrections composed on the ``ppo`` preset: the same functions, so no new code, only this mapping.

=============  ==============================================  ==================================================
OpenRLHF       its rule (ratio w_t = π_prox/μ, band [low, high])  steadyrl
=============  ==============================================  ==================================================
tis            w_t clamped to [low, high]                       ``ppo+token_tis``, ``token_tis.cap=high``,
                                                                ``token_tis.floor=low``
icepop         w_t if low ≤ w_t ≤ high, else 0 (kept in the      ``ppo+icepop``, ``icepop.lower/upper``,
               token-mean's denominator)                         ``icepop.rejected=zero``
seq-mask-tis   w_t if low ≤ exp(mean_t log w) ≤ high, else 0    ``ppo+geo_mis+token_tis``: ``geo_mis.weight=one``,
                                                                ``geo_mis.rejected=zero``, ``token_tis.cap=None``
=============  ==============================================  ==================================================

Loss and gradient w.r.t. log π_θ on hypothesis batches (log-ratios up to ±20, garbage off the mask), float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings

from steadyrl import compute_loss
from tests.parity._parity import Case, assert_close, batch, cases, grad, leaf

EXAMPLES = 10


@pytest.fixture(scope="module")
def openrlhf_loss() -> Any:
    pytest.importorskip("openrlhf", reason="needs openrlhf==0.11.2")
    pytest.importorskip("deepspeed", reason="openrlhf/models/loss.py imports deepspeed")
    from tests.parity._parity import openrlhf_module

    return openrlhf_module("openrlhf.models.loss")


def _ours(name: str, low: float, high: float) -> tuple[str, dict[str, Any]]:
    if name == "tis":
        return "ppo+token_tis", {"token_tis.cap": high, "token_tis.floor": low}
    if name == "icepop":
        return "ppo+icepop", {"icepop.lower": low, "icepop.upper": high, "icepop.rejected": "zero"}
    return "ppo+geo_mis+token_tis", {"geo_mis.lower": low, "geo_mis.upper": high, "geo_mis.weight": "one",
                                     "geo_mis.rejected": "zero", "token_tis.cap": None}  # fmt: skip


THEIRS = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}


@pytest.mark.parametrize("name", list(THEIRS))
@pytest.mark.parametrize(("low", "high"), [(0.5, 5.0), (0.8, 1.25)])
@pytest.mark.parametrize("token_level", [True, False])
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_openrlhf_named_is_corrections(
    openrlhf_loss: Any, case: Case, name: str, low: float, high: float, token_level: bool
) -> None:
    assume(bool(case.mask.any()))  # OpenRLHF's mean of nothing is 0/0
    level, mode = THEIRS[name]
    native = openrlhf_loss.PolicyLoss(
        token_level_loss=token_level, is_correction_level=level, is_correction_mode=mode,
        is_correction_gating="ratio", is_correction_threshold=(low, high),
    )  # fmt: skip
    theta = leaf(case.theta)
    loss, *_ = native(theta, case.prox, case.adv_tok, action_mask=case.mask.to(case.theta.dtype),
                      rollout_log_probs=case.behav)  # fmt: skip
    method, overrides = _ours(name, low, high)
    overrides |= {"advantage.type": "given", "agg": "token-mean" if token_level else "seq-mean-token-mean"}
    logp = leaf(case.ours(case.theta))
    b = batch(case, logp, case.adv_tok) | {"behav_logp": case.ours(case.behav)}
    out = compute_loss(method, b, overrides=overrides)
    assert_close(out.loss, loss, rtol=1e-7, atol=1e-9)
    assert_close(grad(out.loss, logp), torch.where(case.mask, grad(loss, theta), 0.0), rtol=1e-7, atol=1e-9)
