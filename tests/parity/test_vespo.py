"""VESPO parity with TRL 1.16.0 (``loss_type="vespo"``, ``GRPOTrainer.get_gamma_weights`` inside ``_compute_loss``).

TRL's W is π_θ/``old_per_token_logps`` times its token-level vLLM ratio ``importance_sampling_ratio`` (π_prox/μ, in
``token_truncate`` mode clamp(exp(Δ·mask), C_min, C_max)), folded in log space. steadyrl reproduces it with
``objective.ratio_to=proximal`` and a ``token_tis`` correction (cap = C_max, floor = C_min), whose weight the objective
folds the same way; without a vLLM ratio, TRL's W = π_θ/π_old is the preset's W = π_θ/μ with μ := TRL's π_old.
Same loss, gradient and φ metric in float64 on hypothesis batches (heavy-tailed advantages, log-ratios up to ±20,
finite garbage for TRL and NaN/±inf for steadyrl off the mask, all-masked rows).

Not reproduced: TRL's ``token_mask`` mode sets out-of-band ratios to 0, which VESPO folds as ln 1e-8 (the whole
sequence's φ ≈ 0 while its tokens stay in the denominator); steadyrl's masking corrections drop such tokens instead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("trl", reason="the TRL parity tests need trl==1.16.0 (requirements.lock)")

from steadyrl import compute_loss, resolve_method
from tests.parity._parity import DT, Case, assert_close, batch, cases, grad, leaf, trl_loss

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# TRL builds k and λ with torch.where on Python floats: float32 tensors. Kernels exact in float32 keep float64 parity.
KERNELS = [(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 4.0, 1.5), (0.5, 6.0, 2.5, 0.25)]


def _kernel_config(kernel: tuple[float, float, float, float]) -> dict[str, float]:
    kp, lp, kn, ln = kernel
    return {"vespo_k_pos": kp, "vespo_lambda_pos": lp, "vespo_k_neg": kn, "vespo_lambda_neg": ln}


def _kernel_spec(kernel: tuple[float, float, float, float]) -> dict[str, float]:
    kp, lp, kn, ln = kernel
    return {"objective.k_pos": kp, "objective.lambda_pos": lp, "objective.k_neg": kn, "objective.lambda_neg": ln}


def _trl(case: Case, old: torch.Tensor, kernel, is_ratio: torch.Tensor | None = None):
    theirs = leaf(case.theta)
    m = case.mask.to(DT)
    inputs = {"completion_mask": m, "advantages": case.adv_seq, "old_per_token_logps": old,
              "num_items_in_batch": m.sum()}  # fmt: skip
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss, metrics = trl_loss(theirs, inputs, loss_type="vespo", **_kernel_config(kernel))
    return loss, grad(loss, theirs), metrics["vespo/phi_seq_mean"][-1]


def _phi_mean_over_all_rows(case: Case, phi_mean_nonempty: float) -> float:
    """TRL averages φ over all B rows (an empty row has W = 1, φ = 1); steadyrl over the non-empty ones."""
    n = int(case.mask.any(-1).sum())
    return (phi_mean_nonempty * n + (case.mask.shape[0] - n)) / case.mask.shape[0]


@settings(max_examples=40, deadline=None)
@given(case=cases(), kernel=st.sampled_from(KERNELS))
def test_preset_equals_trl_without_a_vllm_ratio(case: Case, kernel) -> None:
    """The preset (W = π_θ/μ) against TRL with ``old_per_token_logps`` = μ and no vLLM ratio."""
    loss_t, grad_t, phi_t = _trl(case, case.behav, kernel)
    ours = leaf(case.ours(case.theta))
    spec = resolve_method("vespo", {"advantage.type": "given", **_kernel_spec(kernel)})
    out = compute_loss(spec, batch(case, ours, case.adv_seq, behav_logp=case.ours(case.behav)))
    assert_close(out.loss, loss_t)
    assert_close(grad(out.loss, ours), grad_t)
    assert_close(torch.tensor(_phi_mean_over_all_rows(case, out.metrics["loss/phi_mean"].item())), phi_t)


@settings(max_examples=40, deadline=None)
@given(case=cases(), kernel=st.sampled_from(KERNELS), bounds=st.sampled_from([(None, 3.0), (0.5, 2.0), (0.9, 1.1)]))
def test_ratio_to_proximal_with_token_tis_equals_trl_token_truncate(case: Case, kernel, bounds) -> None:
    """TRL's ``vllm_importance_sampling_mode="token_truncate"`` ratio (computed as TRL's generation step does) folded
    into W, against ``ratio_to=proximal`` + ``token_tis(cap=C_max, floor=C_min)``."""
    c_min, c_max = bounds
    diff = ((case.prox - case.behav) * case.mask).nan_to_num(nan=0.0)  # TRL: (old − sampling) · mask
    is_ratio = torch.clamp(torch.exp(diff), min=c_min, max=c_max)
    loss_t, grad_t, phi_t = _trl(case, case.prox, kernel, is_ratio)
    ours = leaf(case.ours(case.theta))
    spec = resolve_method("vespo+token_tis", {
        "advantage.type": "given", "objective.ratio_to": "proximal", "token_tis.cap": c_max, "token_tis.floor": c_min,
        **_kernel_spec(kernel),
    })  # fmt: skip
    out = compute_loss(spec, batch(case, ours, case.adv_seq, behav_logp=case.ours(case.behav)))
    assert_close(out.loss, loss_t)
    assert_close(grad(out.loss, ours), grad_t)
    assert_close(torch.tensor(_phi_mean_over_all_rows(case, out.metrics["loss/phi_mean"].item())), phi_t)


def test_the_comparison_sees_a_stale_batch() -> None:
    """Guard against a vacuous pass: on this batch φ is far from 1 and TRL's loss differs from plain −A·log π_θ."""
    from tests.parity._parity import make_case

    case = make_case(3, [5, 4, 0, 6], 6, 1.0)
    loss_t, _, phi_t = _trl(case, case.behav, KERNELS[0])
    m = case.mask.to(DT)
    plain = -(case.adv_seq[:, None] * case.theta * m).sum() / m.sum()
    assert abs(phi_t - 1.0) > 0.05 and abs(loss_t.item() - plain.item()) > 1e-3
