"""compute_loss over the whole catalog: properties every method must have, and end-to-end float64 references."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from steadyrl import compute_loss, resolve_method
from steadyrl.methods import PRESETS, PRESETS_BY_NAME, MethodSpec, reads_behavior, required_inputs
from steadyrl.methods.batch import KEY_DOCS
from tests.core.advantages.test_vaco import _ref_vaco
from tests.methods._batch import make_batch

ALL = [p.name for p in PRESETS]
DIAGNOSTICS = ("is/ess_ratio", "is/weight_max", "kl/k3", "lag/mean", "lag/max", "loss/all_masked", "loss/total")


@pytest.mark.parametrize("name", ALL)
def test_every_method_runs_and_backpropagates(name: str) -> None:
    batch = make_batch()
    loss, metrics = compute_loss(name, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert batch["logp"].grad is not None and torch.isfinite(batch["logp"].grad).all()
    for key in DIAGNOSTICS:
        assert key in metrics, key
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())
    assert torch.equal(metrics["lag/max"], torch.tensor(7.0, dtype=metrics["lag/max"].dtype))


@pytest.mark.parametrize("name", ALL)
def test_fully_masked_batch_gives_zero_loss_zero_grad_and_flag(name: str) -> None:
    batch = make_batch()
    batch["mask"] = torch.zeros_like(batch["mask"])
    loss, metrics = compute_loss(name, batch)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(batch["logp"].grad) == 0
    assert metrics["loss/all_masked"].item() == 1.0


@pytest.mark.parametrize("name", ALL)
def test_extreme_log_ratios_stay_finite(name: str) -> None:
    batch = make_batch()
    sign = torch.where(torch.rand(batch["behav_logp"].shape, generator=torch.Generator().manual_seed(1)) > 0.5, 1, -1)
    batch["behav_logp"] = batch["logp"].detach() + 1000.0 * sign
    loss, metrics = compute_loss(name, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(batch["logp"].grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ALL)
def test_gradient_flows_only_through_logp(name: str) -> None:
    batch = make_batch()
    for key in ("behav_logp", "ref_logp", "values", "grad_sq_norms", "sum_p2", "behav_entropy"):
        batch[key] = batch[key].clone().requires_grad_(True)
    batch["prox_logp"] = batch["logp"].detach().clone().requires_grad_(True)
    loss, _ = compute_loss(name, batch)
    loss.backward()
    for key in ("behav_logp", "prox_logp", "ref_logp", "values", "grad_sq_norms", "sum_p2", "behav_entropy"):
        assert batch[key].grad is None, key


def _mu_shifted(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two copies of one batch that differ only in μ: π_θ and π_prox fixed (π_prox ≠ π_θ, a later update of a phase).

    The first μ is within 1e-4 nats of π_prox (inside every method's keep band, even geometric MIS's 0.999–1.001);
    the second moves every token by noise and a few tokens by +12 nats (π/μ ≈ 6e-6), so thresholds such as the token
    veto's 1e-4 are crossed too.
    """
    b1, b2 = make_batch(seed=seed), make_batch(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    shape = b1["logp"].shape
    prox = b1["logp"].detach() + 0.2 * torch.randn(shape, generator=g).double()
    behav = prox + 1e-4 * torch.randn(shape, generator=g).double()
    shift = 0.5 * torch.randn(shape, generator=g).double()
    shift[::5, 0] += 12.0
    for b in (b1, b2):
        b["prox_logp"], b["behav_logp"] = prox.clone(), behav.clone()
    b2["behav_logp"] = behav + shift
    return b1, b2


@pytest.mark.parametrize("name", ALL)
def test_each_method_reacts_to_the_behavior_policy_as_it_claims(name: str) -> None:
    """The catalog's claim (``Preset.corrects``) against the code: with π_θ and π_prox fixed, a change of μ moves the
    loss or the gradient of every method that claims a behavior correction in its loss, only the controller input
    of a ``step`` method, and nothing of an uncorrected one (whose spec must not read μ either)."""
    preset = PRESETS_BY_NAME[name]
    spec = resolve_method(name)
    moved = []
    for seed in (0, 1, 2):
        b1, b2 = _mu_shifted(seed)
        (l1, m1), (l2, m2) = compute_loss(spec, b1), compute_loss(spec, b2)
        l1.backward()
        l2.backward()
        loss_moved = not torch.allclose(l1, l2, rtol=0, atol=1e-12)
        grad_moved = not torch.allclose(b1["logp"].grad, b2["logp"].grad, rtol=0, atol=1e-12)
        step_moved = "vcpo/ess_ratio" in m1 and not torch.equal(m1["vcpo/ess_ratio"], m2["vcpo/ess_ratio"])
        moved.append((loss_moved or grad_moved, step_moved))
    if preset.corrects == "loss":
        assert all(loss for loss, _ in moved), f"{name}: μ changed, its loss and gradient did not ({moved})"
        assert reads_behavior(spec, controllers=False)
    elif preset.corrects == "step":
        assert not any(loss for loss, _ in moved) and all(step for _, step in moved), moved
        assert reads_behavior(spec) and not reads_behavior(spec, controllers=False)
    else:
        assert not any(loss or step for loss, step in moved), f"{name} claims no correction but reads μ"
        assert not reads_behavior(spec)


def test_tic_grpo_ratio_to_the_proximal_policy_ignores_mu() -> None:
    """The proximal-ratio form (``objective.ratio_to=proximal``): μ does not enter its loss or gradient at all, which
    is why the preset now takes its ratio against μ (the catalog test above would fail on it)."""
    spec = resolve_method("tic_grpo", {"objective.ratio_to": "proximal"})
    b1, b2 = _mu_shifted(0)
    (l1, _), (l2, _) = compute_loss(spec, b1), compute_loss(spec, b2)
    l1.backward()
    l2.backward()
    assert torch.equal(l1, l2) and torch.equal(b1["logp"].grad, b2["logp"].grad)


# Correction presets: on-policy (μ = π_prox = π_θ) they must reduce to the objective they correct.
CORRECTIONS = [p.name for p in PRESETS if p.fields.get("corrections") and "advantage" not in p.fields]


@pytest.mark.parametrize("name", CORRECTIONS)
@given(seed=st.integers(0, 10_000))
def test_on_policy_corrections_reduce_to_the_plain_objective(name: str, seed: int) -> None:
    spec = resolve_method(name)
    plain = spec.model_copy(update={"corrections": (), "recompute_prox": False})
    b1, b2 = make_batch(seed=seed, on_policy=True), make_batch(seed=seed, on_policy=True)
    loss, metrics = compute_loss(spec, b1)
    ref, _ = compute_loss(plain, b2)
    loss.backward()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-12)
    assert torch.allclose(b1["logp"].grad, b2["logp"].grad, atol=1e-12)
    assert metrics["loss/masked_frac"].item() == 0.0


@given(seed=st.integers(0, 10_000))
def test_on_policy_gmc_equals_grpo_gradient(seed: int) -> None:
    b1, b2 = make_batch(seed=seed, on_policy=True), make_batch(seed=seed, on_policy=True)
    compute_loss("gmc_grpo", b1).loss.backward()
    compute_loss("grpo", b2, overrides={"objective.type": "reinforce"}).loss.backward()
    assert torch.allclose(b1["logp"].grad, b2["logp"].grad, atol=1e-12)


NO_PROX = [p.name for p in PRESETS if "prox_logp" not in required_inputs(resolve_method(p.name))]


@pytest.mark.parametrize("name", NO_PROX)
def test_prox_defaults_to_logp_detached(name: str) -> None:
    """Without ``prox_logp`` the loss uses π_θ detached: the same loss and gradient as passing that value."""
    b1, b2 = make_batch(seed=8), make_batch(seed=8)
    del b2["prox_logp"]
    l1, _ = compute_loss(name, b1)
    l2, _ = compute_loss(name, b2)
    l1.backward()
    l2.backward()
    assert torch.equal(l1, l2)
    assert torch.equal(b1["logp"].grad, b2["logp"].grad)


@given(seed=st.integers(0, 10_000), agg=st.sampled_from(["token-mean", "seq-mean-token-mean"]))
def test_on_policy_vaco_is_grpo(seed: int, agg: str) -> None:
    """μ = π_prox = π_θ: no re-alignment (all ρ = 1), no TV drop, weights 1: VACO is REINFORCE on GRPO advantages."""
    spec = resolve_method("vaco", {"agg": agg})
    plain = resolve_method("grpo", {"agg": agg, "objective.type": "reinforce"})
    b1, b2 = make_batch(seed=seed, on_policy=True), make_batch(seed=seed, on_policy=True)
    loss, metrics = compute_loss(spec, b1)
    ref, ref_metrics = compute_loss(plain, b2)
    loss.backward()
    ref.backward()
    assert torch.equal(loss, ref)
    assert torch.equal(b1["logp"].grad, b2["logp"].grad)
    assert metrics["adv/realign_shift"].item() == 0.0 and metrics["loss/masked_frac"].item() == 0.0
    assert torch.equal(metrics["adv/mean"], ref_metrics["adv/mean"])


@given(seed=st.integers(0, 10_000))
def test_vaco_realigns_with_prox_and_matches_float64_reference(seed: int) -> None:
    """The whole VACO loss by hand (filter off): ρ_i from the *given* π_prox, v_g, A_i; the unclipped ratio to μ,
    −A·min(π_prox/μ, 1e4)·π_θ/π_prox = −A·π_θ/μ, summed per sequence and divided by B·T (seq-mean-token-sum-norm)."""
    batch = make_batch(seed=seed, scale=0.5)
    g = torch.Generator().manual_seed(seed)
    batch["prox_logp"] = batch["logp"].detach() + 0.3 * torch.randn(batch["logp"].shape, generator=g).double()
    spec = resolve_method("vaco", {"vaco_filter.delta": 1e9, "advantage.rho_bar": 1.2})
    loss, metrics = compute_loss(spec, batch)
    mask, ell = batch["mask"], batch["prox_logp"] - batch["behav_logp"]
    adv, target, _ = _ref_vaco(batch["rewards"], batch["group_ids"], ell, mask, rho_bar=1.2, ratio="geometric",
                               scale="group", eps=1e-6, unbiased=True)
    r = torch.exp(batch["logp"].detach() - batch["behav_logp"])  # π_θ/μ (value), below the 1e4 truncation here
    B, T = mask.shape
    terms = [-adv[i] * float(r[i, t]) for i in range(B) for t in range(T) if mask[i, t]]
    assert loss.item() == pytest.approx(sum(terms) / (B * T), abs=1e-10)
    assert metrics["adv/baseline_mean"].item() == pytest.approx(sum(target) / len(target), abs=1e-12)
    assert metrics["adv/realign_shift"].item() > 0.0


def _seq_tis_reference(batch: dict[str, torch.Tensor], cap: float = 8.0) -> float:
    """By hand: A_i = GRPO (unbiased std + 1e-6); w̄_i = min(exp S_i, C); seq-mean-token-mean of −A w̄."""
    logp, behav, mask = batch["logp"].detach(), batch["behav_logp"], batch["mask"]
    R, gid = batch["rewards"].tolist(), batch["group_ids"].tolist()
    B, T = logp.shape
    per_seq = []
    for i in range(B):
        members = [R[j] for j in range(B) if gid[j] == gid[i]]
        mean = sum(members) / len(members)
        std = (sum((r - mean) ** 2 for r in members) / (len(members) - 1)) ** 0.5
        A = (R[i] - mean) / (std + 1e-6)
        toks = [t for t in range(T) if mask[i, t]]
        S = sum(float(logp[i, t] - behav[i, t]) for t in toks)
        w = min(torch.exp(torch.tensor(S, dtype=torch.float64)).item(), cap)
        if toks:
            per_seq.append(sum(-A * w for _ in toks) / len(toks))
    return sum(per_seq) / len(per_seq)


@given(seed=st.integers(0, 10_000))
def test_seq_tis_matches_float64_reference(seed: int) -> None:
    batch = make_batch(seed=seed)
    loss, _ = compute_loss("seq_tis", batch)
    assert loss.item() == pytest.approx(_seq_tis_reference(batch), abs=1e-10)


def test_bypass_uses_behavior_as_proximal() -> None:
    batch = make_batch(seed=3)
    _loss, metrics = compute_loss("token_tis+bypass", batch)
    # π_prox := μ: no behavior weight (all 1), and the PPO ratio is π_θ/μ, far from 1 here.
    assert metrics["token_tis/weight_max"].item() == pytest.approx(1.0)
    assert metrics["loss/ratio_max"].item() > 1.2


def test_prox_logp_is_used_for_weights_when_given() -> None:
    batch = make_batch(seed=4)
    batch["prox_logp"] = batch["behav_logp"].clone()
    _, metrics = compute_loss("seq_tis", batch)
    assert metrics["is/ess_ratio"].item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("vcpo", "grad_sq_norms"), ("copc", "values"), ("estr", "behav_entropy"), ("otb", "sum_p2"),
        ("vaco", "prox_logp"),
    ],
)
def test_missing_tensor_is_named(name: str, key: str) -> None:
    batch = make_batch()
    del batch[key]
    with pytest.raises(ValueError, match=key) as err:
        compute_loss(name, batch)
    assert KEY_DOCS[key].split("]")[0] in str(err.value)


def test_bad_batch_errors_name_the_key() -> None:
    batch = make_batch()
    with pytest.raises(ValueError, match="unknown batch key"):
        compute_loss("grpo", {**batch, "old_logp": batch["logp"]})
    with pytest.raises(ValueError, match="'behav_logp' must have"):
        compute_loss("grpo", {**batch, "behav_logp": batch["behav_logp"][:, :3]})
    with pytest.raises(ValueError, match="'group_ids' must be an integer"):
        compute_loss("grpo", {**batch, "group_ids": batch["group_ids"].double()})
    with pytest.raises(ValueError, match="missing 'mask'"):
        compute_loss("grpo", {k: v for k, v in batch.items() if k != "mask"})


def test_required_inputs_cover_each_method() -> None:
    for p in PRESETS:
        needs = required_inputs(resolve_method(p.name))
        assert set(needs) <= set(KEY_DOCS), p.name


def test_ess_lr_controller_input_is_emitted() -> None:
    _, metrics = compute_loss("seq_tis+ess_lr", make_batch(scale=1.0))
    assert 0.0 < metrics["vcpo/ess_ratio"].item() < 1.0
    assert metrics["vcpo/ess_ratio"].item() == pytest.approx(metrics["is/ess_ratio"].item())


def test_m2po_measures_the_mismatch_also_in_bypass_mode() -> None:
    batch = make_batch(seed=5, scale=1.0)
    _, metrics = compute_loss("m2po+bypass", batch)
    assert metrics["m2po/masked_frac"].item() > 0.0
    assert metrics["m2po/m2_before"].item() > 0.04


def test_kl_in_reward_reports_its_penalty() -> None:
    _, metrics = compute_loss("kl_in_reward", make_batch(seed=6))
    assert "kl/ref_mean" in metrics


def test_otb_gets_the_return_to_go_of_token_rewards() -> None:
    from steadyrl.core.advantages.otb import otb_advantages
    from steadyrl.core.masking import safe_exp

    batch = make_batch(seed=7)
    B, T = batch["logp"].shape
    g = torch.Generator().manual_seed(0)
    batch["rewards"] = torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = batch["mask"]
    rtg = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):  # G_t = Σ_{k ≥ t, trained} r_k, by hand
        for t in range(T):
            if mask[i, t]:
                rtg[i, t] = sum(float(batch["rewards"][i, k]) for k in range(t, T) if mask[i, k])
    prox = batch["logp"].detach()
    ell = torch.where(mask, prox - batch["behav_logp"], 0.0)
    expect = otb_advantages(
        returns=rtg, token_logp=prox, sum_p2=batch["sum_p2"], mask=mask, group_ids=batch["group_ids"],
        token_weights=safe_exp(ell),
    ).advantages  # fmt: skip
    spec = resolve_method("otb", {"objective.type": "reinforce", "agg": "token-mean"})
    loss, _ = compute_loss(spec, batch)
    ref = -(expect[mask]).mean()  # REINFORCE at r = 1, no correction: −mean A over trained tokens
    assert loss.item() == pytest.approx(ref.item(), abs=1e-10)


@pytest.mark.parametrize("name", ALL)
def test_the_entropy_bonus_on_every_method(name: str) -> None:
    """``entropy.coef = c`` on any preset adds −c·agg(H) over the tokens its objective trains on (the method's own
    reduction by default), leaves the rest of the loss alone, and gives an exact zero on a fully masked batch."""
    from steadyrl.core.masking import aggregate
    from steadyrl.methods.compose import _entropy_reduction

    spec = resolve_method(name, {"entropy.coef": 0.05})
    batch = make_batch()
    plain = compute_loss(name, {**batch, "entropy_coef": 0.0} if "entropy" in required_inputs(spec) else batch)
    out = compute_loss(spec, batch, return_details=True)
    agg, rows = _entropy_reduction(spec)
    norm = None if spec.norm_len is None else float(spec.norm_len)
    count = batch["mask"] if spec.denominator == "input" else None
    want = -0.05 * aggregate(batch["entropy"].detach(), out.mask, agg, norm_len=norm, empty_rows=rows, count_mask=count)
    torch.testing.assert_close(out.metrics["loss/entropy_bonus"], want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(out.loss.detach() - plain.loss.detach(), want, rtol=1e-9, atol=1e-12)
    assert float(out.metrics["entropy/coef"]) == 0.05 and not out.metrics["entropy/mean"].requires_grad

    batch = make_batch()
    batch["mask"] = torch.zeros_like(batch["mask"])
    loss, metrics = compute_loss(spec, batch)
    loss.backward()
    assert loss.item() == 0.0 and float(metrics["loss/entropy_bonus"]) == 0.0
    assert torch.count_nonzero(batch["logp"].grad) == 0


def test_an_entropy_bonus_needs_the_entropy_and_takes_the_batch_coefficient() -> None:
    batch = make_batch()
    spec = resolve_method("grpo", {"entropy.coef": 0.05})
    assert "entropy" in required_inputs(spec) and "entropy" not in required_inputs(resolve_method("grpo"))
    with pytest.raises(ValueError, match=r"'entropy': \[B,T\] entropy"):
        compute_loss(spec, {k: v for k, v in batch.items() if k != "entropy"})
    a = compute_loss(spec, {**batch, "entropy_coef": torch.tensor(0.1, dtype=torch.float64)})
    b = compute_loss("grpo", batch, overrides={"entropy.coef": 0.1})
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="adaptive_entropy twice"):
        MethodSpec(name="x", controllers=({"type": "adaptive_entropy"}, {"type": "adaptive_entropy"}))  # type: ignore[arg-type]
