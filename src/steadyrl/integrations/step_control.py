"""A method's step-level controllers inside another framework's trainer: the one implementation every adapter uses.

VCPO's ESS-scaled step size (arXiv 2602.17616, Sec. 4.1) and GAC (arXiv 2603.01501) act on the optimizer step, not
on the loss (:mod:`steadyrl.control`). Inside verl, OpenRLHF, AReaL or TRL the loss runs once per micro-batch and the
framework owns the optimizer, so an adapter:

1. calls :meth:`StepControl.record` with each training micro-batch's ``compute_loss`` metrics (only the metrics some
   controller reads are kept: :attr:`~steadyrl.control.base.Controller.reads`), and puts
   :meth:`StepControl.loss_inputs` into each micro-batch's batch (the adaptive entropy coefficient);
2. wraps the optimizer once (:meth:`StepControl.wrap`). Each ``optimizer.step()`` then
   - averages the recorded metrics over the step's micro-batches, and over the data-parallel processes (one learning
     rate for every replica);
   - runs every controller's ``before_step`` (:meth:`StepControl.prepare`; a framework that clips the gradient
     itself calls it before clipping, as steadyrl's learner does, and the wrapped step then does not run it again);
   - skips the step when GAC asks for it (the gradient is dropped, so neither the weights nor Adam's moments move),
     otherwise steps;
   - restores the learning rate (``after_step``) and reads the step's control metrics to the host once
     (:attr:`StepControl.last`: ``steadyrl/vcpo/ess_scale``, ``steadyrl/gac/cos``, ..., ``steadyrl/lr``).

Device: every tensor the controllers make stays on the device of the gradients and metrics they read; the effective
learning rate is read from the optimizer as a Python number and never becomes a tensor on another device.

GAC reads the whole flattened gradient of one process: with data-parallel or sharded training each rank holds a part
(or a differently reduced copy) and ranks could disagree about skipping, so :meth:`StepControl.wrap` refuses GAC when
more than one process trains.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from steadyrl.base.device import host_values
from steadyrl.control.base import SKIP_STEP, Controller, loss_inputs
from steadyrl.control.build import build_controllers
from steadyrl.methods.spec import GAC, MethodSpec

#: Prefix of the metrics the adapters report (``steadyrl/vcpo/ess_scale``, ``steadyrl/lr``, ...).
METRIC_PREFIX = "steadyrl/"


def host_metrics(metrics: Mapping[str, Tensor], prefix: str = METRIC_PREFIX) -> dict[str, float]:
    """``metrics`` as Python floats under ``prefix`` (one host read for all of them)."""
    return {prefix + k: v for k, v in zip(metrics, host_values(metrics.values()), strict=True)}


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group (1 when it is not initialized)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _mean_over_processes(value: Tensor) -> Tensor:
    """The mean of ``value`` over the default process group (``value`` itself with one process)."""
    n = world_size()
    if n == 1:
        return value
    total = value.detach().clone()
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total / n


class StepControl:
    """The step-level controllers of ``spec`` around a framework's optimizer step (module docstring).

    Args:
        spec: the resolved method; a method without controllers makes every call a no-op.
        framework: the adapter's name, for messages (``"verl"``, ``"trl"``, ...).
        wrap_hint: how a user of that framework wraps the optimizer (shown when metrics arrive but nothing is
            wrapped); default: ``steadyrl.integrations.<framework>.wrap_optimizer(optimizer, ...)``.
    """

    def __init__(self, spec: MethodSpec, *, framework: str, wrap_hint: str | None = None) -> None:
        self.spec = spec
        self.framework = framework
        self.wrap_hint = wrap_hint or f"steadyrl.integrations.{framework}.wrap_optimizer(optimizer, ...)"
        self.controllers: list[Controller] = build_controllers(spec)
        self.reads: frozenset[str] = frozenset(k for c in self.controllers for k in getattr(c, "reads", ()))
        self.pending: list[dict[str, Tensor]] = []
        self.control: dict[str, Tensor] = {}
        """The controllers' metrics of the current (or last) step, as tensors on the gradients' device."""
        self.last: dict[str, float] = {}
        """The same metrics and ``lr`` read to the host once per step, named ``steadyrl/<key>``."""
        self.skip = False
        self.wrapped = False
        self._prepared = False
        self._warned = False

    def __bool__(self) -> bool:
        return bool(self.controllers)

    @property
    def prepared(self) -> bool:
        """Whether :meth:`prepare` ran for the current optimizer step (until :meth:`finish`)."""
        return self._prepared

    # --------------------------------------------------------------------------------------------- the loss
    def record(self, metrics: Mapping[str, Tensor]) -> None:
        """Keep what the controllers read from one training micro-batch's ``compute_loss`` metrics."""
        if not self.controllers:
            return
        if not self.wrapped and not self._warned:
            self._warned = True
            kinds = ", ".join(c.type for c in self.spec.controllers)
            warnings.warn(
                f"method {self.spec.name!r} has step-level controllers ({kinds}) that act only once the optimizer "
                f"is wrapped: call {self.wrap_hint} in the training process",
                stacklevel=3,
            )
        self.pending.append({k: v.detach() for k, v in metrics.items() if k in self.reads})

    def loss_inputs(self, device: torch.device | str) -> dict[str, Tensor]:
        """Batch inputs the controllers hand each micro-batch's loss (the adaptive entropy coefficient
        ``entropy_coef``), on ``device``; the same for every micro-batch of an optimizer step."""
        return loss_inputs(self.controllers, device)

    # ---------------------------------------------------------------------------------------- the optimizer
    def check_processes(self) -> None:
        """Refuse GAC when more than one process trains (module docstring)."""
        if any(isinstance(c, GAC) for c in self.spec.controllers) and world_size() > 1:
            raise ValueError(
                f"GAC reads the flat local gradient; with data-parallel or sharded training ({world_size()} "
                "processes) each rank holds a part of it and ranks could disagree about skipping: use GAC with one "
                "process only, or a method without it"
            )

    def prepare(self, optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> None:
        """Run every controller's ``before_step`` once for this optimizer step (later calls do nothing until
        :meth:`finish`): the ESS step size scales the lr, GAC edits ``.grad`` or decides to skip."""
        if self._prepared or not self.controllers:
            return
        self._prepared = True
        self.check_processes()
        steps, self.pending = self.pending, []
        keys = set.intersection(*(set(m) for m in steps)) if steps else set()
        metrics = {k: _mean_over_processes(torch.stack([m[k] for m in steps]).mean()) for k in sorted(keys)}
        control: dict[str, Tensor] = {}
        for c in self.controllers:
            control |= c.before_step(optimizer=optimizer, params=list(params), metrics=metrics)
        self.control = control
        values = host_values(control.values())  # the step's one host read
        self.last = {METRIC_PREFIX + k: v for k, v in zip(control, values, strict=True)}
        self.last[METRIC_PREFIX + "lr"] = float(optimizer.param_groups[0]["lr"])  # this step's effective lr
        self.skip = self.last.get(METRIC_PREFIX + SKIP_STEP, 0.0) != 0.0

    def finish(self, optimizer: torch.optim.Optimizer) -> None:
        """Every controller's ``after_step`` (the lr restored); the next step may :meth:`prepare` again."""
        for c in self.controllers:
            c.after_step(optimizer=optimizer)
        self._prepared = False
        self.skip = False

    def wrap(self, optimizer: Any, params: Iterable[Tensor] | Callable[[], Iterable[Tensor]] | None = None) -> Any:
        """Make ``optimizer.step`` run the controllers (module docstring, point 2); returns ``optimizer``.

        ``params``: the trainable parameters of this process, or a callable giving them at each step (for an
        engine that rebuilds its parameter list); default: the optimizer's own parameters.
        """
        if getattr(optimizer, "_steadyrl_wrapped", False):
            raise ValueError("this optimizer is already wrapped by a steadyrl step control")
        self.check_processes()
        if params is None:
            fixed = [p for g in optimizer.param_groups for p in g["params"]]
            get_params: Callable[[], Iterable[Tensor]] = lambda: fixed  # noqa: E731
        elif callable(params):
            get_params = params
        else:
            fixed = list(params)
            get_params = lambda: fixed  # noqa: E731
        original = optimizer.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self.prepare(optimizer, get_params())
            try:
                if self.skip:  # leave the weights and Adam's moments untouched
                    optimizer.zero_grad(set_to_none=True)
                    return None
                return original(*args, **kwargs)
            finally:
                self.finish(optimizer)

        optimizer.step = step
        optimizer._steadyrl_wrapped = True
        self.wrapped = True
        return optimizer
