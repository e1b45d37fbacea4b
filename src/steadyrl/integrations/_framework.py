"""What every adapter does with its framework at import: a one-line error naming what to install when it is missing,
and a warning when the installed release is not the one the adapter was tested against."""

from __future__ import annotations

import warnings
from importlib import metadata


def install_hint(adapter: str, dist: str, tested: str, *, pin_file: bool = True) -> str:
    """The install command for ``adapter``'s framework: the extra ``steadyrl[<adapter>]`` (the framework alone, at
    least the tested release), and in a checkout of steadyrl its pin file (``requirements/integrations/<adapter>.txt``,
    installed with ``--no-deps``: the frameworks' own requirements would move the locked torch) where it has one."""
    pinned = f"; in a checkout: pip install --no-deps -r requirements/integrations/{adapter}.txt" if pin_file else ""
    return f"pip install 'steadyrl[{adapter}]' (tested with {dist}=={tested}{pinned})"


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
