"""Shared types of ``steadyrl.core``: shape aliases, named results, constants.

Shape letters used throughout the package:

====  ==========================================================
B     sequences (responses) in the batch; ``B = n_groups * G``
T     response tokens per sequence (padded); masked by ``mask``
G     responses per prompt (group size)
P     flattened parameter count (GAC)
====  ==========================================================
"""

from __future__ import annotations

from typing import NamedTuple

from jaxtyping import Bool, Float
from torch import Tensor

#: Log-ratios are clamped to ±LOG_RATIO_CLAMP before ``exp`` wherever a weight is materialized
#: (docs/algorithms.md, "Log-space rules").
LOG_RATIO_CLAMP: float = 20.0

Scalar = Float[Tensor, ""]

Metrics = dict[str, Tensor]


class LossOutput(NamedTuple):
    """Result of every loss function: ``loss`` (0-d, differentiable) and ``metrics`` (detached 0-d tensors).

    Unpacks as ``loss, metrics = fn(...)``. Metric names are namespaced by layer (``loss/``, ``is/``, ``kl/``,
    ``adv/``, ...). A loss over a batch with no trainable token is an exact zero that still carries the graph (so
    ``backward`` gives zero gradients) and sets ``loss/all_masked = 1``.
    """

    loss: Scalar
    metrics: Metrics


class Corrected(NamedTuple):
    """Result of an importance correction: detached per-token weights and the mask of tokens it keeps.

    ``weights`` is 1 where a correction only masks; ``mask`` is the input mask with rejected tokens removed.
    ``unit_weights`` is True when the correction only masks (``weights`` is 1 on every kept token): a caller that
    multiplies corrections' weights together may then skip this one's product.
    """

    weights: Float[Tensor, "B T"]
    mask: Bool[Tensor, "B T"]
    metrics: Metrics
    unit_weights: bool = False
