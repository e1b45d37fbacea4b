"""Test configuration: runtime shape checking of every public ``core``/``control`` function.

Every module under ``steadyrl.core`` and ``steadyrl.control`` is imported under jaxtyping's import hook with beartype,
so each annotated shape (``Float[Tensor, "B T"]``) is checked on every call the tests make.
"""

from __future__ import annotations

import importlib
import os
import pkgutil

import torch
from hypothesis import settings
from jaxtyping import install_import_hook

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

settings.register_profile("steadyrl", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("steadyrl")

_CHECKED = ("steadyrl.core", "steadyrl.control")

with install_import_hook(list(_CHECKED), "beartype.beartype"):
    for _pkg_name in _CHECKED:
        try:
            _pkg = importlib.import_module(_pkg_name)
        except ModuleNotFoundError:
            continue
        for _info in pkgutil.walk_packages(_pkg.__path__, prefix=_pkg_name + "."):
            importlib.import_module(_info.name)
