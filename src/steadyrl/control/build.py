"""A method's controllers, built from its spec by a table: one controller class per step-level component."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from steadyrl.control.adaptive_entropy import AdaptiveEntropyController
from steadyrl.control.base import Controller
from steadyrl.control.ess_lr import EssStepSizeController
from steadyrl.control.gac import GradientAlignmentController
from steadyrl.methods.resolve import resolve_method
from steadyrl.methods.spec import GAC, AdaptiveEntropy, EssStepSize, MethodSpec

#: Step-level component type → the controller that carries it out, built from (component, the whole method).
CONTROLLERS: dict[type, Callable[[Any, MethodSpec], Controller]] = {
    EssStepSize: lambda spec, method: EssStepSizeController(spec),
    GAC: lambda spec, method: GradientAlignmentController(spec),
    AdaptiveEntropy: lambda spec, method: AdaptiveEntropyController(spec, method.entropy.coef),
}


def build_controllers(method: str | MethodSpec, overrides: Mapping[str, Any] | None = None) -> list[Controller]:
    """The controllers of ``method``, in the order its spec lists them.

    ``method``: a preset name (``"vcpo"``), a composition (``"seq_tis+gac"``) or a resolved :class:`MethodSpec`;
    ``overrides`` as in :func:`steadyrl.resolve_method` (``{"ess_lr.rho_base": 0.55}``). A method without step-level
    parts gives ``[]``. The adaptive entropy controller starts from the method's ``entropy.coef``.
    """
    if isinstance(method, str) or overrides:
        method = resolve_method(method, overrides)
    out: list[Controller] = []
    for spec in method.controllers:
        build = CONTROLLERS.get(type(spec))
        if build is None:  # pragma: no cover - the discriminated union admits nothing else
            raise TypeError(f"no controller for {spec!r}")
        out.append(build(spec, method))
    return out
