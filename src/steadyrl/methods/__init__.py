"""Methods: named, documented compositions of ``steadyrl.core`` pieces, and the one loss entry point.

``resolve_method("seq_tis+gac", {"seq_tis.cap": 4})`` builds a validated :class:`MethodSpec`;
``compute_loss(method, batch)`` runs its loss-level part; ``steadyrl methods`` prints the catalog.
"""

from steadyrl.methods.batch import KEY_DOCS, LossBatch
from steadyrl.methods.compose import LossDetails, compute_loss
from steadyrl.methods.presets import PRESETS, PRESETS_BY_NAME, Preset
from steadyrl.methods.resolve import reads_behavior, required_inputs, resolve_method
from steadyrl.methods.spec import MethodSpec

__all__ = [
    "KEY_DOCS",
    "PRESETS",
    "PRESETS_BY_NAME",
    "LossBatch",
    "LossDetails",
    "MethodSpec",
    "Preset",
    "compute_loss",
    "reads_behavior",
    "required_inputs",
    "resolve_method",
]
