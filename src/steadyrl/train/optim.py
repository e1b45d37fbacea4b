"""The policy's optimizer: AdamW (the default), or Muon on the hidden weight matrices with AdamW on the rest.

``optim.name=muon`` follows the RL recipe of "Long-Horizon RL Needs Muon" (arXiv 2610.20256) and "When Does Muon Help
Agentic RL?" (arXiv 2607.16169): :class:`torch.optim.Muon` (momentum, then a Newton–Schulz orthogonalization of the
update, Jordan et al. 2024) on the **hidden 2-D weight matrices** only (attention and MLP projections), and AdamW on
everything else: the token embeddings, the output layer (tied to the embeddings in the embedded model), the norms and
the biases. :func:`split_params` makes that split by module, not by shape alone: every parameter of an
``nn.Embedding`` and the output layer's weight go to AdamW even though they are 2-D.

Constants: the papers fix the split; the Muon hyperparameters below are ours where they give none. Momentum 0.95 with
Nesterov, 5 Newton–Schulz steps and their coefficients (3.4445, −4.775, 2.0315) are ``torch.optim.Muon``'s defaults
(Jordan et al.'s reference implementation). The learning-rate adjustment defaults to ``match_rms_adamw`` (Moonshot,
"Muon is Scalable for LLM Training", arXiv 2502.16982: the update is scaled by 0.2·sqrt(max(A, B)) so its RMS matches
AdamW's), so Muon runs at the run's own ``lr`` unless ``optim.muon.lr`` sets another; Muon's weight decay defaults to
``optim.weight_decay`` (0 by default; torch's own default would be 0.1).

:class:`MuonAdamW` is the two optimizers behind one interface the learner uses (``param_groups``, ``step``,
``zero_grad``, ``state_dict``, ``load_state_dict``): AdamW's groups first, so ``param_groups[0]["lr"]`` stays the
run's lr; each Muon group carries ``lr_scale`` = optim.muon.lr / lr, which the learner's warm-up and the controllers' lr
scaling keep (they multiply every group's lr).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from steadyrl.config.train import OptimConfig

#: ``optim.name`` values.
OptimizerName = Literal["adamw", "muon"]


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's parameters: the hidden 2-D weight matrices, AdamW's: embeddings, output layer, norms, biases), each
    trainable parameter once, in ``model.parameters()`` order."""
    to_adamw: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            to_adamw.update(id(p) for p in module.parameters(recurse=False))
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        layer = fn() if callable(fn) else None
        if layer is not None:
            to_adamw.update(id(p) for p in layer.parameters(recurse=False))
    muon, adamw = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (muon if p.dim() == 2 and id(p) not in to_adamw else adamw).append(p)
    return muon, adamw


class MuonAdamW:
    """``torch.optim.Muon`` on ``muon_params`` and ``torch.optim.AdamW`` on ``adamw_params`` (module docstring)."""

    def __init__(
        self,
        muon_params: Iterable[nn.Parameter],
        adamw_params: Iterable[nn.Parameter],
        *,
        lr: float,
        adamw: dict[str, Any],
        muon_lr: float | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw",
    ) -> None:
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        if not muon_params:
            raise ValueError("optim.name=muon: the model has no hidden 2-D weight matrix for Muon: use adamw")
        scale = 1.0 if muon_lr is None else muon_lr / lr
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, **adamw) if adamw_params else None
        self.muon = torch.optim.Muon(
            muon_params, lr=lr * scale, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, adjust_lr_fn=adjust_lr,
        )  # fmt: skip
        for group in self.muon.param_groups:
            group["lr_scale"] = scale

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.adamw, self.muon) if o is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW's groups, then Muon's (the same dicts: setting a group's lr sets that optimizer's)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"adamw": None if self.adamw is None else self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"adamw", "muon"}:
            raise ValueError("this optimizer state is not Muon + AdamW's (optim.name changed since it was saved?)")
        if self.adamw is not None:
            self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])


def build_optimizer(
    model: nn.Module, params: list[nn.Parameter], *, lr: float, cfg: OptimConfig
) -> torch.optim.Optimizer | MuonAdamW:
    """The optimizer ``cfg.name`` names, over ``params`` (``model``'s trainable parameters)."""
    adamw = {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if cfg.fused:
        adamw["fused"] = True
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=lr, **adamw)
    if cfg.name != "muon":
        raise ValueError(f"optim.name={cfg.name!r} is not one of 'adamw', 'muon'")
    muon, rest = split_params(model)
    m = cfg.muon
    wd = cfg.weight_decay if m.weight_decay is None else m.weight_decay
    return MuonAdamW(
        muon, rest, lr=lr, adamw=adamw, muon_lr=m.lr, momentum=m.momentum, nesterov=m.nesterov,
        weight_decay=wd, ns_steps=m.ns_steps, adjust_lr=m.adjust_lr,
    )  # fmt: skip
