"""Typed, validated description of a method: which advantage, corrections, objective, KL and controllers it composes.

Every variant is a pydantic model with ``type: Literal[...]`` and ``extra="forbid"``; a component list is a
discriminated union on ``type``. Nothing here computes: ``steadyrl.methods.compose`` turns a spec into a loss by
calling ``steadyrl.core``. Field docs name the paper each option comes from.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from steadyrl.core import weights as W
from steadyrl.core.masking import AggMode


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reads_behavior: ClassVar[bool] = False
    """Whether this component's output depends on μ (``behav_logp``); corrections always do."""
    NEEDS: ClassVar[tuple[str, ...]] = ()
    """Batch keys this component reads beyond ``logp``, ``behav_logp`` and ``mask`` (``LossBatch`` fields)."""

    def needs(self) -> tuple[str, ...]:
        """Batch keys this component reads with its options (``resolve.required_inputs`` collects them)."""
        return self.NEEDS


# --------------------------------------------------------------------------------------------------- advantages
class GrpoAdvantage(_Strict):
    """GRPO group-relative advantage (arXiv 2402.03300); ``scale='none'`` is Dr.GRPO (arXiv 2503.20783)."""

    type: Literal["grpo"] = "grpo"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids")
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="divide by the group's reward std (GRPO), the batch's (TRL 'batch'), or not (Dr.GRPO)"
    )
    eps: float = Field(1e-6, ge=0, description="added to the std before dividing (verl 1e-6, TRL 1e-4)")
    unbiased: bool = Field(True, description="n−1 std (verl, TRL) instead of the population std")
    length_corrected: bool = Field(
        False, description="normalize R_i/L_i instead of R_i (TIC-GRPO's length-corrected group normalization, "
        "arXiv 2508.02833) [reconstructed]"
    )


class OpobAdvantage(_Strict):
    """VCPO's off-policy optimal baseline (arXiv 2602.17616, Sec. 4): needs per-trajectory squared grad norms."""

    type: Literal["opob"] = "opob"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids", "grad_sq_norms")
    reads_behavior: ClassVar[bool] = True
    weighting: Literal["paper", "authors_code"] = Field(
        "paper", description="W_i = w_i²‖∇‖² (paper) or w̄_i² w_i² ‖∇‖² (authors' code, ≈ w⁴)"
    )
    scope: Literal["group", "minibatch"] = Field("group", description="one baseline per group, or per minibatch")
    aggregation: Literal["mean", "median", "winsorized"] = Field("mean", description="W-weighted baseline statistic")
    length_normalize: bool = Field(False, description="divide W_i by L_i²")
    clip: float | None = Field(None, gt=0, description="use min(w, clip) instead of the unclipped weight")
    tis_cap: float = Field(8.0, gt=0, description="C of the truncated weight w̄ in the authors'-code weighting")


class OtbAdvantage(_Strict):
    """Optimal token baseline (arXiv 2602.07078; verl ``optimal_token_baseline``): needs ``sum_p2`` per token."""

    type: Literal["otb"] = "otb"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids", "sum_p2")
    reads_behavior: ClassVar[bool] = True
    importance_weighted: bool = Field(True, description="put the squared token weight w_t² into W_t")


class CopcAdvantage(_Strict):
    """COPC two-sided clipped-ratio TD advantages (arXiv 2610.09597) [reconstructed]: needs ``values``."""

    type: Literal["copc"] = "copc"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "values")
    reads_behavior: ClassVar[bool] = True
    gamma: float = Field(1.0, ge=0, le=1, description="discount γ")
    lam: float = Field(1.0, ge=0, le=1, description="trace decay λ")
    rho_min: float = Field(0.5, ge=0, description="lower clip of ρ̄ (paper value unknown; sweep with c_low/c_high)")
    rho_max: float = Field(1.0, gt=0, description="upper clip of ρ̄ (paper value unknown)")


class VacoAdvantage(_Strict):
    """VACO advantage re-alignment (arXiv 2603.01365) [reconstructed]: one-step V-trace target per group.

    A_i = (R_i − v_g)/(std + ε), v_g = b_g + (1/G) Σ_{i∈g} min(ρ̄, ρ_i)(R_i − b_g), ρ_i from π_prox/μ: needs
    ``prox_logp`` (the policy at the start of the optimization phase), so the method must set ``recompute_prox``.
    """

    type: Literal["vaco"] = "vaco"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids", "prox_logp")  # ρ_i from π_prox/μ
    reads_behavior: ClassVar[bool] = True
    rho_bar: float = Field(1.0, gt=0, description="V-trace truncation ρ̄ of the sequence ratio (IMPALA default 1)")
    ratio: Literal["geometric", "product"] = Field(
        "geometric", description="sequence ratio: geometric mean of the token ratios (default) or their product"
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group", description="divide by the group's reward std (as GRPO), the batch's, or not"
    )
    eps: float = Field(1e-6, ge=0, description="added to the std before dividing (verl 1e-6, TRL 1e-4)")
    unbiased: bool = Field(True, description="n−1 std (verl, TRL) instead of the population std")


class GivenAdvantage(_Strict):
    """Use ``batch['advantages']`` as given (computed by the caller's framework)."""

    type: Literal["given"] = "given"
    NEEDS: ClassVar[tuple[str, ...]] = ("advantages",)


AdvantageSpec = Annotated[
    GrpoAdvantage | OpobAdvantage | OtbAdvantage | CopcAdvantage | VacoAdvantage | GivenAdvantage,
    Field(discriminator="type"),
]


# -------------------------------------------------------------------------------------------------- corrections
class TokenTIS(_Strict):
    """Token-level truncated importance sampling: min(exp ℓ_t, C) (verl C = 2, TRL C = 3)."""

    type: Literal["token_tis"] = "token_tis"
    cap: float = Field(W.TOKEN_TIS_CAP, gt=0, description="truncation C")
    floor: float | None = Field(None, gt=0, description="also clamp from below (TRL's minimum)")
    renormalize: Literal["token", "sequence"] | None = Field(None, description="divide by the masked mean (verl)")


class SeqTIS(_Strict):
    """Sequence-level truncated IS: w̄_i = min(exp S_i, C), broadcast (VCPO baseline, C = 8)."""

    type: Literal["seq_tis"] = "seq_tis"
    cap: float = Field(W.SEQ_TIS_CAP, gt=0, description="truncation C")


class _MIS(_Strict):
    lower: float | None = Field(None, gt=0, description="keep iff ratio ≥ lower (None: no lower bound)")
    upper: float | None = Field(None, gt=0, description="keep iff ratio ≤ upper (None: no upper bound)")
    weight: Literal["ratio", "one"] = Field("ratio", description="weight carried by kept tokens")


class TokenMIS(_MIS):
    """Masked IS at token level: drop tokens whose ratio is outside [lower, upper]."""

    type: Literal["token_mis"] = "token_mis"
    lower: float | None = W.TOKEN_MIS_LOWER
    upper: float | None = W.TOKEN_MIS_UPPER


class SeqMIS(_MIS):
    """Masked IS at sequence level on exp(S_i)."""

    type: Literal["seq_mis"] = "seq_mis"
    lower: float | None = W.SEQ_MIS_LOWER
    upper: float | None = W.SEQ_MIS_UPPER


class GeoMIS(_MIS):
    """Masked IS on the geometric mean exp(S̄_i) (verl preset 0.999–1.001)."""

    type: Literal["geo_mis"] = "geo_mis"
    lower: float | None = W.GEO_MIS_LOWER
    upper: float | None = W.GEO_MIS_UPPER


class IcePop(_MIS):
    """IcePop (arXiv 2510.18855): token ratios outside [0.5, 5] are dropped."""

    type: Literal["icepop"] = "icepop"
    lower: float | None = W.ICEPOP_LOWER
    upper: float | None = W.ICEPOP_UPPER


class TokenVeto(_Strict):
    """Drop a whole sequence if any token ratio is below the threshold (verl token veto)."""

    type: Literal["token_veto"] = "token_veto"
    threshold: float = Field(W.TOKEN_VETO_THRESHOLD, gt=0, description="veto when a token ratio < threshold")


class Rejection(_Strict):
    """Rejection on a divergence estimator of ℓ (verl ``rollout_rs``, AReaL ``rejection_sampling.metric``)."""

    type: Literal["rejection"] = "rejection"
    metric: Literal["k1", "k2", "k3"] = Field("k3", description="estimator of KL(μ‖π_prox) per token")
    level: Literal["token", "sequence"] = Field("sequence", description="reject tokens or whole sequences")
    seq_agg: Literal["sum", "mean", "max"] = Field("mean", description="per-sequence aggregation of the metric")
    lower: float | None = Field(None, description="keep iff metric ≥ lower (metric space, AReaL style)")
    upper: float | None = Field(0.01, description="keep iff metric ≤ upper")


class OPSM(_Strict):
    """Off-policy sequence masking (DeepSeek-V3.2; TRL ``off_policy_mask_threshold``)."""

    type: Literal["opsm"] = "opsm"
    delta: float = Field(0.5, description="keep iff A ≥ 0 or mean_t(log μ − log π_θ) ≤ δ")


class PrefixRatio(_Strict):
    """PNPO's prefix ratio w_t = exp((1/t) Σ_{k≤t} ℓ_k) of π_prox/μ as a weight (our earlier reading; the paper's
    objective is ``objective.type=pnpo``)."""

    type: Literal["prefix_ratio"] = "prefix_ratio"
    cap: float | None = Field(None, gt=0, description="optional truncation of w_t")


class M2POMask(_Strict):
    """M2PO masking variant (arXiv 2510.01161; AReaL): drop the largest δ² until mean δ² < τ."""

    type: Literal["m2po_mask"] = "m2po_mask"
    tau: float = Field(0.04, gt=0, description="second-moment budget τ")
    harmful_only: bool = Field(False, description="candidates only harmful tokens [reconstructed]")


class VacoFilter(_Strict):
    """VACO TV filter (arXiv 2603.01365): the first author's released rule by default [reference-code]."""

    type: Literal["vaco_filter"] = "vaco_filter"
    delta: float = Field(0.2, gt=0, description="TV threshold δ on ½·mean|π_θ/μ − 1| (the released LLM scripts: "
                         "0.0075, i.e. clip_ratio 0.015)")
    rule: Literal["tvpo", "sequence", "token"] = Field(
        "tvpo", description="tvpo: TV = ½ mean_t|ρ_t − 1| per sequence, averaged per group and batch; past δ, drop "
        "tokens with A·sign(log ρ) > 0 in groups past δ (released code). sequence: ½|exp(mean_t log ρ) − 1| per "
        "sequence with the sign of r − 1 (our earlier reading); token: the same per token"
    )

    def needs(self) -> tuple[str, ...]:
        return ("group_ids",) if self.rule == "tvpo" else ()  # the released rule averages TV per prompt group


class CopcMask(_Strict):
    """COPC actor mask (arXiv 2610.09597) [reconstructed]: keep tokens with π_θ/μ ∈ [c_low, c_high]."""

    type: Literal["copc_mask"] = "copc_mask"
    c_low: float = Field(0.5, gt=0, description="lower ratio bound (paper value unknown)")
    c_high: float = Field(2.0, gt=0, description="upper ratio bound (paper value unknown)")


class ESTRMask(_Strict):
    """Entropy-scaled trust region (arXiv 2607.22186) [reconstructed]: needs ``behav_entropy``."""

    type: Literal["estr"] = "estr"
    NEEDS: ClassVar[tuple[str, ...]] = ("behav_entropy",)
    tau: float | None = Field(None, gt=0, description="threshold on δ²/(H+ε); None = the module default")
    eps: float = Field(0.01, gt=0, description="entropy offset ε in δ²/(H+ε) (0.01: the paper, per a second-hand "
                       "note; we used 1e-6 before)")


CorrectionSpec = Annotated[
    TokenTIS
    | SeqTIS
    | TokenMIS
    | SeqMIS
    | GeoMIS
    | IcePop
    | TokenVeto
    | Rejection
    | OPSM
    | PrefixRatio
    | M2POMask
    | VacoFilter
    | CopcMask
    | ESTRMask,
    Field(discriminator="type"),
]


# --------------------------------------------------------------------------------------------------- objectives
class PPOClip(_Strict):
    """PPO-clip (arXiv 1707.06347) with clip-higher (DAPO) and optional dual clip."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, lt=1, description="ε_low")
    clip_high: float = Field(0.2, ge=0, description="ε_high (raise it for clip-higher, DAPO 0.28)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip c for A < 0 (verl default 3; TRL none)")


class Reinforce(_Strict):
    """REINFORCE surrogate −A·w·r (r = π_θ/π_prox = 1 in value at the first update)."""

    type: Literal["reinforce"] = "reinforce"


class GSPO(_Strict):
    """GSPO (arXiv 2507.18071): sequence-level geometric-mean ratio with a two-sided clip."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, description="ε_low")
    clip_high: float = Field(4e-4, ge=0, description="ε_high")


class M2POClip(_Strict):
    """M2PO clip-narrowing variant (authors' code): PPO clip range from the second-moment budget."""

    type: Literal["m2po_clip"] = "m2po_clip"
    reads_behavior: ClassVar[bool] = True
    tau: float = Field(0.04, gt=0, description="second-moment budget τ")
    floor_low: float | None = Field(None, ge=0, description="minimum ε_low (0.3 in the code, unset in its scripts)")
    floor_high: float | None = Field(None, ge=0, description="minimum ε_high (0.5 in the code, unset in its scripts)")


class TICGRPO(_Strict):
    """TIC-GRPO (arXiv 2508.02833): one trajectory ratio π_θ(y)/μ(y) with gradient, clipped above at 1 + ε."""

    type: Literal["tic_grpo"] = "tic_grpo"
    reads_behavior: ClassVar[bool] = True
    eps: float = Field(0.2, gt=0, description="clip ε (the paper's value is not known here; 0.2 is ours)")
    upper_only: bool = Field(True, description="clip only above 1+ε (the paper's upper-only clipping); "
                             "false: two-sided [1−ε, 1+ε] (our earlier reading)")
    ratio_to: Literal["behavior", "proximal"] = Field(
        "behavior", description="denominator of the trajectory ratio: μ, the policy that sampled (the paper), or "
        "π_prox (our earlier reading: no behavior correction when π_prox is not recomputed)"
    )


class GMCGRPO(_Strict):
    """GMC-GRPO group-mass capping (arXiv 2610.01896) [reconstructed]."""

    type: Literal["gmc_grpo"] = "gmc_grpo"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids")
    reads_behavior: ClassVar[bool] = True
    eps: float = Field(0.2, gt=0, description="cap of the group's mean ratio at 1+ε (paper value unknown: sweep)")
    cap: Literal["mass", "rms"] = Field("mass", description="mean-ratio cap, or root-mean-square cap")


class PNPO(_Strict):
    """PNPO (arXiv 2608.01418): detached prefix geometric-mean ratio to μ as weight and hard-rejection statistic."""

    type: Literal["pnpo"] = "pnpo"
    reads_behavior: ClassVar[bool] = True
    delta: float | None = Field(
        0.2, gt=0, description="half-width δ of the acceptance band |log w_t| ≤ δ·sqrt(L/t) (ours: the paper's band "
        "is not known here); None: no rejection"
    )


class OAPL(_Strict):
    """OAPL (arXiv 2602.19362): squared regression onto the optimal advantage; no importance ratio."""

    type: Literal["oapl"] = "oapl"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids")
    reads_behavior: ClassVar[bool] = True
    beta1: float = Field(1.0, gt=0, description="temperature of the soft value V̂*")
    beta2: float = Field(1e-3, gt=0, description="scale of the log-ratio to the behavior policy")


ObjectiveSpec = Annotated[
    PPOClip | Reinforce | GSPO | M2POClip | TICGRPO | GMCGRPO | PNPO | OAPL, Field(discriminator="type")
]


# ---------------------------------------------------------------------------------------------------------- KL
class NoKL(_Strict):
    """No reference-model KL term."""

    type: Literal["none"] = "none"


class KLInReward(_Strict):
    """Subtract β·k per token from the reward (needs ``ref_logp``)."""

    type: Literal["in_reward"] = "in_reward"
    NEEDS: ClassVar[tuple[str, ...]] = ("ref_logp",)
    beta: float = Field(1e-3, ge=0, description="β (VCPO's ablation: 0.001)")
    kind: Literal["k1", "k2", "k3", "abs", "low_var_kl"] = Field("k1", description="estimator of KL(π_θ‖π_ref)")


class KLInLoss(_Strict):
    """Add β·KL(π_θ‖π_ref) to the loss (needs ``ref_logp``)."""

    type: Literal["in_loss"] = "in_loss"
    NEEDS: ClassVar[tuple[str, ...]] = ("ref_logp",)
    beta: float = Field(1e-3, ge=0, description="β")
    kind: Literal["k1", "k2", "k3", "abs", "low_var_kl"] = Field("low_var_kl", description="estimator")


KLSpec = Annotated[NoKL | KLInReward | KLInLoss, Field(discriminator="type")]


# -------------------------------------------------------------------------------------------------- controllers
class EssStepSize(_Strict):
    """VCPO ESS-scaled step size (arXiv 2602.17616): lr_t = lr · f(min(1, ρ_ess/ρ_base))."""

    type: Literal["ess_lr"] = "ess_lr"
    reads_behavior: ClassVar[bool] = True
    rho_base: float = Field(1.0, gt=0, description="ρ_base (0.55 for multi-turn in the paper)")
    fn: Literal["sqrt", "identity"] = Field("sqrt", description="f")
    clip: float | None = Field(None, gt=0, description="use min(w, clip) for the ESS instead of unclipped weights")


class GAC(_Strict):
    """Gradient alignment control (arXiv 2603.01501) [reconstructed thresholds]."""

    type: Literal["gac"] = "gac"
    tau_proj: float | None = Field(None, ge=-1, le=1, description="cosine above which to project (None: default)")
    tau_skip: float | None = Field(None, ge=-1, le=1, description="cosine above which to skip (None: default)")
    alpha: float = Field(1.0, ge=0, le=1, description="fraction of the aligned component removed")
    skip_action: Literal["skip", "project"] = Field("skip", description="above tau_skip: skip the step or project")
    prev: Literal["raw", "applied"] = Field("raw", description="compare with the previous raw or applied gradient")


ControllerSpec = Annotated[EssStepSize | GAC, Field(discriminator="type")]


# ------------------------------------------------------------------------------------------------------ method
class MethodSpec(_Strict):
    """A complete method: advantage → corrections → objective (+ KL), and step-level controllers."""

    name: str = Field(description="preset name or composition, e.g. 'seq_tis+gac'")
    advantage: AdvantageSpec = Field(default_factory=GrpoAdvantage, description="baseline / advantage estimator")
    corrections: tuple[CorrectionSpec, ...] = Field(
        default=(), description="importance corrections and filters; weights multiply, masks intersect"
    )
    objective: ObjectiveSpec = Field(default_factory=PPOClip, description="per-token policy objective")
    agg: AggMode = Field("token-mean", description="loss aggregation mode")
    norm_len: int | None = Field(None, gt=0, description="constant length for seq-mean-token-sum-norm (default T)")
    policy: Literal["decoupled", "bypass"] = Field(
        "decoupled",
        description="weights from π_prox/μ and PPO ratio π_θ/π_prox (decoupled), or π_prox := μ (verl bypass)",
    )
    kl: KLSpec = Field(default_factory=NoKL, description="reference-model KL term")
    controllers: tuple[ControllerSpec, ...] = Field(default=(), description="step-level controllers")
    recompute_prox: bool = Field(
        False, description="the learner recomputes π_prox before the first update (AReaL decoupled PPO)"
    )
    prox_approx: Literal["none", "loglinear"] = Field(
        "none", description="none: π_prox is the batch's prox_logp (recomputed) or π_θ detached; loglinear: A-3PO "
        "(arXiv 2512.06547; AReaL prox_logp_method=loglinear): log μ + α(log π_θ − log μ) with "
        "α = (v_θ − 1 − v_t)/(v_θ − v_t) from the per-token versions, no recompute pass"
    )

    @model_validator(mode="after")
    def _approximated_prox_is_not_recomputed(self) -> MethodSpec:
        """A-3PO replaces the recompute pass; asking for both would pay for a forward whose result is discarded."""
        if self.prox_approx != "none" and self.recompute_prox:
            raise ValueError(
                f"prox_approx={self.prox_approx!r} approximates π_prox instead of recomputing it: set "
                "recompute_prox=False (or prox_approx='none' to recompute)"
            )
        if self.prox_approx != "none" and self.advantage.type == "vaco":
            raise ValueError("advantage.type='vaco' needs the recomputed π_prox of the phase: set prox_approx='none'")
        return self

    @model_validator(mode="after")
    def _vaco_needs_the_phase_policy(self) -> MethodSpec:
        """VACO re-aligns with π_prox/μ: without the recompute the learner would not hand it ``prox_logp``."""
        if self.advantage.type == "vaco" and not self.recompute_prox:
            raise ValueError(
                "advantage.type='vaco' re-aligns advantages with π_prox (prox_logp, the policy at the start of the "
                "optimization phase): set recompute_prox=True"
            )
        return self
