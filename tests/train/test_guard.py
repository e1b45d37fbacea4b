"""The collapse guard: the pure rule on synthetic traces, tightening, config errors, warn/stop/rollback end to end."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from steadyrl.base.device import copy_state
from steadyrl.config.guard import GuardConfig
from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import TrainConfig
from steadyrl.methods import resolve_method
from steadyrl.train import checkpoint as ckpt
from steadyrl.train.collapse_guard import GUARD_FILE, CollapseDetector, read_alarms, tighten_method
from steadyrl.train.entry import lag_source, main
from steadyrl.train.loop import train
from steadyrl.train.metrics import read_metrics

ESS, KL, GRAD, COS = "is/ess_ratio", "kl/k3", "grad/norm", "grad/cos_prev"


def _healthy(t: int, rng: random.Random) -> dict[str, float]:
    """A noisy but stable step: ESS ≈ 0.6, k3 ≈ 0.08, ‖g‖ ≈ 1.5, with a one-step weight outlier every 17 steps."""
    ess = 0.01 if t % 17 == 16 else rng.uniform(0.4, 0.8)
    kl = 0.6 if t % 17 == 16 else rng.uniform(0.05, 0.11)
    return {"step": t, ESS: ess, KL: kl, GRAD: rng.uniform(1.0, 2.0), COS: rng.uniform(-0.2, 0.4), "reward/mean": 0.5}


def _collapse(t: int, *, fall: int, spike: int) -> dict[str, float]:
    """Healthy constants until ``fall``; then ESS falls 0.6 → 0.05; from ``spike`` on, k3 ×10 and ‖g‖ ×4."""
    return {
        "step": t,
        ESS: 0.6 if t < fall else 0.05,
        KL: 0.08 if t < spike else 0.8,
        GRAD: 1.5 if t < spike else 6.0,
        COS: 0.1,
    }


def _alarms(detector: CollapseDetector, records: list[dict[str, float]]) -> list[int]:
    return [int(r["step"]) for r in records if detector.observe(r).alarm]


def test_fires_on_a_collapse_at_the_step_the_rule_names() -> None:
    cfg = GuardConfig(kl_max=None)
    fall, spike = 60, 65
    records = [_collapse(t, fall=fall, spike=spike) for t in range(100)]
    # The median of the last `smooth` = 5 values flips once 3 of them are spiked: at spike + 2. Suspicious from there,
    # the alarm comes after `patience` = 4 suspicious steps: spike + 2 + 3. Only one: the guard stays disarmed.
    assert _alarms(CollapseDetector(cfg), records) == [spike + cfg.smooth // 2 + cfg.patience - 1]
    # ESS falling alone, or KL and grad norm spiking while the ESS stays healthy, is not the signature
    assert _alarms(CollapseDetector(cfg), [_collapse(t, fall=fall, spike=10**6) for t in range(100)]) == []
    assert _alarms(CollapseDetector(cfg), [_collapse(t, fall=10**6, spike=spike) for t in range(100)]) == []


def test_quiet_on_a_noisy_healthy_trace() -> None:
    rng = random.Random(0)
    records = [_healthy(t, rng) for t in range(600)]
    detector = CollapseDetector(GuardConfig())
    decisions = [detector.observe(r) for r in records]
    assert not any(d.alarm for d in decisions) and not any(d.suspicious for d in decisions)
    assert decisions[-1].values["ess_base"] == pytest.approx(0.6, abs=0.1)


def test_relative_to_the_healthy_baseline_not_to_absolute_levels() -> None:
    """A run whose healthy level is 100× lower in KL and grad norm collapses the same way: same alarm step."""

    def scaled(r: dict[str, float]) -> dict[str, float]:
        return r | {KL: r[KL] / 100, GRAD: r[GRAD] / 100}

    cfg = GuardConfig(kl_min=0.0, kl_max=None)
    records = [_collapse(t, fall=60, spike=65) for t in range(100)]
    assert _alarms(CollapseDetector(cfg), [scaled(r) for r in records]) == _alarms(CollapseDetector(cfg), records)


def test_silent_during_warmup_and_baselines_learn_only_clean_steps() -> None:
    cfg = GuardConfig(warmup=30, kl_max=None)
    records = [_collapse(t, fall=5, spike=8) for t in range(40)]
    detector = CollapseDetector(cfg)
    decisions = [detector.observe(r) for r in records]
    assert not any(d.alarm or d.suspicious for d in decisions[:30])
    # the warm-up saw the collapse, so it is the baseline: nothing is suspicious relative to it
    assert not any(d.alarm for d in decisions)
    # after warm-up, a suspicious step does not enter the baseline (steps 20, 21 do: their medians are still healthy)
    detector = CollapseDetector(GuardConfig(kl_max=None, warmup=10))
    for r in [_collapse(t, fall=20, spike=20) for t in range(40)]:
        detector.observe(r)
    assert list(detector.base["kl"]) == [0.08] * 20 + [0.8] * 2


def test_after_forget_recent_the_next_steps_are_not_judged() -> None:
    cfg = GuardConfig(kl_max=None)
    detector = CollapseDetector(cfg)
    records = [_collapse(t, fall=60, spike=60) for t in range(80)]
    assert _alarms(detector, records[:70]) == [65]
    detector.forget_recent()  # a rollback
    learned = list(detector.base["kl"])
    decisions = [detector.observe(r) for r in records[70:76]]
    assert [d.suspicious for d in decisions] == [False] * (cfg.smooth - 1) + [True, True]
    assert list(detector.base["kl"]) == learned  # the unjudged steps were not learned either


def test_hard_limits_fire_at_once() -> None:
    cfg = GuardConfig(warmup=3)
    detector = CollapseDetector(cfg)
    steps = [{"step": t, ESS: 0.9, KL: 0.01} for t in range(6)] + [{"step": 6, ESS: 0.9, KL: math.nan}]
    decisions = [detector.observe(r) for r in steps]
    assert [d.alarm for d in decisions] == [False] * 6 + [True]
    assert decisions[-1].reason == "non-finite kl/k3"
    detector = CollapseDetector(cfg)  # smoothed k3 above kl_max (1.0): ESS need not have fallen
    kls = [0.01, 0.01, 0.01, 2.0, 2.0, 2.0, 2.0]
    decisions = [detector.observe({"step": t, ESS: 0.9, KL: k}) for t, k in enumerate(kls)]
    assert [d.alarm for d in decisions] == [False, False, False, False, False, True, False]
    assert decisions[5].reason.startswith("mismatch KL 2 > limit 1")


def test_missing_keys_are_ignored() -> None:
    cfg = GuardConfig(kl_max=None)
    records = [_collapse(t, fall=60, spike=65) for t in range(100)]
    # no ESS key: the spike alone decides; no signal at all: never an alarm, never an error
    assert _alarms(CollapseDetector(cfg), [{k: v for k, v in r.items() if k != ESS} for r in records]) == [70]
    assert _alarms(CollapseDetector(cfg), [{"step": r["step"], "reward/mean": 0.1} for r in records]) == []
    # no KL key: the grad-norm spike still completes the signature
    assert _alarms(CollapseDetector(cfg), [{k: v for k, v in r.items() if k != KL} for r in records]) == [70]


def test_rearms_after_patience_clean_steps_and_state_round_trips() -> None:
    cfg = GuardConfig(kl_max=None)
    records = [_collapse(t, fall=60, spike=65) for t in range(80)] + [_collapse(t, fall=999, spike=999) for t in
                                                                      range(80, 100)]
    records += [_collapse(t, fall=100, spike=100) for t in range(100, 130)]
    straight = _alarms(CollapseDetector(cfg), records)
    assert straight == [70, 100 + 2 + 3]
    first = CollapseDetector(cfg)
    head = _alarms(first, records[:67])
    resumed = CollapseDetector(cfg)
    resumed.load_state_dict(first.state_dict())
    assert head + _alarms(resumed, records[67:]) == straight


def test_cosine_signal_is_optional() -> None:
    records = [_collapse(t, fall=60, spike=10**6) | {COS: 0.1 if t < 60 else 0.9} for t in range(100)]
    assert _alarms(CollapseDetector(GuardConfig(kl_max=None)), records) == []
    assert _alarms(CollapseDetector(GuardConfig(kl_max=None, cos_max=0.5)), records) == [60 + 2 + 3]


def test_tighten_method_scales_truncation_caps_not_below_one() -> None:
    spec = resolve_method("seq_tis", {"seq_tis.cap": 8.0})
    caps = []
    for _ in range(4):
        spec = tighten_method(spec, 0.5)
        caps.append(spec.corrections[0].cap)
    assert caps == [4.0, 2.0, 1.0, 1.0]
    token = tighten_method(resolve_method("token_tis", {"token_tis.cap": 0.5}), 0.5)
    assert token.corrections[0].cap == 0.5  # already below 1: never loosened
    grpo = resolve_method("grpo", {})
    assert tighten_method(grpo, 0.5) == grpo


@pytest.mark.parametrize(
    ("override", "key"),
    [("guard.mode=explode", "guard.mode"), ("guard.patience=0", "guard.patience"),
     ("guard.ess_floor=1.0", "guard.ess_floor"), ("guard.lr_factor=2", "guard.lr_factor"),
     ("guard.patiense=3", "guard.patiense")],
)  # fmt: skip
def test_config_errors_name_the_field(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(TrainConfig, overrides=[override])


def test_guard_config_is_strict_and_documented() -> None:
    with pytest.raises(ValidationError, match="mode"):
        GuardConfig(mode="explode")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="extra"):
        GuardConfig(sensitivity=2)  # type: ignore[call-arg]
    assert all(f.description for f in GuardConfig.model_fields.values())


# ----------------------------------------------------------------------------------------------- end to end
#: A hard KL limit no run stays under: an alarm at the first judged step (warmup + 1).
FORCE = ["guard.kl_max=1e-4", "guard.warmup=6", "runtime.lag.k=3", "method=seq_tis"]


def test_warn_writes_guard_jsonl_only_on_alarm(tiny_overrides: list[str], tmp_path: Path) -> None:
    quiet = tmp_path / "quiet"
    assert main([*tiny_overrides, "steps=12", "runtime.lag.k=3", "method=seq_tis", f"out_dir={quiet}"]) == 0
    records = read_metrics(quiet / "metrics.jsonl")[:-1]
    assert not (quiet / GUARD_FILE).exists() and all(r["guard/alarm"] == 0 for r in records)
    loud = tmp_path / "loud"
    assert main([*tiny_overrides, "steps=12", *FORCE, f"out_dir={loud}"]) == 0
    records = read_metrics(loud / "metrics.jsonl")
    alarms = read_alarms(loud)
    assert alarms and alarms[0]["step"] == 6 and alarms[0]["action"] == "warn"
    assert "mismatch KL" in alarms[0]["reason"] and alarms[0]["kl"] > 1e-4
    assert [r["step"] for r in records if r.get("guard/alarm")] == [a["step"] for a in alarms]
    assert len(records) == 13 and all(r.get("guard/rollbacks", 0) == 0 for r in records)  # warn changes nothing


def test_stop_ends_the_run_with_a_loadable_checkpoint(tiny_overrides: list[str], tmp_path: Path, capsys) -> None:
    out = tmp_path / "stop"
    cfg = load_config(TrainConfig, overrides=[*tiny_overrides, "steps=20", *FORCE, "guard.mode=stop", f"out_dir={out}"])
    result = train(cfg, make_source=lag_source)
    assert result.steps_done == 7 and not result.interrupted and "mismatch KL" in (result.guard_stop or "")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8)) and "eval/acc" in records[-1]  # the final eval ran
    loaded = ckpt.load_latest(out)
    assert loaded is not None and loaded.state["step"] == 7 and loaded.state["guard"]["rollbacks"] == 0
    assert read_alarms(out)[0]["action"] == "stop"
    assert "stopped by the collapse guard: alarm at step 6" in capsys.readouterr().out


class _Recorder:
    """A lag source that keeps a copy of the weights it is restarted from."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.restarts: list[tuple[int, int, dict[str, torch.Tensor]]] = []

    def restart(self, *, step: int, version: int, model: torch.nn.Module) -> None:
        self.restarts.append((step, version, copy_state(model.state_dict(), device=torch.device("cpu"))))
        self.inner.restart(step=step, version=version, model=model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_rollback_restores_healthy_weights_tightens_and_continues(tiny_overrides: list[str], tmp_path: Path) -> None:
    out = tmp_path / "rollback"
    overrides = [*tiny_overrides, *FORCE, "guard.mode=rollback", "guard.snapshot_every=3", "checkpoint.every=3",
                 "checkpoint.keep=100", "guard.max_rollbacks=1"]  # fmt: skip
    cfg = load_config(TrainConfig, overrides=[*overrides, "steps=14", f"out_dir={out}"])
    sources: list[_Recorder] = []

    def factory(cfg: TrainConfig, **kw: Any) -> Any:
        sources.append(_Recorder(lag_source(cfg, **kw)))
        return sources[0]

    result = train(cfg, make_source=factory)
    alarm = read_alarms(out)[0]
    # snapshots at 3 and 6; the one at 3 was confirmed by 3 clean steps at 6, so the alarm at 6 restores step 3
    assert (alarm["step"], alarm["action"], alarm["restored_step"], alarm["version"]) == (6, "rollback", 3, 3)
    step, version, weights = sources[0].restarts[0]
    assert (step, version) == (7, 3)
    healthy = ckpt.load_checkpoint(ckpt.checkpoint_path(out, 3))["model"]
    assert all(torch.equal(weights[k], healthy[k]) for k in healthy)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(15)) and result.steps_done == 14
    after = records[7]
    assert after["guard/rollbacks"] == 1 and after["lr"] == pytest.approx(cfg.lr / 2) and after["version"] == 3
    assert after["lag/mean"] == 0 and after["sample/version"] == 3  # the sampler restarted from the healthy weights
    assert alarm["seq_tis.cap"] == 4.0

    # resumed from the last checkpoint (after the rollback): the tightened lr stays
    assert main([*overrides, "steps=17", f"out_dir={out}", "resume=true"]) == 0
    resumed = read_metrics(out / "metrics.jsonl")[14:17]
    assert [r["step"] for r in resumed] == [14, 15, 16]
    assert all(r["guard/rollbacks"] == 1 and r["lr"] == pytest.approx(cfg.lr / 2) for r in resumed)
