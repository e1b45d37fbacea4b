"""The vLLM engine's server: ``python -m steadyrl.rollout.vllm_server FD``, a child process of
:class:`steadyrl.rollout.vllm_engine.VLLMEngine`.

It owns the ``vllm.LLM`` and answers the client's requests over the pipe ``FD`` (``multiprocessing`` connection):
``init`` (build the engine from the client's settings; one token of warm-up), ``generate`` (sample every row with its
own seed; each row's tokens, the sampled tokens' processed log-probs and, when asked, the processed log-probs of each
step's top-k tokens as vLLM returns them), ``load`` (the client's tensors, received over
the pipe, loaded into the model in place by vLLM's ``reload_weights`` from an iterator; the CPU GEMMs of layers whose
weight is tied re-packed; the prefix cache reset) and ``close``. It imports nothing of steadyrl, so starting it costs
vLLM's import alone.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import torch


def serve(fd: int) -> None:
    """The child process: build ``vllm.LLM`` on the first request, then answer until ``close`` or EOF."""
    conn = Connection(fd)
    llm = None
    workdir: str | None = None
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:  # the parent died without closing (e.g. a killed Ray actor): its directory is ours to delete
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            op, payload = "close", None
        if op == "close":  # nothing to flush: skip vLLM's slow interpreter shutdown (seconds); the parent cleans up
            sys.stdout.flush()
            os._exit(0)
        try:
            if op == "init":
                from vllm import LLM

                payload = dict(payload)
                # the client's process key: tensors of weight updates arrive as shared-memory handles, whose
                # transfer (multiprocessing's resource sharer) authenticates with it
                multiprocessing.current_process().authkey = payload.pop("authkey")
                workdir = payload["model"]
                llm = LLM(**payload)
                # one token now: unsupported shapes fail at start-up, and the first call's warm-up is paid here
                llm.generate([{"prompt_token_ids": [0]}], _warmup_params(), use_tqdm=False)
                result: Any = None
            elif llm is None:
                raise RuntimeError(f"request {op!r} before init")
            elif op == "generate":
                result = _serve_generate(llm, payload)
            elif op == "load":
                # vLLM's in-place reload from an iterator of (checkpoint name, tensor): the loader that maps q/k/v and
                # gate/up onto fused layers and re-runs the post-load processing (the file form reads a directory)
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(payload)})
                from vllm.platforms import current_platform

                if current_platform.is_cpu():
                    llm.collective_rpc(_repack_cpu_gemms)
                llm.reset_prefix_cache()
                result = None
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception:
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))


def _repack_cpu_gemms(worker: Any) -> None:
    """Re-pack the CPU GEMMs that still hold a weight (vLLM 0.32, CPU backend).

    On CPU vLLM packs each output-layer weight into a ``cpu_linear`` closure when it is loaded. A tied ``lm_head``
    has no tensor of its own in the checkpoint, so ``reload_weights`` copies the new embedding into the shared
    parameter but leaves the head's packed copy at the *old* weights (measured: sampled log-probs then match neither
    the old nor the new weights). Layers whose weight was moved into the closure (``numel() == 0``) were re-packed by
    the reload itself; the others are re-packed here from their current weight.
    """
    model = worker.model_runner.get_model()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() and method:
            method.process_weights_after_loading(module)


def _warmup_params() -> Any:
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)


def _serve_generate(
    llm: Any, payload: Mapping[str, Any]
) -> list[tuple[list[int], list[float], list[tuple[list[int], list[float]]] | None]]:
    """Sample every row with its own seed: each row's tokens, the processed log-prob of each sampled token and, when
    ``payload["logprobs"]`` = k ≥ 1, each step's vLLM log-prob entries as ``(ids, log-probs)`` (the k most likely
    tokens and the sampled one: k or k + 1 entries; None when k = 0)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm import TokensPrompt

    p = payload["params"]
    top = int(payload.get("logprobs") or 0)
    max_tokens = payload.get("max_tokens") or [p["max_tokens"]] * len(payload["seeds"])  # per row (tool turns)
    params = [
        VSamplingParams(
            n=1,
            temperature=p["temperature"],
            top_p=p["top_p"],
            top_k=p["top_k"],
            max_tokens=m,
            ignore_eos=True,  # stop on exactly stop_token_ids (the model's generation config adds none)
            stop_token_ids=p["stop_token_ids"],
            # the sampled token's log-prob, plus the top-k's when asked (processed_logprobs: all of the distribution
            # sampled from)
            logprobs=top,
            seed=s,
            detokenize=False,
        )
        for s, m in zip(payload["seeds"], max_tokens, strict=True)
    ]
    prompts = [TokensPrompt(prompt_token_ids=r) for r in payload["rows"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for out in outs:
        c = out.outputs[0]
        tokens = list(c.token_ids)
        steps = list(c.logprobs or [])
        logps = [float(d[t].logprob) for d, t in zip(steps, tokens, strict=True)]
        entries = [(list(d), [float(x.logprob) for x in d.values()]) for d in steps] if top else None
        result.append((tokens, logps, entries))
    return result


if __name__ == "__main__":
    serve(int(sys.argv[1]))
