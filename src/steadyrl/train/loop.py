"""The driver of ``steadyrl train``: batches from a rollout source, the learner step, eval, metrics, checkpoints.

For learner step t = 0 … steps − 1:

1. evaluate the current weights when t is an eval step (t = 0 is the base model's accuracy);
2. take ``prompts_per_step`` train problems (a seeded order over a fixed pool, reshuffled every epoch);
3. ask the rollout source for ``group_size`` responses per prompt — the source decides which weights sample them
   (``steadyrl.runtime.lag``: those of step t − k); score them with the task's verifier;
4. run the learner step, write one line of metrics, hand the new weights to the source;
5. checkpoint every ``checkpoint.every`` steps.

After the last step: a final evaluation (the line ``step = steps``), a checkpoint, the plot and a summary. Ctrl-C
asks the run to stop after the current step: it then checkpoints, plots and returns (a second Ctrl-C aborts at once).

The collapse guard (:mod:`steadyrl.train.collapse_guard`, ``guard.mode``) judges every step's record before it is
written (adding ``guard/*`` metrics); on alarm it warns, stops the run after that step (checkpoint, final eval,
summary with its reason), or rolls back to its last healthy snapshot and restarts the rollout source from it.

This module does not know which runtime produces the batches: :func:`train` takes a factory for any object with the
:class:`RolloutSource` methods (``steadyrl.train.entry`` passes the lag runtime's).
"""

from __future__ import annotations

import contextlib
import copy
import random
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import yaml
from torch import nn
from tqdm.auto import tqdm

from steadyrl.base.device import PARAM_DTYPES, Placement
from steadyrl.base.seeding import generator
from steadyrl.config.io import flatten
from steadyrl.config.renamed import move_renamed
from steadyrl.config.train import TrainConfig
from steadyrl.control import build_controllers
from steadyrl.models import load_policy
from steadyrl.rollout.scored import ScoredRollouts
from steadyrl.rollout.tool_metrics import tool_metrics_from_rollouts
from steadyrl.tasks import Problem, Task, build_task
from steadyrl.tools import SandboxPool
from steadyrl.train import checkpoint as ckpt
from steadyrl.train.collapse_guard import GUARD_FILE, CollapseGuard
from steadyrl.train.evaluate import EvalResult, evaluate
from steadyrl.train.learner import Learner
from steadyrl.train.ledger import IDLE_CLIP_KL, BatchLedger, IdleClipAlarm
from steadyrl.train.log_sinks import TRACKER_FILES, open_trackers, require_trackers
from steadyrl.train.metric_names import framework_names
from steadyrl.train.metrics import METRICS_FILE, TB_DIR, TIMINGS_FILE, MetricsOffsets, MetricsWriter, read_metrics
from steadyrl.train.plot import PLOT_FILE, write_plot

CONFIG_FILE = "config.yaml"
#: Files and directories a run writes in out_dir (what a fresh start replaces; nothing else there is touched).
RUN_FILES = (METRICS_FILE, TIMINGS_FILE, CONFIG_FILE, PLOT_FILE, TB_DIR, GUARD_FILE, ckpt.CHECKPOINT_DIR,
             *TRACKER_FILES)  # fmt: skip
#: Their presence means out_dir holds a run that a fresh start would destroy (so it needs ``overwrite=true``).
PROTECTED_FILES = (METRICS_FILE, ckpt.CHECKPOINT_DIR)
#: Config keys a resumed run may change (the others must match the checkpoint's, or the continuation is not exact).
RESUMABLE_KEYS = ("steps", "resume", "overwrite", "log", "checkpoint", "eval", "runtime.threads")


class RolloutSource(Protocol):
    """Where the learner's batches come from (a runtime: :mod:`steadyrl.runtime`)."""

    def publish(self, *, step: int, version: int, model: nn.Module) -> None:
        """The learner's weights at the start of ``step`` (called for step 0 and after every step)."""
        ...

    def next_batch(self, *, step: int) -> ScoredRollouts:
        """The scored batch of learner step ``step``: whole groups, group i's rows at i·G … i·G+G−1."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...

    def restart(self, *, step: int, version: int, model: nn.Module) -> None:
        """Discard the in-flight weights: from ``step`` on, sample with ``model`` until newer weights are published
        (the collapse guard's rollback)."""
        ...

    def close(self) -> None:
        """Release processes and files (called once, also after an error)."""
        ...


class SourceFactory(Protocol):
    """Builds the rollout source of a run once the policy, the task and its train problems are loaded."""

    def __call__(
        self, cfg: TrainConfig, *, model: nn.Module, tokenizer: Any, task: Task, train_pool: list[Problem],
        record_entropy: bool,
    ) -> RolloutSource:  # fmt: skip
        ...


class RunDirError(ValueError):
    """out_dir already holds a run and neither ``resume`` nor ``overwrite`` was asked for (or resume is impossible)."""


class Summary(NamedTuple):
    """What a run achieved, read back from its metrics.jsonl."""

    steps: int
    base_acc: float | None
    final_acc: float | None
    best_acc: float | None
    min_ess_ratio: float | None
    max_kl_k3: float | None
    skipped: int
    alarms: int = 0
    """Collapse-guard alarms (``guard/alarm``)."""
    rollbacks: int = 0
    """Collapse-guard rollbacks (the last ``guard/rollbacks``)."""

    def format(self, *, cfg: TrainConfig, out_dir: Path, seconds: float | None, guard_stop: str | None = None) -> str:
        """A few lines for the terminal (``guard_stop``: why the collapse guard ended the run, if it did)."""

        def f(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"

        kind = "greedy" if cfg.rollout.eval.greedy else f"sampled, T={cfg.rollout.eval.temperature:g}"
        took = f" in {seconds:.0f} s" if seconds is not None else ""
        return "\n".join(
            [
                f"steadyrl train: {self.steps} steps of {cfg.method.name} {_staleness(cfg)} on {cfg.task.name}{took}",
                f"  eval/acc ({kind}, {cfg.eval.n} problems): base {f(self.base_acc)} -> final {f(self.final_acc)}"
                f" (best {f(self.best_acc)})",
                f"  min is/ess_ratio {f(self.min_ess_ratio)}, max kl/k3 {f(self.max_kl_k3)}, "
                f"skipped steps {self.skipped}",
                *(
                    [f"  collapse guard: {self.alarms} alarm(s), {self.rollbacks} rollback(s): {out_dir / GUARD_FILE}"]
                    if self.alarms
                    else []
                ),
                *([f"  stopped by the collapse guard: {guard_stop}"] if guard_stop else []),
                f"  metrics: {out_dir / METRICS_FILE}",
                *([f"  plot:    {out_dir / PLOT_FILE}"] if cfg.log.plot else []),
                f"  config:  {out_dir / CONFIG_FILE}",
            ]
        )


def is_stale(cfg: TrainConfig) -> bool:
    """Whether the run's sampler can lag its learner (False: lag 0 on the pipeline schedule, periodic refresh every
    step, or a synchronous concurrent runtime)."""
    rt = cfg.runtime
    if rt.mode == "lag":
        return rt.lag.k > 0 if rt.lag.schedule == "pipeline" else rt.lag.refresh_every > 1
    return not rt.concurrent.sync


def _staleness(cfg: TrainConfig) -> str:
    """How the run's staleness arises, in a few words."""
    rt = cfg.runtime
    if rt.mode == "lag":
        lag = rt.lag
        return f"at lag {lag.k}" if lag.schedule == "pipeline" else f"refreshed every {lag.refresh_every} steps"
    if rt.concurrent.sync:
        return f"synchronous in runtime {rt.mode}"
    bound = f" s={cfg.pool.max_staleness}" if cfg.pool.policy in ("max_staleness", "drop") else ""
    return f"in runtime {rt.mode} (pool {cfg.pool.policy}{bound})"


class RunResult(NamedTuple):
    """The outcome of :func:`train`."""

    out_dir: Path
    steps_done: int
    interrupted: bool
    summary: Summary
    guard_stop: str | None = None
    """Why the collapse guard stopped the run (None: it did not)."""


def summarize(records: Sequence[Mapping[str, Any]]) -> Summary:
    """Base/final/best accuracy, min ESS ratio, max k3 KL and skipped steps of a run's records."""

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in records if r.get(key) is not None]

    accs = [(int(r["step"]), float(r["eval/acc"])) for r in records if r.get("eval/acc") is not None]
    ess, kl = values("is/ess_ratio"), values("kl/k3")
    base = next((a for s, a in accs if s == 0), None)
    return Summary(
        steps=sum(1 for r in records if "loss" in r or "reward/mean" in r),
        base_acc=base,
        final_acc=accs[-1][1] if accs else None,
        best_acc=max(a for _, a in accs) if accs else None,
        min_ess_ratio=min(ess) if ess else None,
        max_kl_k3=max(kl) if kl else None,
        skipped=int(sum(values("train/skipped"))),
        alarms=int(sum(values("guard/alarm"))),
        rollbacks=int(max(values("guard/rollbacks"), default=0)),
    )


class StopFlag:
    """Set by the first Ctrl-C (the run stops after the current step); a second Ctrl-C raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def request(self) -> None:
        """Ask the run to stop at the next step boundary."""
        self.requested = True

    def _handler(self, signum: int, frame: Any) -> None:
        self.request()
        signal.signal(signal.SIGINT, self._previous)
        tqdm.write("[steadyrl train] Ctrl-C: stopping after this step (checkpoint + plot); Ctrl-C again to abort now")

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _say(message: str) -> None:
    tqdm.write(message)


def _config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Keys that differ between a checkpoint's config and this run's: the checkpoint's in the current key names (one
    written before a key moved resumes), ``model.dtype`` compared as the dtype each loads the model in."""
    a = flatten(move_renamed(dict(old), warn=False), opaque=("options",))
    b = flatten(new, opaque=("options",))
    for flat in (a, b):
        if flat.get("model.dtype") is None and flat.get("precision") in PARAM_DTYPES:
            flat["model.dtype"] = PARAM_DTYPES[flat["precision"]]
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [k for k in changed if not any(k == r or k.startswith(r + ".") for r in RESUMABLE_KEYS)]


def _prepare_out_dir(cfg: TrainConfig) -> ckpt.LoadedCheckpoint | None:
    out = Path(cfg.out_dir)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    protected = [name for name in PROTECTED_FILES if name in existing]
    loaded = None
    if cfg.resume:
        loaded = ckpt.load_latest(out, warn=_say)
        if loaded is None and protected:
            _say(f"[steadyrl train] resume: no loadable checkpoint in {out}; starting from step 0")
    elif protected and not cfg.overwrite:
        raise RunDirError(
            f"out_dir {str(out)!r} already holds a run ({', '.join(protected)}); pass resume=true to continue it, "
            "overwrite=true to replace it, or choose another out_dir"
        )
    if loaded is None:
        for name in existing:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    else:
        changes = _config_changes(loaded.state["config"], cfg.model_dump(mode="json"))
        if changes:
            raise RunDirError(
                f"cannot resume {str(out)!r} with a different config: {', '.join(changes)} differ from the "
                f"checkpoint's (only {', '.join(RESUMABLE_KEYS)} may change); use another out_dir or overwrite=true"
            )
        if int(loaded.state["step"]) > cfg.steps:
            raise RunDirError(f"cannot resume: the checkpoint is at step {loaded.state['step']} > steps={cfg.steps}")
    out.mkdir(parents=True, exist_ok=True)
    return loaded


def _write_config(cfg: TrainConfig) -> None:
    path = Path(cfg.out_dir) / CONFIG_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    tmp.replace(path)


class ContextLengthError(ValueError):
    """The longest prompt plus the response budget exceeds the model's positions (raised before step 0)."""


def check_context_length(cfg: TrainConfig, *, model: nn.Module, tokenizer: Any, problems: Sequence[Problem]) -> None:
    """Refuse a run whose longest prompt + response budget exceeds ``model.config.max_position_embeddings``.

    The budget is ``rollout.max_new_tokens`` (``tools.max_total_tokens`` with tools on). Past its positions a
    model with learned position embeddings fails mid-run and a RoPE model is scored where it was never trained;
    either way the fix is in the config, so it is named before anything is sampled.
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int) or not problems:
        return
    budget = cfg.tools.max_total_tokens if cfg.tools.enabled else cfg.rollout.max_new_tokens
    lengths = [len(ids) for ids in tokenizer([p.prompt for p in problems])["input_ids"]]
    longest = max(lengths)
    if longest + budget > limit:
        key = "tools.max_total_tokens" if cfg.tools.enabled else "rollout.max_new_tokens"
        raise ContextLengthError(
            f"the longest prompt ({longest} tokens, of {len(problems)} train and eval problems) plus {key}={budget} "
            f"exceeds the model's max_position_embeddings ({limit}): lower {key} to at most {limit - longest}, "
            "choose shorter problems (task.*), or a model with a longer context"
        )


class _Run:
    """The state of one run (built once, then stepped)."""

    def __init__(self, cfg: TrainConfig, make_source: SourceFactory, placement: Placement) -> None:
        self.cfg = cfg
        # The default model is warm-started on the task (built first); chat prompts need the policy's tokenizer (built
        # after it; TrainConfig refuses task.chat with the default model).
        task = None if getattr(cfg.task, "chat", False) else build_task(cfg.task)
        # loaded in the precision's parameter dtype (one setting: TrainConfig refuses a model.dtype that differs)
        source = cfg.model.model_copy(update={"dtype": PARAM_DTYPES[cfg.precision]})
        policy = load_policy(source, task, seed=cfg.seed, progress=cfg.log.progress)
        self.placement = placement
        self.model, self.tokenizer = self.placement.place(policy.model), policy.tokenizer
        self.task: Task = task if task is not None else build_task(cfg.task, tokenizer=self.tokenizer)
        self.method = cfg.method.resolve()
        needs_ref = self.method.kl.type != "none"
        ref = copy.deepcopy(self.model).eval().requires_grad_(False) if needs_ref else None
        self.learner = Learner(
            model=self.model,
            method=self.method,
            controllers=build_controllers(self.method),
            lr=cfg.lr,
            optim=cfg.optim,
            temperature=cfg.rollout.temperature,
            ref_model=ref,
            log=_say,
            critic=cfg.critic,
            placement=self.placement,
            proximal=cfg.proximal.name,
            proximal_beta=cfg.proximal.beta,
            rac=cfg.rac,
        )
        record_entropy = any(c.type == "estr" for c in self.method.corrections)
        self.pool: list[Problem] = self.task.problems("train", cfg.data.train_pool, seed=cfg.seed)
        self.eval_set: list[Problem] = self.task.problems("eval", cfg.eval.n, seed=cfg.seed)
        check_context_length(cfg, model=self.model, tokenizer=self.tokenizer, problems=[*self.pool, *self.eval_set])
        self.source = make_source(
            cfg, model=self.model, tokenizer=self.tokenizer, task=self.task, train_pool=self.pool,
            record_entropy=record_entropy,
        )  # fmt: skip
        self.guard = CollapseGuard(
            cfg.guard, out_dir=Path(cfg.out_dir), model=self.model, learner=self.learner, base_lr=cfg.lr, say=_say
        )
        self.ledger = BatchLedger()
        self.idle_clip = IdleClipAlarm.for_method(self.method, stale=is_stale(cfg))
        self.idle_clip_said = False

    def state(self, *, step: int, offsets: MetricsOffsets) -> dict[str, Any]:
        return {
            "step": step,
            "model": self.model.state_dict(),
            "learner": self.learner.state_dict(),
            "source": self.source.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "metrics": offsets._asdict(),
            "config": self.cfg.model_dump(mode="json"),
            "guard": self.guard.state_dict(),
            "ledger": self.ledger.state_dict(),
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.learner.load_state_dict(state["learner"])
        self.source.load_state_dict(state["source"])
        if "guard" in state:  # after the learner: it re-applies the tightening of past rollbacks
            self.guard.load_state_dict(state["guard"])
        if "ledger" in state:
            self.ledger.load_state_dict(state["ledger"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(_as_tuple(state["rng"]["python"]))

    def evaluate(self) -> tuple[EvalResult, float]:
        t0 = time.perf_counter()
        tools = self.cfg.tools
        with contextlib.ExitStack() as stack:  # with tools: the multi-turn path, in a sandbox pool of its own
            stack.enter_context(self.placement.autocast())
            sandbox = stack.enter_context(SandboxPool(tools.sandbox)) if tools.enabled else None
            res = evaluate(
                model=self.model,
                tokenizer=self.tokenizer,
                task=self.task,
                problems=self.eval_set,
                cfg=self.cfg.eval,
                sampling=self.cfg.rollout.eval,
                max_new_tokens=self.cfg.rollout.max_new_tokens,
                generator=generator(self.cfg.seed, "eval", device=self.placement.device),
                version=self.learner.version,
                tools=None if sandbox is None else tools.tool_use(sandbox),
            )
        return res, time.perf_counter() - t0

    def eval_record(self) -> dict[str, float]:
        res, seconds = self.evaluate()
        return {"eval/acc": res.acc, "eval/len_mean": res.len_mean, "time/eval_s": seconds}

    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.eval.every
        return step == 0 or (every > 0 and step % every == 0)

    def step(self, t: int) -> dict[str, Any]:
        t_start = time.perf_counter()
        record: dict[str, Any] = {"step": t, "version": self.learner.version}
        if self.is_eval_step(t):
            record |= self.eval_record()
        t0 = time.perf_counter()
        batch = self.source.next_batch(step=t)
        rollouts, rewards = batch.rollouts, batch.rewards
        t1 = time.perf_counter()
        out = self.learner.step(
            rollouts, rewards, old_logp=getattr(batch, "old_logp", None), delayed=getattr(batch, "delayed", None)
        )
        t2 = time.perf_counter()
        lengths = rollouts.response_mask.sum(dim=-1).float()
        record |= out.metrics
        record |= batch.metrics
        record |= self.ledger.record(
            prompt_ids=rollouts.prompt_ids, prompt_mask=rollouts.prompt_mask, response_ids=rollouts.response_ids,
            response_mask=rollouts.response_mask, versions=rollouts.versions, learner_version=record["version"],
        )  # fmt: skip
        record["check/idle_clip"] = self.idle_clip(record)
        if record["check/idle_clip"] and not self.idle_clip_said:
            self.idle_clip_said = True
            _say(
                f"[steadyrl check] step {t}: idle clip: mismatch KL {record['kl/k3']:.3g} > {IDLE_CLIP_KL} nat/token "
                f"while the ratio to π_prox is 1 on every token; {self.method.name!r} has no correction against μ, "
                "so its clip does not bound the update (use a corrected method, e.g. seq_tis, or several updates)"
            )
        if self.cfg.tools.enabled and "tool/calls_mean" not in batch.metrics:  # a source without per-row tool counts
            record |= tool_metrics_from_rollouts(rollouts)
        record |= {
            "sample/version": int(rollouts.versions.max()),
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            "response/len_mean": float(lengths.mean()),
            "response/truncated": float(rollouts.truncated.float().mean()),
            "time/batch_s": t1 - t0,
            "time/learn_s": t2 - t1,
        }
        self.source.publish(step=t + 1, version=self.learner.version, model=self.model)
        record["time/step_s"] = time.perf_counter() - t_start
        return record


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _postfix(record: Mapping[str, Any], last_acc: float | None) -> dict[str, str]:
    out = {"reward": f"{record.get('reward/mean', float('nan')):.3f}"}
    if record.get("is/ess_ratio") is not None:
        out["ess"] = f"{record['is/ess_ratio']:.2f}"
    if last_acc is not None:
        out["acc"] = f"{last_acc:.3f}"
    return out


def train(cfg: TrainConfig, *, make_source: SourceFactory, stop: StopFlag | None = None) -> RunResult:
    """Run (or resume) the training job ``cfg`` describes; see the module docstring for the order of events."""
    # device and precision, decided once (steadyrl.base.device): the learner, the reference, the critic and the lag
    # runtime's sampler (a copy of the model) all follow it; its runtime settings hold for the whole run
    placement = Placement.from_names(cfg.device, cfg.precision)
    with placement.runtime(deterministic=cfg.runtime.deterministic):
        return _train(cfg, make_source=make_source, stop=stop, placement=placement)


def _train(cfg: TrainConfig, *, make_source: SourceFactory, stop: StopFlag | None, placement: Placement) -> RunResult:
    if cfg.runtime.threads > 0:
        torch.set_num_threads(cfg.runtime.threads)
    wall0 = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    # a missing package fails before anything is done
    require_trackers(wandb=cfg.log.wandb.enabled, mlflow=cfg.log.mlflow.enabled)
    loaded = _prepare_out_dir(cfg)
    run = _Run(cfg, make_source, placement)
    _write_config(cfg)
    start, offsets = 0, None
    if loaded is not None:
        run.restore(loaded.state)
        start = int(loaded.state["step"])
        offsets = MetricsOffsets(**loaded.state["metrics"])
        _say(f"[steadyrl train] resumed from {loaded.path} (step {start})")
    else:
        run.source.publish(step=0, version=0, model=run.model)
    run.guard.start(start)
    writer = MetricsWriter(
        out_dir,
        separate_timings=cfg.log.timings == "separate",
        tensorboard=cfg.log.tensorboard,
        start=offsets,
        start_step=start,
        trackers=open_trackers(cfg.log, out_dir, config=cfg.model_dump(mode="json"), resume=loaded is not None),
    )
    stop = stop or StopFlag()
    interrupted = False
    guard_stop: str | None = None
    t = start
    try:
        with (
            stop,
            tqdm(
                total=cfg.steps,
                initial=start,
                disable=not cfg.log.progress,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            ) as bar,
        ):
            last_acc = None
            while t < cfg.steps:
                if stop.requested:
                    interrupted = True
                    break
                record = run.step(t)
                action = run.guard.after_step(t, record, source=run.source)
                writer.write(framework_names(record, cfg.log.metric_names))
                last_acc = record.get("eval/acc", last_acc)
                bar.set_postfix(_postfix(record, last_acc), refresh=False)
                bar.update(1)
                t += 1
                if action.kind == "stop":
                    guard_stop = f"alarm at step {t - 1}: {action.reason}"
                    break
                if cfg.checkpoint.every and t % cfg.checkpoint.every == 0 and t < cfg.steps:
                    writer.sync()
                    ckpt.save_checkpoint(out_dir, run.state(step=t, offsets=writer.offsets()), keep=cfg.checkpoint.keep)
        writer.sync()
        ckpt.save_checkpoint(out_dir, run.state(step=t, offsets=writer.offsets()), keep=cfg.checkpoint.keep)
        if interrupted:
            _say(f"[steadyrl train] stopped at step {t}; continue with: steadyrl train ... resume=true")
        else:
            if guard_stop:
                _say(f"[steadyrl train] the collapse guard stopped the run at step {t} ({guard_stop}); final eval")
            final = {"step": t, "version": run.learner.version, **run.eval_record()}
            writer.write(framework_names(final, cfg.log.metric_names))
    finally:
        writer.close()
        run.source.close()
    records = read_metrics(out_dir / METRICS_FILE)
    if cfg.log.plot:
        title = f"{cfg.task.name} · {cfg.method.name} · {_staleness(cfg)} · seed {cfg.seed}"
        write_plot(records, out_dir / PLOT_FILE, title=title)
    summary = summarize(records)
    print(summary.format(cfg=cfg, out_dir=out_dir, seconds=time.perf_counter() - wall0, guard_stop=guard_stop))
    return RunResult(out_dir=out_dir, steps_done=t, interrupted=interrupted, summary=summary, guard_stop=guard_stop)
