"""Full-vocabulary terms a method's loss reads, built per batch for the learner's chunked log-prob pass.

A method asks for a batch key whose value is a function of the whole policy distribution at each token (a
vocabulary term of :mod:`steadyrl.core.vocab_chunks`): the learner looks the key up in :data:`VOCAB_TERMS`, builds
the term from the method and the batch's rollouts, and computes it in the same forward as ``logp``
(:func:`~steadyrl.rollout.logprobs.sequence_logprob_terms`: chunk by chunk with its gradient, never a second
full-vocabulary pass), then hands it to the loss under that key.

- ``centering``: score centering's Σ_v sg(μ_v w_v) log π_θ(v) (arXiv 2609.20807, Eq. 14) from the behavior
  distribution the sampler recorded (:func:`steadyrl.core.objectives.score_centering.centering_term`);
- ``entropy``: the policy's entropy H = −Σ_v π_θ(v) log π_θ(v) of the entropy bonus (``entropy.coef``, the
  ``adaptive_entropy`` controller; :func:`steadyrl.core.entropy.entropy_term`), of the distribution the log-probs
  are scored under (the learner's temperature).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from steadyrl.core.entropy import entropy_term
from steadyrl.core.objectives.score_centering import centering_term
from steadyrl.core.vocab_chunks import VocabTerm
from steadyrl.methods.spec import MethodSpec, ScoreCentering
from steadyrl.rollout.rollouts import Rollouts

#: Builds a term from the method and the rollouts it will be evaluated on (rows and columns as the forward's batch).
TermBuilder = Callable[[MethodSpec, Rollouts], VocabTerm]


def _centering(method: MethodSpec, rollouts: Rollouts) -> VocabTerm:
    obj = method.objective
    if not isinstance(obj, ScoreCentering):
        raise ValueError(f"method {method.name!r}: the 'centering' term belongs to objective.type=score_centering")
    dist, ids = rollouts.behav_dist_logp, rollouts.behav_dist_ids
    if dist is None:
        raise ValueError(
            f"method {method.name!r} needs the behavior distribution at each token, and these rollouts carry none: "
            f"sample with record_dist={obj.top_k} (steadyrl train records it for this method)"
        )
    if obj.top_k == 0 and ids is not None:
        raise ValueError(
            f"method {method.name!r} (objective.top_k=0, the exact form) needs the full behavior distribution; the "
            f"rollouts carry its top-{dist.shape[-1]}: set objective.top_k={dist.shape[-1]} or record it in full"
        )
    N, T, K = dist.shape
    flat_ids = None if ids is None else ids.reshape(N * T, K)
    if obj.top_k > 0 and flat_ids is None:  # a full record serves the top-k form too: its k most likely tokens
        top = dist.reshape(N * T, K).topk(min(obj.top_k, K), dim=-1)
        return centering_term(behav_logp=top.values, head_ids=top.indices, weight=obj.weight)
    return centering_term(behav_logp=dist.reshape(N * T, K), head_ids=flat_ids, weight=obj.weight)


def _entropy(method: MethodSpec, rollouts: Rollouts) -> VocabTerm:
    return entropy_term  # a function of the log-probs alone: the same term for every batch


#: Batch key → builder of its vocabulary term.
VOCAB_TERMS: dict[str, TermBuilder] = {"centering": _centering, "entropy": _entropy}


def vocab_terms(method: MethodSpec, needs: Iterable[str], rollouts: Rollouts) -> dict[str, VocabTerm]:
    """The vocabulary terms among ``needs`` (the method's batch keys), built for ``rollouts``."""
    return {key: VOCAB_TERMS[key](method, rollouts) for key in needs if key in VOCAB_TERMS}
