"""Moving the learner's weights to samplers as one flat array with a version.

Only parameters travel (``model.named_parameters()``: a tied embedding once); buffers such as rotary frequencies are
built by the sampler's own copy of the architecture and never change. The layout is the order of
``named_parameters()``, which two copies of one architecture share. Values travel in the parameters' own dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn


class Entry(NamedTuple):
    """One parameter's place in the flat array."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class FlatLayout:
    """Where each parameter of an architecture sits in one flat array."""

    def __init__(self, model: nn.Module) -> None:
        entries, offset = [], 0
        dtypes = set()
        for name, p in model.named_parameters():
            entries.append(Entry(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
            dtypes.add(p.dtype)
        if len(dtypes) > 1:
            raise ValueError(f"parameters have several dtypes {sorted(map(str, dtypes))}; one flat array needs one")
        self.entries: list[Entry] = entries
        self.numel = offset
        self.dtype: torch.dtype = dtypes.pop() if dtypes else torch.float32

    def empty(self) -> Tensor:
        """A zero flat array of this layout (CPU)."""
        return torch.zeros(self.numel, dtype=self.dtype)

    def flatten_into(self, model: nn.Module, out: Tensor) -> None:
        """Copy ``model``'s parameters into ``out`` (``[numel]``)."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for e in self.entries:
                out[e.offset : e.offset + e.numel].copy_(params[e.name].detach().reshape(-1))

    def flatten(self, model: nn.Module) -> Tensor:
        """A new flat CPU copy of ``model``'s parameters."""
        out = self.empty()
        self.flatten_into(model, out)
        return out

    def load_into(self, model: nn.Module, flat: Tensor) -> None:
        """Copy ``flat`` into ``model``'s parameters, in place (no re-allocation; a KV cache stays valid)."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat weights have {flat.numel()} values, the layout {self.numel}")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for e in self.entries:
                p = params[e.name]
                p.copy_(flat[e.offset : e.offset + e.numel].view(e.shape).to(p.device, p.dtype))
