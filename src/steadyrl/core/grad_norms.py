"""Per-trajectory squared gradient norms ‖∇_θ w_i Σ_t m_{i,t} log π_θ(y_{i,t})‖², for OPOB, without micro-batch 1.

VCPO's off-policy optimal baseline (arXiv 2602.17616, OPOB; docs/algorithms.md) weighs trajectory i by
W_i = w_i² ‖∇_θ log π_θ(y_i)‖², so it needs one squared gradient norm per trajectory: the batch key
``grad_sq_norms`` of :func:`steadyrl.compute_loss`. The authors' code runs one backward pass per trajectory at
micro-batch 1. Here, for any model and any function that computes its log-probs,

    n_i = ‖∇_θ ℓ_i‖²,   ℓ_i = w_i Σ_t m_{i,t} logp_fn(model)_{i,t}   (w_i = 1 unless ``weights`` is given),

summed over every trainable parameter of the model (a tied parameter counts once: its gradient is the sum of the
gradients of all its uses)::

    norms = steadyrl.per_trajectory_grad_sq_norms(model, lambda m: my_logprobs(m, batch), mask)   # [B]

Two methods compute it (:mod:`steadyrl.train.grad_norms` adds ``"vmap"`` and a per-trajectory reference for the
learner's token batches):

- ``"ghost"`` (default): one forward and one backward over the whole batch of Σ_i ℓ_i. Forward hooks record each
  parametrized module's inputs and outputs; one ``torch.autograd.grad`` call returns the gradients with respect to
  those outputs (the weights' own batch gradients are never formed). Samples do not interact in a causal LM (padding
  is masked out of attention), so row i of an output gradient is ∂ℓ_i/∂output_i and every per-sample gradient follows
  layer by layer:

  * ``nn.Linear`` (x ↦ W a + b): per-sample ∇W_i = Σ_s g_{i,s} a_{i,s}ᵀ, ∇b_i = Σ_s g_{i,s}. Its squared norm is
    either the **ghost norm** (Goodfellow, arXiv 1510.01799; ghost clipping, Li et al., arXiv 2110.05679)
    ‖Σ_s g_s a_sᵀ‖²_F = Σ_{s,t} (g_s·g_t)(a_s·a_t), from two S×S Gram matrices, or the materialized [N, out, in]
    gradient; the cheaper one is chosen per parameter from the shapes (mixed ghost clipping, Bu et al.,
    arXiv 2205.10683: Gram form when roughly S² (out + in) < S·out·in).
  * ``nn.Embedding`` (ids ↦ E[ids]): ∇E_i = Σ_s onehot(id_{i,s}) e_{i,s}ᵀ, e the output gradient (rows at
    ``padding_idx`` get no gradient, as in PyTorch). Not tied to a Linear (``auto``): n_i = Σ_v ‖Σ_{s: id_s = v} e_s‖²,
    a segment sum per (sample, id), O(S·C) a sample; tied, or forced: Gram form Σ_{s,t} [id_s = id_t] (e_s·e_t), or a
    scatter-add into [N, V, C].
  * A parameter used more than once (**tied** input/output embeddings: ``embed_tokens`` and ``lm_head`` share one
    matrix; or a module called twice) has the per-sample gradient Σ_u G_{i,u}, so its squared norm is not the sum of
    the uses' norms: n = Σ_{u,v} ⟨G_u, G_v⟩ with the cross terms in Gram form, e.g. embedding × lm_head
    ⟨Σ_s onehot(id_s) e_sᵀ, Σ_t g_t a_tᵀ⟩ = Σ_{s,t} g_t[id_s] (e_s·a_t), or by materializing Σ_u G_u
    (again the cheaper of the two).
  * An output layer a subclass leaves unhooked (``skip``; :class:`steadyrl.train.grad_norms.GhostPass` where the
    chunked head applies): ``_Head``, from the layer's inputs h, the scored tokens y and the temperature τ. With
    g_t = ∂ℓ_i/∂z_t = m_t (onehot(y_t) − p_t)/τ, ‖Σ_t g_t h_tᵀ‖² = Σ_{s,t} K_st (h_s·h_t), K_st = g_s·g_t =
    m_s m_t ([y_s = y_t] − p_t(y_s) − p_s(y_t) + Σ_v p_s(v) p_t(v))/τ², where p_t(y_s) is a [T, T] product with the
    rows W[y] and Σ_v p_s p_t runs over vocabulary chunks; a tied embedding adds 2 Σ_{s,t} g_t[id_s] (e_s·h_t).
    That kernel costs T² (V + H) a sample; materializing Σ_t g_t h_tᵀ one vocabulary chunk at a time costs T V H, so
    (``auto``) the kernel is used while T < H roughly, and long responses take the materialized form, the embedding's
    rows added chunk by chunk. The bias always takes the materialized form (T V against T² V).
  * Any other module with its own trainable parameters (RMSNorm weights, LayerNorm, subclasses that override
    ``forward``): per-sample gradients of its direct parameters by ``vmap`` over the batch of a ``vjp`` of that
    module alone, at the recorded input with the recorded output gradient row as cotangent (materialized).

- ``"naive"``: the reference: one batched forward of ``logp_fn``, then one backward per trajectory.

w_i is a detached constant, so every method computes ‖∇ Σ_t m log π‖² and multiplies by w_i² afterwards (exact).

Side effects: none left behind. No ``.grad`` is read or written (every gradient comes from ``torch.autograd.grad``),
hooks are removed in ``finally``. The model's train/eval mode is not changed: with dropout active the methods draw
different masks and disagree.

Assumptions of "ghost" (checked where cheap): every parametrized module's input and output have the batch first
(row i of the batch is trajectory i, as in ``logp_fn``'s output); parameters are used only through their own module's
``forward``; a recorded output is not modified in place later (checked via tensor versions); no cross-sample
interaction (true for causal LMs; verified against "naive" in tests). Memory: a training step's activations plus, at
the end of the backward, the gradients of every recorded module output at once (about one more copy of them); the
result is per row, so a caller can split the batch by rows to bound it. Activation checkpointing: "ghost" and "naive"
work with non-reentrant checkpointing (``use_reentrant=False``); reentrant checkpointing refuses
``torch.autograd.grad``.

Shapes: ``logp_fn(model)`` ``[N, T]`` (with gradient), ``mask`` ``[N, T]``, ``weights`` ``[N]`` → ``[N]`` (float32, or
float64 for a float64 model), detached. Reduction: sum over tokens inside ℓ_i, squared L2 norm over all trainable
parameters; no reduction over trajectories.
Confidence: [exact] (an identity of the gradient; the methods agree to ~1e-15 relative in float64).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

CoreGradNormMethod = Literal["ghost", "naive"]
GhostStrategy = Literal["auto", "gram", "materialize"]
CORE_GRAD_NORM_METHODS: tuple[str, ...] = get_args(CoreGradNormMethod)
GHOST_STRATEGIES: tuple[str, ...] = get_args(GhostStrategy)

#: The most elements the per-sample norm sums hold at once (:meth:`GhostPass.sq_norms`: Gram matrices cached across
#: parameters, or materialized per-sample gradients, of one chunk of rows; at least one row): 2^26, 256 MiB in float32.
NORM_SUM_ELEMENTS: int = 2**26
#: Float dtypes the Gram sums run in as they are; others (bf16, fp16) are upcast to float32 first.
_FULL_PRECISION = (torch.float32, torch.float64)

#: ``logp_fn(model)``: the per-token log-probs ``[N, T]`` of the batch under ``model``, with gradient.
LogpFn = Callable[[nn.Module], Tensor]


def per_trajectory_grad_sq_norms(
    model: nn.Module,
    logp_fn: Callable[[nn.Module], Tensor],
    mask: Tensor,
    *,
    method: CoreGradNormMethod | str = "ghost",
    weights: Float[Tensor, " N"] | None = None,
    ghost_strategy: GhostStrategy | str = "auto",
) -> Float[Tensor, " N"]:
    """n_i = ‖∇_θ w_i Σ_t m_{i,t} log π_θ(y_{i,t})‖² for every trajectory: the ``grad_sq_norms`` batch key (OPOB, VCPO).

    ===================  ======  =====================================================================================
    argument             shape   meaning
    ===================  ======  =====================================================================================
    ``model``                    any ``nn.Module`` whose trainable parameters define θ (a causal LM)
    ``logp_fn``                  ``logp_fn(model)`` → ``[N, T]`` log π_θ of the sampled tokens, with gradient: the
                                 same forward that gives ``compute_loss`` its ``logp`` (called once, under grad)
    ``mask``             [N, T]  m: tokens summed into ℓ_i (bool or 0/1), usually the batch's ``mask``
    ``method``                   ``ghost`` (one batched forward + backward) | ``naive`` (one backward per trajectory,
                                 the reference)
    ``weights``          [N]     w_i, a detached per-trajectory factor on ℓ_i, so n_i = w_i² ‖∇ Σ_t m log π‖²
                                 (applied after the norm); None: 1
    ``ghost_strategy``           ``auto`` (cheaper of Gram / materialized per parameter) | ``gram`` | ``materialize``
    ===================  ======  =====================================================================================

    Returns ``[N]`` detached, float32 (float64 for a float64 model), summed over all trainable parameters; rows
    with no masked-in token give 0. ``.grad`` of the parameters is neither read nor changed (module docstring).
    """
    if method not in CORE_GRAD_NORM_METHODS:
        raise ValueError(f"method={method!r} is not one of {', '.join(CORE_GRAD_NORM_METHODS)}")
    if ghost_strategy not in GHOST_STRATEGIES:
        raise ValueError(f"ghost_strategy={ghost_strategy!r} is not one of {', '.join(GHOST_STRATEGIES)}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [N, T]; got shape {tuple(mask.shape)}")
    N = mask.shape[0]
    if weights is not None and tuple(weights.shape) != (N,):
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected {(N,)}")
    dtype = _result_dtype(model)
    if N == 0 or not _trainable(model):
        return torch.zeros(N, dtype=dtype, device=mask.device)
    with torch.enable_grad():
        if method == "naive":
            out = _naive(model, logp_fn, mask.bool(), dtype)
        else:
            with GhostPass(model, logp_fn, mask, strategy=ghost_strategy) as ghost:
                out = ghost.sq_norms().to(dtype)
    if weights is not None:
        out = out * weights.detach().to(dtype).square()  # ‖∇(w_i Σ_t m log π)‖² = w_i² ‖∇ Σ_t m log π‖² (w_i constant)
    return out.detach()


# ---------------------------------------------------------------------------------------------------------------------
# Shared: the objective ℓ_i and the parameters it is differentiated by


def masked_row_sums(logp: Tensor, mask: Tensor) -> Tensor:
    """Σ_t m_{i,t} logp_{i,t} per row ``[N]``.

    ``torch.where``, not a product: a token outside a top-k/top-p set has logp = −inf and must give 0, not NaN.
    """
    if tuple(logp.shape) != tuple(mask.shape):
        raise ValueError(f"logp_fn returned shape {tuple(logp.shape)}; the mask is {tuple(mask.shape)}")
    return torch.where(mask.bool(), logp, torch.zeros_like(logp)).sum(dim=-1)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each once (a tied parameter appears once)."""
    return [p for p in model.parameters() if p.requires_grad]


def _result_dtype(model: nn.Module) -> torch.dtype:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return torch.promote_types(dtype, torch.float32)


def _sq_norm(tensors: Sequence[Tensor | None], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Σ over tensors of the squared L2 norm (None counts as 0)."""
    terms = [t.to(dtype).square().sum() for t in tensors if t is not None]
    return torch.stack(terms).sum() if terms else torch.zeros((), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------------------------------
# "naive": one batched forward, then one backward per trajectory (the reference)


def _naive(model: nn.Module, logp_fn: LogpFn, mask: Tensor, dtype: torch.dtype) -> Tensor:
    params = _trainable(model)
    ell = masked_row_sums(logp_fn(model), mask)  # ℓ_i [N]
    norms = []
    for i in range(ell.shape[0]):
        if not ell.requires_grad:  # nothing depends on θ: a constant
            norms.append(torch.zeros((), dtype=dtype, device=mask.device))
            continue
        grads = torch.autograd.grad(ell[i], params, allow_unused=True, retain_graph=True)  # ∇θ ℓ_i; .grad untouched
        norms.append(_sq_norm(grads, dtype, mask.device))
    return torch.stack(norms)


# ---------------------------------------------------------------------------------------------------------------------
# "ghost": one forward + one backward over the batch, per-layer norms from recorded activations and output gradients


@dataclass(frozen=True)
class _Call:
    """One call of a module that owns trainable parameters, recorded by the forward hook."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Tensor
    versions: tuple[int, ...]  # _version of the output and the tensor arguments at record time


@dataclass(frozen=True)
class _Outer:
    """Per-sample gradient G_i = Σ_s u_{i,s} w_{i,s}ᵀ of an [R, C] matrix parameter.

    ``u``: [N, S, R] dense (Linear: output gradients), or [N, S] integer rows (Embedding: one-hot of the ids);
    ``w``: [N, S, C] (Linear: inputs; Embedding: output gradients), or with ``group`` [N] (dense ``u`` only) the
    [U, S, C] inputs of a call that ran once for several samples (a shared prompt): sample i's factor is
    ``w[group[i]]``, its ``u`` row its own output gradient.
    """

    u: Tensor
    w: Tensor
    rows: int
    group: Tensor | None = None

    @property
    def indexed(self) -> bool:
        return self.u.dim() == 2


@dataclass(frozen=True)
class _Dense:
    """A materialized per-sample gradient ``g`` [N, *shape] (biases, norm weights, generic modules)."""

    g: Tensor
    #: 0-dim bool tensor, False when the fast path's re-run did not reproduce the recorded output (then the generic
    #: path replaces it); read to the host once per pass for all modules together. None: nothing to check.
    exact: Tensor | None = None


@dataclass
class _Head:
    """The output layer's per-sample gradient, never materialized: G_i = Σ_t g_{i,t} h_{i,t}ᵀ for its weight (or
    Σ_t g_{i,t} for its bias, ``of_bias``), with g_{i,t} = ∂ℓ_i/∂z_{i,t} = m_{i,t} (onehot(y_{i,t}) − p_{i,t}) / τ,
    z = W h + b the logits and p = softmax(z/τ). Every product with it runs over vocabulary chunks
    (:func:`_head_kernel`).

    ``h`` [N, T, H] the layer's inputs (detached), ``y`` [N, T] the scored tokens, ``m`` [N, T] 0/1 (the tokens in
    ℓ_i), ``weight`` [V, H], ``bias`` [V] or None, ``tau`` the temperature; ``lse`` [N, T] = log Σ_v exp(z_v/τ),
    filled on first use.
    """

    h: Tensor
    y: Tensor
    m: Tensor
    weight: Tensor
    bias: Tensor | None
    tau: float
    of_bias: bool = False
    lse: Tensor | None = None


_Contribution = _Outer | _Dense | _Head


class GhostPass:
    """One forward of ``logp_fn`` → per-trajectory squared gradient norms *and* the batch gradient.

    The "ghost" method as an object a trainer can keep between the norms and its own backward (VCPO's step):

    1. ``GhostPass(model, logp_fn, mask)`` runs ``logp_fn(model)`` with the recording hooks; ``.logp`` ``[N, T]``
       carries the graph (give it to ``compute_loss`` as ``logp``, detached with ``requires_grad_()``, and use
       :meth:`backward` for the gradient; or use it as it is and call ``loss.backward()`` yourself).
    2. :meth:`sq_norms` runs the one backward of Σ_i ℓ_i (ℓ_i = Σ_t m_{i,t} log π(y_{i,t})) to the recorded module
       outputs, keeps the per-sample contributions G_{i,u} of every parameter and returns n_i = ‖∇_θ ℓ_i‖² (as
       :func:`per_trajectory_grad_sq_norms`). The graph is kept for step 4.
    3. :meth:`accumulate_grad` with per-trajectory coefficients c ``[N]`` adds Σ_i c_i ∇_θ ℓ_i to each parameter's
       ``.grad`` **without another backward**: per parameter Σ_u Σ_i c_i G_{i,u} (Linear: Σ_{i,s} c_i g_{i,s}
       a_{i,s}ᵀ, one matmul, as autograd's weight gradient; Embedding: an index-add; others: Σ_i c_i g_i). This is
       the "book-keeping" trick of Bu et al. (arXiv 2210.00038): the weight gradients are formed once, from the
       stored activations and output gradients, after the per-sample norms are known. It is exact whenever the loss's
       gradient with respect to the log-probs is constant along each trajectory, ∂L/∂logp_{i,t} = c_i on its masked
       tokens — true for sequence-weighted REINFORCE with ``seq-mean-token-mean`` or ``seq-mean-token-sum``
       aggregation (VCPO: w̄_i A_i / (B L_i)).
    4. Otherwise :meth:`backward` takes the full ``∂L/∂logp`` ``[N, T]`` and backpropagates it through the kept
       graph (a second backward, the general case).

    ``mask`` ``[N, T]`` (bool or 0/1): the tokens summed into ℓ_i. Use as a context manager (or call :meth:`close`)
    so the graph and the stored tensors are released.
    """

    def __init__(
        self,
        model: nn.Module,
        logp_fn: Callable[[nn.Module], Tensor],
        mask: Tensor,
        *,
        strategy: GhostStrategy | str = "auto",
        skip: Sequence[nn.Module] = (),
    ) -> None:
        if strategy not in GHOST_STRATEGIES:
            raise ValueError(f"ghost_strategy={strategy!r} is not one of {', '.join(GHOST_STRATEGIES)}")
        if mask.dim() != 2:
            raise ValueError(f"mask must be [N, T]; got shape {tuple(mask.shape)}")
        self.model, self.mask, self.strategy = model, mask.bool(), strategy
        self.N = mask.shape[0]
        skipped = {id(m) for m in skip}  # a subclass forms these modules' contributions itself (_extra_contributions)
        owners = [m for m in model.modules()
                  if id(m) not in skipped and any(p.requires_grad for p in m.parameters(recurse=False))]  # fmt: skip
        calls: list[_Call] = []
        self._recorded = calls  # every recorded call in order (a subclass's forward may mark where a phase ends)
        handles = [m.register_forward_hook(_recorder(calls), with_kwargs=True) for m in owners]
        try:
            with torch.enable_grad():
                self.logp: Tensor = logp_fn(model)  # one forward, batched
        finally:
            for h in handles:
                h.remove()
        if tuple(self.logp.shape) != tuple(mask.shape):
            raise ValueError(f"logp_fn returned shape {tuple(self.logp.shape)}; the mask is {tuple(mask.shape)}")
        self._calls = [c for c in calls if c.output.requires_grad]
        self._contributions: dict[int, list[_Contribution]] | None = None
        self._params: dict[int, nn.Parameter] = {}
        self._norms: Tensor | None = None

    def __enter__(self) -> GhostPass:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the graph, the recorded calls and the per-sample contributions."""
        self._calls, self._recorded, self._contributions, self._params = [], [], {}, {}
        self.logp = self.logp.detach()

    def _objective_sum(self) -> Tensor:
        return masked_row_sums(self.logp, self.mask).sum()  # Σ_i ℓ_i

    def _output_grads(self, loss: Tensor) -> list[tuple[_Call, Tensor | None, Tensor | None]]:
        """(call, ∂(Σ_i ℓ_i)/∂output with row i = ∂ℓ_i/∂output_i [N, ...], row map) for every recorded call.

        One backward to the recorded module outputs only (samples independent); the weights' batch gradients are
        never formed and the graph is kept for :meth:`backward`. The row map is None here; a subclass whose forward
        runs some calls once for several samples returns ``group`` [N] for them (output gradient row i belongs to
        the call's input row ``group[i]``).
        """
        out_grads = torch.autograd.grad(loss, [c.output for c in self._calls], allow_unused=True, retain_graph=True)
        return [(call, g, None) for call, g in zip(self._calls, out_grads, strict=True)]

    def _record(self) -> dict[int, list[_Contribution]]:
        if self._contributions is not None:
            return self._contributions
        self._contributions = {}
        loss = self._objective_sum()
        if not loss.requires_grad:
            return self._contributions
        extra = self._extra_contributions()  # before the backward: a subclass may read the forward's state
        found: list[tuple[nn.Parameter, _Contribution, _Call, Tensor]] = []
        for call, g, group in self._output_grads(loss) if self._calls else []:
            if _versions(call.output, call.args, call.kwargs) != call.versions:
                raise RuntimeError(
                    f"{type(call.module).__name__}: a recorded tensor was modified in place after the call"
                )
            if g is None:
                continue
            if g.shape[0] != self.N or (group is None and call.output.shape[0] != self.N):
                raise ValueError(f"{type(call.module).__name__}: output {tuple(call.output.shape)} is not batch-first")
            if group is not None and not _plain_linear(call.module):
                call, group = _gathered(call, group), None  # the call's inputs repeated per sample
            found.extend((param, c, call, g) for param, c in _per_sample(call, g, group))
        checks = [c.exact for _, c, _, _ in found if isinstance(c, _Dense) and c.exact is not None]
        redo = bool(checks) and not bool(torch.stack(checks).all())  # one host read for the whole pass
        for param, c, call, g in found:
            if redo and isinstance(c, _Dense) and c.exact is not None and not bool(c.exact):
                c = next(d for q, d in _generic_per_sample(call, g) if q is param)
            self._contributions.setdefault(id(param), []).append(c)
            self._params[id(param)] = param
        for param, c in extra:
            self._contributions.setdefault(id(param), []).append(c)
            self._params[id(param)] = param
        return self._contributions

    def _extra_contributions(self) -> list[tuple[nn.Parameter, _Contribution]]:
        """Contributions of modules the hooks skipped (``skip``), formed by a subclass; none here."""
        return []

    def sq_norms(self) -> Tensor:
        """n_i = ‖∇_θ ℓ_i‖² ``[N]`` (detached; float32, or the parameters' float64), computed once.

        Rows are summed in chunks whose Gram matrices (cached across parameters) or materialized per-sample gradients
        hold at most :data:`NORM_SUM_ELEMENTS` elements (at least one row a chunk): the sums never hold S×S per row
        for every layer of the whole batch at once.
        """
        if self._norms is None:
            dtype = _result_dtype(self.model)
            total = torch.zeros(self.N, dtype=dtype, device=self.logp.device)
            contributions = list(self._record().values())
            step = max(1, NORM_SUM_ELEMENTS // max(1, _per_row_elements(contributions, self.strategy)))
            for start in range(0, self.N, step):
                rows = slice(start, min(self.N, start + step))
                grams: dict[tuple[Any, ...], Tensor] = {}  # a shared input (of q/k/v, of gate/up): one Gram matrix
                groups: dict[int, Tensor] = {}  # one slice per shared row map (the Gram-per-group path needs it)
                for parts in contributions:
                    chunk = [_row_slice(c, rows, groups) for c in parts]
                    total[rows] += _param_sq_norm(chunk, self.strategy, grams).to(dtype)
            self._norms = total.detach()
        return self._norms

    def accumulate_grad(self, coef: Tensor) -> None:
        """``p.grad += Σ_i coef_i ∇_p ℓ_i`` for every trainable parameter, from the stored contributions (step 3)."""
        if tuple(coef.shape) != (self.N,):
            raise ValueError(f"coef has shape {tuple(coef.shape)}, expected {(self.N,)}")
        coef = coef.detach()
        scaled = _RecentFactors()  # c_i x_{i,s} of the last few stored tensors (q/k/v share inputs, gate/up too)
        for key, parts in self._record().items():
            param = self._params[key]
            total = sum(_weighted_sum(c, coef, scaled) for c in parts)
            total = total.reshape(param.shape).to(param.dtype)
            param.grad = total if param.grad is None else param.grad + total

    def backward(self, grad_logp: Tensor) -> None:
        """Backpropagate ∂L/∂logp ``[N, T]`` through the kept graph into ``.grad`` (the general case, step 4)."""
        if self.logp.requires_grad:
            torch.autograd.backward(self.logp, grad_tensors=grad_logp.detach().to(self.logp.dtype))


class _RecentFactors(dict):
    """The scaled factors of :meth:`GhostPass.accumulate_grad`, keeping only the :data:`RECENT` newest: parameters
    that share an input (q/k/v, gate/up) come one after another, so older ones are not asked for again, and the
    weighted sums never hold a scaled copy of every layer's activations."""

    RECENT = 4

    def __setitem__(self, key: Any, value: Tensor) -> None:
        super().__setitem__(key, value)
        while len(self) > self.RECENT:
            del self[next(iter(self))]


def _row_slice(c: _Contribution, rows: slice, groups: dict[int, Tensor]) -> _Contribution:
    """Samples ``rows`` of a contribution (views; a shared factor stays whole, its row map sliced once per map)."""
    if isinstance(c, _Dense):
        return _Dense(c.g[rows], c.exact)
    if isinstance(c, _Head):
        lse = _head_lse(c)
        return _Head(c.h[rows], c.y[rows], c.m[rows], c.weight, c.bias, c.tau, c.of_bias, lse[rows])
    if c.group is None:
        return _Outer(u=c.u[rows], w=c.w[rows], rows=c.rows)
    if id(c.group) not in groups:
        groups[id(c.group)] = c.group[rows]
    return _Outer(u=c.u[rows], w=c.w, rows=c.rows, group=groups[id(c.group)])


def _per_row_elements(contributions: Sequence[list[_Contribution]], strategy: str) -> int:
    """Elements the norm sums hold per sample: every Gram matrix (cached for the whole pass) plus the largest
    transient (a Gram product, a materialized per-sample gradient, an embedding's segment sums)."""
    cached = transient = 0
    for parts in contributions:
        heads = [c for c in parts if isinstance(c, _Head)]
        if heads:  # [T, T] kernels and [S, T] cross products (the vocabulary chunks bound themselves)
            T, S = heads[0].h.shape[1], sum(c.w.shape[1] for c in parts if isinstance(c, _Outer))
            if any(_head_uses_kernel(h, strategy) for h in heads):
                transient = max(transient, 6 * T * T + 4 * S * T)
            continue
        outers = [c for c in parts if isinstance(c, _Outer)]
        if strategy == "auto" and len(outers) == len(parts) and all(c.indexed for c in outers):
            transient = max(transient, 2 * sum(c.w.shape[1] for c in outers) * outers[0].w.shape[2])
        elif _uses_gram(parts, outers, strategy):
            pairs = [a.w.shape[1] * b.w.shape[1] for j, a in enumerate(outers) for b in outers[j:]]
            cached += sum(pairs)
            transient = max(transient, 2 * max(pairs))
        else:
            transient = max(transient, sum(_numel_per_row(c) for c in parts))
    return cached + transient


def _numel_per_row(c: _Contribution) -> int:
    if isinstance(c, _Dense):
        return c.g[0].numel() if c.g.shape[0] else 0
    return c.rows * c.w.shape[2]


def _weighted_sum(c: _Contribution, coef: Tensor, cache: dict[tuple[Any, ...], Tensor]) -> Tensor:
    """Σ_i coef_i G_i of one contribution, shaped like its parameter (flattened for matrices: [R, C]).

    For a matrix, coef_i multiplies the narrower of the two factors (fewer multiplications), and a factor shared by
    several parameters (the input of q/k/v, of gate/up) is scaled once (``cache``, keyed by storage and shape).
    """
    if isinstance(c, _Dense):
        return torch.einsum("n,n...->...", coef.to(c.g.dtype), c.g)
    if isinstance(c, _Head):
        return _head_weighted_sum(c, coef)
    (N, S), C = c.u.shape[:2], c.w.shape[2]

    def scale(x: Tensor) -> Tensor:
        key = (x.data_ptr(), tuple(x.shape), x.stride())
        if key not in cache:
            cache[key] = x * coef.to(x.dtype).view(N, *([1] * (x.dim() - 1)))  # c_i x_{i,s}
        return cache[key]

    if c.indexed:  # Σ_{i,s} onehot(id_{i,s}) (c_i w_{i,s})ᵀ
        return c.w.new_zeros(c.rows, C).index_add_(0, c.u.reshape(-1), scale(c.w).reshape(N * S, C))
    if c.group is not None:  # Σ_U (Σ_{i in U} c_i u_{i,s}) w_{U,s}ᵀ: the shared factor once per group
        summed = c.u.new_zeros(c.w.shape[0], *c.u.shape[1:]).index_add_(0, c.group, scale(c.u))
        return summed.reshape(-1, c.rows).transpose(0, 1) @ c.w.reshape(-1, C)
    u, w = (scale(c.u), c.w) if c.rows <= C else (c.u, scale(c.w))
    return u.reshape(N * S, c.rows).transpose(0, 1) @ w.reshape(N * S, C)  # Σ_{i,s} c_i u_{i,s} w_{i,s}ᵀ


def _recorder(calls: list[_Call]) -> Callable[..., None]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not isinstance(output, Tensor):
            raise TypeError(f"{type(module).__name__} returns {type(output).__name__}; ghost norms need a tensor")
        calls.append(_Call(module, args, kwargs, output, _versions(output, args, kwargs)))

    return hook


def _versions(output: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    leaves = tree_flatten((args, kwargs))[0]
    return (output._version, *(x._version for x in leaves if isinstance(x, Tensor)))


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` computing x Wᵀ + b (steadyrl.base.device's float32 output layer is the same map)."""
    plain = type(module).forward is nn.Linear.forward or getattr(module, "computes_linear", False)
    return isinstance(module, nn.Linear) and bool(plain)


def _gathered(call: _Call, group: Tensor) -> _Call:
    """``call`` as if it had run on every sample: batch-first tensor arguments and the output indexed by ``group``."""
    U = call.output.shape[0]

    def take(x: Any) -> Any:
        return x[group] if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == U else x

    args, kwargs = tree_map(take, (call.args, call.kwargs))
    output = call.output[group]
    return _Call(call.module, args, kwargs, output, _versions(output, args, kwargs))


def _per_sample(call: _Call, g: Tensor, group: Tensor | None = None) -> list[tuple[nn.Parameter, _Contribution]]:
    """(parameter, its per-sample gradient from this call) for the trainable direct parameters of ``call.module``.

    ``group`` [N] (plain Linear only): the call ran on U input rows, output gradient row i belongs to input row
    ``group[i]`` (the input factor is kept at U rows, :class:`_Outer`)."""
    module, N = call.module, g.shape[0]
    x = call.args[0] if call.args else next(iter(call.kwargs.values()), None)
    if _plain_linear(module):
        U = N if group is None else x.shape[0]
        a = _full(x.detach()).reshape(U, -1, module.in_features)  # a_{i,s}: [N, S, in] (or [U, S, in] shared)
        gg = _full(g).reshape(N, -1, module.out_features)  # g_{i,s}: [N, S, out]
        out: list[tuple[nn.Parameter, _Contribution]] = []
        if module.weight.requires_grad:  # ∇W_i = Σ_s g_s a_sᵀ
            out.append((module.weight, _Outer(u=gg, w=a, rows=module.out_features, group=group)))
        if module.bias is not None and module.bias.requires_grad:
            out.append((module.bias, _Dense(gg.sum(dim=1))))  # ∇b_i = Σ_s g_s
        return out
    if isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward:
        if module.max_norm is not None or module.scale_grad_by_freq:
            raise ValueError("ghost norms do not support nn.Embedding with max_norm or scale_grad_by_freq")
        ids = x.reshape(N, -1)  # id_{i,s}: [N, S]
        e = _full(g).reshape(N, ids.shape[1], module.embedding_dim)  # e_{i,s}: [N, S, D]
        if module.padding_idx is not None:
            e = e.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0.0)  # the padding row gets no gradient
        return [(module.weight, _Outer(u=ids, w=e, rows=module.num_embeddings))]  # ∇E_i = Σ_s onehot(id_s) e_sᵀ
    fast = _rms_norm_per_sample(call, g)
    return fast if fast is not None else _generic_per_sample(call, g)


def _rms_norm_per_sample(call: _Call, g: Tensor) -> list[tuple[nn.Parameter, _Contribution]] | None:
    """Per-sample gradient of an RMSNorm's scale (``*RMSNorm`` with one 1-D ``weight``) in one batched vjp.

    The module is re-run with its weight broadcast per sample ([N, 1, …, 1, D]); the vjp of that call with the
    output gradient gives every sample's gradient at once (the scale multiplies the normalized input elementwise, so
    row i of the output depends on copy i only). Used only when the re-run reproduces the recorded output exactly:
    the check is returned as ``exact`` and read once per pass for all modules together (where it fails, the generic
    per-row vjp replaces it); None for a module that refuses the broadcast weight (``torch.nn.RMSNorm`` checks the
    weight's shape) — the generic path runs then too.
    """
    module, N = call.module, g.shape[0]
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if (not type(module).__name__.endswith("RMSNorm") or set(params) != {"weight"} or weight is None
            or weight.dim() != 1 or call.output.dim() < 2 or call.output.shape[-1] != weight.shape[0]):  # fmt: skip
        return None
    args, kwargs = tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, (call.args, call.kwargs))
    per_sample = weight.detach().view((1,) * (call.output.dim() - 1) + (-1,))
    per_sample = per_sample.expand((N,) + (1,) * (call.output.dim() - 2) + (-1,)).clone().requires_grad_(True)
    with torch.enable_grad():
        try:
            out = functional_call(module, {"weight": per_sample}, args, kwargs)
        except RuntimeError:
            return None
        if out.shape != call.output.shape or out.dtype != call.output.dtype:
            return None
        exact = (out.detach() == call.output.detach()).all()  # read for all modules at once (GhostPass._record)
        (grad_w,) = torch.autograd.grad(out, per_sample, grad_outputs=g.to(out.dtype))
    return [(weight, _Dense(_full(grad_w.reshape(N, -1)), exact=exact))]


def _full(t: Tensor) -> Tensor:
    return t if t.dtype in _FULL_PRECISION else t.float()


def _generic_per_sample(call: _Call, g: Tensor) -> list[tuple[nn.Parameter, _Contribution]]:
    """Per-sample gradients of a module's direct parameters: vmap over rows of the vjp of the module alone.

    Tensor arguments with the batch size as first dimension are split by row (each row keeps a batch dim of 1);
    other arguments are passed whole.
    """
    module, N = call.module, g.shape[0]
    params = {name: p for name, p in module.named_parameters(recurse=False) if p.requires_grad}
    leaves, tree = tree_flatten((call.args, call.kwargs))
    split = [isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == N for x in leaves]
    fixed = [x.detach() if isinstance(x, Tensor) else x for x in leaves]
    per_row = [x for x, s in zip(fixed, split, strict=True) if s]

    primal = {k: v.detach() for k, v in params.items()}

    def one(rows: list[Tensor], cotangent: Tensor) -> dict[str, Tensor]:
        it = iter(rows)
        args, kwargs = tree_unflatten([next(it)[None] if s else x for x, s in zip(fixed, split, strict=True)], tree)
        _, pullback = vjp(lambda p: functional_call(module, p, args, kwargs), primal)
        return pullback(cotangent[None])[0]  # ∇_p ⟨g_i, module(x_i; p)⟩ = per-sample ∇p

    grads = vmap(one)(per_row, g.detach())
    return [(params[name], _Dense(_full(grads[name]))) for name in params]


# --- squared norm of one parameter's per-sample gradient Σ_u G_{i,u}


def _param_sq_norm(
    parts: list[_Contribution], strategy: str, grams: dict[tuple[Any, ...], Tensor] | None = None
) -> Tensor:
    """n_i(p) = ‖Σ_u G_{i,u}‖²: Gram form Σ_{u,v} ⟨G_u, G_v⟩ or materialized, per ``strategy`` / the cost estimate.

    ``grams`` caches the S×S Gram matrices of factors shared between parameters (pass the same dict for a batch).
    """
    grams = {} if grams is None else grams
    heads = [c for c in parts if isinstance(c, _Head)]
    if heads:  # the output layer (with, when tied, the embedding's one-hot contributions)
        head, others = heads[0], [c for c in parts if not isinstance(c, _Head)]
        tied_to_embedding = all(isinstance(c, _Outer) and c.indexed for c in others)
        if len(heads) > 1 or not tied_to_embedding or (head.of_bias and others):
            raise ValueError("ghost norms: the output layer's weight is used by a module other than an embedding")
        if not _head_uses_kernel(head, strategy):
            return _head_materialized_sq_norm(head, others)  # type: ignore[arg-type]
        total = _head_sq_norm(head)
        if others:  # ‖E + G‖² = ‖E‖² + ‖G‖² + 2⟨E, G⟩
            total = total + _param_sq_norm(others, strategy, grams)
            total = total + 2.0 * sum(_head_cross(o, head) for o in others)  # type: ignore[arg-type]
        return total
    outers = [c for c in parts if isinstance(c, _Outer)]
    if strategy == "auto" and len(outers) == len(parts) and all(c.indexed for c in outers):
        return _indexed_sq_norm(outers)  # an embedding not tied to a Linear: O(S·C), neither S² nor V·C
    if _uses_gram(parts, outers, strategy):
        total = sum(_outer_inner(a, a, grams) for a in outers)  # Σ_u ‖G_u‖²
        for j, a in enumerate(outers):
            for b in outers[j + 1 :]:
                total = total + 2.0 * _outer_inner(a, b, grams)  # + 2 Σ_{u<v} ⟨G_u, G_v⟩ (tied / reused parameters)
        return total
    G = sum(_materialize(c) for c in parts)  # Σ_u G_{i,u}: [N, numel]
    return G.square().sum(dim=1)


def _head_chunk(c: _Head, width: int | None = None) -> int:
    """Vocabulary rows per chunk: N·width·chunk elements at most ``vocab_chunks.DEFAULT_CHUNK_ELEMENTS`` (``width``:
    T by default, the [N, T, chunk] logits; the materialized form also holds [N, chunk, H])."""
    from steadyrl.core.vocab_chunks import DEFAULT_CHUNK_ELEMENTS

    return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, c.h.shape[0] * (c.h.shape[1] if width is None else width)))


def _head_logits(c: _Head, rows: slice) -> Tensor:
    """z_v / τ for the vocabulary rows ``rows``: [N, T, chunk]."""
    w = c.weight[rows].to(c.h.dtype)
    z = c.h @ w.transpose(0, 1)
    if c.bias is not None:
        z = z + c.bias[rows].to(c.h.dtype)
    return z / c.tau


def _head_chunks(c: _Head) -> list[slice]:
    V, step = c.weight.shape[0], _head_chunk(c)
    return [slice(v, min(V, v + step)) for v in range(0, V, step)]


def _head_lse(c: _Head) -> Tensor:
    """log Σ_v exp(z_v/τ) [N, T], over vocabulary chunks; computed once per contribution."""
    if c.lse is None:
        lse = torch.full(c.y.shape, -torch.inf, dtype=c.h.dtype, device=c.h.device)
        for rows in _head_chunks(c):
            lse = torch.logaddexp(lse, _head_logits(c, rows).logsumexp(dim=-1))
        c.lse = lse
    return c.lse


def _head_at(c: _Head, ids: Tensor) -> Tensor:
    """p_t(ids_s) = exp(z_t(ids_s)/τ − lse_t) for every s, t: [N, S, T] (``ids`` [N, S])."""
    w = c.weight[ids].to(c.h.dtype)  # [N, S, H]
    z = torch.bmm(w, c.h.transpose(1, 2))  # z_t(ids_s): [N, S, T]
    if c.bias is not None:
        z = z + c.bias[ids].to(c.h.dtype).unsqueeze(-1)
    return torch.exp(z / c.tau - _head_lse(c).unsqueeze(1))


def _head_kernel(c: _Head) -> Tensor:
    """K_{s,t} = g_s·g_t = m_s m_t ([y_s = y_t] − p_t(y_s) − p_s(y_t) + Σ_v p_s(v) p_t(v)) / τ² per sample: [N, T, T].

    The last sum runs over vocabulary chunks; p_t(y_s) is one [T, T] product with the rows W[y]: no [N, T, V]."""
    lse = _head_lse(c)
    q = torch.zeros((*c.y.shape, c.y.shape[1]), dtype=c.h.dtype, device=c.h.device)
    for rows in _head_chunks(c):
        p = torch.exp(_head_logits(c, rows) - lse.unsqueeze(-1))  # [N, T, chunk]
        q = q + torch.bmm(p, p.transpose(1, 2))
    at = _head_at(c, c.y)  # [N, S=T, T]: p_t(y_s)
    same = (c.y.unsqueeze(2) == c.y.unsqueeze(1)).to(c.h.dtype)
    m = c.m.to(c.h.dtype)
    return (same - at - at.transpose(1, 2) + q) * (m.unsqueeze(2) * m.unsqueeze(1)) / c.tau**2


def _head_sq_norm(c: _Head) -> Tensor:
    """‖G_i‖² [N]: Σ_{s,t} K_{s,t} (h_s·h_t) for the weight, Σ_{s,t} K_{s,t} for the bias."""
    k = _head_kernel(c)
    if c.of_bias:
        return k.sum(dim=(1, 2))
    return (k * torch.bmm(c.h, c.h.transpose(1, 2))).sum(dim=(1, 2))


def _head_cross(e: _Outer, c: _Head) -> Tensor:
    """⟨Σ_s onehot(id_s) e_sᵀ, Σ_t g_t h_tᵀ⟩ = Σ_{s,t} g_t[id_s] (e_s·h_t) per sample (a tied embedding): [N]."""
    ids = e.u  # [N, S]
    g = (c.y.unsqueeze(1) == ids.unsqueeze(2)).to(c.h.dtype) - _head_at(c, ids)  # [N, S, T]: τ g_t[id_s] / m_t
    g = g * c.m.to(c.h.dtype).unsqueeze(1) / c.tau
    return (g * torch.bmm(e.w.to(c.h.dtype), c.h.transpose(1, 2))).sum(dim=(1, 2))


def _head_uses_kernel(c: _Head, strategy: str) -> bool:
    """Whether the output layer's norm takes the [T, T] kernel (``gram``; ``auto``: while T² (V + H) ≤ T V H + V H)
    rather than the per-sample gradient materialized over vocabulary chunks (``materialize``; always for the bias)."""
    if c.of_bias or strategy == "materialize":
        return False
    if strategy == "gram":
        return True
    (T, H), V = c.h.shape[1:], c.weight.shape[0]
    return T * T * (V + H) <= T * V * H + V * H


def _head_materialized_sq_norm(c: _Head, embeddings: Sequence[_Outer]) -> Tensor:
    """‖G_i + Σ_e E_i‖² [N] with G_i = Σ_t g_t h_tᵀ (or Σ_t g_t for the bias) formed one vocabulary chunk at a time:
    [N, chunk, H] per chunk, never [N, V, H]; a tied embedding's rows Σ_{s: id_s = v} e_s are added to the chunk
    that holds v."""
    N, T, H = c.h.shape
    V, lse = c.weight.shape[0], _head_lse(c)
    a = c.m.to(c.h.dtype) / c.tau  # [N, T]: m_t / τ
    step = _head_chunk(c, T if c.of_bias else max(T, H))  # [N, chunk, H] within the budget too
    rows_of = torch.arange(N, device=c.h.device).unsqueeze(1)
    total = c.h.new_zeros(N)
    for v0 in range(0, V, step):
        rows = slice(v0, min(V, v0 + step))
        width = rows.stop - rows.start
        g = torch.exp(_head_logits(c, rows) - lse.unsqueeze(-1)).mul_(-a.unsqueeze(-1))  # −m p / τ: [N, T, chunk]
        hit = (c.y >= rows.start) & (c.y < rows.stop)  # + m onehot(y) / τ where y_t falls in this chunk
        g.scatter_add_(2, (c.y - rows.start).clamp(0, width - 1).unsqueeze(-1), (a * hit).unsqueeze(-1))
        if c.of_bias:
            total = total + g.sum(dim=1).square().sum(dim=1)
            continue
        flat = c.h.new_empty(N * width + 1, H)  # the chunk's rows of every G_i, and a spare row for ids outside it
        G = flat[: N * width].view(N, width, H)
        torch.bmm(g.transpose(1, 2), c.h, out=G)  # Σ_t g_t h_tᵀ on this chunk
        for e in embeddings:  # + Σ_{s: id_s = v} e_s for the ids v in this chunk
            inside = (e.u >= rows.start) & (e.u < rows.stop)
            slot = torch.where(inside, rows_of * width + (e.u - rows.start), N * width)
            flat.index_add_(0, slot.reshape(-1), e.w.to(flat.dtype).reshape(-1, H))
        total = total + G.square().sum(dim=(1, 2))
    return total


def _head_weighted_sum(c: _Head, coef: Tensor) -> Tensor:
    """Σ_i coef_i G_i: Σ_{i,t} coef_i g_{i,t} h_{i,t}ᵀ [V, H] (or Σ_{i,t} coef_i g_{i,t} [V]), the softmax part over
    vocabulary chunks."""
    V, lse = c.weight.shape[0], _head_lse(c)
    a = coef.to(c.h.dtype).unsqueeze(1) * c.m.to(c.h.dtype) / c.tau  # [N, T]: coef_i m_{i,t} / τ
    if c.of_bias:
        out = torch.zeros(V, dtype=c.h.dtype, device=c.h.device).index_add_(0, c.y.reshape(-1), a.reshape(-1))
        for rows in _head_chunks(c):
            p = torch.exp(_head_logits(c, rows) - lse.unsqueeze(-1))
            out[rows] -= (p * a.unsqueeze(-1)).sum(dim=(0, 1))
        return out
    x = (c.h * a.unsqueeze(-1)).reshape(-1, c.h.shape[2])  # [N·T, H]
    out = torch.zeros(V, c.h.shape[2], dtype=c.h.dtype, device=c.h.device).index_add_(0, c.y.reshape(-1), x)
    for rows in _head_chunks(c):
        p = torch.exp(_head_logits(c, rows) - lse.unsqueeze(-1)).reshape(-1, rows.stop - rows.start)
        out[rows] -= p.transpose(0, 1) @ x
    return out


def _uses_gram(parts: list[_Contribution], outers: list[_Outer], strategy: str) -> bool:
    """Whether a parameter's norm takes the Gram form (``gram``; ``auto``: when it costs no more than materializing)."""
    return len(outers) == len(parts) and (
        strategy == "gram" or (strategy == "auto" and _gram_cost(outers) <= _materialize_cost(outers))
    )


def _indexed_sq_norm(parts: list[_Outer]) -> Tensor:
    """‖Σ_u Σ_s onehot(id_{i,s}) e_{i,s}ᵀ‖² per sample for contributions that are all one-hot (an embedding's calls).

    Row v of sample i's gradient is Σ_{s: id_{i,s} = v} e_{i,s}, so n_i = Σ_v ‖Σ_{s: id_{i,s} = v} e_{i,s}‖²: a segment
    sum over the sorted (sample, id) keys, then squares. Memory and work O(N·S·C), against the Gram form's N·S²·C and
    the materialized [N, V, C] (2 GiB a sample at V = 128k, C = 4096). No host read: the segments are counted in a
    buffer of N·S rows, the unused ones staying 0.
    """
    ids = torch.cat([c.u for c in parts], dim=1)  # [N, S]: every call's ids
    e = torch.cat([c.w for c in parts], dim=1)  # [N, S, C] (0 at padding_idx)
    (N, S), C, V = ids.shape, e.shape[2], parts[0].rows
    rows = torch.arange(N, device=ids.device).unsqueeze(1)
    key = (rows * V + ids).reshape(-1)  # (sample, id) as one int64
    order = torch.argsort(key)
    sorted_key = key[order]
    starts = torch.ones_like(sorted_key, dtype=torch.bool)
    starts[1:] = sorted_key[1:] != sorted_key[:-1]
    segment = torch.cumsum(starts, 0) - 1  # [N·S]: the (sample, id) each sorted position sums into
    sums = e.new_zeros(N * S, C).index_add_(0, segment, e.reshape(N * S, C)[order])
    owner = torch.zeros(N * S, dtype=torch.long, device=ids.device).scatter_(0, segment, sorted_key // V)
    return e.new_zeros(N).index_add_(0, owner, sums.square().sum(dim=1))


def _bmm_t(x: Tensor, y: Tensor, cache: dict[tuple[Any, ...], Tensor]) -> Tensor:
    """x yᵀ per sample ([N, S, C] × [N, S', C] → [N, S, S']), cached by the two tensors' storage, shape and strides."""
    key = (x.data_ptr(), tuple(x.shape), x.stride(), y.data_ptr(), tuple(y.shape), y.stride())
    if key not in cache:
        cache[key] = torch.bmm(x, y.transpose(1, 2))
    return cache[key]


def _outer_inner(a: _Outer, b: _Outer, grams: dict[tuple[Any, ...], Tensor]) -> Tensor:
    """⟨Σ_s u_s w_sᵀ, Σ_t u'_t w'_tᵀ⟩_F = Σ_{s,t} (u_s·u'_t)(w_s·w'_t) per sample: [N]."""
    N, Sa, Sb = a.u.shape[0], a.w.shape[1], b.w.shape[1]
    if a.indexed and b.indexed:
        U = (a.u.unsqueeze(2) == b.u.unsqueeze(1)).to(a.w.dtype)  # onehot(id_s)·onehot(id'_t) = [id_s = id'_t]
    elif a.indexed:
        U = torch.gather(b.u, 2, a.u.unsqueeze(1).expand(N, Sb, Sa)).transpose(1, 2)  # u'_t[id_s]
    elif b.indexed:
        U = torch.gather(a.u, 2, b.u.unsqueeze(1).expand(N, Sa, Sb))  # u_s[id'_t]
    else:
        U = torch.bmm(a.u, b.u.transpose(1, 2))  # u_s·u'_t
    if a.group is not None and a.group is b.group:  # both factors shared the same way: the Gram once per group
        W = _bmm_t(a.w, b.w, grams)[a.group]
    else:
        W = _bmm_t(_sample_w(a, grams), _sample_w(b, grams), grams)  # w_s·w'_t
    return (U * W).sum(dim=(1, 2))


def _sample_w(c: _Outer, cache: dict[tuple[Any, ...], Tensor]) -> Tensor:
    """``c.w`` per sample [N, S, C] (a shared factor indexed by its group once, cached)."""
    if c.group is None:
        return c.w
    key = ("rows", c.w.data_ptr(), tuple(c.w.shape), c.w.stride(), id(c.group))
    if key not in cache:
        cache[key] = c.w[c.group]
    return cache[key]


def _materialize(c: _Contribution) -> Tensor:
    """The per-sample gradient flattened to [N, numel]."""
    if isinstance(c, _Dense):
        return c.g.reshape(c.g.shape[0], -1)
    (N, S), C = c.u.shape[:2], c.w.shape[2]
    if c.indexed:
        G = c.w.new_zeros(N, c.rows, C).scatter_add_(1, c.u.unsqueeze(-1).expand(N, S, C), c.w)  # Σ_s onehot(id_s) w_s
    else:
        w = c.w if c.group is None else c.w[c.group]
        G = torch.bmm(c.u.transpose(1, 2), w)  # Σ_s u_s w_sᵀ: [N, R, C]
    return G.reshape(N, -1)


def _gram_cost(outers: list[_Outer]) -> int:
    """Multiply-adds per sample of the Gram form: Σ_{u,v} S_u S_v (C + R or 1 when a side is one-hot)."""
    cost = 0
    for a in outers:
        for b in outers:
            row_dot = 1 if a.indexed or b.indexed else a.rows
            cost += a.w.shape[1] * b.w.shape[1] * (a.w.shape[2] + row_dot)
    return cost


def _materialize_cost(outers: list[_Outer]) -> int:
    """Multiply-adds (and writes) per sample of materializing Σ_u G_u and its norm: Σ_u S_u R C (S_u C one-hot) + RC."""
    cost = 0
    for c in outers:
        S, C = c.w.shape[1], c.w.shape[2]
        cost += S * C if c.indexed else S * c.rows * C
    return cost + outers[0].rows * outers[0].w.shape[2]
