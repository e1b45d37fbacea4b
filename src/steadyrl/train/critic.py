"""COPC's critic in ``steadyrl train``: a linear value head on the policy's final hidden states, its AdamW and loss.

COPC (arXiv 2610.09597) [reconstructed; only the abstract and summaries were available] is actor-critic: the actor's
advantages are TD residuals of a critic V weighted by a two-sided clipped ratio
(:func:`steadyrl.core.advantages.vtrace.copc_advantages`), and the critic regresses on the value targets
V(s_t) + Â_t. How we build that critic is our choice, not the paper's:

1. **Head.** V(s_t) = w·h_t + b, one ``nn.Linear(hidden_size, 1)`` in float32, zero-initialized (V ≡ 0 at the
   start), on h_t = the policy's final hidden state (after the final norm: the output layer's input) at the position
   whose logits predict response token y_t, so V(s_t) is the value of the state *before* y_t is emitted. h_t comes
   from the learner's own forward (``sequence_logprobs(..., return_hidden=True)``): no second forward.
2. **Targets.** ``steadyrl.methods.compose.copc_value_targets``: the same rewards (outcome reward on the last
   response token), log-ratios and options as the actor's advantages, with the values of the same forward, detached.
3. **Loss** (the learner adds it to the actor's loss)::

       L_V = value_coef · ½ · Σ_t m_t (V(s_t) − target_t)² / Σ_t m_t        (masked mean over response tokens)

4. **Trunk.** ``trunk_grad=False`` (default): the head reads h_t detached, so L_V trains the head only and the
   policy's gradient is the actor's alone. ``trunk_grad=True``: L_V also flows into the shared trunk (through the
   policy's optimizer, weighted by ``value_coef``).
5. **Optimizer.** Its own AdamW (``lr``, no weight decay) with its own gradient clip; it steps exactly when the
   actor's optimizer steps, and a skipped actor step skips it too.

BRACE (arXiv 2609.09783, §3 and App. D) uses the same head with the paper's settings, taken from the method's
``advantage`` options: targets V_targ from ``steadyrl.methods.compose.brace_value_targets``; the clipped value loss

    L_V = value_coef · ½ · masked mean max[(V − V_targ)², (clip(V, V_old − c, V_old + c) − V_targ)²],   c = 0.5,

with V_old the head's values at the batch's first optimizer step (the learner computes them with π_prox when the
batch gets several optimizer steps; with one, V_old = V and the clip is inactive); AdamW lr ``critic_lr`` = 1e-5
instead of ``lr``; and ``critic_warmup`` = 5 critic-only optimizer steps (the policy does not step) before the
actor's first step.

Metrics (detached 0-d tensors): ``critic/loss`` (½ masked MSE, without ``value_coef``), ``critic/explained_var``
(1 − Var(target − V) / Var(target) over the masked tokens, population variances; NaN when the targets have no
variance), ``critic/value_mean`` (masked mean of V).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from jaxtyping import Float, Shaped
from torch import Tensor, nn

from steadyrl.config.critic import CriticConfig
from steadyrl.core.masking import as_bool_mask, masked_mean, where_masked
from steadyrl.core.types import Metrics
from steadyrl.methods import spec as S
from steadyrl.methods.compose import brace_value_targets, copc_value_targets
from steadyrl.methods.spec import MethodSpec


class CriticTerms(NamedTuple):
    """What the critic adds to one optimizer step.

    ==========  ======  ===================================================================================
    field       shape   meaning
    ==========  ======  ===================================================================================
    ``values``  [B, T]  V(s_t), detached, 0 outside the mask: the batch's ``values`` for ``compute_loss``
    ``loss``    []      value_coef · ½ · masked mean (V − target)², with gradient (head; trunk if trunk_grad)
    ``metrics``         ``critic/loss``, ``critic/explained_var``, ``critic/value_mean`` (detached)
    ==========  ======  ===================================================================================
    """

    values: Float[Tensor, "B T"]
    loss: Float[Tensor, ""]
    metrics: Metrics


def value_loss(
    values: Float[Tensor, "B T"], targets: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]
) -> Float[Tensor, ""]:
    """½ · Σ_t m_t (V_t − target_t)² / Σ_t m_t (0 when nothing is masked in); ``targets`` are detached here."""
    m = as_bool_mask(mask)
    sq = (values - targets.detach().to(values.dtype)).pow(2)  # (V(s_t) − target_t)²
    return 0.5 * masked_mean(where_masked(sq, m), m)


def clipped_value_loss(
    values: Float[Tensor, "B T"], old_values: Float[Tensor, "B T"], targets: Float[Tensor, "B T"],
    mask: Shaped[Tensor, "B T"], clip: float,
) -> Float[Tensor, ""]:
    """½ · masked mean max[(V − target)², (clip(V, V_old − c, V_old + c) − target)²] (PPO's value clip; BRACE §3)."""
    m = as_bool_mask(mask)
    t = targets.detach().to(values.dtype)
    old = old_values.detach().to(values.dtype)
    clipped = old + (values - old).clamp(-clip, clip)  # clip(V, V_old ± c)
    sq = torch.maximum((values - t).pow(2), (clipped - t).pow(2))
    return 0.5 * masked_mean(where_masked(sq, m), m)


def explained_variance(
    values: Float[Tensor, "B T"], targets: Float[Tensor, "B T"], mask: Shaped[Tensor, "B T"]
) -> Float[Tensor, ""]:
    """1 − Var(target − V) / Var(target) over the masked tokens (population variances); NaN if Var(target) = 0.

    1: V explains the targets exactly; 0: no better than their mean; < 0: worse than their mean.
    """
    m = as_bool_mask(mask)
    v, t = values.detach().to(targets.dtype), targets.detach()

    def var(x: Tensor) -> Tensor:
        mean = masked_mean(where_masked(x, m), m)
        return masked_mean(where_masked((x - mean).pow(2), m), m)

    var_t = var(t)
    ratio = var(t - v) / torch.where(var_t > 0, var_t, torch.full_like(var_t, torch.nan))
    return 1 - ratio


class Critic:
    """The value head, its AdamW and loss weight; :meth:`terms` builds the step's values and loss, :meth:`step`
    applies the update (see the module docstring)."""

    def __init__(
        self, hidden_size: int, cfg: CriticConfig, *, device: torch.device | str | None = None,
        method: MethodSpec | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        adv = None if method is None else method.advantage
        self.brace = adv if isinstance(adv, S.BraceAdvantage) else None
        lr = cfg.lr if self.brace is None else self.brace.critic_lr
        self.warmup_left = 0 if self.brace is None else self.brace.critic_warmup
        """Critic-only optimizer steps still to run before the policy's first step (BRACE's warm-up)."""
        self.head = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.params = list(self.head.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    def values(self, hidden: Float[Tensor, "B T H"], mask: Shaped[Tensor, "B T"]) -> Float[Tensor, "B T"]:
        """V(s_t) = w·h_t + b in float32, 0 outside the mask; h_t detached unless ``trunk_grad``."""
        h = hidden if self.cfg.trunk_grad else hidden.detach()
        return where_masked(self.head(h.float()).squeeze(-1), as_bool_mask(mask))

    def terms(
        self, *, method: MethodSpec, batch: Mapping[str, Any], hidden: Float[Tensor, "B T H"],
        old_values: Float[Tensor, "B T"] | None = None,
    ) -> CriticTerms:  # fmt: skip
        """Values, weighted loss and metrics for ``batch`` (the loss batch without ``values``) and its hidden states.

        The targets are COPC's V(s_t) + Â_t (:func:`~steadyrl.methods.compose.copc_value_targets`) or BRACE's V_targ
        (:func:`~steadyrl.methods.compose.brace_value_targets`), computed with these values (detached) exactly as
        ``compute_loss`` computes the advantages. ``old_values``: BRACE's V_old of the value clip (None: these
        values, detached).
        """
        mask = batch["mask"]
        values = self.values(hidden, mask)
        detached = values.detach()
        if isinstance(method.advantage, S.BraceAdvantage):
            targets = brace_value_targets(method, {**batch, "values": detached})
            clip = method.advantage.value_clip
            old = detached if old_values is None else old_values
            raw = value_loss(values, targets, mask) if clip is None else clipped_value_loss(
                values, old, targets, mask, clip
            )
        else:
            targets = copc_value_targets(method, {**batch, "values": detached})
            raw = value_loss(values, targets, mask)
        metrics: Metrics = {
            "critic/loss": raw.detach(),
            "critic/explained_var": explained_variance(detached, targets, mask),
            "critic/value_mean": masked_mean(detached, as_bool_mask(mask)),
        }
        return CriticTerms(values=detached, loss=self.cfg.value_coef * raw, metrics=metrics)

    def zero_grad(self) -> None:
        """Drop the head's gradient (at the start of every optimizer step, and after a skipped one)."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Clip the head's gradient to ``grad_clip`` and apply one AdamW step (call when the actor steps, and on
        each critic-only warm-up step)."""
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()

    def warmup_step(self) -> bool:
        """Whether this optimizer step is critic-only (BRACE's warm-up); counts it down when it is."""
        if self.warmup_left <= 0:
            return False
        self.warmup_left -= 1
        return True

    def state_dict(self) -> dict[str, Any]:
        """Head weights, AdamW state (and BRACE's critic-only steps left)."""
        state: dict[str, Any] = {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.brace is not None:
            state["warmup_left"] = self.warmup_left
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.warmup_left = int(state.get("warmup_left", 0))
