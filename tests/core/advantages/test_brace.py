"""BRACE targets and advantages against a float64 double loop written from the paper's equation (arXiv 2609.09783)."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.core.advantages.brace import brace_advantages
from steadyrl.core.advantages.vtrace import vtrace


def _ref(
    r: torch.Tensor, R: torch.Tensor, V: torch.Tensor, lr: torch.Tensor, mask: torch.Tensor, *, k: int,
    rho_bar: float, c_bar: float, gamma: float, lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """V_targ(s) = V(s) + Σ_{t=s}^{j−1} γ^{t−s} Π_{i=s}^{t−1} c_i δ_t + Π_{i=s}^{j−1} c_i [γ^{j−s} G_j − γ^{j−s} V(s_j)]
    term by term (G_j = Σ_{t≥j} γ^{t−j} r_t + γ^{T−j} R, = γ^{T−j} R when r ≡ 0) and Â_s = r_s + γ V_targ(s+1) − V(s).
    """
    B, Tpad = mask.shape
    targ_out = torch.zeros(B, Tpad, dtype=torch.float64)
    adv_out = torch.zeros(B, Tpad, dtype=torch.float64)
    for b in range(B):
        cols = [t for t in range(Tpad) if mask[b, t]]
        T = len(cols)
        rr = [float(r[b, t]) for t in cols]
        vv = [float(V[b, t]) for t in cols] + [0.0]  # V(s_T) = 0: terminal
        w = [math.exp(max(-20.0, min(20.0, float(lr[b, t])))) for t in cols]
        rho = [min(rho_bar, x) for x in w]
        c = [lam * min(c_bar, x) for x in w]
        RR = float(R[b])

        def mc(j: int, rr: list[float] = rr, T: int = T, RR: float = RR) -> float:
            return sum(gamma ** (t - j) * rr[t] for t in range(j, T)) + gamma ** (T - j) * RR

        targ = []
        for s in range(T + 1):
            j = min(s + k, T)
            total = vv[s]
            for t in range(s, j):
                prod = 1.0
                for i in range(s, t):
                    prod *= c[i]
                delta = rho[t] * (rr[t] + gamma * vv[t + 1] - vv[t])
                total += gamma ** (t - s) * prod * delta
            prod = 1.0
            for i in range(s, j):
                prod *= c[i]
            total += prod * (gamma ** (j - s) * mc(j) - gamma ** (j - s) * vv[j])
            targ.append(total)
        for s, col in enumerate(cols):
            targ_out[b, col] = targ[s]
            adv_out[b, col] = rr[s] + gamma * targ[s + 1] - vv[s]
    return targ_out, adv_out


def _batch(seed: int, B: int = 4, T: int = 9, rewards_inside: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0] = True
    mask[-1] = False  # an empty row
    mask[1, :3] = False  # a prompt-like prefix
    return {
        "rewards": torch.randn(B, T, generator=g, dtype=torch.float64) * (0.3 if rewards_inside else 0.0),
        "returns": torch.randn(B, generator=g, dtype=torch.float64),
        "values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "log_ratio": torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4,
        "mask": mask,
    }


@pytest.mark.parametrize("k", [0, 1, 3, 100])
@pytest.mark.parametrize("rewards_inside", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_matches_double_loop(k: int, rewards_inside: bool, gamma: float, lam: float) -> None:
    x = _batch(k + 7, rewards_inside=rewards_inside)
    out = brace_advantages(**x, k=k, gamma=gamma, lam=lam, whiten=False)
    targ, adv = _ref(x["rewards"], x["returns"], x["values"], x["log_ratio"], x["mask"], k=k, rho_bar=1.2,
                     c_bar=1.1, gamma=gamma, lam=lam)  # fmt: skip
    assert out.targets.dtype == torch.float64
    torch.testing.assert_close(out.targets, targ, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.advantages, adv, rtol=1e-12, atol=1e-12)


def test_whitening_over_batch_tokens() -> None:
    x = _batch(3)
    raw = brace_advantages(**x, whiten=False).advantages
    white = brace_advantages(**x).advantages
    m = x["mask"]
    mean, std = raw[m].mean(), raw[m].std(unbiased=False)
    torch.testing.assert_close(white[m], (raw[m] - mean) / (std + 1e-8))
    assert (white[~m] == 0).all()


def test_k0_is_monte_carlo() -> None:
    x = _batch(11, rewards_inside=True)
    gamma = 0.95
    out = brace_advantages(**x, k=0, gamma=gamma, whiten=False)
    m = x["mask"]
    for b in range(m.shape[0]):
        cols = [t for t in range(m.shape[1]) if m[b, t]]
        for s, col in enumerate(cols):
            mc = sum(gamma ** (t - s) * float(x["rewards"][b, cols[t]]) for t in range(s, len(cols)))
            mc += gamma ** (len(cols) - s) * float(x["returns"][b])
            assert out.targets[b, col].item() == pytest.approx(mc, abs=1e-12)


def test_on_policy_target_is_monte_carlo_for_every_k() -> None:
    x = {**_batch(5, rewards_inside=True), "log_ratio": torch.zeros(4, 9, dtype=torch.float64)}
    mc = brace_advantages(**x, k=0, whiten=False).targets
    for k in (1, 4, 100):
        torch.testing.assert_close(brace_advantages(**x, k=k, whiten=False).targets, mc, rtol=0, atol=1e-12)


def test_window_past_the_end_is_vtrace_with_the_terminal_step() -> None:
    """k ≥ T: V-trace (IMPALA Eq. 1, :func:`vtrace`) on the trajectory followed by a terminal step that carries R with
    ratio 1 and value 0."""
    x = _batch(13, rewards_inside=True)
    B, T = x["mask"].shape
    out = brace_advantages(**x, k=T + 5, gamma=0.9, lam=0.7, whiten=False)
    n = x["mask"].sum(-1)
    # append the terminal step right after each row's last trained token (an extra column on the right)
    mask = torch.cat([x["mask"], n.unsqueeze(-1) > 0], dim=-1)
    rewards = torch.cat([x["rewards"], x["returns"].unsqueeze(-1)], dim=-1)
    values = torch.cat([x["values"], torch.zeros(B, 1, dtype=torch.float64)], dim=-1)
    log_rhos = torch.cat([x["log_ratio"], torch.zeros(B, 1, dtype=torch.float64)], dim=-1)
    ref = vtrace(rewards=rewards, values=values, log_rhos=log_rhos, mask=mask, gamma=0.9, lam=0.7, rho_bar=1.2,
                 c_bar=1.1)  # fmt: skip
    torch.testing.assert_close(out.targets, ref.vs[:, :T], rtol=1e-12, atol=1e-12)


def test_extreme_log_ratios_stay_finite() -> None:
    x = _batch(2)
    x["log_ratio"] = torch.full_like(x["log_ratio"], 1000.0) * torch.sign(torch.randn_like(x["log_ratio"]))
    out = brace_advantages(**{**x, "values": x["values"].float(), "rewards": x["rewards"].float(),
                              "returns": x["returns"].float(), "log_ratio": x["log_ratio"].float()})  # fmt: skip
    assert torch.isfinite(out.targets).all() and torch.isfinite(out.advantages).all()
    for key in ("adv/mean", "brace/bias_hat", "brace/gap_hat"):
        assert torch.isfinite(out.metrics[key]), key


def test_all_masked_gives_zeros() -> None:
    x = {**_batch(4), "mask": torch.zeros(4, 9, dtype=torch.bool)}
    out = brace_advantages(**x)
    assert (out.targets == 0).all() and (out.advantages == 0).all()
    assert torch.isfinite(out.metrics["adv/mean"])


def test_reacts_to_behavior() -> None:
    x = _batch(6)
    a = brace_advantages(**x, k=3).targets
    b = brace_advantages(**{**x, "log_ratio": x["log_ratio"] + 0.5}, k=3).targets
    assert not torch.allclose(a, b)


def test_slope_diagnostic_is_one_for_monte_carlo() -> None:
    x = _batch(8, B=16, T=20)
    x["mask"][-1] = True
    out = brace_advantages(**x, k=0)
    assert out.metrics["brace/slope_h1_4"].item() == pytest.approx(1.0)
    assert out.metrics["brace/slope_h5_16"].item() == pytest.approx(1.0)
    assert out.metrics["brace/slope_h257_inf"].item() == 0.0  # an empty bin
    assert out.metrics["brace/frac_h257_inf"].item() == 0.0
    assert sum(v.item() for k, v in out.metrics.items() if k.startswith("brace/frac_")) == pytest.approx(1.0)


def test_bias_and_gap_estimates() -> None:
    x = _batch(9)
    x["log_ratio"] = torch.zeros_like(x["log_ratio"])
    out = brace_advantages(**x)
    assert out.metrics["brace/bias_hat"].item() == pytest.approx(0.0, abs=1e-12)  # π = μ: no bias
    R, m = x["returns"][:3], x["mask"]
    v0 = torch.stack([x["values"][b][m[b]][0] for b in range(3)]).mean()
    assert out.metrics["brace/gap_hat"].item() == pytest.approx(abs(v0 - R.mean()).item(), abs=1e-12)
