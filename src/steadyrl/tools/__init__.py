"""Tools a policy can call during a rollout; for now a sandboxed Python interpreter.

=====================  ===========================================================================
module                 holds
=====================  ===========================================================================
``config``             :class:`SandboxConfig`: limits, workers, isolation level
``sandbox``            :func:`run_python`, :class:`SandboxPool`, :class:`ToolResult`; what each isolation
                       level guarantees
``_supervisor``        program of the sandbox's supervisor process (run as text by a fresh interpreter)
``_runner``            program of the tool process: audit hook, then the code
=====================  ===========================================================================
"""

from steadyrl.tools.config import SandboxConfig
from steadyrl.tools.sandbox import SandboxPool, SandboxUnavailableError, ToolResult, resolve_isolation, run_python

__all__ = ["SandboxConfig", "SandboxPool", "SandboxUnavailableError", "ToolResult", "resolve_isolation", "run_python"]
