"""The collapse guard: watch a run for the signature that precedes an off-policy collapse; warn, stop or roll back.

The papers show the same sequence before a run on stale rollouts collapses: the effective sample size of the
importance weights falls, then the mismatch KL and the gradient norm spike (VCPO, arXiv 2602.17616, Fig. 2, 7, 8);
GAC (arXiv 2603.01501) adds persistently high cosine between consecutive gradients. They show curves, not a
detector: the rule below and its defaults are ours [reconstructed], calibrated on the testbed's traces (README,
"Collapse guard").

Signals (keys of the learner step's record; a missing key is ignored):
``is/ess_ratio`` (ESS/B), ``kl/k3`` (KL(μ‖π_prox), k3 per token), ``grad/norm`` (‖g‖ before clipping),
``grad/cos_prev`` (cos(g_t, g_{t−1})).

Rule, at every learner step t after ``warmup`` steps, for each signal x:

1. r_x = median of x over the last ``smooth`` steps (one-step outliers — a single huge weight — do not count);
   b_x = median of x over the last ``window`` *clean* steps (the healthy baseline; warm-up steps are clean).
2. The step is **suspicious** when the ESS ratio has fallen, r_ess < ``ess_drop``·b_ess or r_ess < ``ess_floor``,
   AND something spikes: r_kl > max(``kl_factor``·b_kl, ``kl_min``), or r_grad > ``grad_factor``·b_grad, or
   (if ``cos_max`` is set) r_cos > ``cos_max``. Without the ESS key the first condition is dropped.
3. **Alarm** after ``patience`` consecutive suspicious steps, or at once on a hard limit: r_kl > ``kl_max``, or a
   non-finite signal. After an alarm the guard re-arms once ``patience`` consecutive steps are not suspicious.
4. Only steps that are neither suspicious nor over a hard limit enter the baselines, so a collapse cannot teach the
   guard that it is normal. A rollback empties the smoothing windows: the next ``smooth`` − 1 steps are not judged.

On alarm the guard does what ``mode`` says: ``warn`` (a line on the terminal and in ``<out_dir>/guard.jsonl``),
``stop`` (checkpoint, final eval, end), or ``rollback``: restore the weights, optimizer, version and controller
state of the last healthy snapshot, multiply the lr by ``lr_factor`` and every truncation cap (token/sequence TIS,
prefix-ratio cap) by ``cap_factor`` (never below 1), restart the sampler from the restored weights, and go on; after
``max_rollbacks`` rollbacks the next alarm stops the run. A snapshot (CPU copies of model and learner) taken every
``snapshot_every`` steps becomes the rollback target once ``snapshot_every`` further steps passed without a
suspicious one; the run's starting state is the first target (memory: two CPU copies of weights and optimizer).
The tightening and the detector's state are part of the checkpoint, so a resumed run keeps them; the snapshots are
not (a resumed run's starting state is its first target unless it resumed in the middle of a suspicious streak).

Metrics added to every step's record (unless ``mode=off``): ``guard/suspicious`` and ``guard/alarm`` (0/1),
``guard/rollbacks`` (count so far). Each alarm is one line of ``guard.jsonl``: step, action, reason, the smoothed
signals and their baselines, and for a rollback the restored step and version and the new lr and caps.

:class:`CollapseDetector` is the pure rule (records in, decisions out); :class:`CollapseGuard` acts on a run.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import torch
from torch import nn

from steadyrl.config.guard import GuardConfig
from steadyrl.methods.spec import MethodSpec, PrefixRatio, SeqTIS, TokenTIS

if TYPE_CHECKING:
    from steadyrl.train.learner import Learner

GUARD_FILE = "guard.jsonl"
#: The watched signals: short name → record key.
SIGNALS: dict[str, str] = {"ess": "is/ess_ratio", "kl": "kl/k3", "grad": "grad/norm", "cos": "grad/cos_prev"}


class GuardDecision(NamedTuple):
    """What the detector concluded about one step."""

    alarm: bool
    suspicious: bool
    reason: str
    """Why the step is suspicious or alarming ('' when neither)."""
    values: dict[str, float]
    """Smoothed current value (``<name>``) and baseline (``<name>_base``) of each judged signal."""


def _median(values: Any) -> float:
    return float(statistics.median(values))


class CollapseDetector:
    """The pure rule of the module docstring: feed it every learner step's record, get a :class:`GuardDecision`."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.seen = 0
        self.streak = 0
        self.clean_streak = 0
        self.armed = True
        self.recent: dict[str, deque[float]] = {n: deque(maxlen=cfg.smooth) for n in SIGNALS}
        self.base: dict[str, deque[float]] = {n: deque(maxlen=cfg.window) for n in SIGNALS}

    def observe(self, record: Mapping[str, Any]) -> GuardDecision:
        """Judge the step whose record this is (call once per learner step, in order)."""
        cfg = self.cfg
        now = {n: float(record[k]) for n, k in SIGNALS.items() if record.get(k) is not None}
        bad = sorted(SIGNALS[n] for n, v in now.items() if not math.isfinite(v))
        for name, value in now.items():
            if math.isfinite(value):
                self.recent[name].append(value)
        self.seen += 1
        if self.seen <= cfg.warmup:
            self._learn(now)
            return GuardDecision(False, False, "", {})
        r = {n: _median(q) for n, q in self.recent.items() if n in now and len(q) == q.maxlen}
        b = {n: _median(q) for n, q in self.base.items() if q}
        values = {n: r[n] for n in r} | {f"{n}_base": b[n] for n in r if n in b}
        hard = ""
        if bad:
            hard = f"non-finite {', '.join(bad)}"
        elif cfg.kl_max is not None and r.get("kl", 0.0) > cfg.kl_max:
            hard = f"mismatch KL {r['kl']:.3g} > limit {cfg.kl_max:g}"
        if not r and not hard:  # no full smoothing window (refilling after a rollback): not judged, not learned
            return GuardDecision(False, False, "", {})
        reason = self._suspicion(r, b)
        suspicious = bool(reason) or bool(hard)
        self.streak = self.streak + 1 if suspicious else 0
        self.clean_streak = 0 if suspicious else self.clean_streak + 1
        if not suspicious:
            self._learn(now)
            if self.clean_streak >= cfg.patience:
                self.armed = True
        alarm = self.armed and (bool(hard) or self.streak >= cfg.patience)
        if alarm:
            self.armed = False
            self.streak = 0
        why = hard or (f"{reason} for {cfg.patience} steps" if alarm else reason)
        return GuardDecision(alarm, suspicious, why, values)

    def _suspicion(self, r: Mapping[str, float], b: Mapping[str, float]) -> str:
        """The reason the smoothed values make this step suspicious, or ''."""
        cfg = self.cfg
        fallen = ""
        if "ess" in r:
            if r["ess"] < cfg.ess_floor:
                fallen = f"ESS ratio {r['ess']:.3g} < floor {cfg.ess_floor:g}"
            elif "ess" in b and r["ess"] < cfg.ess_drop * b["ess"]:
                fallen = f"ESS ratio {r['ess']:.3g} < {cfg.ess_drop:g} x healthy {b['ess']:.3g}"
            else:
                return ""
        spikes = []
        if "kl" in r and "kl" in b and r["kl"] > max(cfg.kl_factor * b["kl"], cfg.kl_min):
            spikes.append(f"mismatch KL {r['kl']:.3g} > {cfg.kl_factor:g} x healthy {b['kl']:.3g}")
        if "grad" in r and "grad" in b and r["grad"] > cfg.grad_factor * b["grad"]:
            spikes.append(f"grad norm {r['grad']:.3g} > {cfg.grad_factor:g} x healthy {b['grad']:.3g}")
        if cfg.cos_max is not None and "cos" in r and r["cos"] > cfg.cos_max:
            spikes.append(f"grad cosine {r['cos']:.3g} > {cfg.cos_max:g}")
        if not spikes:
            return ""
        return " and ".join(([fallen] if fallen else []) + spikes)

    def _learn(self, now: Mapping[str, float]) -> None:
        for name, value in now.items():
            if math.isfinite(value):
                self.base[name].append(value)

    def forget_recent(self) -> None:
        """Drop the smoothing windows and the streak (after a rollback: those values came from diverged weights)."""
        for q in self.recent.values():
            q.clear()
        self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        """Counters, smoothing windows and baselines (plain Python values)."""
        return {
            "seen": self.seen,
            "streak": self.streak,
            "clean_streak": self.clean_streak,
            "armed": self.armed,
            "recent": {n: list(q) for n, q in self.recent.items()},
            "base": {n: list(q) for n, q in self.base.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.seen, self.streak = int(state["seen"]), int(state["streak"])
        self.clean_streak, self.armed = int(state["clean_streak"]), bool(state["armed"])
        for name in SIGNALS:
            self.recent[name] = deque(state["recent"].get(name, []), maxlen=self.cfg.smooth)
            self.base[name] = deque(state["base"].get(name, []), maxlen=self.cfg.window)


# ------------------------------------------------------------------------------------------------- tightening
def tighten_method(method: MethodSpec, factor: float) -> MethodSpec:
    """``method`` with every truncation cap (token/sequence TIS, prefix ratio) times ``factor``, never below 1.

    A cap already below 1 is left as it is (tightening never loosens).
    """

    def cap(c: float) -> float:
        return max(min(c, 1.0), c * factor)

    corrections = tuple(
        c.model_copy(update={"cap": cap(c.cap)})
        if isinstance(c, (SeqTIS, TokenTIS)) or (isinstance(c, PrefixRatio) and c.cap is not None)
        else c
        for c in method.corrections
    )
    return method.model_copy(update={"corrections": corrections})


def caps(method: MethodSpec) -> dict[str, float]:
    """The truncation caps of ``method`` by correction type."""
    return {c.type: c.cap for c in method.corrections if isinstance(c, (SeqTIS, TokenTIS, PrefixRatio)) and c.cap}


# ------------------------------------------------------------------------------------------------ the plumbing
class Restartable(Protocol):
    """The rollout source's hook a rollback needs (``steadyrl.runtime.lag.LagSampler.restart``)."""

    def restart(self, *, step: int, version: int, model: nn.Module) -> None: ...


def _cpu_clone(x: Any) -> Any:
    """A deep copy of nested dicts/lists/tuples with every tensor cloned to CPU (optimizer states alias live ones)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, Mapping):
        return {k: _cpu_clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu_clone(v) for v in x)
    return x


class _Snapshot(NamedTuple):
    step: int
    model: dict[str, Any]
    learner: dict[str, Any]


class GuardAction(NamedTuple):
    """What the guard did after a step: ``none``, ``warn``, ``stop`` or ``rollback``, and why."""

    kind: Literal["none", "warn", "stop", "rollback"]
    reason: str


class CollapseGuard:
    """The detector wired to a run: metrics, ``guard.jsonl``, snapshots, rollback and tightening.

    The loop calls :meth:`start` once (fresh or resumed), then :meth:`after_step` with every learner step's record
    (it adds ``guard/*`` metrics to it), and puts :meth:`state_dict` into its checkpoints.
    """

    def __init__(
        self,
        cfg: GuardConfig,
        *,
        out_dir: Path,
        model: nn.Module,
        learner: Learner,
        base_lr: float,
        say: Callable[[str], None] = print,
    ) -> None:
        self.cfg = cfg
        self.detector = CollapseDetector(cfg)
        self.path = Path(out_dir) / GUARD_FILE
        self.model, self.learner = model, learner
        self.base_lr = base_lr
        self.base_method = learner.method
        self.say = say
        self.rollbacks = 0
        self._target: _Snapshot | None = None
        self._candidate: _Snapshot | None = None

    @property
    def enabled(self) -> bool:
        """False for ``mode=off``."""
        return self.cfg.mode != "off"

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Rollbacks so far (the tightening follows from them) and the detector's state."""
        return {"rollbacks": self.rollbacks, "detector": self.detector.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` and re-apply the tightening of the rollbacks it records to the learner."""
        self.rollbacks = int(state["rollbacks"])
        self.detector.load_state_dict(state["detector"])
        self._apply_tightening()

    def _apply_tightening(self) -> None:
        self.learner.lr = self.base_lr * self.cfg.lr_factor**self.rollbacks
        method = self.base_method
        for _ in range(self.rollbacks):
            method = tighten_method(method, self.cfg.cap_factor)
        self.learner.method = method

    # -------------------------------------------------------------------------------------------- the steps
    def start(self, step: int) -> None:
        """Call before the first step of this process (``step`` = 0 or the resumed step)."""
        if not self.enabled:
            return
        self._truncate_log(step)
        if self.cfg.mode == "rollback" and self.detector.streak == 0:
            self._target = self._snapshot(step)

    def after_step(self, step: int, record: dict[str, Any], *, source: Any) -> GuardAction:
        """Judge learner step ``step`` (its record gets ``guard/*`` metrics) and act on an alarm."""
        if not self.enabled:
            return GuardAction("none", "")
        decision = self.detector.observe(record)
        action = GuardAction("none", decision.reason)
        if decision.alarm:
            action = self._act(step, decision, source)
        elif self.cfg.mode == "rollback":
            self._refresh_snapshots(step + 1, clean=not decision.suspicious)
        record["guard/suspicious"] = float(decision.suspicious)
        record["guard/alarm"] = float(decision.alarm)
        record["guard/rollbacks"] = float(self.rollbacks)
        return action

    def _act(self, step: int, decision: GuardDecision, source: Any) -> GuardAction:
        mode, extra = self.cfg.mode, {}
        reason = decision.reason
        if mode == "rollback" and self.rollbacks >= self.cfg.max_rollbacks:
            mode, reason = "stop", f"{reason}; max_rollbacks={self.cfg.max_rollbacks} reached"
        elif mode == "rollback" and self._target is None:
            mode, reason = "stop", f"{reason}; no healthy snapshot to roll back to"
        if mode == "rollback":
            extra = self._rollback(step, source)
        entry = {"step": step, "action": mode, "reason": reason, "rollbacks": self.rollbacks}
        entry |= decision.values | extra
        self._log(entry)
        shown = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
        self.say(f"[steadyrl guard] step {step}: collapse alarm ({mode}): {reason}" + (f"; {shown}" if shown else ""))
        return GuardAction(mode, reason)

    def _rollback(self, step: int, source: Restartable) -> dict[str, Any]:
        assert self._target is not None
        target = self._target
        old_lr, old_caps = self.learner.lr, caps(self.learner.method)
        self.model.load_state_dict(target.model)
        self.learner.load_state_dict(_cpu_clone(target.learner))  # a fresh copy: the optimizer aliases what it loads
        self.rollbacks += 1
        self._apply_tightening()
        source.restart(step=step + 1, version=self.learner.version, model=self.model)
        self.detector.forget_recent()
        self._candidate = None
        new_caps = caps(self.learner.method)
        extra: dict[str, Any] = {"restored_step": target.step, "version": self.learner.version, "lr": self.learner.lr}
        extra |= {f"{k}.cap": v for k, v in new_caps.items() if old_caps.get(k) != v}
        extra["lr_before"] = old_lr
        return extra

    def _snapshot(self, step: int) -> _Snapshot:
        return _Snapshot(step, _cpu_clone(self.model.state_dict()), _cpu_clone(self.learner.state_dict()))

    def _refresh_snapshots(self, steps_done: int, *, clean: bool) -> None:
        """Promote the candidate once ``snapshot_every`` clean steps followed it; take a new one every period."""
        if not clean:
            self._candidate = None
        if steps_done % self.cfg.snapshot_every:
            return
        if self._candidate is not None:
            self._target = self._candidate
        self._candidate = self._snapshot(steps_done)

    # ------------------------------------------------------------------------------------------------- log
    def _log(self, entry: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plain = {k: float(f"{v:.6g}") if isinstance(v, float) and math.isfinite(v) else v for k, v in entry.items()}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(plain, sort_keys=True) + "\n")

    def _truncate_log(self, step: int) -> None:
        """On resume, drop alarms of steps at or after ``step`` (the resumed run will judge them again)."""
        if not self.path.is_file():
            return
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in lines if int(json.loads(ln)["step"]) < step]
        if len(keep) != len(lines):
            self.path.write_text("".join(ln + "\n" for ln in keep))


def read_alarms(out_dir: str | Path) -> list[dict[str, Any]]:
    """The alarms a run logged in ``<out_dir>/guard.jsonl`` (empty if none)."""
    path = Path(out_dir) / GUARD_FILE
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
