"""Typed, validated description of a method: which advantage, corrections, objective, KL and controllers it composes.

Every variant is a pydantic model with ``type: Literal[...]`` and ``extra="forbid"``; a component list is a
discriminated union on ``type``. Nothing here computes: ``steadyrl.methods.compose`` turns a spec into a loss by
calling ``steadyrl.core``. Field docs name the paper each option comes from.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from steadyrl.core import importance_weights as W
from steadyrl.core import rejection as RJ
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
    batch_std: Literal["rewards", "centered"] = Field(
        "rewards", description="scale='batch': std of the raw rewards (TRL scale_rewards='batch') or of the "
        "group-centred rewards R − mean_g R (AReaL NormConfig mean_level='group', std_level='batch')"
    )
    singleton: Literal["zero", "reward"] = Field(
        "zero", description="a group of one response: advantage 0, or baseline 0 and group std 1 so A = R/(1+eps) "
        "(verl, SkyRL)"
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
    alignment: Literal["trained_tokens", "absolute"] = Field(
        "trained_tokens", description="position t = the t-th trained token of a response (verl's multi-turn OTB) or "
        "the padded column (verl's single-turn OTB)"
    )
    zero_lone_baseline: bool = Field(
        True, description="baseline 0 where a response is alone at its position (verl's handle_zero_tail and groups "
        "of one); false: the formula as written"
    )
    eps: float = Field(1e-8, ge=0, description="ε of the baseline's denominator (verl's default)")


class CopcAdvantage(_Strict):
    """COPC two-sided clipped-ratio TD advantages (arXiv 2610.09597) [reconstructed]: needs ``values``."""

    type: Literal["copc"] = "copc"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "values")
    reads_behavior: ClassVar[bool] = True
    gamma: float = Field(1.0, ge=0, le=1, description="discount γ")
    lam: float = Field(1.0, ge=0, le=1, description="trace decay λ")
    rho_min: float = Field(0.5, ge=0, description="lower clip of ρ̄ (paper value unknown; sweep with c_low/c_high)")
    rho_max: float = Field(1.0, gt=0, description="upper clip of ρ̄ (paper value unknown)")


class BraceAdvantage(_Strict):
    """BRACE (arXiv 2609.09783, §3 and App. D): k-capped importance-corrected critic target with a Monte-Carlo tail;
    the actor's advantage r_s + γ V_targ(s+1) − V(s), whitened over the batch. Needs ``values`` (the critic)."""

    type: Literal["brace"] = "brace"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "values")
    reads_behavior: ClassVar[bool] = True
    k: int = Field(100, ge=0, description="window of importance-corrected TD residuals before the Monte-Carlo tail "
                   "(paper: 100; 0 = Monte Carlo, >= the response length = V-trace)")
    rho_bar: float = Field(1.2, gt=0, description="ρ̄ of ρ_t = min(ρ̄, π_prox/μ) (paper: 1.2)")
    c_bar: float = Field(1.1, ge=0, description="c̄ of the trace c_i = λ min(c̄, π_prox/μ) (paper: 1.1)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount γ (paper: 1)")
    lam: float = Field(1.0, ge=0, le=1, description="trace decay λ (paper: 1)")
    whiten: bool = Field(True, description="whiten the advantages over the batch's response tokens (paper)")
    critic_lr: float = Field(1e-5, gt=0, le=1, description="AdamW lr of the critic under BRACE (paper: 1e-5); "
                             "replaces critic.lr")
    critic_warmup: int = Field(5, ge=0, description="critic-only optimizer steps before the actor's first step "
                               "(paper: 5)")
    value_clip: float | None = Field(0.5, gt=0, description="clip of V around V_old in the value loss "
                                     "½·max[(V − V_targ)², (clip(V, V_old ± c) − V_targ)²] (paper: 0.5; None: "
                                     "unclipped)")


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


# --- advantage estimators the frameworks ship (verl 0.9.1 rloo / reinforce_plus_plus[_baseline])
class RlooAdvantage(_Strict):
    """RLOO leave-one-out baseline (arXiv 2402.14740, Eq. 5): A_i = R_i − mean_{j≠i} R_j (verl ``rloo``)."""

    type: Literal["rloo"] = "rloo"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids")
    singleton: Literal["zero", "reward"] = Field(
        "zero", description="a group of one response: A = 0 (verl rloo_vectorized) or A = R (verl rloo's loop)"
    )


class ReinforcePPAdvantage(_Strict):
    """REINFORCE++ (arXiv 2501.03262): discounted return-to-go whitened over the batch's tokens (verl
    ``reinforce_plus_plus``)."""

    type: Literal["reinforce_pp"] = "reinforce_pp"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards",)
    gamma: float = Field(1.0, ge=0, le=1, description="discount γ of the return-to-go (verl algorithm.gamma: 1)")


class ReinforcePPBaselineAdvantage(_Strict):
    """REINFORCE++-baseline (arXiv 2501.03262): R_i − group mean, whitened over the batch's tokens (verl
    ``reinforce_plus_plus_baseline``)."""

    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    NEEDS: ClassVar[tuple[str, ...]] = ("rewards", "group_ids")


AdvantageSpec = Annotated[
    GrpoAdvantage | OpobAdvantage | OtbAdvantage | CopcAdvantage | BraceAdvantage | VacoAdvantage | GivenAdvantage
    | RlooAdvantage | ReinforcePPAdvantage | ReinforcePPBaselineAdvantage,
    Field(discriminator="type"),
]


# -------------------------------------------------------------------------------------------------- corrections
class TokenTIS(_Strict):
    """Token-level truncated importance sampling: min(exp ℓ_t, C) (verl C = 2, TRL C = 3)."""

    type: Literal["token_tis"] = "token_tis"
    cap: float | None = Field(W.TOKEN_TIS_CAP, gt=0, description="truncation C; None: no upper clamp (TRL "
                              "vllm_importance_sampling_clip_max=None)")
    floor: float | None = Field(None, gt=0, description="also clamp from below (TRL's clip_min)")
    renormalize: Literal["token", "sequence"] | None = Field(None, description="divide by the masked mean (verl)")


class SeqTIS(_Strict):
    """Sequence-level truncated IS: w̄_i = min(exp S_i, C), broadcast (VCPO baseline, C = 8)."""

    type: Literal["seq_tis"] = "seq_tis"
    cap: float | None = Field(W.SEQ_TIS_CAP, gt=0, description="truncation C; None: the uncapped weight exp(S_i)")
    floor: float | None = Field(None, gt=0, description="also clamp from below (TRL's clip_min with "
                                "vllm_importance_sampling_mode='sequence_truncate')")
    ratio: Literal["product", "geometric"] = Field(
        "product", description="truncate exp(S_i) (default) or the geometric mean exp(S_i/L_i) (AReaL's "
        "rejection_sampling level=sequence, metric=ratio, agg=mean, action=clamp)"
    )
    renormalize: Literal["token", "sequence"] | None = Field(
        None, description="divide by the mean weight after truncation (verl rollout_is_batch_normalize: 'sequence')"
    )


class _MIS(_Strict):
    lower: float | None = Field(None, gt=0, description="keep iff ratio ≥ lower (None: no lower bound)")
    upper: float | None = Field(None, gt=0, description="keep iff ratio ≤ upper (None: no upper bound)")
    weight: Literal["ratio", "one"] = Field("ratio", description="weight carried by kept tokens")
    rejected: Literal["drop", "zero"] = Field(
        "drop", description="rejected tokens leave the mask and the denominators (drop), or stay in the mask with "
        "weight 0 (zero: verl's IcePop rollout_is_threshold='lower_upper', TRL's *_mask modes)"
    )


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
    weight: Literal["one", "ratio"] = Field("one", description="weight carried by kept tokens: 1 (a pure mask) or "
                                            "their ratio π_prox/μ")


class Rejection(_Strict):
    """Rejection on a divergence statistic of ℓ (verl ``rollout_rs``, AReaL ``rejection_sampling.metric``, KPop).

    verl's options: ``token_k{1,2,3}`` is ``level=token, metric=k*``; ``seq_{sum,mean,max}_k*`` is ``level=sequence,
    seq_agg=sum|mean|max``; its k1 thresholds are ratios (``ratio_bounds=True``; ``"0.999_1.001"`` → lower, upper);
    Geo-RS is ``seq_mean_k1`` with [0.999, 1.001]. A comma list is one ``rejection`` correction per option, the
    sequence-level ones first. AReaL's ``metric=kl_k*`` is ``convention=areal``; ``metric=ratio`` is ``ratio``.
    """

    type: Literal["rejection"] = "rejection"
    metric: Literal["k1", "k2", "k3", "ratio", "binary_kl"] = Field(
        "k3", description="statistic per token: estimator k1|k2|k3 of KL(μ‖π_prox); ratio: log(π_prox/μ) with ratio "
        "bounds (AReaL metric=ratio); binary_kl: KPop's max of the two Bernoulli KLs of π_prox(y_t), μ(y_t) "
        "[reconstructed: AReaL PR #1405]"
    )
    level: Literal["token", "sequence"] = Field("sequence", description="reject tokens or whole sequences")
    seq_agg: Literal["sum", "mean", "max"] = Field("mean", description="per-sequence aggregation of the metric")
    lower: float | None = Field(None, description="keep iff metric ≥ lower (metric space, AReaL style)")
    upper: float | None = Field(RJ.REJECTION_UPPER, description="keep iff metric ≤ upper (verl's k3 presets: 0.01)")
    ratio_bounds: bool = Field(
        False, description="bounds are ratios compared as log(bound) (verl's k1 thresholds); implied by metric=ratio"
    )
    convention: Literal["verl", "areal"] = Field(
        "verl", description="direction of k1/k3: verl (k1 = −ℓ, k3 = e^ℓ − 1 − ℓ) or AReaL (k1 = ℓ, k3 = e^−ℓ − 1 + ℓ)"
    )
    weight: Literal["one", "token", "geometric"] = Field(
        "one", description="what kept tokens carry: 1 (a pure mask, verl), π_prox/μ per token (AReaL's KL metrics) "
        "or exp(mean_t ℓ) per sequence (AReaL's sequence-level ratio metric)"
    )


class OPSM(_Strict):
    """Off-policy sequence masking (DeepSeek-V3.2; TRL ``off_policy_mask_threshold``)."""

    type: Literal["opsm"] = "opsm"
    delta: float = Field(0.5, description="keep iff A ≥ 0 or mean_t(log μ − log π_θ) ≤ δ")


class PrefixRatio(_Strict):
    """PNPO's prefix ratio w_t = exp((1/t) Σ_{k≤t} ℓ_k) of π_prox/μ as a weight (an alternative reading; the paper's
    objective is ``objective.type=pnpo``)."""

    type: Literal["prefix_ratio"] = "prefix_ratio"
    cap: float | None = Field(None, gt=0, description="optional truncation of w_t")


class M2POMask(_Strict):
    """M2PO masking variant (arXiv 2510.01161; AReaL): drop the largest δ² until mean δ² < τ."""

    type: Literal["m2po_mask"] = "m2po_mask"
    tau: float = Field(0.04, gt=0, description="second-moment budget τ (AReaL m2_threshold)")
    harmful_only: bool = Field(False, description="candidates only harmful tokens [reconstructed]")
    budget_over: Literal["candidates", "valid"] = Field(
        "candidates", description="M2 measured over the candidates (default) or every masked-in token"
    )


class VacoFilter(_Strict):
    """VACO TV filter (arXiv 2603.01365): the first author's released rule by default [reference-code]."""

    type: Literal["vaco_filter"] = "vaco_filter"
    delta: float = Field(0.2, gt=0, description="TV threshold δ on ½·mean|π_θ/μ − 1| (the released LLM scripts: "
                         "0.0075, i.e. clip_ratio 0.015)")
    rule: Literal["tvpo", "sequence", "token"] = Field(
        "tvpo", description="tvpo: TV = ½ mean_t|ρ_t − 1| per sequence, averaged per group and batch; past δ, drop "
        "tokens with A·sign(log ρ) > 0 in groups past δ (released code). sequence: ½|exp(mean_t log ρ) − 1| per "
        "sequence with the sign of r − 1 (a reading of the abstract); token: the same per token"
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


class SeqLogprobError(_Strict):
    """NeMo-RL's sequence log-prob-error mask (``grpo.seq_logprob_error_threshold``) [reference-code]: drop a sequence
    whose token mean of e^{|log π_prox − log μ|} exceeds the threshold."""

    type: Literal["seq_logprob_error"] = "seq_logprob_error"
    threshold: float = Field(2.0, ge=1, description="keep iff mean_t exp(|ℓ_t|) ≤ threshold (NeMo-RL's multiplicative "
                             "prob error; 2 in its Nemotron 3 recipes)")


class SegmentTIS(_Strict):
    """ROLL's segment-level IS (``train_infer_correction.is_weight.weight_type=segment``) [reference-code]: one
    weight per turn segment (a run of masked-in tokens), min(exp(segment mean of ℓ), C)."""

    type: Literal["segment_tis"] = "segment_tis"
    cap: float | None = Field(1.2, gt=0, description="truncation C (ROLL's is_weight.upper_bound default 1.2); None: "
                              "no cap")


class ProbDiffFilter(_Strict):
    """ROLL's probability-difference filter (``train_infer_correction.filters``, ``diff_enabled``) [reference-code;
    not installed]: keep tokens whose statistic of π_prox(y) − μ(y) lies in [lower, upper]."""

    type: Literal["prob_diff"] = "prob_diff"
    level: Literal["token", "geometric", "sequence", "segment"] = Field(
        "token", description="statistic: the token's d, the sequence mean of d (ROLL 'geometric'), its sum "
        "('sequence'), or the mean over the token's turn segment ('segment')"
    )
    lower: float | None = Field(-0.2, description="keep iff statistic ≥ lower (ROLL diff_low: −0.2); None: no bound")
    upper: float | None = Field(0.2, description="keep iff statistic ≤ upper (ROLL diff_high: 0.2); None: no bound")


CorrectionSpec = Annotated[
    ProbDiffFilter
    | TokenTIS
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
    | ESTRMask
    | SeqLogprobError
    | SegmentTIS,
    Field(discriminator="type"),
]


# --------------------------------------------------------------------------------------------------- objectives
class PPOClip(_Strict):
    """PPO-clip (arXiv 1707.06347) with clip-higher (DAPO) and optional dual clip."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip_low: float = Field(0.2, ge=0, lt=1, description="ε_low")
    clip_high: float = Field(0.2, ge=0, description="ε_high (raise it for clip-higher, DAPO 0.28)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip c for A < 0 (verl default 3; TRL none)")
    empty_rows: Literal["skip", "count"] = Field(
        "skip", description="sequence means (seq-mean agg only) over the non-empty rows (skip) or over all B rows "
        "(count: TRL loss_type='grpo', SkyRL sequence_mean, verl's trainer)"
    )


class Reinforce(_Strict):
    """REINFORCE surrogate −A·w·r (r = π_θ/π_prox = 1 in value at the first update)."""

    type: Literal["reinforce"] = "reinforce"
    surrogate: Literal["ratio", "log_prob"] = Field(
        "ratio", description="−A·w·r (ours) or −A·w·log π_θ (verl 0.9.1 compute_policy_loss_reinforce, its bypass-mode "
        "REINFORCE): the same gradient at r = 1, other loss values"
    )


class GSPO(_Strict):
    """GSPO (arXiv 2507.18071): sequence-level geometric-mean ratio with a two-sided clip."""

    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, description="ε_low")
    clip_high: float = Field(4e-4, ge=0, description="ε_high")
    form: Literal["sequence", "token"] = Field(
        "sequence", description="s_i with its gradient (TRL, AReaL, OpenRLHF) or GSPO-token sg[s_i]·π_θ/sg[π_θ] "
        "(the paper's §4.3; verl, SkyRL): same loss, different gradient only with token-level A or weights"
    )
    log_ratio_cap: float | None = Field(
        None, description="cap log s_i above only, instead of the ±20 clamp (verl and SkyRL: 10)"
    )
    empty_rows: Literal["skip", "count"] = Field(
        "skip", description="sequence means over the non-empty rows (skip) or all B rows (count: TRL "
        "loss_type='grpo', SkyRL sequence_mean)"
    )


class ScoreCentering(_Strict):
    """Score centering (arXiv 2609.20807, Eq. 14): REINFORCE −A·[w_a log π_θ(a) − Σ_v sg(μ_v w_v) log π_θ(v)], no clip.

    Needs ``centering`` = Σ_v sg(μ_v w_v) log π_θ(v) at each token, which the learner computes from the behavior
    distribution the sampler records (in full, or its top-k) through the chunked log-prob path.
    """

    type: Literal["score_centering"] = "score_centering"
    NEEDS: ClassVar[tuple[str, ...]] = ("centering",)
    reads_behavior: ClassVar[bool] = True
    weight: Literal["none", "tis", "mis"] = Field(
        "tis", description="w = f(π_θ/μ): none (f ≡ 1), tis (min(r, 2)) or mis (r·1[0.5 ≤ r ≤ 5]); the paper's three "
        "choices; the default tis is ours"
    )
    top_k: int = Field(
        0, ge=0, description="0: the exact form on the full behavior distribution (vocabularies up to 4096 tokens); "
        "k ≥ 1: the top-k form on the sampler's k most likely tokens with the paper's tail rule"
    )


class M2POClip(_Strict):
    """M2PO clip-narrowing variant (authors' code): PPO clip range from the second-moment budget."""

    type: Literal["m2po_clip"] = "m2po_clip"
    reads_behavior: ClassVar[bool] = True
    tau: float = Field(0.04, gt=0, description="second-moment budget τ (the authors' M2_budget)")
    floor_low: float | None = Field(None, ge=0, description="minimum ε_low, the authors' miniclip_low (0.3 in "
                                    "compute_m2po_policy_loss, unset in its scripts)")
    floor_high: float | None = Field(None, ge=0, description="minimum ε_high, the authors' miniclip_high (0.5 in "
                                     "compute_m2po_policy_loss, unset in its scripts)")


class TICGRPO(_Strict):
    """TIC-GRPO (arXiv 2508.02833): one trajectory ratio π_θ(y)/μ(y) with gradient, clipped above at 1 + ε."""

    type: Literal["tic_grpo"] = "tic_grpo"
    reads_behavior: ClassVar[bool] = True
    eps: float = Field(0.2, gt=0, description="clip ε (the paper's value is not known here; 0.2 is ours)")
    upper_only: bool = Field(True, description="clip only above 1+ε (the paper's upper-only clipping); "
                             "false: two-sided [1−ε, 1+ε] (a symmetric clip)")
    ratio_to: Literal["behavior", "proximal"] = Field(
        "behavior", description="denominator of the trajectory ratio: μ, the policy that sampled (the paper), or "
        "π_prox (no behavior correction when π_prox is not recomputed)"
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


class VESPO(_Strict):
    """VESPO (arXiv 2602.10693): detached gamma kernel φ(W) = W^k·exp(λ(1 − W)) of the sequence ratio W as the
    coefficient of −A·log π_θ (authors' verl recipe; TRL ``loss_type="vespo"``) [reference-code]."""

    type: Literal["vespo"] = "vespo"
    reads_behavior: ClassVar[bool] = True
    k_pos: float = Field(2.0, ge=0, description="exponent k for A ≥ 0 (paper's c1; authors' scripts, TRL vespo_k_pos)")
    lambda_pos: float = Field(3.0, ge=0, description="decay λ for A ≥ 0 (paper's c2; TRL vespo_lambda_pos)")
    k_neg: float = Field(3.0, ge=0, description="exponent k for A < 0 (TRL vespo_k_neg)")
    lambda_neg: float = Field(2.0, ge=0, description="decay λ for A < 0 (TRL vespo_lambda_neg)")
    ratio_to: Literal["behavior", "proximal"] = Field(
        "behavior", description="denominator of W = Π_t π_θ/π_den: μ (the paper's W = π_θ(τ)/μ(τ)) or π_prox (the "
        "authors' code and TRL, which fold a token TIS weight π_prox/μ into W: compose token_tis for it). Corrections' "
        "weights are always folded into W, so with 'behavior' add no behavior-weight correction"
    )


_EMPTY_ROWS_DOC = (
    "sequence means over the non-empty rows (skip: steadyrl's aggregate, verl's agg_loss) or over every row of the "
    "batch, trained or not (count: TRL's row .mean(), verl's geo_mean, SkyRL's sequence_mean); seq-mean agg only"
)


class CISPO(_Strict):
    """CISPO (MiniMax-M1, arXiv 2506.13585, Eq. 4): detached clipped ratio sg(clip(r)) as the coefficient of
    −A·log π_θ [reference-code: ε_high is TRL's]."""

    type: Literal["cispo"] = "cispo"
    clip_low: float | None = Field(
        None, ge=0, description="ε_low of the weight's lower bound 1 − ε_low; None: no lower bound (the paper's "
        "practice, 'ε_low set to a large value'; TRL has none; verl clip_ratio_low, SkyRL cispo_eps_clip_low = 0)"
    )
    clip_high: float | None = Field(
        4.0, ge=0, description="ε_high of the cap 1 + ε_high (4: TRL's recommended epsilon_high = 5, the cap itself; "
        "the paper tunes it without a value; verl clip_ratio_high, SkyRL cispo_eps_clip_high = 5); None: no cap"
    )


class SAPO(_Strict):
    """SAPO (arXiv 2511.20347): soft gate σ(τ(r − 1))·4/τ of the token ratio in place of the clip."""

    type: Literal["sapo"] = "sapo"
    tau_pos: float = Field(1.0, gt=0, description="τ for A > 0 (paper; verl tau_pos, TRL sapo_temperature_pos, "
                           "SkyRL sapo.tau_pos, AReaL sapo_tau_pos: all 1.0)")
    tau_neg: float = Field(1.05, gt=0, description="τ for A ≤ 0 (paper; verl tau_neg, TRL sapo_temperature_neg, "
                           "SkyRL sapo.tau_neg, AReaL sapo_tau_neg: all 1.05)")
    empty_rows: Literal["skip", "count"] = Field("skip", description=_EMPTY_ROWS_DOC)


class GMPO(_Strict):
    """GMPO (arXiv 2507.20673): −A_i × the geometric mean of the token ratios, each clipped one-sided in log space."""

    type: Literal["gmpo"] = "gmpo"
    clip_low: float = Field(0.4, ge=0, description="ε_low: log-ratios clipped at −ε_low (authors' CLIPRANGE 0.4; "
                            "verl geo_mean clip_ratio_low, TRL GMPOConfig epsilon)")
    clip_high: float = Field(0.4, ge=0, description="ε_high: log-ratios clipped at ε_high (authors' CLIPRANGE 0.4; "
                             "verl clip_ratio_high, TRL epsilon_high)")
    empty_rows: Literal["skip", "count"] = Field("skip", description=_EMPTY_ROWS_DOC)


class TOPR(_Strict):
    """TOPR (arXiv 2503.14286): REINFORCE on log π_θ(y); rows with A < 0 weighted by sg(min(1, π_θ(y)/μ(y)))."""

    type: Literal["topr"] = "topr"
    reads_behavior: ClassVar[bool] = True
    value: Literal["unit", "logp"] = Field(
        "unit", description="loss value (same gradient): −w·α·A per token (unit: steadyrl's REINFORCE convention, no "
        "absolute log-probs in the value) or the paper's surrogate −w·α·A·log π_θ (logp)"
    )


class _DPPO(_Strict):
    """DPPO (arXiv 2602.04879): a trust-region mask on a divergence in probability space, not a ratio clip. The
    anchor is π_prox: μ under ``policy=bypass`` (the paper's recommendation, which the presets set)."""

    delta_low: float = Field(gt=0, description="δ_low: A < 0 tokens whose probability fell past it are dropped")
    delta_high: float = Field(gt=0, description="δ_high: A > 0 tokens whose probability rose past it are dropped")
    trunc: float | None = Field(
        None, gt=0, description="C of the detached ratio weight min(r, C) (verl clip_ratio_c: 20 in its function, 3 "
        "from ActorConfig's default; the authors' repository 10; their verl example 1e4); None: no truncation "
        "(SkyRL, prime-rl)"
    )
    surrogate: Literal["ratio", "log_prob"] = Field(
        "ratio", description="−A·r (SkyRL, prime-rl) or −A·sg(min(r, C))·log π_θ (verl, the authors): same gradient"
    )
    sq_log_ratio_coef: float = Field(
        0.0, ge=0, description="κ of the (log r)² term on every trained token (prime-rl's default loss: kl_tau = 1e-3)"
    )


class DPPOTV(_DPPO):
    """DPPO-Binary-TV: drop a token when |π_θ(y) − π_anc(y)| passes δ in its advantage's direction."""

    type: Literal["dppo_tv"] = "dppo_tv"
    DIVERGENCE: ClassVar[str] = "tv"
    delta_low: float = Field(0.15, gt=0, description="δ_low (authors' verl example: 0.15; SkyRL and prime-rl 0.2)")
    delta_high: float = Field(0.15, gt=0, description="δ_high (authors' verl example: 0.15; SkyRL and prime-rl 0.2)")


class DPPOKL(_DPPO):
    """DPPO-Binary-KL: drop a token when KL(Bern(π_anc(y)) ‖ Bern(π_θ(y))) passes δ in its advantage's direction."""

    type: Literal["dppo_kl"] = "dppo_kl"
    DIVERGENCE: ClassVar[str] = "kl"
    delta_low: float = Field(0.05, gt=0, description="δ_low (authors' verl example: 0.05)")
    delta_high: float = Field(0.05, gt=0, description="δ_high (authors' verl example: 0.05)")


class ClipCov(_Strict):
    """Clip-Cov (arXiv 2505.22617): PPO-clip, with a random ρ·N of the tokens whose Cov(log π_θ, A) lies in
    (ω_low, ω_high) dropped from the loss (verl ``clip_cov``, SkyRL ``CLIP_COV``)."""

    type: Literal["clip_cov"] = "clip_cov"
    clip_low: float = Field(1.0, ge=0, le=1, description="PPO ε_low (the authors' Clip-Cov scripts: 1, i.e. no lower "
                            "clip; verl's default 0.2)")
    clip_high: float = Field(1.0, ge=0, description="PPO ε_high (the authors' Clip-Cov scripts: 1; verl's 0.2)")
    frac: float = Field(2e-4, gt=0, le=1, description="ρ: fraction of the trained tokens dropped (authors, verl, "
                        "SkyRL clip_cov_ratio / clip_ratio: 2e-4)")
    cov_lb: float = Field(1.0, description="ω_low: candidates have Cov > ω_low (authors, verl, SkyRL: 1)")
    cov_ub: float = Field(5.0, description="ω_high: candidates have Cov < ω_high (authors, verl, SkyRL: 5)")
    seed: int | None = Field(
        0, description="seed of the random draw, combined with the learner's version: the same draw on every "
        "evaluation of a step's loss, a new one each step; None: torch's global generator (verl's randperm)"
    )


class KLCov(_Strict):
    """KL-Cov (arXiv 2505.22617): unclipped −A·r plus β·|log r| on the top-k·N tokens by Cov(log π_θ, A) (verl
    ``kl_cov``, SkyRL ``KL_COV``)."""

    type: Literal["kl_cov"] = "kl_cov"
    frac: float = Field(2e-3, gt=0, le=1, description="k: fraction of the trained tokens penalized (authors' 7B "
                        "script 2e-3, 32B 2e-4; verl kl_cov_ratio 2e-4; SkyRL kl_cov_frac 0.2)")
    coef: float = Field(1.0, ge=0, description="β of β·|log r| (authors and SkyRL ppo_kl_coef: 1; verl's "
                        "PolicyLossConfig: 0.1)")


class BAPO(_Strict):
    """BAPO (arXiv 2510.18927): PPO-clip with ratio bounds [c_low, c_high] searched per batch until the positive
    tokens carry a share ρ0 of the loss (Algorithm 1; §5 constants)."""

    type: Literal["bapo"] = "bapo"
    target: float = Field(0.4, ge=0, description="ρ0, the positive share to reach (paper §5: 0.4); with "
                          "balance='odds' the ratio P/N (the released recipe: 1 in its yaml, 0.5 in its script)")
    balance: Literal["share", "odds"] = Field(
        "share", description="share: P/(P + N) ≥ ρ0 (Eq. 8); odds: P/N ≥ target (the authors' released recipe)"
    )
    low_start: float = Field(0.6, gt=0, le=1, description="a⁻, the first c_low (paper §5: 0.6)")
    low_max: float = Field(0.9, gt=0, le=1, description="b⁻, the largest c_low (paper §5: 0.9)")
    low_step: float = Field(0.02, gt=0, description="δ2, the c_low step (paper §5: 0.02)")
    high_start: float = Field(1.2, ge=1, description="a⁺, the first c_high (paper §5: 1.2)")
    high_max: float = Field(3.0, ge=1, description="b⁺, the largest c_high (paper §5: 3.0)")
    high_step: float = Field(0.05, gt=0, description="δ1, the c_high step (paper §5: 0.05)")
    order: Literal["high_first", "low_first"] = Field(
        "high_first", description="raise c_high to b⁺ first, then c_low (Algorithm 1), or c_low first (the released "
        "recipe, whose steps stop exactly at the maxima)"
    )
    dual_clip: float | None = Field(None, gt=1, description="dual-clip c for A < 0 (the released recipe: verl's 3; "
                                    "Algorithm 1 has none)")

    @model_validator(mode="after")
    def _ranges_are_ordered(self) -> BAPO:
        if self.low_start > self.low_max or self.high_start > self.high_max:
            raise ValueError("BAPO's ranges must be ordered: low_start ≤ low_max and high_start ≤ high_max")
        return self


# --- objectives the frameworks ship (verl 0.9.1 dro)
class DRO(_Strict):
    """DRO's policy loss (arXiv 2405.19107; verl ``dro``): −A·log π_θ + ½β(log π_θ/π_prox)² per token."""

    type: Literal["dro"] = "dro"
    beta: float = Field(0.1, gt=0, description="β of the quadratic log-ratio penalty (verl policy_loss.dro_beta, "
                        "which has no default; 0.1 is steadyrl's)")


class IPO(_Strict):
    """prime-rl's IPO loss: −A·r on tokens with |π_θ(y) − π_prox(y)| ≤ ε, plus κ(log r)² on every trained token
    [reference-code: prime-rl's public ipo_loss_fn; not installed]."""

    type: Literal["ipo"] = "ipo"
    epsilon: float = Field(0.1, gt=0, le=1, description="ε of the symmetric probability trust region (prime-rl's "
                           "ipo_threshold default)")
    kl_coef: float = Field(1e-3, ge=0, description="κ of κ·(log r)² (prime-rl's kl_tau default)")


ObjectiveSpec = Annotated[
    PPOClip | Reinforce | GSPO | M2POClip | TICGRPO | GMCGRPO | PNPO | OAPL | VESPO | CISPO | SAPO | GMPO | TOPR
    | DPPOTV | DPPOKL | ClipCov | KLCov | BAPO | ScoreCentering | DRO | IPO,
    Field(discriminator="type"),
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
    value_clamp: float | None = Field(
        None, gt=0, description="clamp every estimator's value to ±c (OpenRLHF compute_approx_kl and AReaL "
        "KLEstimator: 10)"
    )


class KLInLoss(_Strict):
    """Add β·KL(π_θ‖π_ref) to the loss (needs ``ref_logp``)."""

    type: Literal["in_loss"] = "in_loss"
    NEEDS: ClassVar[tuple[str, ...]] = ("ref_logp",)
    beta: float = Field(1e-3, ge=0, description="β")
    kind: Literal["k1", "k2", "k3", "abs", "low_var_kl"] = Field("low_var_kl", description="estimator")
    value_clamp: float | None = Field(
        None, gt=0, description="clamp every estimator's value to ±c (OpenRLHF compute_approx_kl and AReaL "
        "KLEstimator: 10)"
    )
    straight_through: bool = Field(
        False, description="value of kind, gradient of k2 = x²/2 (verl kl_loss_type 'k3+', 'low_var_kl+', ...)"
    )
    agg: AggMode | None = Field(
        None, description="reduce the KL term with this mode instead of the method's agg and the objective's "
        "empty_rows (OpenRLHF: token-mean; SkyRL: seq-mean-token-mean with empty_rows='count')"
    )
    empty_rows: Literal["skip", "count"] = Field("skip", description="with agg set: as the objectives' empty_rows")
    bias_correction: Literal["none", "token", "sequence"] = Field(
        "none", description="multiply k by π_θ/π_prox with gradient (DeepSeek-V3.2's unbiased KL estimate, arXiv "
        "2512.02556; TRL use_bias_correction_kl): per token, or the sequence's geometric-mean ratio (TRL with "
        "importance_sampling_level='sequence')"
    )


KLSpec = Annotated[NoKL | KLInReward | KLInLoss, Field(discriminator="type")]


# ------------------------------------------------------------------------------------------------------ entropy
class EntropyBonus(_Strict):
    """Entropy bonus −c·agg(H(π_θ(·|s_t))) added to any method's loss (verl ``actor.entropy_coeff``, TRL
    ``GRPOConfig.entropy_coef``); the adaptive coefficient of Skywork-OR1 (arXiv 2505.22312) is the controller
    ``adaptive_entropy``, which starts from ``coef``.

    H is the full-vocabulary entropy of the policy at each trained token (batch key ``entropy``; the learner computes
    it chunk by chunk in the forward of log π_θ, at its temperature). Off by default (``coef=0``).
    """

    coef: float = Field(
        0.0,
        allow_inf_nan=False,
        description="c of L − c·agg(H) (verl actor.entropy_coeff, TRL entropy_coef: both 0 by default); with "
        "adaptive_entropy, the initial c; 0: off; negative: an entropy penalty",
    )
    agg: AggMode | None = Field(
        None,
        description="reduce H with this mode instead of the method's agg and the objective's empty_rows (None: verl, "
        "which aggregates the entropy with the actor's loss_agg_mode; 'token-mean': TRL, whose bonus is a token mean "
        "whatever its loss_type)",
    )
    empty_rows: Literal["skip", "count"] = Field("skip", description="with agg set: as the objectives' empty_rows")
    mask: Literal["kept", "input"] = Field(
        "kept",
        description="tokens H is averaged over: those the objective trains on, after the corrections' rejections "
        "(kept: verl, whose rollout rejection edits response_mask) or every trained token of the input mask (input: "
        "TRL, whose importance-sampling masks leave its entropy bonus alone)",
    )

    def needs(self) -> tuple[str, ...]:
        return ("entropy",) if self.coef != 0 else ()


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


class AdaptiveEntropy(_Strict):
    """Adaptive entropy coefficient (Skywork-OR1, arXiv 2505.22312, §3.2; TRL ``use_adaptive_entropy``): after each
    optimizer step c ← min(c + δ, c_max) if the step's token-mean entropy Ĥ ≤ target, else max(c − δ, c_min); the
    bonus applies c only while the previous step's Ĥ was ≤ target (0 at the first step). c starts at
    ``entropy.coef``; the bonus's aggregation and mask are ``entropy``'s."""

    type: Literal["adaptive_entropy"] = "adaptive_entropy"
    NEEDS: ClassVar[tuple[str, ...]] = ("entropy",)
    target: float = Field(
        0.2,
        ge=0,
        allow_inf_nan=False,
        description="H_target, in nats (TRL entropy_target: 0.2; set it near the entropy observed early in training)",
    )
    delta: float = Field(
        0.005,
        ge=0,
        allow_inf_nan=False,
        description="δ, the step of c per optimizer step (TRL entropy_coef_delta: 0.005)",
    )
    coef_min: float = Field(0.0, ge=0, allow_inf_nan=False, description="c_min (TRL entropy_coef_min: 0)")
    coef_max: float = Field(1.0, ge=0, allow_inf_nan=False, description="c_max (TRL entropy_coef_max: 1)")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> AdaptiveEntropy:
        if self.coef_min > self.coef_max:
            raise ValueError(f"adaptive_entropy: coef_min={self.coef_min} must not exceed coef_max={self.coef_max}")
        return self


ControllerSpec = Annotated[EssStepSize | GAC | AdaptiveEntropy, Field(discriminator="type")]


# ------------------------------------------------------------------------------------------------------ method
#: Objectives whose reduction takes the count mask (``MethodSpec.denominator='input'``).
INPUT_DENOMINATOR_OBJECTIVES: tuple[str, ...] = ("ppo_clip", "reinforce", "gspo", "m2po_clip")


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
    entropy: EntropyBonus = Field(
        default_factory=EntropyBonus, description="entropy bonus −c·agg(H) on any objective (off: coef=0)"
    )
    recompute_prox: bool = Field(
        False, description="the learner recomputes π_prox before the first update (AReaL decoupled PPO)"
    )
    denominator: Literal["kept", "input"] = Field(
        "kept", description="the token and sequence counts the objective divides by: after the corrections' "
        "rejections (kept, verl) or of the input mask, rejected tokens counted (input: TRL loss_type dapo/bnpo/grpo, "
        "whose IS masking zeroes weights; AReaL's loss_mask_count). Objectives ppo_clip, reinforce, gspo, m2po_clip"
    )
    bypass_ratio: Literal["one", "current"] = Field(
        "one", description="policy=bypass: the ratio the corrections read, π_prox/μ = 1 (π_prox := μ, every "
        "correction a no-op) or π_θ(detached)/μ (current: verl's bypass mode computes rollout_is/rollout_rs from the "
        "current log-probs)"
    )
    pad_weight: Literal["zero", "one"] = Field(
        "zero", description="value of return_details' weights outside the input mask: 0 (verl, AReaL) or 1 (TRL's "
        "token-level importance_sampling_ratio, exp(0) at padding)"
    )
    weights_ess: bool = Field(
        False, description="also log is/ess_ratio_weights: verl's rollout_is_eff_sample_size, the ESS ratio of the "
        "corrections' weights over the input mask's tokens, each token one sample"
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
    def _conventions_apply(self) -> MethodSpec:
        """``denominator='input'`` needs an objective that takes the count mask; ``bypass_ratio`` needs bypass."""
        if self.denominator == "input" and self.objective.type not in INPUT_DENOMINATOR_OBJECTIVES:
            raise ValueError(
                f"denominator='input' is implemented for the objectives {', '.join(INPUT_DENOMINATOR_OBJECTIVES)}; "
                f"objective.type={self.objective.type!r} divides by its own counts"
            )
        if self.bypass_ratio != "one" and self.policy != "bypass":
            raise ValueError(f"bypass_ratio={self.bypass_ratio!r} applies to policy='bypass' only")
        return self

    @model_validator(mode="after")
    def _one_entropy_controller(self) -> MethodSpec:
        """Two adaptive entropy controllers would each move the one coefficient of the bonus."""
        if sum(c.type == "adaptive_entropy" for c in self.controllers) > 1:
            raise ValueError("the method lists adaptive_entropy twice: the bonus has one coefficient")
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
