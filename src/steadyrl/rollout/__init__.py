"""Sampling engines and the learner's log-prob recompute.

=====================  ===========================================================================
module                 holds
=====================  ===========================================================================
``distribution``       the sampling distribution (temperature, top-k, top-p) in log space
``rollouts``           :class:`Rollouts` (tokens, masks, behavior log-probs, versions), ``concat``,
                       :func:`trim_padding`
``sampler``            :func:`generate`: batched KV-cache sampling from a ``transformers`` causal LM
``logprobs``           :func:`sequence_logprobs`: per-token log-probs (and entropies) with gradient, in
                       vocabulary chunks past an element budget; :func:`sequence_logprob_terms`:
                       full-vocabulary terms (entropy bonus, Σ_v c_v log π_v) with gradient
``framing``            :func:`~steadyrl.rollout.framing.encode_tool_text`: tool output encoded without any
                       special token
=====================  ===========================================================================
"""

from steadyrl.base import needs_train as _needs_train  # noqa: F401  (one line naming the extra when it is missing)
from steadyrl.rollout.distribution import SamplingParams, entropy_from_log_probs, sampling_log_probs
from steadyrl.rollout.logprobs import SequenceLogprobs, SequenceLogprobTerms, sequence_logprob_terms, sequence_logprobs
from steadyrl.rollout.rollouts import Rollouts, TokenBatch, TokenBatchLike, concat, trim_padding
from steadyrl.rollout.sampler import generate

__all__ = [
    "Rollouts",
    "SamplingParams",
    "SequenceLogprobTerms",
    "SequenceLogprobs",
    "TokenBatch",
    "TokenBatchLike",
    "concat",
    "entropy_from_log_probs",
    "generate",
    "sampling_log_probs",
    "sequence_logprob_terms",
    "sequence_logprobs",
    "trim_padding",
]
