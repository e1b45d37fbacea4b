"""What every adapter does with its framework at import: a one-line error naming what to install when it is missing,
and a warning when the installed release is not the one the adapter was tested against."""

from __future__ import annotations

import warnings
from importlib import metadata


def install_hint(adapter: str, dist: str, tested: str) -> str:
    """The install command for ``adapter``'s framework: its pin file (``requirements/integrations/<adapter>.txt``,
    installed with ``--no-deps``: the frameworks' own requirements would move the locked torch), or a plain
    ``pip install`` of the tested release for a framework that needs no pin file."""
    return f"pip install --no-deps -r requirements/integrations/{adapter}.txt ({dist}=={tested})"


def missing_framework(adapter: str, framework: str, install: str) -> ImportError:
    """The ``ImportError`` (one line) that ``steadyrl.integrations.<adapter>`` raises when ``framework`` is missing."""
    return ImportError(f"steadyrl.integrations.{adapter} needs {framework}: {install}")


def warn_if_untested(adapter: str, dist: str, tested: str) -> None:
    """Warn when the installed distribution ``dist`` is not release ``tested`` (the adapter may use its internals)."""
    found = metadata.version(dist)
    if found != tested:
        warnings.warn(
            f"steadyrl.integrations.{adapter} was tested with {dist}=={tested}; found {dist}=={found}", stacklevel=3
        )
