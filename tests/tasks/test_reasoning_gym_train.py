"""``steadyrl train task=reasoning_gym`` end to end on a tiny default model, with 100-token responses."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics

#: Response budget of the run: responses of 100 tokens go through the sampler, the masks and the learner.
MAX_NEW_TOKENS = 100


@pytest.mark.filterwarnings("ignore:warm start of reasoning_gym stopped at max_steps")
def test_train_on_basic_arithmetic_with_100_token_responses(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        "task=reasoning_gym", "task.dataset=basic_arithmetic", "task.eval_size=16",
        "task.config.min_terms=2", "task.config.max_terms=2", "task.config.min_digits=1", "task.config.max_digits=1",
        "steps=2", "prompts_per_step=2", "group_size=2", f"rollout.max_new_tokens={MAX_NEW_TOKENS}", "eval.n=4",
        "eval.every=1", "runtime.lag.k=0", "method=grpo", "data.train_pool=16",
        # A tiny model barely warm-started (seconds): it rarely ends a response early, so responses reach the cap.
        "model.arch.hidden_size=32", "model.arch.num_layers=2", "model.arch.num_heads=2",
        "model.arch.intermediate_size=64", "model.warm_start.max_steps=2", "model.warm_start.eval_every=2",
        "model.warm_start.eval_problems=4", "model.warm_start.batch_size=8", "model.warm_start.train_problems=16",
        "model.warm_start.warmup_steps=1", f"model.cache_dir={tmp_path / 'models'}",
        "runtime.threads=1", "log.progress=false", f"out_dir={out}",
    ]  # fmt: skip
    assert main(args) == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    steps = records[:-1]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in steps)
    assert max(r["response/truncated"] for r in steps) > 0  # some responses ran the full 100 tokens
    assert max(r["response/len_mean"] for r in steps) > MAX_NEW_TOKENS / 2
    assert all("eval/acc" in r for r in records)
    assert (out / "config.yaml").read_text().count("dataset: basic_arithmetic") == 1
