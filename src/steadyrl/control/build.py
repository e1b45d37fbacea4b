"""A method's controllers, built from its spec by a table: one controller class per step-level component."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from steadyrl.control.base import Controller
from steadyrl.control.ess_lr import EssStepSizeController
from steadyrl.control.gac import GradientAlignmentController
from steadyrl.methods.resolve import resolve_method
from steadyrl.methods.spec import GAC, EssStepSize, MethodSpec

#: Step-level component type → the controller that carries it out.
CONTROLLERS: dict[type, Callable[[Any], Controller]] = {
    EssStepSize: EssStepSizeController,
    GAC: GradientAlignmentController,
}


def build_controllers(method: str | MethodSpec, overrides: Mapping[str, Any] | None = None) -> list[Controller]:
    """The controllers of ``method``, in the order its spec lists them.

    ``method``: a preset name (``"vcpo"``), a composition (``"seq_tis+gac"``) or a resolved :class:`MethodSpec`;
    ``overrides`` as in :func:`steadyrl.resolve_method` (``{"ess_lr.rho_base": 0.55}``). A method without step-level
    parts gives ``[]``.
    """
    if isinstance(method, str) or overrides:
        method = resolve_method(method, overrides)
    out: list[Controller] = []
    for spec in method.controllers:
        build = CONTROLLERS.get(type(spec))
        if build is None:  # pragma: no cover - the discriminated union admits nothing else
            raise TypeError(f"no controller for {spec!r}")
        out.append(build(spec))
    return out
