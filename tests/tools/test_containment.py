"""A failure of one call (its code, its directory, its supervisor, its cleanup) is that call's result.

Each test gives ``SandboxPool.map`` several codes of which one fails inside the sandbox machinery (not inside the
code): that call's result says ``error="internal_error"`` with the reason in its stderr, every other call completes
normally, and nothing of the failed call is left behind.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

import pytest

from steadyrl.tools import SandboxConfig, SandboxPool, SandboxUnavailableError, ToolResult, run_python, sandbox
from tests.tools.conftest import level_config

#: A code the tests make fail in the sandbox machinery; the others print their index.
MARKER = "FAILS_HERE"
CODES = ["print(0)", f"print('{MARKER}')", "print(2)"]


def source(code: str | bytes) -> str:
    """The code a sandbox helper received (as text, whichever form it takes)."""
    return code.decode("utf-8") if isinstance(code, bytes) else code


def assert_only_the_marked_call_failed(results: list[ToolResult], reason: str) -> None:
    """Call 1 ended with ``internal_error`` and ``reason`` in its stderr; calls 0 and 2 printed their index."""
    failed = results[1]
    assert failed.error == "internal_error" and not failed.ok, failed
    assert reason in failed.stderr and failed.stdout == "", failed
    failed.stderr.encode("utf-8")  # the message is valid text (a lone surrogate in it would fail tokenization later)
    assert [(r.error, r.stdout) for r in (results[0], results[2])] == [(None, "0\n"), (None, "2\n")], results


def test_a_lone_surrogate_fails_only_its_call(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args: Any, **kwargs: Any) -> str:
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    with SandboxPool(level_config(level, workers=2)) as pool:
        results = pool.map(["print(0)", "print('\ud800')", "print(2)"])
    assert_only_the_marked_call_failed(results, "UTF-8")
    assert not [p for p in made if os.path.exists(p)], "a call's directory was left behind"


def test_run_python_returns_a_lone_surrogate_as_a_result(level: str) -> None:
    r = run_python("x = '\udfff'", limits=level_config(level))
    assert r.error == "internal_error" and "UTF-8" in r.stderr and r.isolation == level, r


def test_a_failing_directory_setup_fails_only_its_call(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_prepare = sandbox._prepare_dir

    def prepare(code: bytes, mode: str, *args: Any) -> sandbox._CallDir:
        if MARKER in source(code):
            raise OSError(28, "No space left on device (test)")
        return real_prepare(code, mode, *args)

    monkeypatch.setattr(sandbox, "_prepare_dir", prepare)
    with SandboxPool(level_config(level, workers=2)) as pool:
        results = pool.map(CODES)
    assert_only_the_marked_call_failed(results, "No space left on device (test)")


def test_a_failing_cleanup_fails_only_its_call(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_prepare, real_remove = sandbox._prepare_dir, sandbox._remove_tree
    marked: list[str] = []

    def prepare(code: bytes, mode: str, *args: Any) -> sandbox._CallDir:
        made = real_prepare(code, mode, *args)
        if MARKER in source(code):
            marked.append(made.tmp)
        return made

    def remove(made: sandbox._CallDir) -> None:
        real_remove(made)
        if made.tmp in marked:
            raise PermissionError(13, "Permission denied (test)", made.tmp)

    monkeypatch.setattr(sandbox, "_prepare_dir", prepare)
    monkeypatch.setattr(sandbox, "_remove_tree", remove)
    with SandboxPool(level_config(level, workers=2)) as pool:
        results = pool.map(CODES)
    assert_only_the_marked_call_failed(results, "Permission denied (test)")
    assert marked and not os.path.exists(marked[0])


def test_a_supervisor_that_cannot_start_fails_only_its_call(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_popen, real_prepare = subprocess.Popen, sandbox._prepare_dir
    last_code: list[bytes] = [b""]  # one worker: the code of the call whose supervisor is being started

    def prepare(code: bytes, mode: str, *args: Any) -> sandbox._CallDir:
        last_code[0] = code
        return real_prepare(code, mode, *args)

    def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if MARKER in source(last_code[0]):
            raise BlockingIOError(11, "Resource temporarily unavailable (test)")
        return real_popen(args, **kwargs)

    with SandboxPool(level_config(level, workers=1)) as pool:
        pool.map(["print(0)"])  # the pool's thread exists before the file descriptors are counted
        fds = len(os.listdir("/proc/self/fd"))
        monkeypatch.setattr(sandbox, "_prepare_dir", prepare)
        monkeypatch.setattr(subprocess, "Popen", popen)
        results = pool.map(CODES)
        monkeypatch.undo()
        assert len(os.listdir("/proc/self/fd")) == fds, "the failed call left a file descriptor open"
    assert_only_the_marked_call_failed(results, "Resource temporarily unavailable (test)")


def test_a_setup_error_of_one_call_fails_only_that_call(level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real_classify = sandbox._classify

    def classify(got: Any, config: SandboxConfig, mode: str, duration: float, **kwargs: Any) -> ToolResult:
        if MARKER in got.stdout.decode():
            message = f"the {mode} sandbox could not be built:\nTraceback ...\nOSError: mount (test)"
            raise SandboxUnavailableError(message)
        return real_classify(got, config, mode, duration, **kwargs)

    monkeypatch.setattr(sandbox, "_classify", classify)
    with SandboxPool(level_config(level, workers=2)) as pool:
        results = pool.map(CODES)
    assert_only_the_marked_call_failed(results, "OSError: mount (test)")


def test_a_pool_that_cannot_start_still_raises() -> None:
    with pytest.raises(SandboxUnavailableError, match="python"):
        SandboxPool(SandboxConfig(python="relative/python"))
