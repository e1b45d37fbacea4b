"""The optional parts of steadyrl and the one line that says how to install each (``pip install 'steadyrl[train]'``).

``pip install steadyrl`` brings the core only (torch, numpy, pydantic, jaxtyping: ``compute_loss``, the methods,
controllers, diagnostics and per-trajectory gradient norms). Everything else is an extra of ``pyproject.toml``;
a package or command that needs one checks for its modules first (without importing them) and raises
:class:`MissingExtraError`, one line naming the missing modules and the install command.
"""

from __future__ import annotations

import sys
from importlib.util import find_spec

#: The import names each extra brings (``pyproject.toml``'s optional dependencies, by module).
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": (
        "transformers", "safetensors", "yaml", "tqdm", "matplotlib", "reasoning_gym", "math_verify", "pyarrow", "gguf",
    ),
    "ray": ("ray",),
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "vllm": ("vllm",),
}  # fmt: skip


class MissingExtraError(ImportError):
    """A part of steadyrl whose extra is not installed (the message is one line with the install command)."""


def install_line(extra: str) -> str:
    """``pip install 'steadyrl[<extra>]'``."""
    return f"pip install 'steadyrl[{extra}]'"


def missing_modules(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of ``extra`` (or just ``modules``) that cannot be imported here; found without importing them."""
    return [m for m in (EXTRAS[extra] if modules is None else modules) if not _importable(m)]


def _importable(name: str) -> bool:
    if name in sys.modules:  # imported already, or blocked (None)
        return sys.modules[name] is not None
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require_extra(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise :class:`MissingExtraError` when a module of ``extra`` (or of ``modules``) is missing.

    ``what`` names the part that needs them (``"steadyrl train"``, ``"steadyrl.models"``).
    """
    missing = missing_modules(extra, modules)
    if missing:
        raise MissingExtraError(f"{what} needs {', '.join(missing)} (not installed): {install_line(extra)}")
