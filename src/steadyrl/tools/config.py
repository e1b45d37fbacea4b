"""Configuration of the Python tool sandbox (:mod:`steadyrl.tools.sandbox`): limits, workers and isolation level."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: Isolation levels; see :mod:`steadyrl.tools.sandbox` for what each one guarantees.
Isolation = Literal["auto", "namespaces", "rlimits"]


class SandboxConfig(BaseModel):
    """Limits of one tool call and the size of the pool that runs them.

    Every limit applies to one call (one piece of code) and to every process it starts, each of them (RLIMIT_AS,
    RLIMIT_CPU and RLIMIT_FSIZE are per process; the process count is per call at the ``namespaces`` level).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Wall-clock limit of a call, from process start to "
        "exit (seconds). On expiry every process of the call is killed; error='timeout'.",
    )
    cpu_s: int = Field(
        10,
        ge=1,
        le=3600,
        description="CPU-time limit per process (RLIMIT_CPU, whole seconds): "
        "SIGXCPU at the limit, SIGKILL one second later; error='cpu'.",
    )
    memory_mb: int = Field(
        1024,
        ge=64,
        le=1 << 20,
        description="Address-space limit per process (RLIMIT_AS, MiB): "
        "an allocation beyond it fails (Python raises MemoryError; error='memory').",
    )
    max_procs: int = Field(
        32,
        ge=1,
        le=4096,
        description="Processes and threads the code may run at once, itself "
        "included (RLIMIT_NPROC; counted per call at the namespaces level, on top of what the "
        "sandbox uid already runs at the rlimits level). Contains a fork bomb.",
    )
    max_file_mb: int = Field(
        16,
        ge=1,
        le=1 << 16,
        description="Largest file the code may write (RLIMIT_FSIZE, MiB); "
        "at the namespaces level also the size of its tmpfs working directory.",
    )
    max_output_bytes: int = Field(
        65_536,
        ge=256,
        le=1 << 26,
        description="Cap on stdout + stderr kept per call "
        "(bytes, read incrementally). Past it the call is killed; truncated=True, "
        "error='output_limit'.",
    )
    workers: int = Field(4, ge=1, le=256, description="Calls a SandboxPool runs at once (one process tree each).")
    isolation: Isolation = Field(
        "auto",
        description="'namespaces': user+pid+net+mount+ipc+uts namespaces and a "
        "read-only root (error if unavailable); 'rlimits': resource limits, uid drop when "
        "root and an audit hook only (opt in explicitly: see docs/tools.md for what it does not "
        "protect); 'auto': namespaces when a probe call succeeds, else an error naming what is "
        "missing (never a silent downgrade to rlimits).",
    )
    uid_base: int = Field(
        61184,
        ge=1000,
        le=(1 << 31) - 1 - 256,
        description="When steadyrl runs as root, each running call's code runs as a uid (and gid) of its own from "
        "uid_base .. uid_base + 255 (one per call at once, across every steadyrl process of the machine), so that "
        "concurrent calls cannot read, signal or trace each other. The default is systemd's range for dynamic users "
        "(61184-65519); choose a range no account of the machine uses.",
    )
    python: str | None = Field(
        None,
        min_length=1,
        description="Interpreter that runs the code (absolute path); "
        "None: the interpreter running steadyrl. Any CPython >= 3.8.",
    )
    site_packages: bool = Field(
        False,
        description="Let the code import the interpreter's site-packages (numpy, "
        "sympy, ...); False runs it with -S (standard library only). At the namespaces level True also lets "
        "ctypes through the audit hook (numpy and sympy import it; the kernel is the boundary there); at the "
        "rlimits level ctypes stays blocked, so numpy and sympy end with error='blocked'.",
    )
