"""The run-time batch ledger and idle-clip alarm (``steadyrl.train.ledger``) on real sampled rollouts."""

from __future__ import annotations

import torch

from steadyrl.check.rules import RunFacts, batch_reuse
from steadyrl.methods import resolve_method
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model
from steadyrl.rollout.rollouts import Rollouts
from steadyrl.rollout.sampler import generate
from steadyrl.train.ledger import BatchLedger, IdleClipAlarm, batch_fingerprints, corrects_behavior

ARCH = TinyArchConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
PROMPTS = [["1+2=", "7-3="], ["4+4=", "9-1="], ["2+2=", "5-5="]]


def sample(prompts: list[str], seed: int) -> Rollouts:
    model = build_tiny_model(ARCH, tokenizer=build_char_tokenizer(), seed=0)
    return generate(model, build_char_tokenizer(), prompts, group_size=2, max_new_tokens=5,
                    generator=torch.Generator().manual_seed(seed), version=0)  # fmt: skip


def enter(ledger: BatchLedger, r: Rollouts, version: int = 3) -> dict[str, int]:
    return ledger.record(prompt_ids=r.prompt_ids, prompt_mask=r.prompt_mask, response_ids=r.response_ids,
                         response_mask=r.response_mask, versions=r.versions, learner_version=version)  # fmt: skip


def test_fingerprints_ignore_padding_and_see_every_token() -> None:
    r = sample(PROMPTS[0], 0)
    p, b = batch_fingerprints(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    junk = torch.where(r.response_mask, r.response_ids, torch.full_like(r.response_ids, 7))
    assert batch_fingerprints(r.prompt_ids, r.prompt_mask, junk, r.response_mask) == (p, b)
    changed = r.response_ids.clone()
    changed[0, 0] += 1
    p2, b2 = batch_fingerprints(r.prompt_ids, r.prompt_mask, changed, r.response_mask)
    assert p2 == p and b2 != b  # same prompts (data order), another batch
    other = sample(PROMPTS[1], 0)
    assert batch_fingerprints(other.prompt_ids, other.prompt_mask, other.response_ids, other.response_mask)[0] != p


def test_a_sampler_that_repeats_a_batch_is_caught() -> None:
    """Healthy: a new batch each step. Planted: the queue hands batch 0 back at steps 2 and 3."""
    batches = [sample(p, t) for t, p in enumerate(PROMPTS)]
    for planted in (False, True):
        ledger, rows = BatchLedger(), []
        for t in range(5):
            r = batches[0] if planted and t in (2, 3) else batches[t % 3] if t < 3 else sample(PROMPTS[t % 3], t)
            rows.append({"step": t} | enter(ledger, r))
        f = batch_reuse(rows, RunFacts())
        if planted:
            assert (f.verdict, f.step) == ("FAIL", 2)
            assert rows[-1]["data/max_reuse"] == 3 and rows[-1]["data/distinct_batches"] == 3
        else:
            assert f.verdict == "PASS" and rows[-1]["data/distinct_batches"] == 5


def test_ledger_counts_survive_a_checkpoint_and_age_is_versions() -> None:
    ledger = BatchLedger()
    r = sample(PROMPTS[0], 0)  # sampled at version 0
    assert enter(ledger, r, version=3)["data/age_max"] == 3
    restored = BatchLedger()
    restored.load_state_dict(ledger.state_dict())
    assert enter(restored, r)["data/max_reuse"] == 2


def test_the_catalog_says_who_corrects_against_mu() -> None:
    assert not corrects_behavior(resolve_method("grpo"))
    assert not corrects_behavior(resolve_method("gspo"))
    for name in ("seq_tis", "token_tis", "vcpo", "seq_tis+ess_lr", "m2po", "gmc_grpo"):
        assert corrects_behavior(resolve_method(name)), name
    assert corrects_behavior(resolve_method("grpo", {"policy": "bypass"}))  # the ratio is taken to μ itself


def test_idle_clip_alarm() -> None:
    alarm = IdleClipAlarm.for_method(resolve_method("grpo"), stale=True)
    idle = {"kl/k3": torch.tensor(0.3), "loss/ratio_max": torch.tensor(1.0), "loss/clip_frac": torch.tensor(0.0)}
    assert alarm(idle) == 1
    assert alarm(idle | {"kl/k3": torch.tensor(0.04)}) == 0
    assert alarm(idle | {"loss/ratio_max": torch.tensor(1.01)}) == 0
    assert IdleClipAlarm.for_method(resolve_method("grpo"), stale=False)(idle) == 0
    assert IdleClipAlarm.for_method(resolve_method("seq_tis"), stale=True)(idle) == 0
