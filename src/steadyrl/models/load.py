"""Loading the policy: the embedded default model or any ``transformers`` causal LM, through ``from_pretrained``.

``ModelConfig(name="default")`` builds (first use) or reuses (later) the warm-started tiny Llama in the cache, then
loads it back from that directory with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``:
the same two calls that load a local 0.5B–7B checkpoint or a hub id, so everything downstream sees one code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from steadyrl.models.smollm2 import SMOLLM2_NAME, smollm2_cached
from steadyrl.models.tiny import TinyArchConfig
from steadyrl.models.tokenizer import CHARSET
from steadyrl.models.warmstart import ProgressHook, WarmStartConfig, warm_start_cached
from steadyrl.tasks import Task
from steadyrl.tasks.types import MissingFileError

#: ``ModelConfig.name`` of the embedded default model.
DEFAULT_MODEL_NAME = "default"
#: Prefixes that mark a name as a filesystem path rather than a hub id.
_PATH_PREFIXES: tuple[str, ...] = ("/", "./", "../", "~", ".")

#: Fields that do not apply to a built-in name (any other name: ``arch``, ``warm_start``, ``cache_dir``).
_INAPPLICABLE: dict[str, tuple[str, ...]] = {
    DEFAULT_MODEL_NAME: ("download",),
    SMOLLM2_NAME: ("arch", "warm_start", "download"),
}

#: Environment variables that keep ``from_pretrained`` to the local hub cache (either, set to 1 / true / yes / on).
OFFLINE_ENV: tuple[str, ...] = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")

Dtype = Literal["float32", "bfloat16", "float16"]
_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelConfig(BaseModel):
    """Which policy model to load, and how the embedded default is built."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(DEFAULT_MODEL_NAME, min_length=1)
    """``"default"`` (the embedded tiny Llama, warm-started on the run's task), ``"smollm2-135m-instruct"``
    (SmolLM2-135M-Instruct, fetched from the package index and converted once; docs/scale.md), a local checkpoint
    directory, or a Hugging Face hub id (read from the local hub cache, downloaded where the machine can, as
    ``from_pretrained`` does; ``HF_HUB_OFFLINE=1`` keeps it to the cache)."""
    dtype: Dtype | None = None
    """Parameter dtype the model is loaded in; None: float32. ``steadyrl train`` loads in its ``precision``'s dtype
    (float32, or bfloat16 for ``precision=bf16``): set there, this may only repeat it."""
    arch: TinyArchConfig = TinyArchConfig()
    """Architecture of the default model (only with ``name="default"``)."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Warm-start settings of the default model (only with ``name="default"``)."""
    cache_dir: str | None = None
    """Directory of cached built-in models (``default``, ``smollm2-135m-instruct``); None: ``$STEADYRL_CACHE/models``
    or ``~/.cache/steadyrl/models``."""
    download: bool | None = None
    """Whether ``from_pretrained`` may download a hub id missing from the local hub cache. None: as
    ``from_pretrained`` does, unless ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set; false: the cache only
    (an id missing from the cache then fails at once instead of retrying the network); true: download."""

    @model_validator(mode="after")
    def _fields_fit_the_model(self) -> ModelConfig:
        # A field "applies" when it differs from its default: a resolved config written back (every field explicit)
        # must load again.
        fields = _INAPPLICABLE.get(self.name, ("arch", "warm_start", "cache_dir"))
        misplaced = sorted(
            f for f in fields if getattr(self, f) != type(self).model_fields[f].get_default(call_default_factory=True)
        )
        if misplaced:
            raise ValueError(f"{', '.join(misplaced)} does not apply to name={self.name!r}")
        return self


@dataclass(frozen=True)
class Policy:
    """A loaded policy: the model (eval mode), its tokenizer (left padding, a pad token), and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    path: str
    """The directory (or hub id) passed to ``from_pretrained``."""


def load_policy(model_cfg: ModelConfig, task: Task | None, *, seed: int, progress: bool = True) -> Policy:
    """Load the policy ``model_cfg`` names.

    For ``name="default"``, ``task`` and ``seed`` pick the warm-start cache entry (built on first use: about three
    minutes on two CPU threads for chain_sum, with a progress bar unless ``progress`` is False). For
    ``name="smollm2-135m-instruct"`` the converted checkpoint of :mod:`steadyrl.models.smollm2` (fetched and converted
    on first use, about a minute). For any other name ``task`` and ``seed`` are unused. A tokenizer without a pad
    token gets its EOS token as pad.

    Raises:
        MissingFileError: ``name`` is a path that does not exist (a ``FileNotFoundError``), or SmolLM2's weights
            cannot be fetched (its subclass ``ModelFetchError``).
        OSError: ``name`` is a hub id that is neither in the local hub cache nor downloadable (offline, or the id
            or the network is wrong); the message says which.
        ValueError: the default model is asked for without a task, or the task uses characters the character
            tokenizer lacks.
    """
    if model_cfg.name == DEFAULT_MODEL_NAME:
        if task is None:
            raise ValueError("the default model is warm-started on the run's task: pass a task to load_policy")
        path = str(default_model_dir(model_cfg, task, seed=seed, progress=progress))
    elif model_cfg.name == SMOLLM2_NAME:
        path = str(smollm2_cached(model_cfg.cache_dir))
    else:
        path = _resolve_external(model_cfg.name)
    offline_env = next((v for v in OFFLINE_ENV if _truthy(os.environ.get(v))), None)
    offline = model_cfg.download is False or (model_cfg.download is None and offline_env is not None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=offline)
        dtype = _DTYPES[model_cfg.dtype or "float32"]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=offline)
    except OSError as err:
        if model_cfg.download is False:
            hint = "Downloads are off (model.download=false): set model.download=true (or leave it unset) to download."
        elif offline:
            hint = (f"{offline_env}={os.environ[offline_env]} is set, so only the local hub cache is read: unset it, "
                    "or set model.download=true, to let from_pretrained download.")  # fmt: skip
        else:
            hint = "The download failed: check the hub id and the network (or set HF_HUB_OFFLINE=1 to fail at once)."
        raise OSError(
            f"could not load model {path!r} as a local checkpoint or a hub id. {hint} Or pass a local checkpoint "
            "directory (saved with save_pretrained)."
        ) from err
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return Policy(model=model, tokenizer=tokenizer, path=path)


def default_model_dir(
    model_cfg: ModelConfig, task: Task, *, seed: int, progress: bool = True, on_progress: ProgressHook | None = None
) -> Path:
    """The cache directory of the default model warm-started on ``task`` with ``seed``, built on first use (see
    :func:`~steadyrl.models.warmstart.warm_start_cached`; ``on_progress`` sees every warm-start step).

    Raises:
        ValueError: the task uses characters the character tokenizer lacks.
    """
    unknown = sorted(set(task.alphabet) - set(CHARSET))
    if unknown:
        raise ValueError(f"task {task.name} uses characters the default tokenizer lacks: {unknown!r}")
    return warm_start_cached(
        model_cfg.arch,
        task=task,
        cfg=model_cfg.warm_start,
        seed=seed,
        cache_dir=model_cfg.cache_dir,
        progress=progress,
        on_progress=on_progress,
    )


def _resolve_external(name: str) -> str:
    """``name`` as a local directory if it is one; a clear error if it looks like a path but is missing."""
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local)
    if name.startswith(_PATH_PREFIXES) or local.exists() or name.count(os.sep) > 1:
        raise MissingFileError(
            f"model directory {name!r} does not exist (or is not a directory). Give a local checkpoint directory "
            "saved with save_pretrained, or a Hugging Face hub id (org/name)."
        )
    return name  # a hub id: from_pretrained reads the local hub cache, then downloads unless offline


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")
