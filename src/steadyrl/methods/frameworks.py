"""Framework-qualified method names: ``verl:vanilla``, ``trl:dapo``, ``openrlhf:ppo``, ``areal:sapo``,
``skyrl:regular`` ... name a framework's own loss, and resolve to the steadyrl preset with the options that reproduce
it.

Each :class:`FrameworkLoss` row reproduces the framework's loss as its trainer runs it under the framework's defaults
(its clip range, its aggregation and how that counts all-masked rows, its length normaliser), plus the framework
settings the row names (``settings``, where a framework's default for that loss is not the one it is used with). Where
the framework's advantage estimator is part of the same config (TRL's ``scale_rewards``, SkyRL's
``advantage_estimator``), the row sets the estimator's options too. ``reductions`` are the framework's other
aggregation settings this loss honours: overriding ``agg`` on a qualified name (``method.agg=seq-mean-token-mean``)
also applies the options that reproduce that setting (``objective.empty_rows=count`` for verl's trainer), unless the
override sets them itself.

Every row names the parity tests under ``tests/parity`` that establish its mapping on random batches;
``tests/parity/test_framework_names.py`` compares every row (and each of its reductions) with the framework's own
function on ``steadyrl check losses``' fixed float64 batches. This module is data: the code that calls the
frameworks lives in :mod:`steadyrl.check.losses`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Framework:
    """A framework the table covers: the version the parity tests ran against and how its settings are written."""

    name: str
    version: str
    loss_key: str | None
    """The setting that names the loss (None: AReaL, whose rows are named by the function its flags select)."""
    setting: str = "{}"
    """How one setting is written in the framework's config: ``{}`` is ``key=value``."""
    python: bool = False
    """Settings are Python keyword arguments (values written as literals, joined into one call)."""

    def write(self, settings: Mapping[str, Any]) -> str:
        """``settings`` as the framework's config spells them."""
        if self.python:
            return self.setting.format(", ".join(f"{k}={v!r}" for k, v in settings.items())) if settings else ""
        return " ".join(self.setting.format(f"{k}={v}") for k, v in settings.items())


@dataclass(frozen=True)
class Reduction:
    """Another aggregation setting of the framework for the same loss: what to write there, and the options beside
    ``agg`` that steadyrl then needs."""

    settings: Mapping[str, Any]
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FrameworkLoss:
    """One framework's loss and the steadyrl preset + options that reproduce it."""

    framework: str
    name: str
    """The framework's own name for the loss (verl ``loss_mode``, TRL ``loss_type``, SkyRL ``policy_loss_type``,
    OpenRLHF ``policy_loss_type``; AReaL has none: the actor flag that selects the function)."""
    preset: str
    options: Mapping[str, Any]
    """Overrides on ``preset``, applied in order (the framework's defaults: clip range, aggregation, ...)."""
    tests: tuple[str, ...]
    """The parity tests (``tests/parity/<file>::<test>``) that establish the mapping."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """Framework settings besides the loss name that the row reproduces (empty: the framework's defaults)."""
    reductions: Mapping[str, Reduction] = field(default_factory=dict)
    """steadyrl ``agg`` → the framework's setting for it, for the aggregations this loss honours beside its default."""
    advantages: Literal["token", "sequence"] = "token"
    """The advantages the mapping holds for: any token advantages, or one per sequence (GRPO's outcome advantages
    broadcast over the row) where the framework averages or reads them per sequence."""
    note: str = ""

    @property
    def qualified(self) -> str:
        return f"{self.framework}:{self.name}"

    def framework_settings(self) -> str:
        """The framework config this row reproduces, as the framework writes it (the loss name and ``settings``)."""
        fw = FRAMEWORKS[self.framework]
        named = {fw.loss_key: self.name} if fw.loss_key else {}
        return fw.write({**named, **self.settings}) or "(its defaults)"


FRAMEWORKS: dict[str, Framework] = {
    f.name: f
    for f in (
        Framework("verl", "verl 0.9.1", "policy_loss.loss_mode", "actor_rollout_ref.actor.{}"),
        Framework("trl", "trl 1.16.0", "loss_type", "GRPOConfig({})", python=True),
        Framework("openrlhf", "openrlhf 0.11.2", "policy_loss_type", "--actor.{}"),
        Framework("areal", "areal 1.0.4", None, "actor.{}"),
        Framework("skyrl", "skyrl 0.3.0", "policy_loss_type", "trainer.algorithm.{}"),
    )
}

_CLIP_02 = {"objective.clip_low": 0.2, "objective.clip_high": 0.2}  # every framework's default clip range
_SAPO_TAUS = {"objective.tau_pos": 1.0, "objective.tau_neg": 1.05}  # verl, TRL, AReaL and SkyRL defaults
_COUNT = {"objective.empty_rows": "count"}
_TRL_ADVANTAGE = {"advantage.eps": 1e-4}  # scale_rewards="group" with TRL's std ε
_SKYRL_ADVANTAGE = {"advantage.singleton": "reward"}  # advantage_estimator="grpo": a group of one has mean 0, std 1

_VERL_SEQ_MEANS = {
    agg: Reduction({"loss_agg_mode": agg}, _COUNT) for agg in ("seq-mean-token-mean", "seq-mean-token-sum")
}  # verl's trainer hands agg_loss the mini-batch size B: all-masked rows count
_SKYRL_SEQUENCE_MEAN = {"seq-mean-token-mean": Reduction({"loss_reduction": "sequence_mean"}, _COUNT)}

# fmt: off
FRAMEWORK_LOSSES: tuple[FrameworkLoss, ...] = (
    # ---------------------------------------------------------------------------------------------------- verl
    FrameworkLoss(
        "verl", "vanilla", "ppo", {**_CLIP_02, "objective.dual_clip": 3.0},
        ("test_ppo.py::test_verl_vanilla", "test_aggregation.py::test_verl_agg_loss",
         "test_verl_dro_advantages.py::test_verl_token_sum"),
        reductions={**_VERL_SEQ_MEANS,
                    "seq-mean-token-sum-norm": Reduction({"loss_agg_mode": "seq-mean-token-sum-norm"}),
                    "token-sum": Reduction({"loss_agg_mode": "token-sum"})},
        note="verl's dual clip clip_ratio_c (3) is always on; seq-mean-token-sum-norm divides by loss_scale_factor "
        "(unset: the padded length, steadyrl's norm_len default; set: method.norm_len)",
    ),
    FrameworkLoss(
        "verl", "gspo", "gspo",
        {"objective.form": "token", "objective.log_ratio_cap": 10.0, **_CLIP_02, "agg": "token-mean"},
        ("test_gspo.py::test_verl_gspo",),
        reductions={"seq-mean-token-mean": _VERL_SEQ_MEANS["seq-mean-token-mean"]},
        note="the GSPO-token form with log s capped at +10",
    ),
    FrameworkLoss("verl", "cispo", "cispo", _CLIP_02, ("test_cispo.py::test_verl",)),
    FrameworkLoss(
        "verl", "sapo", "sapo", {**_SAPO_TAUS, **_COUNT},
        ("test_sapo.py::test_verl", "test_aggregation.py::test_verl_agg_loss"),
        note="verl ignores loss_agg_mode here: seq-mean-token-mean over the trainer's mini-batch (all rows)",
    ),
    FrameworkLoss(
        "verl", "geo_mean", "gmpo", {**_CLIP_02, **_COUNT}, ("test_gmpo.py::test_verl",), advantages="sequence",
        note="verl ignores loss_agg_mode here: the mean over every row",
    ),
    *(
        FrameworkLoss(
            "verl", name, name,
            {"policy": "decoupled", "objective.surrogate": "log_prob", "objective.trunc": 3.0,
             "objective.delta_low": 0.2, "objective.delta_high": 0.2},
            ("test_dppo.py::test_verl",),
            note="clip_ratio_low/high are δ_low/high, clip_ratio_c the truncation; in verl's bypass mode (its "
            "old_log_prob = μ) use method.policy=bypass",
        )
        for name in ("dppo_tv", "dppo_kl")
    ),
    FrameworkLoss(
        "verl", "kl_cov", "kl_cov", {"objective.frac": 2e-4, "objective.coef": 0.1},
        ("test_cov_penalty.py::test_verl_kl_cov",),
        note="policy_loss.kl_cov_ratio = objective.frac, policy_loss.ppo_kl_coef = objective.coef",
    ),
    FrameworkLoss(
        "verl", "dro", "dro", {"objective.beta": 0.1}, ("test_verl_dro_advantages.py::test_verl_dro",),
        settings={"policy_loss.dro_beta": 0.1},
        note="verl has no default dro_beta: objective.beta is it",
    ),
    # ----------------------------------------------------------------------------------------------------- TRL
    FrameworkLoss(
        "trl", "grpo", "grpo", {**_CLIP_02, **_COUNT, **_TRL_ADVANTAGE},
        ("test_ppo.py::test_trl_loss_types", "test_aggregation.py::test_trl_normalizations",
         "test_grpo_advantages.py::test_trl_scale_rewards"),
        note="each row's token mean, averaged over every row",
    ),
    *(
        FrameworkLoss(
            "trl", name, "ppo", {**_CLIP_02, **_TRL_ADVANTAGE},
            ("test_ppo.py::test_trl_loss_types", "test_aggregation.py::test_trl_normalizations",
             "test_grpo_advantages.py::test_trl_scale_rewards"),
            note="one process, one accumulation window: the batch's token mean",
        )
        for name in ("dapo", "bnpo")
    ),
    FrameworkLoss(
        "trl", "dr_grpo", "dr_grpo", {**_CLIP_02, "norm_len": 512, "advantage.scale": "group", **_TRL_ADVANTAGE},
        ("test_ppo.py::test_trl_loss_types", "test_aggregation.py::test_trl_normalizations",
         "test_grpo_advantages.py::test_trl_scale_rewards"),
        note="norm_len = max_completion_length (512); TRL keeps scale_rewards='group' unless told "
        "(scale_rewards='none': method.advantage.scale=none)",
    ),
    FrameworkLoss(
        "trl", "cispo", "cispo",
        {"objective.clip_low": None, "objective.clip_high": 4.0, **_TRL_ADVANTAGE}, ("test_cispo.py::test_trl",),
        settings={"epsilon_high": 5.0},
        note="epsilon_high is the cap itself: clip_high = epsilon_high − 1 (TRL's default, epsilon_high = epsilon, "
        "would cap the weight at 0.2)",
    ),
    FrameworkLoss(
        "trl", "sapo", "sapo", {**_SAPO_TAUS, **_COUNT, **_TRL_ADVANTAGE}, ("test_sapo.py::test_trl",),
        note="sapo_temperature_pos/neg = objective.tau_pos/neg",
    ),
    FrameworkLoss(
        "trl", "luspo", "luspo", {**_CLIP_02, **_COUNT, **_TRL_ADVANTAGE},
        ("test_luspo.py::test_sequence_level_luspo_equals_trl",),
        settings={"importance_sampling_level": "sequence"}, advantages="sequence",
        note="the sequence level TRL asks for with luspo; its token-level default is PPO-clip summed per row: "
        "test_luspo.py::test_token_level_luspo_is_ppo_clip_with_token_sums",
    ),
    FrameworkLoss(
        "trl", "vespo", "vespo",
        {"objective.k_pos": 2.0, "objective.lambda_pos": 3.0, "objective.k_neg": 3.0, "objective.lambda_neg": 2.0,
         **_TRL_ADVANTAGE},
        ("test_vespo.py::test_preset_equals_trl_without_a_vllm_ratio",), advantages="sequence",
        note="without vLLM's importance ratio (μ = TRL's old log-probs); with vLLM's token_truncate ratio: "
        "vespo+token_tis with objective.ratio_to=proximal (test_vespo.py)",
    ),
    # ------------------------------------------------------------------------------------------------ OpenRLHF
    FrameworkLoss(
        "openrlhf", "ppo", "ppo", _CLIP_02,
        ("test_ppo.py::test_openrlhf_policy_loss", "test_aggregation.py::test_openrlhf_aggregate_loss"),
        reductions={"seq-mean-token-mean": Reduction({"loss_agg_mode": "seq-mean-token-mean"})},
        note="its trainer divides by the step's tokens, or by its non-empty samples (all-masked rows skipped)",
    ),
    FrameworkLoss(
        "openrlhf", "gspo", "gspo", _CLIP_02, ("test_gspo.py::test_openrlhf_gspo",),
        note="the sequence form, one mean per non-empty sample (OpenRLHF forces the per-sample loss for gspo)",
    ),
    # --------------------------------------------------------------------------------------------------- AReaL
    FrameworkLoss(
        "areal", "ppo", "ppo", _CLIP_02, ("test_ppo.py::test_areal_ppo_actor_loss",),
        note="ppo_actor_loss_fn without the decoupled loss: the token mean of the micro-batch",
    ),
    FrameworkLoss(
        "areal", "sapo", "sapo", {**_SAPO_TAUS, "agg": "token-mean"}, ("test_sapo.py::test_areal",),
        settings={"use_sapo_loss": True}, note="sapo_loss_fn: the token mean of the micro-batch",
    ),
    FrameworkLoss(
        "areal", "gspo", "gspo", {**_CLIP_02, "agg": "token-mean"}, ("test_gspo.py::test_areal_sequence_level",),
        settings={"importance_sampling_level": "sequence"}, advantages="sequence",
        note="AReaL averages token advantages per sequence first: equal on per-sequence advantages",
    ),
    # --------------------------------------------------------------------------------------------------- SkyRL
    FrameworkLoss(
        "skyrl", "regular", "ppo", {**_CLIP_02, **_SKYRL_ADVANTAGE},
        ("test_ppo.py::test_skyrl_regular_and_dual_clip", "test_aggregation.py::test_skyrl_loss_reduction",
         "test_grpo_advantages.py::test_skyrl_grpo"),
        reductions=_SKYRL_SEQUENCE_MEAN,
        note="SkyRL pre-scales the advantages for its loss_reduction and sums; exponentiates in float32",
    ),
    FrameworkLoss(
        "skyrl", "dual_clip", "ppo", {**_CLIP_02, "objective.dual_clip": 3.0, **_SKYRL_ADVANTAGE},
        ("test_ppo.py::test_skyrl_regular_and_dual_clip", "test_aggregation.py::test_skyrl_loss_reduction",
         "test_grpo_advantages.py::test_skyrl_grpo"),
        reductions=_SKYRL_SEQUENCE_MEAN, note="clip_ratio_c (3) = objective.dual_clip",
    ),
    FrameworkLoss(
        "skyrl", "gspo", "gspo",
        {"objective.form": "token", "objective.log_ratio_cap": 10.0, **_CLIP_02, "agg": "token-mean",
         **_SKYRL_ADVANTAGE},
        ("test_gspo.py::test_skyrl_gspo", "test_grpo_advantages.py::test_skyrl_grpo"),
        reductions=_SKYRL_SEQUENCE_MEAN, note="the GSPO-token form with log s capped at +10",
    ),
    FrameworkLoss(
        "skyrl", "cispo", "cispo", {"objective.clip_low": 0.0, "objective.clip_high": 5.0, **_SKYRL_ADVANTAGE},
        ("test_cispo.py::test_skyrl", "test_grpo_advantages.py::test_skyrl_grpo"),
        note="cispo.cispo_eps_clip_low/high (0, 5): the weight clamped to [1, 6]",
    ),
    FrameworkLoss(
        "skyrl", "sapo", "sapo", {**_SAPO_TAUS, "agg": "token-mean", **_SKYRL_ADVANTAGE},
        ("test_sapo.py::test_skyrl", "test_grpo_advantages.py::test_skyrl_grpo"),
        reductions=_SKYRL_SEQUENCE_MEAN, note="sapo.tau_pos/neg = objective.tau_pos/neg",
    ),
    FrameworkLoss(
        "skyrl", "dppo", "dppo_tv",
        {"objective.surrogate": "ratio", "objective.trunc": None, "objective.delta_low": 0.2,
         "objective.delta_high": 0.2, **_SKYRL_ADVANTAGE},
        ("test_dppo.py::test_skyrl", "test_aggregation.py::test_skyrl_loss_reduction",
         "test_grpo_advantages.py::test_skyrl_grpo"),
        note="dppo.dppo_type=binary_tv (binary_kl: the dppo_kl preset, same options); the ratio to μ "
        "(rollout_logprobs)",
    ),
    FrameworkLoss(
        "skyrl", "rollout_is", "rollout_is",
        {"token_mis.lower": 0.8, "token_mis.upper": 1.2, "denominator": "input", **_SKYRL_ADVANTAGE},
        ("test_skyrl_off_policy.py::test_skyrl_rollout_is", "test_aggregation.py::test_skyrl_loss_reduction",
         "test_grpo_advantages.py::test_skyrl_grpo"),
        note="token_mis.lower/upper = 1 − eps_clip_low, 1 + eps_clip_high (SkyRL's bounds strict, ours inclusive); "
        "the tokens outside stay in SkyRL's token count: denominator=input",
    ),
)
# fmt: on

FRAMEWORK_LOSSES_BY_NAME: dict[str, FrameworkLoss] = {row.qualified: row for row in FRAMEWORK_LOSSES}
