"""GMPO parity with every installed framework that ships it: verl 0.9.1 (``loss_mode="geo_mean"``) and TRL 1.16.0
(``trl.experimental.gmpo.GMPOTrainer``).

Both clip each token log-ratio one-sided in log space (``objective.clip_low``/``clip_high`` = verl
``clip_ratio_low``/``clip_ratio_high``, TRL ``GMPOConfig.epsilon``/``epsilon_high``), take the geometric mean over
the row and multiply by the row's advantage; both divide by every row of the micro-batch, trained or not
(``objective.empty_rows=count``; verl ignores ``loss_agg_mode``). Two differences, both outside what steadyrl models:

* verl averages with a ``+1e-8`` in the row length (relative 1e-8): 1e-6 there.
* TRL's empty row has exp(mean of nothing) = 1, so it adds the constant −A_i/B to the value (no gradient); the test
  adds that constant to steadyrl's value. verl's empty row contributes 0 (its row advantage is 0).

Sequence advantages (one per row, broadcast for verl, as its docstring requires); hypothesis batches with heavy-tailed
advantages, log-ratios up to ±20, garbage off the mask and empty rows. Loss, gradient and TRL's
``clip_ratio/region_mean`` (steadyrl's ``loss/clip_frac``) are compared.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings

from steadyrl import compute_loss
from tests.parity._parity import Case, _OneProcess, assert_close, batch, cases, grad, leaf

EXAMPLES = 30
CLIPS = [(0.4, 0.4), (0.1, 0.3)]


def ours(case: Case, low: float, high: float):
    logp = leaf(case.ours(case.theta))
    spec = {"advantage.type": "given", "objective.clip_low": low, "objective.clip_high": high,
            "objective.empty_rows": "count"}  # fmt: skip
    out = compute_loss("gmpo", batch(case, logp, case.adv_seq), overrides=spec)
    return out.loss, grad(out.loss, logp), out.metrics


@pytest.mark.parametrize(("low", "high"), CLIPS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_verl(case: Case, low: float, high: float) -> None:
    pytest.importorskip("verl", reason="needs verl==0.9.1")
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    assume(bool(case.mask.any()))
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4, rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode="geo_mean"), loss_agg_mode="token-mean", clip_ratio_low=low,
        clip_ratio_high=high,
    )  # fmt: skip
    theta = leaf(case.theta)
    loss, _ = core_algos.get_policy_loss_fn("geo_mean")(
        old_log_prob=case.prox, log_prob=theta, advantages=case.seq_tok(), response_mask=case.mask,
        loss_agg_mode="token-mean", config=config, rollout_is_weights=None,
    )  # fmt: skip
    ref, g, _ = ours(case, low, high)
    assert_close(ref, loss, rtol=1e-6, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-6, atol=1e-9)


def trl_gmpo_loss(logp: torch.Tensor, inputs: dict[str, torch.Tensor], **config: Any):
    """TRL's ``GMPOTrainer._compute_loss`` run unbound on a stand-in ``self`` holding what ``GRPOTrainer.__init__``
    derives from ``GMPOConfig(**config)`` (ε_low = ``epsilon``, ε_high = ``epsilon_high`` or ``epsilon``) and a
    forward that returns ``logp``; everything from the log-probs on is TRL's code."""
    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

    args = GMPOConfig(output_dir="unused", use_cpu=True, report_to=[], bf16=False, **config)
    B, T = logp.shape
    self = types.SimpleNamespace(
        args=args, accelerator=_OneProcess(), model=types.SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)}, beta=args.beta, top_entropy_quantile=args.top_entropy_quantile,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp.detach()), None),
        epsilon_low=args.epsilon, epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        current_gradient_accumulation_steps=1,
    )  # fmt: skip
    ids = torch.ones(B, T, dtype=torch.long)
    full = {"prompt_ids": ids[:, :1], "prompt_mask": ids[:, :1], "completion_ids": ids} | inputs
    loss = GMPOTrainer._compute_loss(self, None, full)
    return loss, dict(self._metrics["train"])


@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")
@pytest.mark.parametrize(("low", "high"), CLIPS)
@settings(max_examples=EXAMPLES, deadline=None)
@given(case=cases())
def test_trl(case: Case, low: float, high: float) -> None:
    pytest.importorskip("trl", reason="needs trl==1.16.0")
    theta = leaf(case.theta)
    inputs = {"completion_mask": case.mask.long(), "advantages": case.adv_seq, "old_per_token_logps": case.prox}
    loss, metrics = trl_gmpo_loss(theta, inputs, epsilon=low, epsilon_high=high)
    ref, g, m = ours(case, low, high)
    empty = ~case.mask.any(-1)
    constant = -case.adv_seq[empty].sum() / case.mask.shape[0]  # TRL's exp(empty mean) = 1 on an empty row
    assert_close(ref + constant, loss, rtol=1e-9, atol=1e-9)
    assert_close(g, grad(loss, theta), rtol=1e-9, atol=1e-9)
    if case.mask.any() and case.mask.shape[1] > 1:  # TRL reads a [B, 1] metric as per-sequence (unmasked) at T = 1
        assert_close(m["loss/clip_frac"], metrics["clip_ratio/region_mean"][-1], rtol=0, atol=1e-9)
