"""BRACE: a k-capped importance-corrected critic target with a Monte-Carlo tail (arXiv 2609.09783, §3, App. D).

With w_t = π(a_t|s_t)/μ(a_t|s_t) (π the policy at the start of the iteration, π_prox), ρ_t = min(ρ̄, w_t),
c_i = λ·min(c̄, w_i), δ_t V = ρ_t (r_t + γ V(s_{t+1}) − V(s_t)) and j = min(s + k, T)::

    V_targ(s) = V(s) + Σ_{t=s}^{j−1} γ^{t−s} (Π_{i=s}^{t−1} c_i) δ_t V
                     + (Π_{i=s}^{j−1} c_i) · [γ^{T−s} R − γ^{j−s} V(s_j)]

a window of at most k importance-corrected TD residuals, then a Monte-Carlo tail that carries the final reward R.
k = 0 is Monte Carlo (V_targ(s) = γ^{T−s} R); when the window reaches the end (k ≥ T − s) V(s_T) = 0 (terminal) and
the tail is the terminal residual γ^{T−s} R — a last step whose own ratio is 1, weighted by the trace of the tokens
before it — so the target is V-trace on the trajectory followed by that terminal step. With π = μ (all ratios 1)
the residuals telescope and V_targ(s) is the Monte-Carlo return for every k. The actor's advantage is

    Â_s = r_s + γ V_targ(s+1) − V(s),   V_targ(T) = R,

whitened over the batch's response tokens (mean 0, std 1 over every trained token of the batch).

Conventions (ours where the paper is silent; docs/algorithms.md lists them):

* r_t are the rewards *inside* the response (0 for an outcome-only task; KL-in-reward penalties when they are on) and
  R is the outcome reward, delivered at the terminal state s_T. With in-response rewards the Monte-Carlo tail is the
  full return from s_j, γ^{j−s}·G_j with G_j = Σ_{t≥j} γ^{t−j} r_t + γ^{T−j} R (the paper's γ^{T−s} R when r ≡ 0).
* The trajectory is the row's trained tokens: masked-out tokens (prompt, tool output) are skipped, so tool tokens
  carry no ratio and no residual, and s, t, j, T count trained tokens (as in :mod:`.vtrace`).
* The loop over the window's offsets runs min(k, T) times, vectorized over the batch and the start positions; the
  tensors stay on their device and nothing syncs with the host.

Diagnostics (the paper's three; how each is estimated is ours):

* ``brace/bias_hat`` b̂ = Ê_π[R] − Ê_μ[R]: Ê_μ[R] the batch mean of R, Ê_π[R] its self-normalized sequence-level
  importance-weighted mean (weights Π_t π/μ over the trained tokens, normalized in log space).
* ``brace/gap_hat`` ĝ_π = |v̄ − Ê_π[R]|, v̄ the mean of V at each response's first trained token.
* ``brace/slope_h<lo>_<hi>``: the least-squares slope of (V_targ − V) on (G − V) over the trained tokens whose
  remaining horizon T − s lies in [lo, hi] (G the Monte-Carlo return; 0 when a bin is empty or G − V is constant
  in it, so every metric stays finite), and ``brace/frac_h<lo>_<hi>``, the share of the batch's trained tokens in
  the bin. A slope of 1 is Monte Carlo, 0 is no correction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.advantages.grpo import token_advantage_metrics
from steadyrl.core.masking import as_bool_mask, detach_metrics, masked_mean, safe_exp, where_masked
from steadyrl.core.types import Metrics

#: The paper's constants (§3, App. D): window k, ratio caps ρ̄ and c̄, clip range of the value loss.
BRACE_K: int = 100
BRACE_RHO_BAR: float = 1.2
BRACE_C_BAR: float = 1.1
#: Remaining-horizon bins [lo, hi] of the slope diagnostic (ours).
HORIZON_BINS: tuple[tuple[int, int], ...] = ((1, 4), (5, 16), (17, 64), (65, 256), (257, 1 << 30))


class BraceOutput(NamedTuple):
    """Result of :func:`brace_advantages` (detached; 0 at masked-out positions).

    ==============  ======  ===================================================================
    field           shape   meaning
    ==============  ======  ===================================================================
    ``targets``     [B, T]  V_targ(s) at each trained token
    ``advantages``  [B, T]  Â_s = r_s + γ V_targ(s+1) − V(s), whitened over the batch (if asked)
    ``metrics``             ``adv/*``, ``brace/bias_hat``, ``brace/gap_hat``, ``brace/slope_h*``,
                            ``brace/rho_clipped_frac``, ``brace/c_clipped_frac``
    ==============  ======  ===================================================================
    """

    targets: Float[Tensor, "B T"]
    advantages: Float[Tensor, "B T"]
    metrics: Metrics


def brace_advantages(
    *,
    rewards: Float[Tensor, "B T"],
    returns: Float[Tensor, " B"],
    values: Float[Tensor, "B T"],
    log_ratio: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    k: int = BRACE_K,
    rho_bar: float = BRACE_RHO_BAR,
    c_bar: float = BRACE_C_BAR,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    eps: float = 1e-8,
) -> BraceOutput:
    """BRACE value targets and advantages (arXiv 2609.09783, §3 Eq. for V_targ and Â; App. D constants).

    ==============  ======  ===================================================================
    argument        shape   meaning
    ==============  ======  ===================================================================
    ``rewards``     [B, T]  in-response rewards r_t (0 for outcome-only tasks)
    ``returns``     [B]     the outcome reward R, delivered at the terminal state
    ``values``      [B, T]  critic values V(s_t) (the state before token t)
    ``log_ratio``   [B, T]  log w_t = log π_prox − log μ (detached; clamped to ±20 before exp)
    ``mask``        [B, T]  trained tokens (masked-out ones are skipped: no ratio, no residual)
    ``k``                   window length (≥ 0); 0: Monte Carlo, ≥ T: V-trace with the terminal step
    ``rho_bar``             ρ̄ > 0 of ρ_t = min(ρ̄, w_t)
    ``c_bar``               c̄ ≥ 0 of c_i = λ min(c̄, w_i)
    ``gamma, lam``          γ, λ ∈ [0, 1]
    ``whiten``              (Â − mean)/(std + eps) over the batch's trained tokens (population std)
    ==============  ======  ===================================================================
    """
    if k < 0:
        raise ValueError(f"BRACE window k must be >= 0 (got k={k})")
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must lie in [0, 1] (got gamma={gamma}, lam={lam})")
    if not rho_bar > 0 or not c_bar >= 0:
        raise ValueError(f"need rho_bar > 0 and c_bar >= 0 (got rho_bar={rho_bar}, c_bar={c_bar})")
    m = as_bool_mask(mask)
    B, T = m.shape
    order, n = _compact_order(m)  # trained tokens first, in order; n trained tokens per row
    pos = torch.arange(T + 1, device=m.device).expand(B, T + 1)
    live = pos < n.unsqueeze(-1)  # [B, T+1] compact positions 0..n−1 hold the trajectory; n is the terminal state

    def compact(x: Tensor, fill: float) -> Tensor:
        x = where_masked(x.detach(), m, fill).gather(-1, order)
        x = torch.cat([x, x.new_full((B, 1), fill)], dim=-1)
        return torch.where(live, x, torch.full_like(x, fill))

    dtype = torch.promote_types(values.dtype, torch.float32)
    r = compact(rewards.to(dtype), 0.0)
    V = compact(values.to(dtype), 0.0)  # V(s_T) = 0 (terminal) and beyond
    w = compact(safe_exp(where_masked(log_ratio.detach(), m)).to(dtype), 1.0)
    R = returns.detach().to(dtype)
    rho = w.clamp(max=rho_bar)
    c = lam * w.clamp(max=c_bar)
    V_next = _shift(V, 1, 0.0)
    delta = torch.where(live, rho * (r + gamma * V_next - V), torch.zeros_like(V))  # δ_t V

    # G_s: the Monte-Carlo return from s (G_n = R at the terminal state), backwards over compact positions
    G_cols: list[Tensor] = []
    carry = R
    for t in range(T, -1, -1):
        carry = torch.where(live[:, t], r[:, t] + gamma * carry, carry)
        G_cols.append(carry)
    G = torch.stack(G_cols[::-1], dim=-1)  # [B, T+1]

    # the window: acc_s = Σ_{d<min(k, n−s)} γ^d C_{s,s+d} δ_{s+d}, C the running trace product
    acc = torch.zeros_like(V)
    trace = torch.ones_like(V)
    for d in range(min(k, T)):
        inside = _shift(live, d, False)  # s + d < n
        acc = acc + torch.where(inside, (gamma**d) * trace * _shift(delta, d, 0.0), torch.zeros_like(acc))
        trace = torch.where(inside, trace * _shift(c, d, 1.0), trace)
    j = torch.minimum(pos + k, n.unsqueeze(-1)).clamp(max=T)  # j = min(s + k, n) (terminal index n ≤ T)
    span = (j - pos).clamp(min=0).to(dtype)  # j − s
    tail = trace * gamma**span * (G.gather(-1, j) - V.gather(-1, j))  # C_{s,j} γ^{j−s} (G_j − V(s_j))
    targ = V + acc + tail  # V_targ(n) = G_n = R
    adv = r + gamma * _shift(targ, 1, 0.0) - V  # Â_s = r_s + γ V_targ(s+1) − V(s)

    live_t = live[:, :T]
    targets = _scatter_back(torch.where(live_t, targ[:, :T], 0.0), order, m)
    raw_adv = _scatter_back(torch.where(live_t, adv[:, :T], 0.0), order, m)
    advantages = raw_adv
    if whiten:
        mean = masked_mean(raw_adv, m)
        std = masked_mean(where_masked((raw_adv - mean) ** 2, m), m).sqrt()
        advantages = where_masked((raw_adv - mean) / (std + eps), m)

    metrics = token_advantage_metrics(advantages=advantages, baseline=where_masked(values.detach(), m), mask=m)
    metrics["adv/raw_mean"] = masked_mean(raw_adv, m)
    metrics["adv/value_target_mean"] = masked_mean(targets, m)
    w_tok = where_masked(safe_exp(where_masked(log_ratio.detach(), m)), m)
    metrics["brace/rho_clipped_frac"] = masked_mean((w_tok > rho_bar).to(dtype), m)
    metrics["brace/c_clipped_frac"] = masked_mean((w_tok > c_bar).to(dtype), m)
    metrics |= _diagnostics(returns=R, values=V, targets=targ, mc=G, live=live_t, n=n, log_ratio=log_ratio, mask=m, T=T)
    return BraceOutput(targets=targets.detach(), advantages=advantages.detach(), metrics=detach_metrics(metrics))


def _diagnostics(
    *, returns: Tensor, values: Tensor, targets: Tensor, mc: Tensor, live: Tensor, n: Tensor, log_ratio: Tensor,
    mask: Bool[Tensor, "B T"], T: int,
) -> Metrics:  # fmt: skip
    """b̂, ĝ_π and the per-horizon slopes (module docstring); compact [B, T+1] inputs, [B, T] ``live``."""
    valid = n > 0
    dtype = returns.dtype
    vf = valid.to(dtype)
    count = vf.sum().clamp(min=1)
    e_mu = (returns * vf).sum() / count
    log_w = where_masked(log_ratio.detach().to(dtype), mask).sum(-1)  # log Π_t π/μ over the trained tokens
    log_w = torch.where(valid, log_w, torch.full_like(log_w, -torch.inf))
    p = torch.softmax(torch.where(valid.any(), log_w, torch.zeros_like(log_w)), dim=0) * vf
    e_pi = (p * returns).sum() / p.sum().clamp(min=1e-30)
    v_bar = (values[:, 0] * vf).sum() / count  # V at each response's first trained token
    out: Metrics = {"brace/bias_hat": e_pi - e_mu, "brace/gap_hat": (v_bar - e_pi).abs()}
    x = (mc - values)[:, :T]  # G − V
    y = (targets - values)[:, :T]  # V_targ − V
    horizon = n.unsqueeze(-1) - torch.arange(T, device=n.device)  # T − s in trained tokens
    for lo, hi in HORIZON_BINS:
        sel = live & (horizon >= lo) & (horizon <= hi)
        mx, my = masked_mean(x, sel), masked_mean(y, sel)
        cov = masked_mean(where_masked((x - mx) * (y - my), sel), sel)
        var = masked_mean(where_masked((x - mx) ** 2, sel), sel)
        name = f"h{lo}_{hi}" if hi < (1 << 30) else f"h{lo}_inf"
        out[f"brace/slope_{name}"] = torch.where(var > 0, cov / torch.where(var > 0, var, 1.0), 0.0)
        out[f"brace/frac_{name}"] = masked_mean(sel.to(dtype), live)
    return out


def _compact_order(m: Bool[Tensor, "B T"]) -> tuple[Int[Tensor, "B T"], Int[Tensor, " B"]]:
    """Column order that puts each row's trained tokens first (in order), and their count."""
    B, T = m.shape
    cols = torch.arange(T, device=m.device).expand(B, T)
    key = torch.where(m, cols, cols + T)
    return key.argsort(dim=-1), m.sum(-1)


def _scatter_back(x: Float[Tensor, "B T"], order: Int[Tensor, "B T"], m: Bool[Tensor, "B T"]) -> Tensor:
    """Undo :func:`_compact_order` (0 at masked-out positions)."""
    return where_masked(torch.zeros_like(x).scatter(-1, order, x), m)


def _shift(x: Tensor, d: int, fill: float | bool) -> Tensor:
    """x[:, s + d] at column s (``fill`` past the end)."""
    if d == 0:
        return x
    pad = torch.full_like(x[:, :d], fill)
    return torch.cat([x[:, d:], pad], dim=-1)
