"""Where the learner runs and in which precision: the one place device and dtype are decided.

``device``: ``auto`` (the first CUDA GPU where there is one, else the CPU) | ``cpu`` | ``cuda`` | ``cuda:N``. The
policy, its optimizer state (created on the parameters' device), COPC's critic head, the per-trajectory gradient
norms and the ``transformers`` sampler of the lag runtime all live there.

``precision``:

==============  ====================  ==============================  ==========================================
precision       parameters / AdamW    forward (trunk)                 output layer and log-softmax
==============  ====================  ==============================  ==========================================
``fp32``        float32               float32                         float32
``bf16-mixed``  float32 (master)      bf16 autocast                   float32 (autocast off, input upcast)
``bf16``        bfloat16              bfloat16                        float32 (input and weight upcast)
==============  ====================  ==============================  ==========================================

The output layer runs in float32 in every mode (:func:`fp32_output_layer`), so the logits, and hence every log-prob
that enters a ratio (the sampler's μ, the learner's π_θ and π_prox), are computed in float32 from the trunk's
hidden state: never bf16-rounded. The sampler runs under the same autocast as the learner, so μ is the distribution
it actually sampled from; at lag 0 the remaining learner-vs-sampler difference (KV-cache decode against one full
forward, both in bf16) is logged as ``mismatch/*`` exactly as for vLLM
(:func:`steadyrl.rollout.vllm_engine.engine_mismatch`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Precision = Literal["fp32", "bf16-mixed", "bf16"]
#: The allowed values of ``precision`` (for error messages and the CLI's help).
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16-mixed", "bf16")
#: The parameter dtype (by its ``torch`` name) each precision trains in: bf16 holds bfloat16 weights, the other two
#: float32 (bf16-mixed casts inside autocast only).
PARAM_DTYPES: dict[str, str] = {"fp32": "float32", "bf16-mixed": "float32", "bf16": "bfloat16"}
#: ``device`` values: auto, cpu, cuda, cuda:N.
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
#: cuBLAS workspace for deterministic GEMMs (NVIDIA's documented setting; the other is ``:16:8``).
CUBLAS_WORKSPACE = ":4096:8"


class DeviceError(ValueError):
    """The configured device does not exist on this machine (the message names the fix)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` → the current GPU where one is visible, else ``cpu``; ``cuda``/``cuda:N`` checked against this
    machine. A GPU comes back with its index (``cuda`` → ``cuda:<current>``): tensors on a GPU always carry one, so
    ``tensor.device == placement.device`` holds, and ``torch.cuda.set_device`` needs it."""
    if not DEVICE_PATTERN.match(name):
        raise DeviceError(f"device={name!r} is not one of auto, cpu, cuda, cuda:N")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device={name!r} but no CUDA GPU is visible to PyTorch here; use device=cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(f"device={name!r} but this machine has {count} GPU(s) (cuda:0 … cuda:{count - 1})")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


#: Share of the free GPU memory (after the model and room for its gradient and AdamW moments) the lag runtime may
#: fill with weight snapshots before it keeps the rest in pinned CPU memory.
SNAPSHOT_GPU_FRACTION = 0.25


class SnapshotHomes(NamedTuple):
    """Where weight snapshots live (:meth:`Placement.snapshot_homes`)."""

    device_slots: int
    """How many snapshots stay on the model's device."""
    pinned: bool
    """Whether the CPU-held ones use pinned (page-locked) memory with non-blocking copies."""


def copy_state(
    state: Mapping[str, Tensor], *, device: torch.device, pinned: bool = False,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """A detached copy of a state dict on ``device`` (each tensor in ``dtypes[name]`` when given; tensors that
    share storage, such as tied embeddings, stay shared). ``pinned`` (CPU targets with a GPU source): page-locked
    memory filled by a non-blocking copy, ordered on the current CUDA stream before any later kernel that writes
    the source (so an optimizer step cannot race it); call :func:`wait_for_copies` before reading it on the host."""
    copies: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        dtype = tensor.dtype if dtypes is None else dtypes.get(name, tensor.dtype)
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), dtype)
        if key not in copies:
            src = tensor.detach()
            if pinned and device.type == "cpu" and src.device.type == "cuda":
                dst = torch.empty(src.shape, dtype=dtype, device="cpu", pin_memory=True)
                copies[key] = dst.copy_(src, non_blocking=True)
            else:
                copies[key] = src.to(device=device, dtype=dtype, copy=True)
        out[name] = copies[key]
    return out


def wait_for_copies(device: torch.device) -> None:
    """Wait until the non-blocking copies queued on ``device`` (a GPU) are done; a no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass(frozen=True)
class Placement:
    """A resolved device and precision; :meth:`place` moves a model there, :meth:`autocast` wraps its forwards."""

    device: torch.device
    precision: Precision = "fp32"

    @classmethod
    def from_names(cls, device: str, precision: str) -> Placement:
        """The placement of ``TrainConfig.device`` / ``TrainConfig.precision``."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        return cls(resolve_device(device), precision)  # type: ignore[arg-type]

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the parameters (and so of AdamW's moments): bfloat16 for ``bf16``, else float32."""
        return getattr(torch, PARAM_DTYPES[self.precision])

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """bf16 autocast on :attr:`device` for ``bf16-mixed``; a no-op otherwise."""
        if self.precision != "bf16-mixed":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def place(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to :attr:`device` in :attr:`param_dtype` with a float32 output layer (in place)."""
        model.to(device=self.device, dtype=self.param_dtype)
        fp32_output_layer(model)
        return model

    def sampler_copy(self, model: nn.Module) -> nn.Module:
        """A frozen eval-mode copy of ``model`` to sample from, on the same device.

        Under ``bf16-mixed`` its linear layers (all but the float32 output layer) hold bfloat16 weights: autocast
        would cast the float32 ones to bfloat16 at every decode step, with the same rounding, so the copy samples
        bit for bit what a float32 copy under autocast samples, in half the memory and without the per-step casts.
        Norms and embeddings keep their dtype (autocast does not cast them). Weights loaded into it later
        (``load_state_dict``) are cast the same way.
        """
        sampler = copy.deepcopy(model).eval().requires_grad_(False)
        if self.precision == "bf16-mixed":
            for module in sampler.modules():
                if type(module) is nn.Linear:
                    module.to(torch.bfloat16)
        return sampler

    def snapshot_homes(self, *, copy_bytes: int, copies: int, budget_bytes: int | None = None) -> SnapshotHomes:
        """Where the lag runtime's weight snapshots live: how many on the device, and whether CPU copies are pinned.

        On a GPU: as many as fit ``budget_bytes`` (default :data:`SNAPSHOT_GPU_FRACTION` of the GPU memory free
        now, after the model and the room its gradient and AdamW moments will take) stay there (a snapshot is then
        a device-to-device copy); the others go to pinned CPU memory with non-blocking copies. On the CPU: every
        snapshot in CPU memory (not pinned).
        """
        if self.device.type != "cuda":
            return SnapshotHomes(device_slots=0, pinned=False)
        if budget_bytes is None:
            free, _total = torch.cuda.mem_get_info(self.device)
            budget_bytes = int(SNAPSHOT_GPU_FRACTION * max(0, free - 3 * copy_bytes))
        slots = min(copies, budget_bytes // copy_bytes) if copy_bytes else copies
        return SnapshotHomes(device_slots=int(slots), pinned=True)

    @contextlib.contextmanager
    def runtime(self, *, deterministic: bool) -> Iterator[None]:
        """The process-wide torch settings of a run on :attr:`device`, restored afterwards.

        - ``torch.cuda.set_device`` to the run's GPU (kernels, caches and new tensors without a device go there, not
          to ``cuda:0``);
        - float32 matmuls at full precision (``torch.set_float32_matmul_precision("highest")``, so no TF32): the
          output layer and every log-prob that enters an importance ratio are float32 by design, and TF32's 10-bit
          mantissa would put ~1e-3 relative error into the logits; under ``bf16-mixed`` and ``bf16`` the trunk's
          matmuls run in bfloat16 anyway;
        - ``deterministic``: ``torch.use_deterministic_algorithms(True, warn_only=True)`` (why: the CPU's
          ``index_put_`` with accumulate adds in thread order otherwise), and on a GPU the cuBLAS workspace that
          deterministic cuBLAS needs (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set when the environment has none, before
          the run's first cuBLAS call).
        """
        before_det = torch.are_deterministic_algorithms_enabled()
        before_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        before_matmul = torch.get_float32_matmul_precision()
        if self.device.type == "cuda":
            if deterministic and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
                os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
            torch.cuda.set_device(self.device if self.device.index is not None else torch.cuda.current_device())
        torch.set_float32_matmul_precision("highest")
        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(before_det, warn_only=before_warn)
            torch.set_float32_matmul_precision(before_matmul)


class AutocastSpansStepsError(RuntimeError):
    """Code that steps an optimizer was called inside an autocast region (:func:`refuse_outer_autocast`)."""


def refuse_outer_autocast(device: torch.device, where: str, fix: str) -> None:
    """Raise :class:`AutocastSpansStepsError` when an autocast region is open on ``device``'s type.

    Autocast keeps the low-precision copy of each float32 parameter it casts until the outermost region closes
    (``torch.autocast``'s weight-cast cache). A region that spans optimizer steps therefore runs every forward after
    the first on the weights of the first: the gradients belong to stale weights, the loss barely moves, and the
    saved weights differ from the ones the loss was computed with. Code that steps an optimizer opens a region around
    each forward itself (:meth:`Placement.autocast`) and calls this first; ``fix`` says how to ask it for that.
    Costs no device sync.
    """
    try:
        open_region = torch.is_autocast_enabled(device.type)
    except RuntimeError:  # a device type autocast does not know (``meta``): no region can be open on it
        open_region = False
    if open_region:
        raise AutocastSpansStepsError(
            f"{where} was called inside torch.autocast({device.type!r}): autocast keeps its bf16 copy of every weight "
            "until the outermost region closes, so every step after the first would run on the first step's "
            f"weights. Call {where} outside autocast: {fix}."
        )


def to_device(state: Any, device: torch.device | str) -> Any:
    """``state`` with every tensor moved to ``device``, nested dicts, lists and tuples rebuilt (other values kept).

    State read back from a checkpoint (loaded to the CPU) or from a CPU snapshot goes through this before it meets
    the live tensors of a model on a GPU: a previous gradient left on the CPU would make the first step after a
    resume or a rollback mix devices. A tensor already on ``device`` is returned as it is (no copy).
    """
    if isinstance(state, Tensor):
        return state.to(device)
    if isinstance(state, Mapping):
        return {k: to_device(v, device) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_device(v, device) for v in state)
    return state


def host_values(values: Iterable[Tensor]) -> list[float]:
    """Scalar tensors as Python floats in one device-to-host read (one sync however many there are).

    The tensors are stacked on the device of the first one; each is moved there first, so scalars of a CPU
    bookkeeping tensor and of a GPU metric can be read together.
    """
    return _stacked_to_host([v.detach().reshape(()) for v in values])


def host_rows(values: Iterable[Tensor]) -> list[list[float]]:
    """1-D tensors of one length as lists of Python floats, in one device-to-host read (as :func:`host_values`).

    float64 holds every float32 value and every integer below 2⁵³ exactly, so token ids read back as exact integers
    (``int(x)``) and log-probs as the float32 values they were.
    """
    return _stacked_to_host([v.detach() for v in values])


def _stacked_to_host(items: list[Tensor]) -> list[Any]:
    """``items`` (one shape) stacked in float64 on the first one's device, then read in one ``tolist``."""
    if not items:
        return []
    device = items[0].device
    return torch.stack([v.to(device=device, dtype=torch.float64) for v in items]).tolist()


class LaggedCount:
    """A count the host reads without waiting for the device: the newest value whose copy has finished.

    On a GPU, reading a tensor's value stalls the host until the device queue drains; a loop that reads one every
    step (the decoder's count of rows still running) serializes host and device at every step. :meth:`push` starts a
    non-blocking copy of the count into pinned host memory behind an event; :meth:`latest` returns the newest copy
    that has finished (``event.query()``: never waits), so the host decides from a value one or a few steps old and
    the device queue never drains. On the CPU there is no queue to drain: :meth:`push` reads the value at once and
    :meth:`latest` is always current (the decisions, hence the samples, are those of an immediate read).

    ``lagged`` forces the lagged form on the CPU (the copy becomes visible one :meth:`push` later), for tests.
    """

    def __init__(self, device: torch.device, *, lagged: bool | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.lagged = self.cuda if lagged is None else lagged
        self.value: int | None = None
        """The newest finished copy (None: none yet)."""
        self._pending: tuple[Tensor, Any] | None = None
        self.waits = 0
        """Reads that waited for the device (0 in the lagged form: a test reads it)."""

    def push(self, count: Tensor) -> None:
        """Start reading ``count`` (a 0-d integer tensor); a push while a copy is in flight is dropped."""
        if not self.lagged:
            self.value = int(count)
            self.waits += int(count.device.type == "cuda")
            return
        if self._pending is not None:
            return
        if self.cuda:
            host = torch.empty((), dtype=count.dtype, pin_memory=True)
            host.copy_(count, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending = (host, event)
        else:
            self._pending = (count.detach().clone(), None)

    def latest(self) -> int | None:
        """The newest count whose copy has finished, without waiting (None while none has)."""
        if self._pending is not None:
            host, event = self._pending
            if event is None or event.query():
                self.value = int(host)
                self._pending = None
        return self.value


class Float32OutputLinear(nn.Linear):
    """``nn.Linear`` whose product runs in float32 (at least) whatever autocast or the weights' dtype: the output
    layer of every placed model. The same map as ``nn.Linear`` (so the ghost gradient-norm pass treats it as one:
    ``computes_linear``); only the arithmetic precision differs."""

    computes_linear = True

    def forward(self, x: Tensor) -> Tensor:
        """``x W^T (+ b)`` with autocast off, in float32 (float64 stays float64)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            dtype = torch.promote_types(x.dtype, torch.float32)
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(x.to(dtype), self.weight.to(dtype), bias)


def fp32_output_layer(model: nn.Module) -> None:
    """Make ``model``'s output embedding a :class:`Float32OutputLinear` (in place: the class of the existing layer
    is swapped, so its parameters, tying and state-dict keys are untouched; copies and pickles keep it). A no-op
    when the model has no ``get_output_embeddings`` or the layer is not a plain ``nn.Linear``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None and type(head) is nn.Linear:
        head.__class__ = Float32OutputLinear


def sampler_placement(name: str, *, learner: Placement) -> Placement:
    """Where a concurrent runtime's sampler generates (``rollout.device``): ``cpu`` (float32, whatever the
    learner's precision), ``learner`` (the learner's placement), or ``auto``/``cuda``/``cuda:N`` in the learner's
    precision."""
    if name == "cpu":
        return Placement(torch.device("cpu"), "fp32")
    if name == "learner":
        return learner
    return Placement(resolve_device(name), learner.precision)


def visible_gpus() -> list[str]:
    """The GPUs this process may hand to its children, as ``CUDA_VISIBLE_DEVICES`` entries: the entries of its own
    ``CUDA_VISIBLE_DEVICES`` when set (ids or UUIDs), else ``0 … torch.cuda.device_count() − 1``."""
    count = torch.cuda.device_count()
    if count == 0:
        return []
    own = os.environ.get("CUDA_VISIBLE_DEVICES")
    if own is not None and own.strip():
        return [e.strip() for e in own.split(",") if e.strip()][:count]
    return [str(i) for i in range(count)]


class GpuSlots:
    """Spread child processes over the visible GPUs: each gets the least-used GPU as its only visible one.

    A child sees its GPU as ``cuda:0`` (``CUDA_VISIBLE_DEVICES`` = that GPU), so ``device=auto`` or ``cuda`` lands on
    it; with more children than GPUs they share round-robin (a warning says so once). No GPU: :meth:`acquire`
    returns None and children inherit the environment unchanged.
    """

    def __init__(self, gpus: list[str] | None = None) -> None:
        self.gpus = visible_gpus() if gpus is None else list(gpus)
        self.users: dict[str, int] = dict.fromkeys(self.gpus, 0)
        self._warned = False

    def acquire(self) -> str | None:
        """The GPU for the next child (``CUDA_VISIBLE_DEVICES`` value), or None when there is none."""
        if not self.gpus:
            return None
        gpu = min(self.gpus, key=lambda g: self.users[g])  # the first least-used one: 0, 1, ..., then round-robin
        if self.users[gpu] and not self._warned:
            self._warned = True
            warnings.warn(
                f"more parallel runs than GPUs ({len(self.gpus)}): runs share GPUs; lower the sweep's jobs to give "
                "each its own",
                stacklevel=2,
            )
        self.users[gpu] += 1
        return gpu

    def release(self, gpu: str | None) -> None:
        """The child on ``gpu`` ended."""
        if gpu is not None:
            self.users[gpu] -= 1

    @staticmethod
    def env(base: Mapping[str, str], gpu: str | None) -> dict[str, str]:
        """``base`` with ``CUDA_VISIBLE_DEVICES`` = ``gpu`` (unchanged when ``gpu`` is None)."""
        return dict(base) if gpu is None else {**base, "CUDA_VISIBLE_DEVICES": gpu}
