"""The catalog: every named method of docs/algorithms.md as a preset, and the rule that composes them (``seq_tis+gac``).

A preset sets only the components it is about (its ``fields``); everything else keeps the ``MethodSpec`` default
(GRPO advantages, PPO-clip objective, token-mean, no correction). Composing presets merges their fields:
corrections and controllers are concatenated; a singular component (advantage, objective, agg, ...) set by two presets
to different values is an error naming both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Confidence = Literal["exact", "reference-code", "reconstructed"]
Corrects = Literal["loss", "step", "none"]

#: Source of the rollout-correction presets that have no paper of their own.
_VERL_RC = "verl rollout correction (rollout_corr); truncated IS after Yao et al. 2025 (blog, no arXiv id)"


@dataclass(frozen=True)
class Preset:
    """One catalog entry: a name, what it is, where it comes from, and the spec fields it sets."""

    name: str
    summary: str
    paper: str | None
    confidence: Confidence
    fields: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    corrects: Corrects = "loss"
    """How the method claims to act on the behavior policy μ: through its loss or gradient (``loss``), only through
    a step-level controller's input (``step``: VCPO's ESS step size alone), or not at all (``none``: the
    uncorrected baselines, GAC, the reference KL). A property test holds every preset to its claim."""


PRESETS: tuple[Preset, ...] = (
    Preset(
        "grpo",
        "GRPO: group-relative advantages, PPO-clip on π_θ/π_prox, no behavior correction (the staleness baseline)",
        "2402.03300",
        "exact",
        {"agg": "seq-mean-token-mean"},
        corrects="none",
    ),
    Preset(
        "dr_grpo",
        "Dr.GRPO: no std division, token sums divided by B·norm_len (norm_len = the padded length T unless set)",
        "2503.20783",
        "exact",
        {"advantage": {"type": "grpo", "scale": "none"}, "agg": "seq-mean-token-sum-norm"},
        corrects="none",
    ),
    Preset(
        "ppo",
        "PPO-clip with clip-higher and dual clip available, group advantages, token-mean, no behavior correction",
        "1707.06347",
        "exact",
        {"objective": {"type": "ppo_clip"}, "agg": "token-mean"},
        corrects="none",
    ),
    Preset(
        "gspo",
        "GSPO: sequence-level geometric-mean PPO ratio with a narrow two-sided clip",
        "2507.18071",
        "reference-code",
        {"objective": {"type": "gspo"}, "agg": "seq-mean-token-mean"},
        corrects="none",
    ),
    Preset(
        "token_tis",
        "Token-level truncated importance sampling min(π_prox/μ, 2) on PPO-clip",
        None,
        "reference-code",
        {"corrections": [{"type": "token_tis"}]},
        source=_VERL_RC,
    ),
    Preset(
        "seq_tis",
        "Sequence-level truncated importance sampling min(Π_t π_prox/μ, 8), REINFORCE-style (VCPO's baseline)",
        "2602.17616",
        "exact",
        {"corrections": [{"type": "seq_tis"}], "objective": {"type": "reinforce"}, "agg": "seq-mean-token-mean"},
    ),
    Preset(
        "token_mis",
        "Token-level masked importance sampling: drop tokens whose ratio is outside [0.5, 2]",
        None,
        "reference-code",
        {"corrections": [{"type": "token_mis"}]},
        source=_VERL_RC,
    ),
    Preset(
        "seq_mis",
        "Sequence-level masked importance sampling: drop sequences whose ratio is outside [1/8, 8]",
        None,
        "reference-code",
        {"corrections": [{"type": "seq_mis"}]},
        source=_VERL_RC,
    ),
    Preset(
        "geo_mis",
        "Geometric-mean masked IS: drop sequences whose per-token geometric ratio is outside [0.999, 1.001]",
        None,
        "reference-code",
        {"corrections": [{"type": "geo_mis"}]},
        source=_VERL_RC,
    ),
    Preset(
        "icepop",
        "IcePop: token ratios outside [0.5, 5] are masked, kept tokens weighted by their ratio",
        "2510.18855",
        "reference-code",
        {"corrections": [{"type": "icepop"}]},
    ),
    Preset(
        "token_veto",
        "Token veto: drop a sequence if any token ratio is below 1e-4",
        None,
        "reference-code",
        {"corrections": [{"type": "token_veto"}]},
        source=_VERL_RC,
    ),
    Preset(
        "rejection",
        "Rejection on a divergence estimator: drop sequences whose mean k3 KL(μ‖π_prox) exceeds 0.01",
        None,
        "reference-code",
        {"corrections": [{"type": "rejection"}]},
        source=_VERL_RC,
    ),
    Preset(
        "opsm",
        "Off-policy sequence masking (DeepSeek-V3.2): drop negative-advantage sequences far from the behavior policy",
        "2512.02556",
        "reference-code",
        {"corrections": [{"type": "opsm"}]},
    ),
    Preset(
        "decoupled_ppo",
        "AReaL decoupled PPO: weight π_prox/μ (tokens above 5 masked), PPO-clip on π_θ/π_prox, π_prox recomputed",
        "2505.24298",
        "reference-code",
        {
            "corrections": [{"type": "token_mis", "lower": None, "upper": 5.0, "weight": "ratio"}],
            "objective": {"type": "ppo_clip"},
            "recompute_prox": True,
        },
    ),
    Preset(
        "a3po",
        "A-3PO: decoupled PPO with π_prox interpolated in log space between μ and π_θ by each token's staleness, "
        "α = (k − 1)/k for a token k versions old, instead of a recompute pass (AReaL prox_logp_method=loglinear)",
        "2512.06547",
        "reference-code",
        {
            "corrections": [{"type": "token_mis", "lower": None, "upper": 5.0, "weight": "ratio"}],
            "objective": {"type": "ppo_clip"},
            "prox_approx": "loglinear",
        },
    ),
    Preset(
        "m2po",
        "M2PO (masking, AReaL): drop the highest-δ² tokens until the second moment of log(μ/π_prox) is below 0.04",
        "2510.01161",
        "reference-code",
        {"corrections": [{"type": "m2po_mask"}]},
    ),
    Preset(
        "m2po_clip",
        "M2PO (clip narrowing, authors' code): narrow the PPO clip range until the second-moment budget holds",
        "2510.01161",
        "reference-code",
        {"objective": {"type": "m2po_clip"}},
    ),
    Preset(
        "tic_grpo",
        "TIC-GRPO: one trajectory ratio π_θ(y)/μ(y) with gradient in place of token ratios, clipped above at "
        "1+ε, on length-corrected group-normalized advantages",
        "2508.02833",
        "reconstructed",
        {"objective": {"type": "tic_grpo"}, "advantage": {"type": "grpo", "length_corrected": True}},
    ),
    Preset(
        "gmc_grpo",
        "GMC-GRPO: sequence weights whose group mean is capped at 1+ε, relative weights inside the group kept",
        "2610.01896",
        "reconstructed",
        {"objective": {"type": "gmc_grpo"}, "agg": "seq-mean-token-mean"},
    ),
    Preset(
        "vcpo",
        "VCPO: sequence TIS (8) + off-policy optimal baseline + ESS-scaled step size, REINFORCE-style",
        "2602.17616",
        "exact",
        {
            "advantage": {"type": "opob"},
            "corrections": [{"type": "seq_tis", "cap": 8.0}],
            "objective": {"type": "reinforce"},
            "agg": "seq-mean-token-mean",
            "controllers": [{"type": "ess_lr"}],
        },
    ),
    Preset(
        "ess_lr",
        "VCPO's ESS-scaled step size alone: lr · sqrt(min(1, ESS/B)) for the step (compose: seq_tis+ess_lr)",
        "2602.17616",
        "exact",
        {"controllers": [{"type": "ess_lr"}]},
        corrects="step",
    ),
    Preset(
        "opob",
        "VCPO's off-policy optimal baseline alone (needs per-trajectory squared gradient norms)",
        "2602.17616",
        "exact",
        {"advantage": {"type": "opob"}},
    ),
    Preset(
        "gac",
        "Gradient alignment control: project out (or skip) the component aligned with the previous gradient",
        "2603.01501",
        "reconstructed",
        {"controllers": [{"type": "gac"}]},
        corrects="none",
    ),
    Preset(
        "adaptive_entropy",
        "Adaptive entropy bonus: c moves by ±0.005 per step to hold the token-mean entropy at 0.2 nats, applied while "
        "the last step's entropy was at or below it; starts at entropy.coef (compose: grpo+adaptive_entropy)",
        "2505.22312",
        "exact",
        {"controllers": [{"type": "adaptive_entropy"}]},
        source="Skywork-OR1 §3.2; TRL 1.16.0 GRPOTrainer use_adaptive_entropy (parity-tested)",
        corrects="none",
    ),
    Preset(
        "oapl",
        "OAPL: squared regression of β2·log(π_θ/μ) onto R − V̂*, no importance ratio; use it with the periodic "
        "schedule (runtime.lag.schedule=periodic runtime.lag.refresh_every=50 runtime.lag.k=0: "
        "configs/oapl_periodic.yaml)",
        "2602.19362",
        "reference-code",
        {"objective": {"type": "oapl"}},
    ),
    Preset(
        "vaco",
        "VACO: advantages re-aligned once per phase with a one-step V-trace target (ρ̄ = 1, π_prox recomputed); "
        "past a TV of δ = 0.2, drop tokens that moved in their advantage's direction; the filter replaces the "
        "PPO clip (unclipped π_θ/μ, truncated at 1e4, as the released code)",
        "2603.01365",
        "reconstructed",
        {
            "advantage": {"type": "vaco"},
            "corrections": [{"type": "vaco_filter"}, {"type": "token_tis", "cap": 1e4}],
            "objective": {"type": "reinforce"},
            "agg": "seq-mean-token-sum-norm",
            "recompute_prox": True,
        },
    ),
    Preset(
        "copc",
        "COPC: actor masked to π_θ/μ ∈ [0.5, 2], critic TD advantages with a two-sided clipped ratio",
        "2610.09597",
        "reconstructed",
        {"advantage": {"type": "copc"}, "corrections": [{"type": "copc_mask"}]},
    ),
    Preset(
        "brace",
        "BRACE: critic target with a k = 100 window of importance-corrected TD residuals (ρ̄ 1.2, c̄ 1.1) and a "
        "Monte-Carlo tail; whitened TD advantages on the target, PPO-clip 0.20/0.28, clipped value loss, 5 "
        "critic-only warm-up steps",
        "2609.09783",
        "reconstructed",
        {"advantage": {"type": "brace"}, "objective": {"type": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28}},
    ),
    Preset(
        "estr",
        "ESTR: keep tokens whose squared log-ratio to μ is small relative to the behavior entropy, PPO-clip on "
        "π_θ/μ (bypass) for the kept ones",
        "2607.22186",
        "reconstructed",
        {"corrections": [{"type": "estr"}], "policy": "bypass"},
    ),
    Preset(
        "prefix_ratio",
        "PNPO's prefix-normalized ratio of π_prox/μ as a detached weight on PPO-clip (an alternative reading of the "
        "paper, kept as a correction to compose; the paper's method is pnpo)",
        "2608.01418",
        "reconstructed",
        {"corrections": [{"type": "prefix_ratio"}]},
    ),
    Preset(
        "pnpo",
        "PNPO: prefix geometric-mean ratio π_θ/μ as a detached weight and a hard-rejection statistic (band widened "
        "by sqrt(L/t) at early tokens), REINFORCE-style, no PPO clip",
        "2608.01418",
        "reconstructed",
        {"objective": {"type": "pnpo"}, "agg": "seq-mean-token-mean"},
    ),
    Preset(
        "kl_in_reward",
        "Reference-model KL subtracted from the reward per token (β = 0.001)",
        "2203.02155",
        "exact",
        {"kl": {"type": "in_reward"}},
        corrects="none",
    ),
    Preset(
        "kl_in_loss",
        "Reference-model KL (low-variance k3) added to the loss",
        "2402.03300",
        "exact",
        {"kl": {"type": "in_loss"}},
        corrects="none",
    ),
    Preset(
        "otb",
        "Optimal token baseline: per-position baseline weighted by the cumulative gradient-norm proxy",
        "2602.07078",
        "reference-code",
        {"advantage": {"type": "otb"}},
    ),
    Preset(
        "bypass",
        "verl bypass mode: no proximal recompute, π_prox := μ, so the PPO ratio is π_θ/μ",
        None,
        "reference-code",
        {"policy": "bypass"},
        source=_VERL_RC,
    ),
    Preset(
        "vespo",
        "VESPO: detached gamma kernel φ(W) = W^k·e^{λ(1−W)} of the sequence ratio W = π_θ(y)/μ(y) (k, λ = 2, 3 for "
        "A ≥ 0 and 3, 2 for A < 0) scaling −A·log π_θ, no clip, token-mean",
        "2602.10693",
        "reference-code",
        {"objective": {"type": "vespo"}, "agg": "token-mean"},
        source="authors' verl recipe (github.com/FloyedShen/VESPO recipe/vespo); TRL loss_type='vespo'",
    ),
    Preset(
        "luspo",
        "LUSPO: GSPO with each sequence's loss scaled by its length (token sums per sequence, mean over sequences), "
        "clip range 2e-3 / 2.5e-3",
        "2602.05261",
        "reference-code",
        {"objective": {"type": "gspo", "clip_low": 2e-3, "clip_high": 2.5e-3}, "agg": "seq-mean-token-sum"},
        source="TRL loss_type='luspo' with importance_sampling_level='sequence'; clip range: the paper's §5.1 per TRL",
        corrects="none",
    ),
    Preset(
        "kl_bias_corrected",
        "Reference-model k3 KL weighted by π_θ/π_prox with gradient (DeepSeek-V3.2's unbiased KL estimate), added to "
        "the loss",
        "2512.02556",
        "reference-code",
        {"kl": {"type": "in_loss", "kind": "k3", "bias_correction": "token"}},
        source="TRL use_bias_correction_kl (its coef_1 = π_θ/π_prox)",
        corrects="none",
    ),
    Preset(
        "seq_logprob_error",
        "NeMo-RL sequence log-prob-error mask: drop sequences whose token mean of e^{|log π_prox − log μ|} exceeds 2",
        None,
        "reference-code",
        {"corrections": [{"type": "seq_logprob_error"}]},
        source="NeMo-RL grpo.seq_logprob_error_threshold (nemo_rl/algorithms/grpo.py); 2 in its Nemotron 3 recipes",
    ),
    Preset(
        "segment_tis",
        "Segment (turn)-level truncated IS: one weight min(exp(mean ℓ over the turn), 1.2) per run of trained tokens",
        None,
        "reference-code",
        {"corrections": [{"type": "segment_tis"}]},
        source="ROLL train_infer_correction.is_weight.weight_type=segment (roll/utils/train_infer_corrections.py)",
    ),
    Preset(
        "cispo",
        "CISPO: detached clipped ratio sg(min(π_θ/π_prox, 5)) (no lower bound) scaling −A·log π_θ, so clipped tokens "
        "keep their gradient, token-mean",
        "2506.13585",
        "reference-code",
        {"objective": {"type": "cispo"}, "agg": "token-mean"},
        source="the paper's Eq. 4 and its practice of no lower bound; cap 5 from TRL's recommended epsilon_high",
        corrects="none",
    ),
    Preset(
        "sapo",
        "SAPO: soft sigmoid gate σ(τ(r − 1))·4/τ of r = π_θ/π_prox in place of the clip (τ = 1 for A > 0, 1.05 "
        "otherwise), seq-mean-token-mean",
        "2511.20347",
        "reference-code",
        {"objective": {"type": "sapo"}, "agg": "seq-mean-token-mean"},
        source="the paper's gate; verl, TRL, SkyRL and AReaL compute the same gate with the same temperatures",
        corrects="none",
    ),
    Preset(
        "gmpo",
        "GMPO: −A times the geometric mean of the token ratios, each clipped one-sided in log space to ±0.4, one term "
        "per sequence",
        "2507.20673",
        "reference-code",
        {"objective": {"type": "gmpo"}, "agg": "seq-mean-token-mean"},
        source="authors' code (github.com/callsys/GMPO, CLIPRANGE=0.4); verl loss_mode='geo_mean'; TRL GMPOTrainer",
        corrects="none",
    ),
    Preset(
        "topr",
        "TOPR: REINFORCE on log π_θ(y); negative-advantage sequences weighted by sg(min(1, π_θ(y)/μ(y))), positive "
        "ones unweighted; A = R − group mean; mean over sequences of token sums",
        "2503.14286",
        "reconstructed",
        {"objective": {"type": "topr"}, "advantage": {"type": "grpo", "scale": "none"}, "agg": "seq-mean-token-sum"},
        source="the paper's TOPR gradient; the group-mean baseline (the paper's c) and the reduction are ours",
    ),
    Preset(
        "dppo_tv",
        "DPPO-Binary-TV: PPO's ratio clip replaced by a trust-region mask: a token is dropped when its probability "
        "moved more than 0.15 from μ in its advantage's direction; REINFORCE on π_θ/μ for the rest (bypass)",
        "2602.04879",
        "reference-code",
        {"objective": {"type": "dppo_tv"}, "policy": "bypass"},
        source="the authors' verl code (github.com/sail-sg/Stable-RL) as merged into verl (loss_mode='dppo_tv'); "
        "δ = 0.15 and the anchor μ (bypass_mode) from their verl example examples/dppo_trainer/run_qwen30b_dppo.sh",
    ),
    Preset(
        "dppo_kl",
        "DPPO-Binary-KL: drop a token when the KL between the Bernoulli distributions (μ(y), 1 − μ(y)) and "
        "(π_θ(y), 1 − π_θ(y)) passes 0.05 in its advantage's direction; REINFORCE on π_θ/μ for the rest (bypass)",
        "2602.04879",
        "reference-code",
        {"objective": {"type": "dppo_kl"}, "policy": "bypass"},
        source="the authors' verl code (github.com/sail-sg/Stable-RL) as merged into verl (loss_mode='dppo_kl'); "
        "δ = 0.05 and the anchor μ (bypass_mode) from their verl example examples/dppo_trainer/run_qwen30b_dppo.sh",
    ),
    Preset(
        "clip_cov",
        "Clip-Cov: PPO-clip (ε = 1) with a random 2e-4 of the tokens whose Cov(log π_θ, A) lies in (1, 5) dropped "
        "from the loss, against entropy collapse",
        "2505.22617",
        "reference-code",
        {"objective": {"type": "clip_cov"}, "agg": "token-mean"},
        source="the authors' verl code and scripts (github.com/PRIME-RL/Entropy-Mechanism-of-RL, "
        "recipe/dapo/7b_clip_cov.sh), merged into verl as loss_mode='clip_cov'",
        corrects="none",
    ),
    Preset(
        "kl_cov",
        "KL-Cov: unclipped −A·π_θ/π_prox plus |log π_θ/π_prox| on the 2e-3 of the tokens with the largest "
        "Cov(log π_θ, A), against entropy collapse",
        "2505.22617",
        "reference-code",
        {"objective": {"type": "kl_cov"}, "agg": "token-mean"},
        source="the authors' verl code and scripts (github.com/PRIME-RL/Entropy-Mechanism-of-RL, "
        "recipe/dapo/7b_kl_cov.sh: k_percent 0.2 %, ppo_kl_coef 1), merged into verl as loss_mode='kl_cov'",
        corrects="none",
    ),
    Preset(
        "bapo",
        "BAPO: PPO-clip whose ratio bounds are raised per batch (c_high 1.2 → 3.0, then c_low 0.6 → 0.9) until the "
        "positive-advantage tokens carry 40 % of the loss",
        "2510.18927",
        "reconstructed",
        {"objective": {"type": "bapo"}},
        source="the paper's Algorithm 1 and §5 constants, Eq. 8 read as the positive share P/(P + N); the authors' "
        "released verl recipe (github.com/WooooDyy/BAPO) searches the lower bound first on P/N "
        "(objective.order=low_first, objective.balance=odds)",
        corrects="none",
    ),
    Preset(
        "score_centering",
        "Score centering: REINFORCE −A·[w_a log π_θ(a) − Σ_v sg(μ_v w_v) log π_θ(v)] with w = min(π_θ/μ, 2), no "
        "clip, group advantages mean-centred without std; the exact form on the recorded behavior distribution",
        "2609.20807",
        "reconstructed",
        {
            "advantage": {"type": "grpo", "scale": "none"},
            "objective": {"type": "score_centering", "weight": "tis", "top_k": 0},
        },
        source="Eq. 14 of the paper (abstract and equation); NeMo-RL's compute_score_centering_term follows it. "
        "Ours: the default f (tis), token-mean aggregation, the floor's placement in the top-k tail ratio",
    ),
    Preset(
        "bypass_pg_is",
        "verl bypass_pg_is: no proximal recompute (π_prox := μ), REINFORCE −A·w·log π_θ with the sequence weight "
        "w = min(π_θ(y)/μ(y), 2) computed from the current policy (detached), token-mean",
        None,
        "reference-code",
        {
            "policy": "bypass",
            "bypass_ratio": "current",
            "corrections": [{"type": "seq_tis", "cap": 2.0}],
            "objective": {"type": "reinforce", "surrogate": "log_prob"},
        },
        source="verl 0.9.1 RolloutCorrectionConfig.bypass_pg_is (bypass_mode=True, loss_type='reinforce', "
        "rollout_is='sequence', rollout_is_threshold=2.0; compute_policy_loss_bypass_mode)",
    ),
)

# ------------------------------------------------------------------------------------------------------------------
# Losses, corrections and advantage estimators that the installed frameworks ship (verl 0.9.1, OpenRLHF 0.11.2,
# SkyRL 0.3.0, TRL 1.16.0), each checked against the framework's own function in tests/parity.
FRAMEWORK_PRESETS: tuple[Preset, ...] = (
    Preset(
        "dro",
        "DRO: −A·log π_θ + ½β(log π_θ/π_prox)², a REINFORCE term with a quadratic pull back to π_prox (β = 0.1), "
        "token-mean",
        "2405.19107",
        "reference-code",
        {"objective": {"type": "dro"}, "agg": "token-mean"},
        source="verl 0.9.1 compute_policy_loss_dro (policy_loss.loss_mode='dro', dro_beta)",
        corrects="none",
    ),
    Preset(
        "rloo",
        "RLOO: leave-one-out baseline A_i = R_i − mean_{j≠i} R_j, PPO-clip, token-mean",
        "2402.14740",
        "exact",
        {"advantage": {"type": "rloo"}},
        source="verl 0.9.1 rloo_vectorized (advantage.singleton='reward': its loop form rloo)",
        corrects="none",
    ),
    Preset(
        "reinforce_pp",
        "REINFORCE++: return-to-go of the token rewards whitened over the batch's tokens, PPO-clip, token-mean",
        "2501.03262",
        "reference-code",
        {"advantage": {"type": "reinforce_pp"}},
        source="verl 0.9.1 compute_reinforce_plus_plus_outcome_advantage",
        corrects="none",
    ),
    Preset(
        "reinforce_pp_baseline",
        "REINFORCE++-baseline: reward minus its group's mean, whitened over the batch's tokens, PPO-clip, token-mean",
        "2501.03262",
        "reference-code",
        {"advantage": {"type": "reinforce_pp_baseline"}},
        source="verl 0.9.1 compute_reinforce_plus_plus_baseline_outcome_advantage",
        corrects="none",
    ),
    Preset(
        "ipo",
        "prime-rl IPO: π_prox := μ, −A·π_θ/μ on tokens whose probability moved by at most 0.1 in either direction, "
        "plus 1e-3·(log π_θ/μ)² on every token, token-mean",
        None,
        "reference-code",
        {"policy": "bypass", "objective": {"type": "ipo"}, "agg": "token-mean"},
        source="prime-rl trainer/rl/loss.py ipo_loss_fn (PrimeIntellect-ai/prime-rl; not installed, read from its "
        "public repository)",
    ),
    Preset(
        "prob_diff",
        "ROLL probability-difference filter: drop tokens whose π_prox(y) − μ(y) lies outside [−0.2, 0.2] (level "
        "token; geometric, sequence and segment statistics via prob_diff.level), PPO-clip",
        None,
        "reference-code",
        {"corrections": [{"type": "prob_diff"}]},
        source="ROLL roll/utils/train_infer_corrections.py compute_train_infer_correction, diff filters "
        "(alibaba/ROLL; not installed, read from its public repository)",
    ),
    Preset(
        "rollout_is",
        "SkyRL rollout_is: no proximal recompute (π_prox := μ), REINFORCE −w·A·log π_θ with the token ratio "
        "w = π_θ/μ (detached) where it lies in [0.8, 1.2] and the token dropped elsewhere, token-mean",
        None,
        "reference-code",
        {
            "policy": "bypass",
            "bypass_ratio": "current",
            "corrections": [{"type": "token_mis", "lower": 0.8, "upper": 1.2, "weight": "ratio"}],
            "objective": {"type": "reinforce", "surrogate": "log_prob"},
        },
        source="SkyRL 0.3.0 rollout_is_policy_loss (policy_loss_type='rollout_is', eps_clip_low/high = 0.2)",
    ),
)
PRESETS = (*PRESETS, *FRAMEWORK_PRESETS)

PRESETS_BY_NAME: dict[str, Preset] = {p.name: p for p in PRESETS}
