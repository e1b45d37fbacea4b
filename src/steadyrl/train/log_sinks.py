"""Where a run's metric records go: metrics.jsonl and, optionally, TensorBoard, Weights & Biases and MLflow.

Every output is a :class:`MetricsSink` (``write`` / ``sync`` / ``close``); :class:`~steadyrl.train.metrics.
MetricsWriter` calls each in turn with the same record (``step`` = learner step, the final-eval line at
``step = steps``). The trackers here take a record's finite numbers only (a skipped step's NaN loss is left out, as
in TensorBoard); bools become 0/1.

- **TensorBoard** (``log.tensorboard``): events in ``<out_dir>/tb``; a resumed run purges the events an interrupted
  one wrote past the resume point.
- **Weights & Biases** (``log.wandb``): ``wandb.init(project=log.wandb.project, name=<out_dir name>, mode=
  log.wandb.mode, dir=<out_dir>)`` with the resolved config; files in ``<out_dir>/wandb``. Offline mode (the
  default) needs no account or network; ``wandb sync <out_dir>/wandb/offline-run-*`` uploads later (the pieces of a
  resumed run share one run id and are synced in order, into one run).
- **MLflow** (``log.mlflow``): ``MlflowClient(log.mlflow.uri)``, default ``sqlite:///<out_dir>/mlflow.db`` (MLflow
  3.x keeps the ``./mlruns`` file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``);
  experiment ``log.mlflow.experiment``, run name = out_dir's name, params = the flattened config, one metric value
  per key and step. Metric and param keys are mapped by :func:`mlflow_key`.

Resume: each tracker keeps its run id and, per metric key, the last step it sent, in ``<out_dir>/<name>_run.json``
(:data:`WANDB_STATE`, :data:`MLFLOW_STATE`). A resumed run reopens the same run id and skips the (key, step) pairs
already sent, so the steps an interrupted run logged after its last checkpoint are not logged twice. A fresh start
(or ``overwrite=true``) deletes those files and starts new runs.

Closing: ``close`` finishes the tracker's run; called while an exception propagates (the training loop's
``finally``), it marks the run failed (W&B exit code 1; MLflow ``FAILED``, or ``KILLED`` on KeyboardInterrupt).

Neither wandb nor mlflow is imported until its sink is built; :func:`require_trackers` checks both are installed
before a run loads its model.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from steadyrl.base.extras import install_line
from steadyrl.config.io import flatten

if TYPE_CHECKING:
    from steadyrl.config.train import LogConfig

WANDB_DIR = "wandb"
WANDB_STATE = "wandb_run.json"
MLFLOW_STATE = "mlflow_run.json"
MLFLOW_DB = "mlflow.db"
#: Files the trackers write in out_dir (a fresh start deletes them; an external MLflow store is never touched).
TRACKER_FILES = (WANDB_DIR, WANDB_STATE, MLFLOW_STATE, MLFLOW_DB)
#: The install command of a tracker: its extra (in a checkout: the tested pins, installed by setup_extras.sh).
TRACKER_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
PINNED_HINT = "in a checkout: pip install --no-deps -r requirements/logging.txt, or bash scripts/setup_extras.sh"
#: MLflow's limits (mlflow.utils.validation): key length, param value length, params and tags per log_batch call.
MLFLOW_MAX_KEY = 250
MLFLOW_MAX_PARAM_VALUE = 6000
MLFLOW_MAX_PARAMS_PER_BATCH = 100
#: Characters MLflow accepts in a key on every platform (it also takes ':' except on Windows, and Unicode letters).
_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")
#: Tag prefix of a config value a resume changed (MLflow params are immutable once logged).
MLFLOW_RESUME_TAG = "resume/"


class MetricsSink(Protocol):
    """One output of the metric records."""

    def write(self, record: Mapping[str, Any]) -> None:
        """Take one record (it holds ``step``)."""
        ...

    def sync(self) -> None:
        """Make what was written durable (before a checkpoint records the state of the run)."""
        ...

    def close(self) -> None:
        """Flush and release the output (finish the tracker's run)."""
        ...


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of ``record`` except ``step``, as floats (bools as 0/1); what every tracker receives."""
    out = {}
    for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


def mlflow_key(key: str) -> str:
    """``key`` as MLflow accepts it on every platform: a character outside ``A-Z a-z 0-9 _ - . space /`` becomes
    ``_``, an empty, ``.`` or ``..`` path segment becomes ``_`` (MLflow rejects names that normalize to another path),
    and the result is cut to 250 characters. steadyrl's own keys (``reward/mean``, ``is/ess_ratio`` …) pass unchanged.
    """
    parts = _MLFLOW_BAD_CHARS.sub("_", key).split("/")
    return "/".join("_" if p in ("", ".", "..") else p for p in parts)[:MLFLOW_MAX_KEY]


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"a.b.c": str(value)}`` (lists and None as JSON), the MLflow params of a run."""
    out: dict[str, str] = {}
    for name, value in flatten(config, prefix).items():
        text = value if isinstance(value, str) else json.dumps(value)
        out[name] = text[:MLFLOW_MAX_PARAM_VALUE]
    return out


def require_trackers(*, wandb: bool, mlflow: bool, tensorboard: bool = False) -> None:
    """Raise ``ModuleNotFoundError`` (one line naming the install command) when a requested tracker is missing."""
    flags = (("log.wandb", wandb, "wandb"), ("log.mlflow", mlflow, "mlflow"), ("log.tensorboard", tensorboard,
             "tensorboard"))  # fmt: skip
    for flag, wanted, module in flags:
        if wanted and importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"{flag}=true needs the {module} package: {_install(module)}", name=module)


def _import(module: str, flag: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ModuleNotFoundError(f"{flag}=true needs the {module} package: {_install(module)} ({err})",
                                  name=module) from err  # fmt: skip


def _install(module: str) -> str:
    return f"{install_line(TRACKER_EXTRAS[module])} ({PINNED_HINT})"


def closing_status() -> str:
    """``FINISHED``, or ``FAILED`` / ``KILLED`` when called while an exception propagates."""
    exc = sys.exc_info()[1]
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"


class _TrackerState:
    """A tracker's run id and, per key, the last step sent, kept in ``path`` (rewritten after every record)."""

    def __init__(self, path: Path, *, resume: bool) -> None:
        self.path = path
        data = json.loads(path.read_text()) if resume and path.is_file() else {}
        self.run_id: str | None = data.get("run_id")
        self.extra: dict[str, Any] = data.get("extra", {})
        self.logged: dict[str, int] = data.get("logged", {})

    def new(self, step: int, values: Mapping[str, float]) -> dict[str, float]:
        """The entries of ``values`` not yet sent at ``step`` (a resumed run re-runs steps already logged)."""
        return {k: v for k, v in values.items() if step > self.logged.get(k, -1)}

    def mark(self, step: int, keys: Any) -> None:
        """Record that ``keys`` were sent at ``step``, and save."""
        for key in keys:
            self.logged[key] = step
        self.save()

    def save(self) -> None:
        """Write the file atomically."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "extra": self.extra, "logged": self.logged}))
        tmp.replace(self.path)


class TensorBoardSink:
    """TensorBoard events in ``log_dir``; ``purge_step`` drops events an interrupted run wrote past the resume step."""

    def __init__(self, log_dir: Path, *, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(log_dir), purge_step=purge_step)

    def write(self, record: Mapping[str, Any]) -> None:
        """One scalar per finite key at ``global_step = step``."""
        for key, value in scalars(record).items():
            self._tb.add_scalar(key, value, global_step=int(record["step"]))

    def sync(self) -> None:
        """Flush the event file."""
        self._tb.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._tb.close()


class WandbSink:
    """A Weights & Biases run in ``<out_dir>/wandb``: one ``run.log(…, step=step)`` per record."""

    def __init__(self, out_dir: Path, *, project: str, mode: str, config: Mapping[str, Any], resume: bool) -> None:
        wandb = _import("wandb", "log.wandb")
        self.state = _TrackerState(out_dir / WANDB_STATE, resume=resume)
        (out_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=out_dir.name, id=self.state.run_id, resume="allow", mode=mode,
                              dir=str(out_dir), config=dict(config), reinit="create_new")  # fmt: skip
        self.state.run_id = self.run.id  # a fresh run: the id wandb drew
        self.state.save()

    def write(self, record: Mapping[str, Any]) -> None:
        """Log the record's new finite scalars at its step."""
        step = int(record["step"])
        values = self.state.new(step, scalars(record))
        if values:
            self.run.log(values, step=step)
            self.state.mark(step, values)

    def sync(self) -> None:
        """Nothing to do: the W&B service writes (and uploads) in the background."""

    def close(self) -> None:
        """Finish the run (exit code 1 when an exception propagates)."""
        self.run.finish(exit_code=0 if closing_status() == "FINISHED" else 1)


class MlflowSink:
    """An MLflow run: params = the flattened config, one ``log_batch`` of metrics per record."""

    def __init__(self, out_dir: Path, *, tracking_uri: str | None, experiment: str, config: Mapping[str, Any],
                 resume: bool) -> None:  # fmt: skip
        _import("mlflow", "log.mlflow")
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._param, self._tag = Metric, Param, RunTag
        self.tracking_uri = tracking_uri or f"sqlite:///{(out_dir / MLFLOW_DB).resolve()}"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.state = _TrackerState(out_dir / MLFLOW_STATE, resume=resume)
        if self.state.run_id is not None and self.state.extra.get("tracking_uri") != self.tracking_uri:
            self.state = _TrackerState(self.state.path, resume=False)  # another store: a new run there
        params = {mlflow_key(k): v for k, v in flatten_config(config).items()}
        if self.state.run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            run = self.client.create_run(exp_id, run_name=out_dir.name, tags={"steadyrl.out_dir": str(out_dir)})
            self.state.run_id, self.state.extra = run.info.run_id, {"tracking_uri": self.tracking_uri}
            self.state.save()
            self._log_params(params, {})
        else:
            self._log_params(params, self.client.get_run(self.state.run_id).data.params)
            self.client.update_run(self.state.run_id, status="RUNNING")

    def _log_params(self, params: Mapping[str, str], existing: Mapping[str, str]) -> None:
        """New params are logged; a value a resume changed (params are immutable) goes to tag ``resume/<key>``."""
        new = [self._param(k, v) for k, v in params.items() if k not in existing]
        changed = [self._tag(mlflow_key(MLFLOW_RESUME_TAG + k), v) for k, v in params.items()
                   if k in existing and existing[k] != v]  # fmt: skip
        entities = [*new, *changed]
        for i in range(0, len(entities), MLFLOW_MAX_PARAMS_PER_BATCH):
            chunk = entities[i : i + MLFLOW_MAX_PARAMS_PER_BATCH]
            self.client.log_batch(self.state.run_id, params=[e for e in chunk if isinstance(e, self._param)],
                                  tags=[e for e in chunk if isinstance(e, self._tag)])  # fmt: skip

    def write(self, record: Mapping[str, Any]) -> None:
        """Log the record's new finite scalars at its step (keys through :func:`mlflow_key`)."""
        step = int(record["step"])
        values = self.state.new(step, {mlflow_key(k): v for k, v in scalars(record).items()})
        if values:
            now = int(time.time() * 1000)
            self.client.log_batch(self.state.run_id, metrics=[self._metric(k, v, now, step) for k, v in values.items()])
            self.state.mark(step, values)

    def sync(self) -> None:
        """Nothing to do: every ``log_batch`` is committed to the store."""

    def close(self) -> None:
        """Mark the run terminated: ``FINISHED``, or ``FAILED`` / ``KILLED`` when an exception propagates."""
        self.client.set_terminated(self.state.run_id, status=closing_status())


def open_trackers(log: LogConfig, out_dir: Path, *, config: Mapping[str, Any], resume: bool) -> list[MetricsSink]:
    """The W&B and MLflow sinks ``log`` asks for (``resume``: continue the runs recorded in out_dir)."""
    require_trackers(wandb=log.wandb.enabled, mlflow=log.mlflow.enabled)
    sinks: list[MetricsSink] = []
    try:
        if log.wandb.enabled:
            sinks.append(WandbSink(out_dir, project=log.wandb.project, mode=log.wandb.mode, config=config,
                                   resume=resume))  # fmt: skip
        if log.mlflow.enabled:
            sinks.append(MlflowSink(out_dir, tracking_uri=log.mlflow.uri, experiment=log.mlflow.experiment,
                                    config=config, resume=resume))  # fmt: skip
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks
