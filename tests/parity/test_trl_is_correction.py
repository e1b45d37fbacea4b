"""TRL 1.16.0's vLLM importance-sampling correction and off-policy sequence mask against steadyrl's corrections.

TRL computes the behavior-correction ratio ρ = π_prox/μ inline in ``GRPOTrainer._generate_and_score_completions``
(``vllm_importance_sampling_mode`` ∈ token_truncate | token_mask | sequence_truncate | sequence_mask, bounds
``vllm_importance_sampling_clip_min`` / ``_clip_max``): the test runs that block of TRL's own source, sliced from the
installed trainer, on the batch; then TRL's ``_compute_loss`` (``_parity.trl_loss``) multiplies its per-token
loss by ρ. The spec that reproduces each mode:

==================  ======================================================================================
token_truncate      ``token_tis(cap=C_max, floor=C_min)`` (``cap=None`` when C_max is None)
token_mask          ``token_mis(lower=C_min, upper=C_max, weight=ratio)`` + ``denominator=input``
sequence_truncate   ``seq_tis(cap=C_max, floor=C_min)``
sequence_mask       ``seq_mis(lower=C_min, upper=C_max, weight=ratio)`` + ``denominator=input``
OPSM (δ)            ``opsm(delta=δ)`` first + ``denominator=input``
==================  ======================================================================================

TRL zeroes a masked token's ratio but keeps it in its mask, so the loss divides by the input counts
(``denominator="input"``; loss types grpo = ``seq-mean-token-mean`` over all B rows, bnpo / dapo = ``token-mean``,
dr_grpo = ``seq-mean-token-sum-norm`` with ``norm_len = max_completion_length``). Its token ratio is exp(0) = 1 at
padding: ``pad_weight="one"`` reports the same weights. Float64, hypothesis batches with heavy-tailed log-ratios up to
±20, garbage at padding (NaN for steadyrl, finite for TRL) and all-masked rows; same loss, gradient and weights to 1e-9.
"""

from __future__ import annotations

import inspect
import math
import textwrap
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl import compute_loss
from steadyrl.methods.spec import MethodSpec
from tests.parity._parity import Case, assert_close, batch, cases, grad, heavy, leaf

trl = pytest.importorskip("trl", reason="trl==1.16.0 (requirements.lock)")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecations inside GRPOConfig

from tests.parity._parity import trl_loss as trl_compute_loss  # noqa: E402

#: loss_type → (agg, objective.empty_rows)
TRL_AGG = {"grpo": ("seq-mean-token-mean", "count"), "bnpo": ("token-mean", "skip"),
           "dr_grpo": ("seq-mean-token-sum-norm", "skip"), "dapo": ("token-mean", "skip")}  # fmt: skip
TOKEN_BOUNDS = [(None, 3.0), (0.5, 2.0), (0.9, 1.1), (0.3, None)]
SEQ_BOUNDS = [(None, 3.0), (0.5, 2.0), (0.2, 5.0)]


def _is_ratio_block() -> str:
    """The lines of TRL's ``_generate_and_score_completions`` that compute ``vllm_importance_sampling_ratio``."""
    src = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    head = "            if self.use_vllm and self.vllm_importance_sampling_correction:\n                mask ="
    start = src.index(head)
    end = src.index("# Compute the per-token log probabilities for the reference model", start)
    return textwrap.dedent(src[start:end])


IS_RATIO_BLOCK = _is_ratio_block()


def trl_is_ratio(case: Case, mode: str, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's ρ ([B, T] token modes, [B, 1] sequence modes) from its own code, with the attributes its ``__init__``
    sets from a real ``GRPOConfig``."""
    args = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, use_vllm=True,
                          vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                          vllm_importance_sampling_clip_max=clip_max)  # fmt: skip
    trainer = types.SimpleNamespace(
        use_vllm=args.use_vllm, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=args.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=args.vllm_importance_sampling_clip_max,
    )  # fmt: skip
    scope = {"self": trainer, "torch": torch, "math": math, "completion_mask": case.mask.long(), "tool_mask": None,
             "old_per_token_logps": case.prox, "sampling_per_token_logps": case.behav}  # fmt: skip
    exec(IS_RATIO_BLOCK, scope)  # TRL's own lines, from the installed package
    return scope["vllm_importance_sampling_ratio"]


@st.composite
def stale(draw: Any) -> Case:
    """A batch whose behavior log-ratio ℓ = log π_prox − log μ is heavy-tailed, |ℓ| ≤ 20 (μ ≠ π_prox ≠ π_θ)."""
    case = draw(cases())
    scale = draw(st.sampled_from([0.05, 0.3, 1.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    ell = (scale * heavy(g, *case.mask.shape)).clamp(-20.0, 20.0)
    return case._replace(behav=torch.where(case.mask, case.prox - ell, case.behav))


def correction(mode: str, clip_min: float | None, clip_max: float | None) -> dict[str, Any]:
    if mode == "token_truncate":
        return {"type": "token_tis", "cap": clip_max, "floor": clip_min}
    if mode == "sequence_truncate":
        return {"type": "seq_tis", "cap": clip_max, "floor": clip_min}
    kind = "token_mis" if mode == "token_mask" else "seq_mis"
    return {"type": kind, "lower": clip_min, "upper": clip_max, "weight": "ratio"}


def spec(loss_type: str, corrections: list[dict[str, Any]], T: int, clip: tuple[float, float]) -> MethodSpec:
    agg, rows = TRL_AGG[loss_type]
    return MethodSpec.model_validate({
        "name": f"trl-{loss_type}", "advantage": {"type": "given"}, "corrections": corrections,
        "objective": {"type": "ppo_clip", "clip_low": clip[0], "clip_high": clip[1], "empty_rows": rows},
        "agg": agg, "norm_len": T + 2, "denominator": "input", "pad_weight": "one",
    })  # fmt: skip


def trl_loss(case: Case, loss_type: str, clip: tuple[float, float], inputs: dict[str, Any], **config: Any):
    logp = leaf(case.theta)
    base = {"completion_mask": case.mask.long(), "advantages": case.adv_seq, "old_per_token_logps": case.prox,
            "num_items_in_batch": case.mask.sum()}  # fmt: skip
    loss, _ = trl_compute_loss(logp, base | inputs, loss_type=loss_type, epsilon=clip[0], epsilon_high=clip[1],
                               max_completion_length=case.mask.shape[1] + 2, beta=0.0, **config)  # fmt: skip
    return loss, grad(loss, logp)


def ours(case: Case, method: MethodSpec) -> tuple[Any, torch.Tensor]:
    logp = leaf(case.ours(case.theta))
    out = compute_loss(method, batch(case, logp, case.adv_seq, behav_logp=case.ours(case.behav)), return_details=True)
    return out, grad(out.loss, logp)


def _mode_and_bounds() -> st.SearchStrategy[tuple[str, tuple[float | None, float | None]]]:
    token = st.tuples(st.sampled_from(["token_truncate", "token_mask"]), st.sampled_from(TOKEN_BOUNDS))
    seq = st.tuples(st.sampled_from(["sequence_truncate", "sequence_mask"]), st.sampled_from(SEQ_BOUNDS))
    return token | seq


@settings(max_examples=30, deadline=None)
@given(case=stale(), mode_bounds=_mode_and_bounds(), loss_type=st.sampled_from(sorted(TRL_AGG)),
       clip=st.sampled_from([(0.2, 0.2), (0.2, 0.28)]))  # fmt: skip
def test_vllm_importance_sampling_modes(case: Case, mode_bounds, loss_type: str, clip: tuple[float, float]) -> None:
    mode, (c_min, c_max) = mode_bounds
    rho = trl_is_ratio(case, mode, c_min, c_max)
    loss, g_theirs = trl_loss(case, loss_type, clip, {"importance_sampling_ratio": rho}, use_vllm=True,
                              vllm_importance_sampling_mode=mode)  # fmt: skip
    out, g = ours(case, spec(loss_type, [correction(mode, c_min, c_max)], case.mask.shape[1], clip))
    # TRL exponentiates S_i unguarded; steadyrl takes exp(clamp(S_i, ±20)) (verl's guard): a weight below e^{−20}
    # differs by less than e^{−20} (above e^{20} C_max caps both). The loss and gradient move by at most that times
    # the unweighted per-token terms |A|·max(r, 1 + ε_high).
    tol = 0.0 if mode.startswith("token") else math.exp(-20.0)
    r = torch.exp((case.theta - case.prox).clamp(-20, 20))
    slack = tol * float((case.adv_seq[:, None].abs() * torch.clamp(r, min=1 + clip[1]))[case.mask].sum())
    assert_close(out.loss, loss, atol=1e-9 + slack)
    assert_close(g, g_theirs, atol=1e-9 + slack)
    if mode.startswith("token"):  # TRL's [B, T] ratio, exp(0) = 1 at padding: pad_weight='one' reports the same
        assert_close(out.weights, rho)
    else:  # [B, 1]: one value per sequence; compare where the sequence is trained
        m = case.mask
        assert_close(out.weights[m], rho.expand_as(m)[m], atol=1e-9 + tol)
    if mode.endswith("mask"):  # TRL keeps the token in its mask with ρ = 0; steadyrl drops it and counts it (input)
        assert torch.equal(out.mask, case.mask & (rho.expand_as(case.mask) > 0))


@settings(max_examples=15, deadline=None)
@given(case=stale(), delta=st.sampled_from([0.0, 0.05, 0.5]), loss_type=st.sampled_from(sorted(TRL_AGG)))
def test_off_policy_sequence_mask(case: Case, delta: float, loss_type: str) -> None:
    """TRL's OPSM (``off_policy_mask_threshold``, log μ from ``sampling_per_token_logps``) multiplies the loss by its
    (B, 1) keep mask and leaves its mask alone: ``opsm`` with the input denominator."""
    clip = (0.2, 0.2)
    loss, g_theirs = trl_loss(case, loss_type, clip, {"sampling_per_token_logps": case.behav},
                              off_policy_mask_threshold=delta)  # fmt: skip
    method = spec(loss_type, [{"type": "opsm", "delta": delta}], case.mask.shape[1], clip)
    out, g = ours(case, method)
    assert_close(out.loss, loss)
    assert_close(g, g_theirs)


@settings(max_examples=10, deadline=None)
@given(case=stale(), bounds=st.sampled_from([(0.5, 2.0), (0.9, 1.1)]), loss_type=st.sampled_from(sorted(TRL_AGG)))
def test_off_policy_mask_with_token_mask(case: Case, bounds, loss_type: str) -> None:
    """Both at once (OPSM first, so its sequence statistic sees the input mask, as TRL's does)."""
    clip = (0.2, 0.28)
    rho = trl_is_ratio(case, "token_mask", *bounds)
    loss, g_theirs = trl_loss(case, loss_type, clip,
                              {"importance_sampling_ratio": rho, "sampling_per_token_logps": case.behav},
                              use_vllm=True, vllm_importance_sampling_mode="token_mask",
                              off_policy_mask_threshold=0.05)  # fmt: skip
    method = spec(loss_type, [{"type": "opsm", "delta": 0.05}, correction("token_mask", *bounds)],
                  case.mask.shape[1], clip)  # fmt: skip
    out, g = ours(case, method)
    assert_close(out.loss, loss)
    assert_close(g, g_theirs)


def test_the_comparisons_see_masking_and_a_moved_denominator() -> None:
    """Guard against a vacuous pass: on this batch token_mask drops tokens, and with the kept-token denominator
    (steadyrl's default) the loss differs from TRL's."""
    from tests.parity._parity import make_case

    case = make_case(5, [6, 4, 0, 6], 6, log_scale=0.5)
    g = torch.Generator().manual_seed(0)
    case = case._replace(behav=torch.where(case.mask, case.prox - 1.5 * torch.randn(4, 6, generator=g,
                                                                                      dtype=torch.float64), 0.0))
    rho = trl_is_ratio(case, "token_mask", 0.5, 2.0)
    assert 0 < int(((rho == 0) & case.mask).sum()) < int(case.mask.sum())
    loss, _ = trl_loss(case, "dapo", (0.2, 0.2), {"importance_sampling_ratio": rho}, use_vllm=True,
                       vllm_importance_sampling_mode="token_mask")  # fmt: skip
    method = spec("dapo", [correction("token_mask", 0.5, 2.0)], 6, (0.2, 0.2))
    out, _ = ours(case, method)
    assert_close(out.loss, loss)
    kept, _ = ours(case, method.model_copy(update={"denominator": "kept"}))
    assert abs(float(kept.loss.detach()) - float(loss.detach())) > 1e-6
