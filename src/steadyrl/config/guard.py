"""The collapse guard's settings (``guard.*``); the rule itself is :mod:`steadyrl.train.collapse_guard`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["off", "warn", "stop", "rollback"]


class GuardConfig(BaseModel):
    """The collapse guard of ``steadyrl train`` (rule: ``steadyrl.train.collapse_guard``; ``mode=off`` turns it off)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field(
        "warn",
        description="On alarm: warn (print + guard.jsonl), stop (checkpoint and end), rollback "
        "(restore the last healthy snapshot, lower lr, tighten truncation), or off.",
    )
    warmup: int = Field(10, ge=0, le=1_000_000, description="Learner steps before any alarm; they seed the baselines.")
    window: int = Field(
        50, ge=1, le=1_000_000, description="Clean steps whose median is each signal's healthy baseline."
    )
    smooth: int = Field(
        5, ge=1, le=1000, description="Steps whose median is a signal's current value (ignores one-step outliers)."
    )
    patience: int = Field(4, ge=1, le=1000, description="Consecutive suspicious steps before an alarm.")
    ess_drop: float = Field(0.25, gt=0, le=1, description="ESS ratio has fallen below this fraction of its baseline.")
    ess_floor: float = Field(
        0.05, ge=0, lt=1, description="ESS ratio below this counts as fallen whatever the baseline."
    )
    kl_factor: float = Field(1.5, ge=1, description="Mismatch KL (kl/k3) spikes above this multiple of its baseline.")
    kl_min: float = Field(0.05, ge=0, description="A KL spike must also exceed this absolute value (per token).")
    kl_max: float | None = Field(
        1.0, gt=0, description="Hard limit: KL (smoothed, per token) above this alarms at once (None: off)."
    )
    grad_factor: float = Field(2.0, ge=1, description="Gradient norm spikes above this multiple of its baseline.")
    cos_max: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="If set, a smoothed cos(g_t, g_{t-1}) above this also counts as a spike (GAC's signal).",
    )
    lr_factor: float = Field(0.5, gt=0, le=1, description="rollback: multiply the lr by this.")
    cap_factor: float = Field(
        0.5, gt=0, le=1, description="rollback: multiply truncation caps (TIS C) by this, not below 1."
    )
    max_rollbacks: int = Field(
        3, ge=0, le=1000, description="rollback: after this many rollbacks the next alarm stops the run."
    )
    snapshot_every: int = Field(10, ge=1, le=1_000_000, description="rollback: steps between in-memory snapshots.")
