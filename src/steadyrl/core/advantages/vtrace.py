"""Token-level off-policy TD targets: V-trace (IMPALA) and COPC's clipped-ratio advantages.

V-trace (IMPALA, arXiv 1802.01561, §4.1 Eq. (1) and §4.2) [exact]: with ρ_t = min(ρ̄, π_t/μ_t) and
c_t = λ · min(c̄, π_t/μ_t),

    v_s = V_s + Σ_{t≥s} γ^{t−s} (Π_{i=s}^{t−1} c_i) δ_t,   δ_t = ρ_t (r_t + γ V_{t+1} − V_t),
    computed backwards as v_s − V_s = δ_s + γ c_s (v_{s+1} − V_{s+1});
    policy-gradient advantage A_s = ρ_s (r_s + γ v_{s+1} − V_s).

COPC (arXiv 2610.09597) [reconstructed: only the abstract and summaries were available]: TD residuals weighted by a
*two-sided* clipped ratio ρ̄_t = clip(π_t/μ_t, ρ_min, ρ_max),

    δ_t = r_t + γ V_{t+1} − V_t,   Â_t = Σ_{k≥0} (γλ)^k ρ̄_{t+k} δ_{t+k},   value target V_t + Â_t.

The defaults ρ_min = 0.5, ρ_max = 1.0 are our starting points, not the paper's (unknown; sweep them jointly with
the actor's ratio mask).

Trajectory convention (both estimators). A response is the sequence of its masked-in tokens: masked-out tokens
inside it (prompt, tool output) are skipped — the "next state" of a trained token is the next trained token of
the same row, γ, λ and the trace products step once per trained token, and rewards, values and ratios at
masked-out positions are ignored (they may be garbage), so a token reward must sit on a trained token (e.g. the
outcome reward on the last response token). Past the last trained token the value is ``bootstrap`` for V-trace
(0, terminal, by default) and 0 (terminal) for COPC. Outputs are 0 at masked-out positions and detached.
The backward recursion is a loop over T, vectorized over B; nothing loops over B and nothing syncs with the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from steadyrl.core.advantages.grpo import token_advantage_metrics
from steadyrl.core.masking import as_bool_mask, masked_mean, safe_exp, where_masked
from steadyrl.core.types import Metrics

#: COPC's ratio clip [ρ_min, ρ_max] (our starting point; the paper's values are not known).
COPC_RHO_MIN: float = 0.5
COPC_RHO_MAX: float = 1.0


class VTraceOutput(NamedTuple):
    """Result of :func:`vtrace` (detached; 0 at masked-out positions).

    ==============  ======  ===============================================================
    field           shape   meaning
    ==============  ======  ===============================================================
    ``vs``          [B, T]  V-trace value targets v_t
    ``advantages``  [B, T]  policy-gradient advantages ρ_t (r_t + γ v_{t+1} − V_t)
    ``metrics``             ``adv/mean``, ``adv/std``, ``adv/baseline_mean`` (mean V),
                            ``adv/value_target_mean``, ``adv/rho_clipped_frac``, ``adv/c_clipped_frac``
    ==============  ======  ===============================================================
    """

    vs: Float[Tensor, "B T"]
    advantages: Float[Tensor, "B T"]
    metrics: Metrics


class CopcAdvantages(NamedTuple):
    """Result of :func:`copc_advantages` (detached; 0 at masked-out positions).

    ==============  ======  ===============================================================
    field           shape   meaning
    ==============  ======  ===============================================================
    ``advantages``  [B, T]  Â_t = Σ_k (γλ)^k ρ̄_{t+k} δ_{t+k}
    ``returns``     [B, T]  value targets V_t + Â_t
    ``metrics``             ``adv/mean``, ``adv/std``, ``adv/baseline_mean`` (mean V),
                            ``adv/value_target_mean``, ``adv/rho_clipped_low_frac``,
                            ``adv/rho_clipped_high_frac``
    ==============  ======  ===============================================================
    """

    advantages: Float[Tensor, "B T"]
    returns: Float[Tensor, "B T"]
    metrics: Metrics


def vtrace(
    *,
    rewards: Float[Tensor, "B T"],
    values: Float[Tensor, "B T"],
    log_rhos: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    bootstrap: Float[Tensor, " B"] | float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> VTraceOutput:
    """V-trace value targets and policy-gradient advantages (IMPALA, arXiv 1802.01561, Eq. (1)) [exact].

    ==============  ======  ===================================================================
    argument        shape   meaning
    ==============  ======  ===================================================================
    ``rewards``     [B, T]  token rewards r_t (on trained tokens)
    ``values``      [B, T]  critic values V_t = V(x_t)
    ``log_rhos``    [B, T]  log π/μ of the sampled token (detached here; clamped to ±20 before exp)
    ``mask``        [B, T]  trained tokens (module docstring: masked-out tokens are skipped)
    ``bootstrap``   [B]     V after each response's last trained token (0: terminal)
    ``gamma``               discount γ ∈ [0, 1]
    ``lam``                 λ ∈ [0, 1] in c_t = λ min(c̄, ρ) (IMPALA remark; 1 = plain V-trace)
    ``rho_bar``             ρ̄ > 0: truncation of the TD weights and of the advantage's ρ
    ``c_bar``               c̄ ≥ 0: truncation of the trace coefficients
    ==============  ======  ===================================================================

    With π = μ, ρ̄ = c̄ = 1: v_t is the λ-return and A_t = r_t + γ v_{t+1} − V_t (TD(λ) / GAE targets).
    """
    _check_discounts(gamma, lam)
    if not rho_bar > 0 or not c_bar >= 0:
        raise ValueError(f"need rho_bar > 0 and c_bar >= 0 (got rho_bar={rho_bar}, c_bar={c_bar})")
    m = as_bool_mask(mask)
    r, V, ratio = _trajectory_inputs(rewards, values, log_rhos, m)
    tail = bootstrap.detach() if isinstance(bootstrap, Tensor) else torch.full_like(V[:, 0], bootstrap)
    rho = ratio.clamp(max=rho_bar)  # ρ_t = min(ρ̄, π/μ)
    c = lam * ratio.clamp(max=c_bar)  # c_t = λ min(c̄, π/μ)
    nxt = _next_index(m)
    V_next = _at_next(V, nxt, tail)
    delta = rho * (r + gamma * V_next - V)  # δ_t = ρ_t (r_t + γ V_{t+1} − V_t)
    vs = where_masked(V + _backward_scan(delta, gamma * c, m), m)  # v_t − V_t = δ_t + γ c_t (v_{t+1} − V_{t+1})
    advantages = where_masked(rho * (r + gamma * _at_next(vs, nxt, tail) - V), m)  # ρ_t (r_t + γ v_{t+1} − V_t)

    metrics = token_advantage_metrics(advantages=advantages, baseline=V, mask=m)
    metrics["adv/value_target_mean"] = masked_mean(vs, m).detach()
    metrics["adv/rho_clipped_frac"] = masked_mean((ratio > rho_bar).to(V.dtype), m).detach()
    metrics["adv/c_clipped_frac"] = masked_mean((ratio > c_bar).to(V.dtype), m).detach()
    return VTraceOutput(vs=vs, advantages=advantages, metrics=metrics)


def copc_advantages(
    *,
    rewards: Float[Tensor, "B T"],
    values: Float[Tensor, "B T"],
    log_rhos: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"],
    gamma: float = 1.0,
    lam: float = 1.0,
    rho_min: float = COPC_RHO_MIN,
    rho_max: float = COPC_RHO_MAX,
) -> CopcAdvantages:
    """COPC advantages Â_t = Σ_k (γλ)^k ρ̄_{t+k} δ_{t+k} and value targets (arXiv 2610.09597) [reconstructed].

    ==============  ======  ===================================================================
    argument        shape   meaning
    ==============  ======  ===================================================================
    ``rewards``     [B, T]  token rewards r_t (on trained tokens)
    ``values``      [B, T]  critic values V(s_t)
    ``log_rhos``    [B, T]  log π/μ of the sampled token (detached here; clamped to ±20 before exp)
    ``mask``        [B, T]  trained tokens (module docstring: masked-out tokens are skipped)
    ``gamma``               discount γ ∈ [0, 1]
    ``lam``                 λ ∈ [0, 1]
    ``rho_min``             lower clip of ρ̄ (≥ 0) — reconstructed option, sweep it
    ``rho_max``             upper clip of ρ̄ (≥ ``rho_min``) — reconstructed option, sweep it
    ==============  ======  ===================================================================

    Computed backwards as Â_t = ρ̄_t δ_t + γλ Â_{t+1}; V after the last trained token is 0 (terminal). With
    ρ_min = ρ_max = 1 this is GAE(γ, λ).
    """
    _check_discounts(gamma, lam)
    if not 0 <= rho_min <= rho_max:
        raise ValueError(f"need 0 <= rho_min <= rho_max (got rho_min={rho_min}, rho_max={rho_max})")
    m = as_bool_mask(mask)
    r, V, ratio = _trajectory_inputs(rewards, values, log_rhos, m)
    rho_clipped = ratio.clamp(min=rho_min, max=rho_max)  # ρ̄_t = clip(ρ_t, ρ_min, ρ_max)
    delta = r + gamma * _at_next(V, _next_index(m), torch.zeros_like(V[:, 0])) - V  # δ_t = r_t + γV_{t+1} − V_t
    advantages = _backward_scan(rho_clipped * delta, torch.full_like(V, gamma * lam), m)  # ρ̄_t δ_t + γλ Â_{t+1}
    returns = where_masked(V + advantages, m)  # value target V(s_t) + Â_t

    metrics = token_advantage_metrics(advantages=advantages, baseline=V, mask=m)
    metrics["adv/value_target_mean"] = masked_mean(returns, m).detach()
    metrics["adv/rho_clipped_low_frac"] = masked_mean((ratio < rho_min).to(V.dtype), m).detach()
    metrics["adv/rho_clipped_high_frac"] = masked_mean((ratio > rho_max).to(V.dtype), m).detach()
    return CopcAdvantages(advantages=advantages, returns=returns, metrics=metrics)


def _check_discounts(gamma: float, lam: float) -> None:
    if not (0 <= gamma <= 1 and 0 <= lam <= 1):
        raise ValueError(f"gamma and lam must lie in [0, 1] (got gamma={gamma}, lam={lam})")


def _trajectory_inputs(
    rewards: Float[Tensor, "B T"], values: Float[Tensor, "B T"], log_rhos: Float[Tensor, "B T"], m: Bool[Tensor, "B T"]
) -> tuple[Float[Tensor, "B T"], Float[Tensor, "B T"], Float[Tensor, "B T"]]:
    """Detached r, V and ρ = exp(clamp(log ρ, ±20)), with masked-out positions set to 0, 0 and 1."""
    r = where_masked(rewards.detach(), m)
    V = where_masked(values.detach(), m)
    ratio = safe_exp(where_masked(log_rhos.detach(), m))
    return r, V, ratio


def _next_index(m: Bool[Tensor, "B T"]) -> Int[Tensor, "B T"]:
    """For each position, the column of the next masked-in token of its row (T when there is none)."""
    B, T = m.shape
    columns = torch.arange(T, device=m.device).expand(B, T)
    trained = torch.where(m, columns, T)
    after = torch.cat([trained[:, 1:], trained.new_full((B, 1), T)], dim=-1)  # candidates strictly after t
    return after.flip(-1).cummin(dim=-1).values.flip(-1)


def _at_next(x: Float[Tensor, "B T"], nxt: Int[Tensor, "B T"], tail: Float[Tensor, " B"]) -> Float[Tensor, "B T"]:
    """x at the next trained token of the row, ``tail`` past the last one."""
    return torch.cat([x, tail.to(x.dtype).unsqueeze(-1)], dim=-1).gather(-1, nxt)


def _backward_scan(a: Float[Tensor, "B T"], coef: Float[Tensor, "B T"], m: Bool[Tensor, "B T"]) -> Float[Tensor, "B T"]:
    """y_t = a_t + coef_t · y_{next trained token}, y = 0 past the last one; 0 at masked-out positions."""
    B, T = a.shape
    carry = a.new_zeros(B)
    out: list[Tensor] = []
    for t in range(T - 1, -1, -1):  # loop over time, vectorized over B
        carry = torch.where(m[:, t], a[:, t] + coef[:, t] * carry, carry)  # skipped tokens pass the carry on
        out.append(carry)
    if not out:
        return torch.zeros_like(a)
    return where_masked(torch.stack(out[::-1], dim=-1), m)
