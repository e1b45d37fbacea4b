"""Peak memory of the loss head alone: hidden states in, output layer, log-probs of the sampled tokens, forward and
backward, in the direct form against the chunked one (:mod:`steadyrl.core.vocab_chunks`).

Each (form, tokens) case runs in a fresh subprocess, so its peak is its own: the child builds float32 hidden states
``[N·T, H]`` (leaf, with gradient) and an output layer ``[V, H]`` (SmolLM2-135M's sizes by default: V = 49,152,
H = 576), records its peak RSS (``resource.getrusage(RUSAGE_SELF).ru_maxrss``: torch loaded, inputs allocated),
runs one forward and backward of Σ_t log π(y_t), and reports its peak RSS again and the growth (ru_maxrss is
monotone, so the growth is the step's own peak above the inputs).

- ``direct``: what :func:`steadyrl.rollout.logprobs.sequence_logprobs` does within its budget: the ``[N, T, V]``
  float32 logits (``F.linear``), :func:`~steadyrl.rollout.distribution.sampling_log_probs` (a log-softmax at
  T = 1), the gather, the masked sum, autograd's backward;
- ``chunked``: :func:`~steadyrl.core.vocab_chunks.chunked_log_probs` with the default element budget
  (:data:`~steadyrl.core.vocab_chunks.DEFAULT_CHUNK_ELEMENTS`, 2^26 logits: 1,365 tokens per chunk at V = 49,152).

    .venv/bin/python benchmarks/loss_head_memory.py                  # the table of docs/scale.md
    .venv/bin/python benchmarks/loss_head_memory.py --tokens 1024 --vocab 8192 --json /tmp/head.json

Prints one row per token count and writes JSON (``--json``, default ``runs/loss_head_memory.json``) with the
command, date, commit, machine (platform, torch's CPU capability, cores) and every case.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("direct", "chunked")


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_case(form: str, *, tokens: int, vocab: int, hidden: int, chunk_elements: int | None, threads: int) -> dict:
    """One forward + backward of the loss head in this process; peak RSS before and after (MiB), seconds."""
    import torch
    import torch.nn.functional as F

    from steadyrl.core.vocab_chunks import DEFAULT_CHUNK_ELEMENTS, chunk_tokens_for, chunked_log_probs
    from steadyrl.rollout.distribution import SamplingParams, sampling_log_probs

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = max(1, tokens // 128)
    h = (torch.randn(rows, tokens // rows, hidden, generator=gen)).requires_grad_()  # [N, T, H]
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).requires_grad_()  # [V, H]
    y = torch.randint(0, vocab, h.shape[:2], generator=gen)
    mask = torch.ones(h.shape[:2], dtype=torch.bool)
    budget = DEFAULT_CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    before = _maxrss_mib()
    start = time.perf_counter()
    if form == "direct":
        log_probs = sampling_log_probs(F.linear(h, w), params=SamplingParams())  # [N, T, V]
        logp = log_probs.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        loss = torch.where(mask, logp, torch.zeros_like(logp)).sum()
        del log_probs
    else:
        out = chunked_log_probs(hidden=h[mask], weight=w, tokens=y[mask],
                                chunk_tokens=chunk_tokens_for(vocab_size=vocab, chunk_elements=budget))  # fmt: skip
        loss = out.logp.sum()
    loss.backward()
    seconds = time.perf_counter() - start
    assert h.grad is not None and w.grad is not None and torch.isfinite(w.grad).all()
    after = _maxrss_mib()
    return {
        "form": form, "tokens": h.shape[0] * h.shape[1], "vocab": vocab, "hidden": hidden,
        "chunk_tokens": chunk_tokens_for(vocab_size=vocab, chunk_elements=budget) if form == "chunked" else None,
        "rss_before_mib": round(before, 1), "peak_rss_mib": round(after, 1),
        "peak_growth_mib": round(after - before, 1), "seconds": round(seconds, 2), "loss": float(loss),
    }  # fmt: skip


def provenance(argv: list[str]) -> dict:
    """Command, date (UTC), commit and machine of a run."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    return {
        "command": " ".join(["python", "benchmarks/loss_head_memory.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + ("-dirty" if dirty else ""),
        "machine": {
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
        },
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,16384", help="N·T values (comma-separated)")
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--chunk-elements", type=int, default=None, help="element budget (default: the library's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=ROOT / "runs" / "loss_head_memory.json")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case and print its JSON
    args = parser.parse_args(argv)
    common = dict(vocab=args.vocab, hidden=args.hidden, chunk_elements=args.chunk_elements, threads=args.threads)
    if args.case:
        form, tokens = json.loads(args.case)
        print(json.dumps(run_case(form, tokens=tokens, **common)))
        return 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    meta = provenance(argv)
    print(f"loss head, forward + backward: V = {args.vocab:,}, H = {args.hidden}, float32, {args.threads} threads; "
          f"peak RSS of a fresh process per case")  # fmt: skip
    mach = meta["machine"]
    print(f"{meta['date']}  commit {meta['commit']}  {mach['platform']}  {mach['cpu_capability']}, "
          f"{mach['cpus']} CPUs, torch {mach['torch']}")  # fmt: skip
    header = f"{'N·T':>7}  {'direct peak (growth)':>24}  {'chunked peak (growth)':>24}  {'ratio':>6}  {'seconds':>13}"
    print(header)
    cases = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = {}
        for form in FORMS:  # one at a time: the direct form alone may take most of the RAM
            cmd = [sys.executable, __file__, *argv, "--case", json.dumps([form, tokens])]
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            row[form] = json.loads(proc.stdout.splitlines()[-1])
            cases.append(row[form])
        d, c = row["direct"], row["chunked"]
        ratio = d["peak_rss_mib"] / c["peak_rss_mib"]
        print(f"{tokens:>7}  {d['peak_rss_mib']:>9,.0f} MiB ({d['peak_growth_mib']:>7,.0f})  "
              f"{c['peak_rss_mib']:>9,.0f} MiB ({c['peak_growth_mib']:>7,.0f})  "
              f"{ratio:>5.1f}x  {d['seconds']:>5.1f} / {c['seconds']:>5.1f}")  # fmt: skip
    print("(peak: the process's peak RSS, MiB; growth: above the peak before the step (torch + inputs); "
          "ratio: direct / chunked peak; seconds: forward + backward, direct / chunked)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**meta, "cases": cases}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    status = main()
    if "--case" not in sys.argv:  # a child run prints JSON only
        from _provenance import print_provenance

        print_provenance()
    sys.exit(status)
