"""Divergence rejection and OPSM against float64 loop references written from docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl.core.masking import aggregate
from steadyrl.core.rejection import RejectionSpec, divergence_rejection, divergence_rejection_all, opsm

ATOL = 1e-10


def _batch(seed: int = 0, B: int = 10, T: int = 7, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    ell = scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False
    mask[1, 0] = True
    return torch.where(mask, ell, float("nan")), mask


def _k(x: float, metric: str, convention: str) -> float:
    if metric == "k2":
        return x * x / 2
    if convention == "verl":
        return -x if metric == "k1" else math.exp(x) - x - 1
    return x if metric == "k1" else math.exp(-x) - 1 + x


def _inside(v: float, lo: float | None, hi: float | None) -> bool:
    return (lo is None or v >= lo) and (hi is None or v <= hi)


def _ref_keep(ell, mask, spec: RejectionSpec, convention: str) -> list[list[bool]]:
    B, T = mask.shape
    lo, hi = spec.lower, spec.upper
    if spec.ratio_bounds:
        lo = None if lo is None else math.log(lo)
        hi = None if hi is None else math.log(hi)
    keep = [[False] * T for _ in range(B)]
    for i in range(B):
        ks = {t: _k(float(ell[i, t]), spec.metric, convention) for t in range(T) if mask[i, t]}
        if spec.level == "sequence" and ks:
            vals = list(ks.values())
            agg = {"sum": sum(vals), "mean": sum(vals) / len(vals), "max": max(vals)}[spec.seq_agg]
            seq_ok = _inside(agg, lo, hi)
        for t, k in ks.items():
            keep[i][t] = seq_ok if spec.level == "sequence" else _inside(k, lo, hi)
    return keep


_SPECS = [
    RejectionSpec(metric="k1", level="token", lower=-0.5, upper=0.8),
    RejectionSpec(metric="k1", level="token", upper=0.3),
    RejectionSpec(metric="k1", level="token", lower=-0.3),
    RejectionSpec(metric="k2", level="token", upper=0.4),
    RejectionSpec(metric="k3", level="token", upper=0.3),
    RejectionSpec(metric="k3", level="sequence", seq_agg="sum", upper=1.5),
    RejectionSpec(metric="k3", level="sequence", seq_agg="mean", upper=0.4),
    RejectionSpec(metric="k2", level="sequence", seq_agg="max", upper=1.0),
    RejectionSpec(metric="k1", level="sequence", seq_agg="sum", lower=-1.0, upper=2.0),
    RejectionSpec(metric="k1", level="sequence", seq_agg="mean", lower=0.5, upper=2.0, ratio_bounds=True),
    RejectionSpec(metric="k1", level="token", lower=0.5, upper=2.0, ratio_bounds=True),
]


@pytest.mark.parametrize("spec", _SPECS, ids=lambda s: f"{s.metric}-{s.level}-{s.seq_agg}-{s.ratio_bounds}")
@pytest.mark.parametrize("convention", ["verl", "areal"])
def test_divergence_rejection_matches_reference(spec: RejectionSpec, convention: str) -> None:
    ell, mask = _batch(seed=1)
    out = divergence_rejection(log_ratio=ell, mask=mask, convention=convention, **spec._asdict())
    ref = _ref_keep(ell, mask, spec, convention)
    assert out.mask.tolist() == ref
    n_kept = sum(map(sum, ref))
    assert 0 < n_kept < int(mask.sum())  # the condition is exercised on both sides
    assert torch.equal(out.weights, out.mask.double())  # default weight "one"
    n_in = int(mask.sum())
    assert abs(float(out.metrics["is/masked_frac"]) - (n_in - n_kept) / n_in) < ATOL


def test_verl_k1_ratio_bounds_mapping() -> None:
    """verl's k1 bounds are ratios compared in log space: keep iff log lo ≤ k1 ≤ log hi, k1 = −ℓ (verl)."""
    ell = torch.log(torch.tensor([[0.4, 0.5, 1.0, 2.0, 2.5]], dtype=torch.float64))
    mask = torch.ones(1, 5, dtype=torch.bool)
    out = divergence_rejection(
        log_ratio=ell, mask=mask, metric="k1", level="token", lower=0.5, upper=2.0, ratio_bounds=True
    )
    # k1 = −ℓ = log(1/ρ) ∈ [log 0.5, log 2] ⇔ ρ ∈ [0.5, 2]
    assert out.mask.tolist() == [[False, True, True, True, False]]


def test_specs_are_anded() -> None:
    ell, mask = _batch(seed=2, B=16, scale=0.6)
    specs = [_SPECS[3], _SPECS[5], _SPECS[1]]
    out = divergence_rejection_all(log_ratio=ell, mask=mask, specs=specs)
    refs = [_ref_keep(ell, mask, s, "verl") for s in specs]
    B, T = mask.shape
    expect = [[all(r[i][t] for r in refs) for t in range(T)] for i in range(B)]
    assert out.mask.tolist() == expect
    singles = [divergence_rejection_all(log_ratio=ell, mask=mask, specs=[s]).mask for s in specs]
    assert 0 < int(out.mask.sum()) < min(int(m.sum()) for m in singles)
    assert torch.equal(divergence_rejection_all(log_ratio=ell, mask=mask, specs=[]).mask, mask)


@pytest.mark.parametrize("weight", ["token", "geometric"])
def test_rejection_weights(weight: str) -> None:
    ell, mask = _batch(seed=3)
    out = divergence_rejection(log_ratio=ell, mask=mask, metric="k3", level="token", upper=0.5, weight=weight)
    B, T = mask.shape
    for i in range(B):
        row = [float(ell[i, t]) for t in range(T) if mask[i, t]]
        for t in range(T):
            if not out.mask[i, t]:
                assert float(out.weights[i, t]) == 0.0
            elif weight == "token":
                assert abs(float(out.weights[i, t]) - math.exp(float(ell[i, t]))) < ATOL  # π_prox/μ
            else:
                assert abs(float(out.weights[i, t]) - math.exp(sum(row) / len(row))) < ATOL  # exp(S̄_i)


def test_rejection_can_remove_everything() -> None:
    ell, mask = _batch(seed=4, scale=3.0)
    out = divergence_rejection(log_ratio=ell, mask=mask, metric="k2", level="token", upper=1e-6)
    assert not out.mask.any() and float(out.metrics["loss/all_masked"]) == 1.0
    logp = torch.zeros(*mask.shape, dtype=torch.float64, requires_grad=True)
    loss = aggregate(-out.weights * logp, out.mask, "seq-mean-token-mean")
    loss.backward()
    assert float(loss.detach()) == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))


@given(seed=st.integers(0, 2**16), spec=st.sampled_from(_SPECS[:9]), convention=st.sampled_from(["verl", "areal"]))
def test_rejection_on_policy_keeps_everything_if_zero_is_in_bounds(seed, spec, convention) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 5, generator=g) > 0.4
    out = divergence_rejection(log_ratio=torch.zeros(3, 5), mask=mask, convention=convention, **spec._asdict())
    assert torch.equal(out.mask, mask) and torch.equal(out.weights, mask.float())


@given(seed=st.integers(0, 2**16), sign=st.sampled_from([-1.0, 1.0]), spec=st.sampled_from(_SPECS))
def test_rejection_huge_log_ratios_finite(seed, sign, spec) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 5, generator=g) > 0.4
    ell = (sign * 1000.0 * (torch.rand(3, 5, generator=g) > 0.5).float()).requires_grad_(True)
    out = divergence_rejection(log_ratio=ell, mask=mask, weight="token", **spec._asdict())
    assert torch.isfinite(out.weights).all() and not out.weights.requires_grad
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_rejection_bad_options() -> None:
    ell, mask = _batch()
    for kwargs in (
        {"metric": "k4"},
        {"metric": "ratio", "lower": 0.0},
        {"level": "group"},
        {"level": "sequence", "seq_agg": "min"},
        {"lower": 2.0, "upper": 1.0},
        {"ratio_bounds": True, "lower": 0.0},
        {"weight": "ratio"},
        {"convention": "trl"},
    ):
        with pytest.raises(ValueError):
            divergence_rejection(log_ratio=ell, mask=mask, **kwargs)


def test_default_level_agrees_with_the_spec() -> None:
    """The core function, its NamedTuple and the ``rejection`` spec default to the same level (sequence)."""
    import inspect

    from steadyrl.methods.spec import Rejection

    core_default = inspect.signature(divergence_rejection).parameters["level"].default
    assert core_default == RejectionSpec().level == Rejection().level == "sequence"


def _ref_stat_ratio(ell, mask, level: str, agg: str) -> list[float | None]:
    """AReaL's ``metric="ratio"`` statistic in log space: log ρ_t per token, or sum | mean | max of log ρ_t."""
    out = []
    for i in range(mask.shape[0]):
        row = [float(ell[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
        if not row:
            out.append(None)
        elif level == "sequence":
            out.append({"sum": sum(row), "mean": sum(row) / len(row), "max": max(row)}[agg])
    return out


@pytest.mark.parametrize("agg", ["sum", "mean", "max"])
def test_ratio_metric_tests_the_ratio_in_log_space(agg: str) -> None:
    ell, mask = _batch(seed=6, B=16, scale=0.5)
    lo, hi = 0.7, 1.6
    out = divergence_rejection(
        log_ratio=ell, mask=mask, metric="ratio", level="sequence", seq_agg=agg, lower=lo, upper=hi, weight="geometric"
    )
    stats = _ref_stat_ratio(ell, mask, "sequence", agg)
    for i, st_i in enumerate(stats):
        keep = st_i is not None and math.log(lo) <= st_i <= math.log(hi)  # exp(agg) ∈ [lo, hi]
        assert out.mask[i].tolist() == [bool(mask[i, t]) and keep for t in range(mask.shape[1])]
        if keep:
            row = [float(ell[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
            w = math.exp(sum(row) / len(row))  # AReaL's sequence weight: the geometric mean for every agg
            assert all(abs(float(out.weights[i, t]) - w) < ATOL for t in range(mask.shape[1]) if mask[i, t])
    assert 0 < int(out.mask.sum()) < int(mask.sum())
    token = divergence_rejection(log_ratio=ell, mask=mask, metric="ratio", level="token", lower=lo, upper=hi)
    expect = mask & (ell >= math.log(lo)) & (ell <= math.log(hi))
    assert torch.equal(token.mask, expect)  # token level: token MIS with a pure-mask weight


def _ref_binary_kl(lp: float, lq: float, eps: float = 1e-8) -> float:
    p = min(max(math.exp(lp), eps), 1 - eps)
    q = min(max(math.exp(lq), eps), 1 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_binary_kl_kpop_matches_reference() -> None:
    """KPop: keep token t iff max(D(p‖q), D(q‖p)) ≤ φ, p = π_prox(y_t), q = μ(y_t), D the Bernoulli KL."""
    ell, mask = _batch(seed=7, B=16, T=9, scale=0.8)
    g = torch.Generator().manual_seed(8)
    behav = torch.log(torch.rand(mask.shape, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    behav[0, 0] = 0.0  # p = 1 (clamped to 1 − ε)
    behav_in = torch.where(mask, behav, float("nan"))
    phi = 0.05
    out = divergence_rejection(
        log_ratio=ell, mask=mask, metric="binary_kl", level="token", upper=phi, weight="token", behav_logp=behav_in
    )
    B, T = mask.shape
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                assert not out.mask[i, t] and float(out.weights[i, t]) == 0.0
                continue
            lp, lq = float(behav[i, t] + ell[i, t]), float(behav[i, t])
            d = max(_ref_binary_kl(lp, lq), _ref_binary_kl(lq, lp))
            assert bool(out.mask[i, t]) == (d <= phi), (i, t, d)
            if d <= phi:
                assert abs(float(out.weights[i, t]) - math.exp(float(ell[i, t]))) < ATOL
    assert 0 < int(out.mask.sum()) < int(mask.sum())
    with pytest.raises(ValueError, match="behav_logp"):
        divergence_rejection(log_ratio=ell, mask=mask, metric="binary_kl", upper=phi)


@given(seed=st.integers(0, 2**16), sign=st.sampled_from([-1.0, 1.0]))
def test_binary_kl_huge_log_ratios_finite(seed, sign) -> None:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(3, 5, generator=g) > 0.4
    ell = sign * 1000.0 * (torch.rand(3, 5, generator=g) > 0.5).double()
    behav = torch.where(mask, -torch.rand(3, 5, generator=g, dtype=torch.float64) * 1000.0, float("nan"))
    out = divergence_rejection(
        log_ratio=ell, mask=mask, metric="binary_kl", level="sequence", seq_agg="max", upper=0.1, behav_logp=behav
    )
    assert torch.isfinite(out.weights).all() and all(torch.isfinite(v) for v in out.metrics.values())
    assert not (out.mask & ~mask).any()


# ---------------------------------------------------------------------------------------------------- OPSM


def test_opsm_matches_reference() -> None:
    g = torch.Generator().manual_seed(5)
    B, T = 12, 6
    behav = torch.randn(B, T, generator=g, dtype=torch.float64) - 1.0
    logp = behav + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0] = False
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    delta = 0.1
    logp_in = torch.where(mask, logp, float("nan")).requires_grad_(True)
    behav_in = torch.where(mask, behav, float("-inf")).requires_grad_(True)
    adv_in = adv.clone().requires_grad_(True)
    out = opsm(logp=logp_in, behav_logp=behav_in, advantages=adv_in, mask=mask, delta=delta)
    dropped = 0
    for i in range(B):
        d = [float(behav[i, t] - logp[i, t]) for t in range(T) if mask[i, t]]
        keep = float(adv[i]) >= 0 or (sum(d) / len(d) if d else 0.0) <= delta  # A_i ≥ 0 or mean(log μ − log π) ≤ δ
        dropped += bool(d) and not keep
        for t in range(T):
            assert bool(out.mask[i, t]) == (bool(mask[i, t]) and keep)
    assert dropped > 0
    assert torch.equal(out.weights, out.mask.double())
    assert not out.weights.requires_grad and not out.mask.requires_grad  # computed detached
    # positive-advantage sequences are never dropped
    assert all(out.mask[i].any() for i in range(B) if mask[i].any() and adv[i] >= 0)


def test_opsm_on_policy_and_all_masked() -> None:
    lp = torch.randn(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = opsm(logp=lp, behav_logp=lp.clone(), advantages=-torch.ones(3), mask=mask, delta=0.0)
    assert torch.equal(out.mask, mask)
    out = opsm(logp=lp, behav_logp=lp + 5.0, advantages=-torch.ones(3), mask=mask, delta=1.0)
    assert not out.mask.any() and float(out.metrics["loss/all_masked"]) == 1.0
    assert abs(float(out.metrics["kl/opsm_seq_mean"]) - 5.0) < 1e-5


# ----------------------------------------------------------------------------- rejected tokens and the denominators


def _ref_aggregate(z, kept, counted, mode: str, empty_rows: str) -> float:
    """Sums over the kept tokens, counts on ``counted`` (the mask from before the rejections)."""
    B, T = kept.shape
    if mode == "token-mean":
        n = sum(bool(counted[i, t]) for i in range(B) for t in range(T))
        return sum(float(z[i, t]) for i in range(B) for t in range(T) if kept[i, t]) / max(n, 1)
    rows = [i for i in range(B) if counted[i].any()]
    per = []
    for i in rows:
        s = sum(float(z[i, t]) for t in range(T) if kept[i, t])
        per.append(s / int(counted[i].sum()) if mode == "seq-mean-token-mean" else s)
    return sum(per) / (B if empty_rows == "count" else max(len(rows), 1))


@pytest.mark.parametrize(
    ("mode", "empty_rows"),
    [("token-mean", "skip"), ("seq-mean-token-mean", "skip"), ("seq-mean-token-mean", "count"),
     ("seq-mean-token-sum", "skip"), ("seq-mean-token-sum", "count")],
)  # fmt: skip
def test_aggregate_counts_on_the_count_mask(mode: str, empty_rows: str) -> None:
    """``aggregate(..., count_mask=m⁰)``: the rejected tokens stay in every denominator (TRL, AReaL)."""
    g = torch.Generator().manual_seed(9)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64)
    counted = torch.rand(6, 5, generator=g) > 0.3
    counted[0] = False
    kept = counted & (torch.rand(6, 5, generator=g) > 0.4)
    kept[1] = False  # a row rejected entirely: still counted
    z_in = torch.where(counted, z, float("nan"))
    out = aggregate(z_in, kept, mode, empty_rows=empty_rows, count_mask=counted)
    assert abs(float(out) - _ref_aggregate(z, kept, counted, mode, empty_rows)) < ATOL
    same = aggregate(z_in, kept, mode, empty_rows=empty_rows, count_mask=None)
    assert abs(float(same) - _ref_aggregate(z, kept, kept, mode, empty_rows)) < ATOL  # default: the kept mask
    norm = aggregate(z_in, kept, "seq-mean-token-sum-norm", count_mask=counted)
    assert torch.equal(norm, aggregate(z_in, kept, "seq-mean-token-sum-norm"))  # B · norm_len either way


def _batch_for_loss(seed: int = 0):
    from tests.methods._batch import make_batch

    b = make_batch(seed=seed, scale=0.8)
    g = torch.Generator().manual_seed(seed)
    b["advantages"] = torch.randn(b["mask"].shape[0], generator=g, dtype=torch.float64)
    return b


@pytest.mark.parametrize("objective", ["ppo_clip", "reinforce"])
def test_rejected_zero_equals_input_denominator(objective: str) -> None:
    """One masked-IS correction before a token-level objective: keeping its rejected tokens with weight 0
    (``rejected=zero``) and dropping them with the input denominator (``denominator=input``) give the same loss and
    gradient; both differ from the default. (GSPO's s_i would average over the kept tokens only in the second.)"""
    from steadyrl import compute_loss
    from steadyrl.methods.spec import MethodSpec

    def run(**fields):
        b = _batch_for_loss(3)
        corr = {"type": "icepop", "lower": 0.8, "upper": 1.25, "rejected": fields.pop("rejected", "drop")}
        spec = MethodSpec.model_validate({"name": "t", "advantage": {"type": "given"}, "corrections": [corr],
                                          "objective": {"type": objective}, **fields})  # fmt: skip
        out = compute_loss(spec, b, return_details=True)
        out.loss.backward()
        return out, b["logp"].grad

    zero, g_zero = run(rejected="zero")
    inp, g_inp = run(denominator="input")
    kept, _ = run()
    assert 0 < int(kept.mask.sum()) < int(zero.mask.sum())  # the rejection is exercised
    assert torch.equal(zero.mask, _batch_for_loss(3)["mask"]) and torch.equal(zero.weights, inp.weights)
    assert torch.allclose(zero.loss, inp.loss, atol=1e-12) and torch.allclose(g_zero, g_inp, atol=1e-12)
    assert abs(float((kept.loss - inp.loss).detach())) > 1e-6


def test_method_conventions_refuse_what_they_cannot_do() -> None:
    from steadyrl.methods.spec import MethodSpec

    with pytest.raises(ValueError, match="denominator='input'"):
        MethodSpec.model_validate({"name": "t", "objective": {"type": "oapl"}, "denominator": "input"})
    with pytest.raises(ValueError, match="bypass_ratio"):
        MethodSpec.model_validate({"name": "t", "bypass_ratio": "current"})
    MethodSpec.model_validate({"name": "t", "policy": "bypass", "bypass_ratio": "current", "denominator": "input"})


def test_newly_public_options_reach_core() -> None:
    """Options that were core-only (OTB's alignment / zero_lone_baseline / eps, M2PO mask's budget_over, the veto's
    weight) reach the core functions through the spec: ``compute_loss`` hands the objective what a direct call gives."""
    from steadyrl import compute_loss
    from steadyrl.core.advantages.otb import otb_advantages
    from steadyrl.core.importance_weights import token_veto
    from steadyrl.core.masking import where_masked as wm
    from steadyrl.core.objectives.m2po import m2po_mask
    from steadyrl.methods.spec import MethodSpec

    b = _batch_for_loss(5)
    mask = b["mask"].clone()
    mask[0, 1] = False  # a hole inside a response: the two OTB alignments differ
    b["mask"] = mask
    prox, behav = b["prox_logp"], b["behav_logp"]
    spec = MethodSpec.model_validate({"name": "t", "advantage": {"type": "otb", "alignment": "absolute",
                                      "zero_lone_baseline": False, "eps": 1e-3}})  # fmt: skip
    out = compute_loss(spec, b, return_details=True)
    returns = wm(b["rewards"][:, None].expand_as(mask), mask)
    ref = otb_advantages(returns=returns, token_logp=prox, sum_p2=b["sum_p2"], mask=mask, group_ids=b["group_ids"],
                         token_weights=torch.exp(wm(prox - behav, mask)), eps=1e-3, alignment="absolute",
                         zero_lone_baseline=False)  # fmt: skip
    assert torch.allclose(out.advantages, ref.advantages, atol=1e-12)
    default = compute_loss(MethodSpec.model_validate({"name": "t", "advantage": {"type": "otb"}}), b,
                           return_details=True)  # fmt: skip
    assert not torch.allclose(default.advantages, ref.advantages)

    spec = MethodSpec.model_validate({"name": "t", "advantage": {"type": "given"}, "corrections": [
        {"type": "m2po_mask", "harmful_only": True, "budget_over": "valid"}]})  # fmt: skip
    out = compute_loss(spec, b, return_details=True)
    adv_tok = wm(b["advantages"][:, None].expand_as(mask), mask)
    ref_m = m2po_mask(log_ratio=behav - prox, mask=mask, harmful_only=True, advantages=adv_tok, budget_over="valid")
    assert torch.equal(out.mask, ref_m.mask)
    cand = m2po_mask(log_ratio=behav - prox, mask=mask, harmful_only=True, advantages=adv_tok)
    assert not torch.equal(cand.mask, ref_m.mask)  # the option changes the result on this batch

    spec = MethodSpec.model_validate({"name": "t", "advantage": {"type": "given"}, "corrections": [
        {"type": "token_veto", "threshold": 0.5, "weight": "ratio"}]})  # fmt: skip
    out = compute_loss(spec, b, return_details=True)
    ref_v = token_veto(log_ratio=wm(prox - behav, mask), mask=mask, threshold=0.5, weight="ratio")
    assert torch.equal(out.mask, ref_v.mask) and torch.allclose(out.weights, ref_v.weights, atol=1e-15)
    assert not torch.equal(out.weights, out.mask.double())  # the ratio, not 1
