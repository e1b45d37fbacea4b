"""Claim 5 (GMC-GRPO, arXiv 2610.01896): group-mass capping's bias vanishes as G grows; trajectory clipping's does not.

A bandit with exact answers: a softmax policy over K answers (one-token "responses"), behavior μ = softmax(θ_μ),
current π = softmax(θ_μ + d·u) for a fixed random direction u (d sets the staleness), rewards R(a) ∈ {0, 1}, baseline
b = E_μ[R]. The off-policy policy-gradient estimators, per group of G answers y_1..y_G ~ μ,

    ĝ = (1/G) Σ_i w_i (R(y_i) − b) ∇θ log π(y_i),      ∇θ log π(a) = e_a − π,

differ only in the weight w_i:

    is    w_i = ρ_i = π(y_i)/μ(y_i)                                   (unbiased)
    gmc   w_i = ρ_i · min(1, G(1+ε)/Σ_j ρ_j)     (steadyrl.core.objectives.gmc_grpo.gmc_weights, cap="mass")
    clip  w_i = clip(ρ_i, 1−ε, 1+ε)               (trajectory-level clipping as a truncated weight)
    tic   w_i = ρ_i · [not (A_i > 0 and ρ_i > 1+ε)]  (the gradient of TIC-GRPO's surrogate min(ρA, min(ρ, 1+ε)A) with
                                                  its upper-only clip, A_i = R(y_i) − b: ``core.objectives.tic_grpo``)

The target is the exact gradient g = E_μ[ρ (R − b) ∇ log π] = Σ_a π(a) (R(a) − b) (e_a − π). The relative bias
‖E[ĝ] − g‖ / ‖g‖ is estimated with M groups (E[ĝ] by Monte Carlo; its own sampling error is printed as the
standard error of the 'is' row, whose true bias is 0). Float64 throughout; ε = 0.2 (our GMC default).

    .venv/bin/python benchmarks/claim5_gmc_bias.py [--samples 4000000] [--seed 0]
"""

from __future__ import annotations

import argparse

import torch

from steadyrl.core.objectives.gmc_grpo import gmc_weights

K = 16
EPS = 0.2


def estimators(G: int, n: int, d: float, gen: torch.Generator) -> dict[str, tuple[float, float]]:
    """Relative bias (and its Monte-Carlo standard error) of each estimator for group size G, staleness d."""
    theta_mu = torch.randn(K, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u = torch.randn(K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    R = (torch.rand(K, generator=torch.Generator().manual_seed(3), dtype=torch.float64) < 0.4).to(torch.float64)
    log_mu = torch.log_softmax(theta_mu, 0)
    log_pi = torch.log_softmax(theta_mu + d * u, 0)
    pi = log_pi.exp()
    b = (log_mu.exp() * R).sum()
    g_true = pi * (R - b) - pi * (pi * (R - b)).sum()  # Σ_a π(a)(R(a) − b)(e_a − π)
    M = n // G
    y = torch.multinomial(log_mu.exp(), M * G, replacement=True, generator=gen)  # answers ~ μ
    rho = (log_pi[y] - log_mu[y]).exp()
    groups = torch.arange(M).repeat_interleave(G)
    w = {
        "is": rho,
        "gmc": gmc_weights(prox_logp=log_pi[y][:, None], behav_logp=log_mu[y][:, None],
                           mask=torch.ones(M * G, 1, dtype=torch.bool), group_ids=groups, eps=EPS).weights,
        "clip": rho.clamp(1 - EPS, 1 + EPS),
        "tic": torch.where((R[y] - b > 0) & (rho > 1 + EPS), torch.zeros_like(rho), rho),  # clipped branch: no grad
    }  # fmt: skip
    out = {}
    for name, wi in w.items():
        coef = wi * (R[y] - b)  # per sample: w_i (R_i − b); ∇ log π(y_i) = e_{y_i} − π
        per_group = torch.zeros(M, K, dtype=torch.float64).index_put_((groups, y), coef, accumulate=True)
        per_group = (per_group - coef.view(M, G).sum(1, keepdim=True) * pi) / G  # ĝ of each group
        mean, se = per_group.mean(0), per_group.std(0) / M**0.5
        out[name] = (float((mean - g_true).norm() / g_true.norm()), float(se.norm() / g_true.norm()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4_000_000, help="answers drawn per (G, staleness)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    print(f"K = {K} answers, eps = {EPS}, {args.samples:,} samples per cell; relative bias ||E[g_hat] - g|| / ||g|| "
          "(Monte-Carlo standard error in brackets)")
    for d in (0.5, 1.5):
        print(f"\nstaleness d = {d}")
        print("| G | is (unbiased) | gmc | clip | tic |\n|---|---|---|---|---|")
        for G in (2, 4, 8, 16, 32, 64, 128):
            r = estimators(G, args.samples, d, gen)
            cells = " | ".join(f"{r[k][0]:.4f} ({r[k][1]:.4f})" for k in ("is", "gmc", "clip", "tic"))
            print(f"| {G} | {cells} |")


if __name__ == "__main__":
    main()
    from _provenance import print_provenance  # benchmarks/ is on sys.path when a script runs

    print_provenance()
