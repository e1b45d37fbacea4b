"""Policy models: the embedded default (a character tokenizer and a tiny Llama, warm-started on the task and cached in
the Hugging Face layout) and loading of any causal LM through ``from_pretrained``.

=====================  ===========================================================================
module                 holds
=====================  ===========================================================================
``tokenizer``          :func:`build_char_tokenizer`: one token per character, ``<bos>/<eos>/<pad>``
``tiny``               :class:`TinyArchConfig`, :func:`build_tiny_model` (seeded random init)
``warmstart``          :class:`WarmStartConfig`, :func:`warm_start` (SFT to a target accuracy),
                       :func:`warm_start_cached` (build once, reuse)
``cache``              cache root (``$STEADYRL_CACHE``), keys, atomic directory builds
``smollm2``            :func:`smollm2_cached`: SmolLM2-135M-Instruct from the package index, converted once
``load``               :class:`ModelConfig`, :class:`Policy`, :func:`load_policy`
=====================  ===========================================================================
"""

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)
from steadyrl.models.load import DEFAULT_MODEL_NAME, ModelConfig, Policy, load_policy
from steadyrl.models.model_cache import models_dir
from steadyrl.models.smollm2 import SMOLLM2_NAME, ModelFetchError, smollm2_cached
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.models.warmstart import (
    EvalPoint,
    WarmStartConfig,
    WarmStartReport,
    read_warm_start_metadata,
    sampled_accuracy,
    warm_start,
    warm_start_cached,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SMOLLM2_NAME",
    "EvalPoint",
    "ModelConfig",
    "ModelFetchError",
    "Policy",
    "TinyArchConfig",
    "WarmStartConfig",
    "WarmStartReport",
    "build_char_tokenizer",
    "build_tiny_model",
    "load_policy",
    "models_dir",
    "read_warm_start_metadata",
    "sampled_accuracy",
    "smollm2_cached",
    "warm_start",
    "warm_start_cached",
]
