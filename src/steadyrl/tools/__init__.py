"""Tools a policy can call during a rollout; for now a sandboxed Python interpreter.

=====================  ===========================================================================
module                 holds
=====================  ===========================================================================
``config``             :class:`SandboxConfig`: limits, workers, isolation level
``sandbox``            :func:`run_python`, :class:`SandboxPool`, :class:`ToolResult`; what each isolation
                       level guarantees
``cgroups``            a cgroup per call: memory (shared memory included), processes, CPU
``uids``               a uid per running call (root), and the sweep of what it left behind
``mounts``             the tmpfs disk quota of a call's working directory at the rlimits level
``_kernel_guards``            Landlock and seccomp of the tool process (text prepended to the supervisor's)
``_supervisor``        program of the sandbox's supervisor process (run as text by a fresh interpreter)
``_runner``            program of the tool process: audit hook, then the code
=====================  ===========================================================================
"""

from steadyrl.tools.config import SandboxConfig
from steadyrl.tools.sandbox import (
    SandboxLayers,
    SandboxPool,
    SandboxUnavailableError,
    ToolResult,
    resolve_isolation,
    run_python,
    sandbox_layers,
)

__all__ = [
    "SandboxConfig",
    "SandboxLayers",
    "SandboxPool",
    "SandboxUnavailableError",
    "ToolResult",
    "resolve_isolation",
    "run_python",
    "sandbox_layers",
]
