"""Test configuration: runtime shape checking of every public ``core``/``control`` function.

Every module under ``steadyrl.core`` and ``steadyrl.control`` is imported under jaxtyping's import hook with beartype,
so each annotated shape (``Float[Tensor, "B T"]``) is checked on every call the tests make.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from jaxtyping import install_import_hook

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# model.name=<hub id> downloads as from_pretrained does; the suite never does (it must pass without a network): an
# uncached hub id fails at once, naming the variable.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

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

# The suite's synthetic batches are arbitrary tensors rather than log-probabilities (behaviour log-probs shifted by
# ±1000 or above 0, NaN planted on purpose): compute_loss's input checks, on by default for a direct call, are off
# for them. tests/methods/test_validate.py passes validate=True itself and checks the default in a fresh interpreter.
from steadyrl.methods import compose as _compose  # noqa: E402

_compose.compute_loss.__kwdefaults__["validate"] = False


# A tiny warm-started model on an easy task, shared by the end-to-end tests of `steadyrl train` (every runtime):
# chain_sum with two one-digit terms, a 2-layer Llama of hidden size 32 warm-started (about 5 s) into a per-session
# temporary cache; every run of the tests reuses that cache entry.
@pytest.fixture(scope="session")
def tiny_overrides(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``key=value`` overrides that turn the default job into a seconds-long one (add out_dir=...)."""
    cache: Path = tmp_path_factory.mktemp("model-cache")
    return [
        "task.min_terms=2", "task.max_terms=2", "task.min_digits=1", "task.max_digits=1", "task.eval_size=128",
        "model.arch.hidden_size=32", "model.arch.num_layers=2", "model.arch.num_heads=2",
        "model.arch.intermediate_size=64", "model.warm_start.target_accuracy=0.25", "model.warm_start.max_steps=400",
        "model.warm_start.eval_every=20", "model.warm_start.eval_problems=128", "model.warm_start.batch_size=64",
        "model.warm_start.lr=1e-2", "model.warm_start.warmup_steps=10", "model.warm_start.train_problems=2048",
        f"model.cache_dir={cache}",
        "eval.n=128", "eval.every=10", "rollout.max_new_tokens=4", "data.train_pool=512", "lr=1e-3",
        "prompts_per_step=16", "runtime.threads=1",
        "log.progress=false", "log.timings=separate", "checkpoint.every=5",
    ]  # fmt: skip
