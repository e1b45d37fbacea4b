"""``metrics.jsonl``: one JSON object per learner step, written so that two identical runs give identical bytes.

Each line has sorted keys; floats are rounded to ``FLOAT_DIGITS`` significant digits and written by ``repr``; a
non-finite value (the loss of a skipped step) is written as ``null``. Line t (t = 0 … steps − 1) holds learner step t;
a last line at ``step = steps`` holds the final evaluation only. Wall-clock keys (``time/*``) differ from run to run:
``log.timings=separate`` moves them to ``timings.jsonl`` (same layout, ``step`` plus ``time/*``), leaving
``metrics.jsonl`` byte-reproducible.

The writer flushes every line and reports its byte offsets, which a checkpoint records so that a resumed run first
truncates the files to the checkpointed step. TensorBoard events (``log.tensorboard``) go to ``<out_dir>/tb``; W&B
(``log.wandb``) and MLflow (``log.mlflow``) get the same records (:mod:`steadyrl.train.log_sinks`).

Metric keys (namespaced by layer; the loss-level ones come from ``compute_loss``):

===================  ==========================================================================================
``step``, version    learner step; optimizer steps applied to the weights that computed this step's gradient
``sample/version``   version of the weights that sampled the batch; ``lag/*`` = version − sample version per token
``reward/mean``      mean reward of the batch (``reward/std`` its std)
``response/len_mean``  mean response length in tokens (EOS included); ``response/truncated`` fraction cut off
``loss``             the scalar loss (mean over optimizer steps)
``lr``               effective learning rate (after warm-up and controllers)
``grad/norm``        ‖g‖ of the raw gradient, before controllers and clipping
``grad/cos_prev``    cos(g_t, g_{t−1}) of consecutive raw gradients (0 at the first step)
``train/skipped``    1 when a step was skipped for a non-finite loss, gradient or lr
``train/*``          ``optim.microbatch_tokens``: ``microbatches`` per optimizer step, ``values_pass`` 1 when the
                     step ran a separate no-grad forward for the loss's values (0: one forward a micro-batch,
                     docs/scale.md), ``norm_microbatches`` for OPOB's norm pass
``grad/per_traj_*``  VCPO/OPOB: mean_i ‖∇θ log π(y_i)‖ (``grad/per_traj_norm_mean``); ``grad/fused`` 1 when the
                     step's gradient was assembled from the same backward as those norms (docs/algorithms.md, vcpo)
``vcpo/*``           ``ess_ratio`` and ``ess_scale`` (the ESS step size's lr factor), ``baseline_mean`` (OPOB)
``gac/*``            GAC's cosine to the previous gradient, ``projected`` and ``skipped`` flags
``critic/*``         COPC's value head: ``loss``, ``explained_var``, ``value_mean``
``guard/*``          collapse guard: ``suspicious`` (this step matches the collapse signature), ``alarm`` (an alarm
                     was raised at this step), ``rollbacks`` (count so far); reasons in ``guard.jsonl``
``is/*``, ``kl/*``   importance-weight diagnostics (``is/ess_ratio``, ``is/weight_max``) and mismatch KL (``kl/k3``)
``eval/acc``         held-out accuracy of the weights at the start of the step (eval steps and the final line)
``time/*``           ``step_s`` (the whole step), ``sample_s``, ``learn_s``, ``eval_s``
===================  ==========================================================================================
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from steadyrl.train.log_sinks import MetricsSink, TensorBoardSink

#: Significant digits kept for every float in metrics.jsonl.
FLOAT_DIGITS = 8
METRICS_FILE = "metrics.jsonl"
TIMINGS_FILE = "timings.jsonl"
TB_DIR = "tb"
#: Prefix of the wall-clock keys.
TIME_PREFIX = "time/"


class MetricsOffsets(NamedTuple):
    """Where the metric files end after a given step: lines and bytes of metrics.jsonl, bytes of timings.jsonl."""

    lines: int
    bytes: int
    timing_bytes: int


def _plain(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    x = float(value)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{FLOAT_DIGITS}g}")


def format_record(record: Mapping[str, Any]) -> str:
    """One JSON line with sorted keys and rounded floats (``null`` for NaN/inf)."""
    return json.dumps({k: _plain(v) for k, v in record.items()}, sort_keys=True, separators=(", ", ": "))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (an incomplete last line, from a killed process, is ignored)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


class JsonlSink:
    """metrics.jsonl (and timings.jsonl): appends records, optionally first truncating the files to offsets."""

    def __init__(self, out_dir: Path, *, separate_timings: bool, start: MetricsOffsets | None = None) -> None:
        self.path = out_dir / METRICS_FILE
        self.timing_path = out_dir / TIMINGS_FILE
        offsets = start or MetricsOffsets(0, 0, 0)
        self._lines = offsets.lines
        self._file = self._open(self.path, offsets.bytes)
        self._timing_file = self._open(self.timing_path, offsets.timing_bytes) if separate_timings else None

    @staticmethod
    def _open(path: Path, size: int) -> Any:
        handle = open(path, "a+b")  # noqa: SIM115 - closed in close()
        handle.truncate(size)
        handle.seek(size)
        return handle

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one line (the ``time/*`` keys to timings.jsonl when separated), flushed."""
        main = dict(record)
        if self._timing_file is not None:
            timings = {k: main.pop(k) for k in list(main) if k.startswith(TIME_PREFIX)}
            self._timing_file.write((format_record({"step": record["step"], **timings}) + "\n").encode())
            self._timing_file.flush()
        self._file.write((format_record(main) + "\n").encode())
        self._file.flush()
        self._lines += 1

    def offsets(self) -> MetricsOffsets:
        """Current end of the files (to store in a checkpoint)."""
        timing = self._timing_file.tell() if self._timing_file is not None else 0
        return MetricsOffsets(self._lines, self._file.tell(), timing)

    def sync(self) -> None:
        """fsync both files."""
        for handle in (self._file, self._timing_file):
            if handle is not None:
                handle.flush()
                os.fsync(handle.fileno())

    def close(self) -> None:
        """Flush and close the files."""
        self.sync()
        self._file.close()
        if self._timing_file is not None:
            self._timing_file.close()


class MetricsWriter:
    """Hands each record to a list of sinks (:mod:`steadyrl.train.log_sinks`): metrics.jsonl first, then TensorBoard
    and the trackers (W&B, MLflow) in that order, each called the same way."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        separate_timings: bool,
        tensorboard: bool,
        start: MetricsOffsets | None = None,
        start_step: int = 0,
        trackers: Sequence[MetricsSink] = (),
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = JsonlSink(self.dir, separate_timings=separate_timings, start=start)
        self.path, self.timing_path = self.jsonl.path, self.jsonl.timing_path
        self.sinks: list[MetricsSink] = [self.jsonl]
        if tensorboard:
            self.sinks.append(TensorBoardSink(self.dir / TB_DIR, purge_step=start_step if start else None))
        self.sinks.extend(trackers)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (it must hold ``step``) to every sink."""
        for sink in self.sinks:
            sink.write(record)

    def offsets(self) -> MetricsOffsets:
        """Current end of metrics.jsonl / timings.jsonl (to store in a checkpoint)."""
        return self.jsonl.offsets()

    def sync(self) -> None:
        """Flush every sink to disk (before a checkpoint records the offsets)."""
        for sink in self.sinks:
            sink.sync()

    def close(self) -> None:
        """Flush and close every sink; each one is closed even if an earlier one raises (the first error is raised)."""
        error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # every sink gets its close
                error = error or err
        if error is not None:
            raise error
