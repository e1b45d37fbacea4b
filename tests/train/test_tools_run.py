"""``steadyrl train`` with tools: the tiny model, warm-started on chain_sum_tool demonstrations, calls the sandboxed
Python tool; the run logs the tool metrics, trains on sampled tokens only, and survives malicious tool calls."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import ToolsConfig, TrainConfig
from steadyrl.rollout.multiturn import SharedCalls
from steadyrl.rollout.rollouts import TOOL_VERSION, Rollouts
from steadyrl.tools import ToolResult
from steadyrl.train import learner as learner_module
from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics

#: Metrics every learner-step line of a tool run carries.
TOOL_METRICS = {"tool/calls_mean", "tool/errors", "tool/timeouts", "turns/mean", "response/context_len_mean"}
#: Code planted in place of the model's calls: an infinite loop and a fork bomb.
INFINITE_LOOP = "while True:\n    pass"
FORK_BOMB = "import os\nwhile True:\n    os.fork()"


def tool_overrides(tiny_overrides: list[str]) -> list[str]:
    """The tiny job on chain_sum_tool (two 1–2 digit terms) with tools on; the warm start measures few problems
    (each costs a sandbox call)."""
    return [
        *tiny_overrides,
        "task=chain_sum_tool", "task.min_terms=2", "task.max_terms=2", "task.min_digits=1", "task.max_digits=2",
        "task.eval_size=128", "model.warm_start.eval_problems=16", "model.warm_start.eval_every=100",
        "model.warm_start.max_steps=300", "tools.enabled=true", "tools.share_calls=true", "tools.max_total_tokens=56",
        "tools.max_tool_tokens=12", "tools.sandbox.workers=2", "tools.sandbox.timeout_s=3", "tools.sandbox.cpu_s=2",
        "tools.sandbox.max_procs=8", "eval.n=16", "eval.every=0", "prompts_per_step=4", "group_size=4",
        "runtime.lag.k=0",
        "method=seq_tis", "checkpoint.every=0",
    ]  # fmt: skip


class _Seen:
    """What the learner was handed: each step's rollouts and the loss mask compute_loss saw."""

    def __init__(self) -> None:
        self.rollouts: list[Rollouts] = []
        self.masks: list[torch.Tensor] = []


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> _Seen:
    record = _Seen()
    step, loss = learner_module.Learner.step, learner_module.compute_loss

    def spy_step(self: Any, rollouts: Rollouts, rewards: torch.Tensor, **kwargs: Any) -> Any:
        record.rollouts.append(rollouts)
        return step(self, rollouts, rewards, **kwargs)

    def spy_loss(method: Any, batch: dict, **kwargs: Any) -> Any:
        record.masks.append(batch["mask"].clone())
        return loss(method, batch, **kwargs)

    monkeypatch.setattr(learner_module.Learner, "step", spy_step)
    monkeypatch.setattr(learner_module, "compute_loss", spy_loss)
    return record


def test_tool_run_logs_tool_metrics_and_trains_on_model_tokens_only(
    tiny_overrides: list[str], tmp_path: Path, seen: _Seen
) -> None:
    out = tmp_path / "tools"
    assert main([*tool_overrides(tiny_overrides), f"out_dir={out}", "steps=3"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    steps, final = records[:-1], records[-1]
    assert len(steps) == 3 and "eval/acc" in final and "eval/acc" in steps[0]
    for r in steps:
        assert r.keys() >= TOOL_METRICS, TOOL_METRICS - r.keys()
        assert r["turns/mean"] >= 1
    assert sum(r["tool/calls_mean"] for r in steps) > 0  # the warm-started model calls the tool ...
    assert max(r["turns/mean"] for r in steps) > 1  # ... and answers after reading its output
    tool_rows = 0
    for rollouts, mask in zip(seen.rollouts, seen.masks, strict=True):
        tool = rollouts.tool_mask
        assert tool is not None
        tool_rows += int(tool.any(-1).sum())
        assert torch.equal(mask, rollouts.response_mask)  # the loss mask is the sampled tokens ...
        assert not (mask & tool).any()  # ... and never a tool-output token
        assert (rollouts.versions[tool] == TOOL_VERSION).all() and (rollouts.behav_logp[tool] == 0).all()
    assert tool_rows > 0


def test_local_runtime_reports_tool_errors_and_timeouts_from_the_sampler_process(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """In ``runtime.mode=local`` the counts cross the process boundary in the group records: with a wall-clock
    limit of 1 ms the calls end as timeouts, and the learner's metrics say so (a call that happens to exit before its
    supervisor sees the deadline counts as a success, hence "nearly all")."""
    out = tmp_path / "local"
    overrides = [*tool_overrides(tiny_overrides), f"out_dir={out}", "steps=2", "runtime.mode=local",
                 "tools.sandbox.timeout_s=0.001", "tools.share_calls=false"]  # fmt: skip
    assert main(overrides) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert len(steps) == 2
    rows = 4 * 4  # prompts_per_step × group_size
    calls = errors = 0.0
    for r in steps:
        assert r.keys() >= TOOL_METRICS, TOOL_METRICS - r.keys()
        assert r["tool/errors"] == r["tool/timeouts"]  # every error is a timeout here
        calls, errors = calls + r["tool/calls_mean"] * rows, errors + r["tool/errors"]
    assert calls > 0 and 0.8 * calls <= errors <= calls


class _Planted:
    """A tool runner that replaces the first call of every batch with malicious code."""

    def __init__(self, runner: Any, code: str) -> None:
        self.runner, self.code = runner, code

    def map(self, codes: Sequence[str]) -> list[ToolResult]:
        return self.runner.map([self.code, *codes[1:]]) if codes else []


@pytest.mark.parametrize(("code", "errors"), [(INFINITE_LOOP, {"timeout", "cpu"}), (FORK_BOMB, None)])
def test_planted_malicious_call_ends_with_an_error_not_the_run(
    code: str, errors: set[str] | None, tiny_overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results: list[ToolResult] = []
    tool_use = ToolsConfig.tool_use

    def planted(self: ToolsConfig, runner: Any) -> Any:
        inner = _Planted(runner, code)

        class Recording:
            def map(self, codes: Sequence[str]) -> list[ToolResult]:
                got = inner.map(codes)
                results.extend(got[:1])
                return got

        return tool_use(self, Recording())

    monkeypatch.setattr(ToolsConfig, "tool_use", planted)
    out = tmp_path / "planted"
    assert main([*tool_overrides(tiny_overrides), f"out_dir={out}", "steps=2", "tools.share_calls=false"]) == 0
    steps = read_metrics(out / "metrics.jsonl")[:-1]
    assert len(steps) == 2
    assert results, "no tool call was made"
    assert all(r.error is not None for r in results)
    if errors is not None:
        assert {r.error for r in results} <= errors
    assert sum(r["tool/errors"] for r in steps) >= 1  # logged in metrics.jsonl


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("tools.max_turns=0", ["tools.max_turns"]),
        ("tools.output_template=no slot", ["tools.output_template", "{output}"]),
        ("tools.output_template='{output}{output}'", ["tools.output_template", "exactly once"]),
        ("tools.call_open=''", ["tools.call_open"]),
        ("tools.max_tool_tokens=96", ["max_tool_tokens (96)", "max_total_tokens (96)"]),
        ("tools.sandbox.isolation=chroot", ["tools.sandbox.isolation"]),
        ("tools.sandbox.timeout_s=0", ["tools.sandbox.timeout_s"]),
        ("tools.bogus=1", ["tools.bogus"]),
    ],
)
def test_bad_tools_config_names_the_field(override: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, overrides=[override])
    for name in names:
        assert name in str(info.value), (name, str(info.value))


def test_tools_config_builds_the_sampler_settings() -> None:
    cfg = load_config(TrainConfig, overrides=["tools.enabled=true", "tools.share_calls=true", "tools.max_turns=5"])
    runner = object()
    use = cfg.tools.tool_use(runner)  # type: ignore[arg-type]
    assert use.max_turns == 5 and use.max_total_tokens == 96 and use.max_tool_tokens == 32
    assert isinstance(use.runner, SharedCalls) and use.runner.runner is runner
    assert cfg.tools.model_copy(update={"share_calls": False}).tool_use(runner).runner is runner  # type: ignore[arg-type]


def test_shared_calls_run_each_distinct_code_once() -> None:
    calls: list[list[str]] = []

    class Echo:
        def map(self, codes: Sequence[str]) -> list[ToolResult]:
            calls.append(list(codes))
            return [ToolResult(c, "", False, 0, None, 0.0, "stub") for c in codes]

    got = SharedCalls(Echo()).map(["a", "b", "a", "c", "b"])
    assert [r.stdout for r in got] == ["a", "b", "a", "c", "b"] and calls == [["a", "b", "c"]]
