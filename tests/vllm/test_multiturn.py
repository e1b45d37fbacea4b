"""VLLMEngine.generate_multiturn: the turn logic (scripted vLLM answers, runs without vLLM), behavior log-probs of
tool trajectories against the learner's recompute, and ``steadyrl train rollout.engine=vllm tools.enabled=true``.

Tolerance: as tests/vllm/test_engine.py (|log μ_vLLM − log π_HF| ≤ 1e-4 per sampled token, float32 on both sides).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.multiturn import ToolCallFormat, ToolUse
from steadyrl.rollout.rollouts import TOOL_VERSION
from steadyrl.rollout.vllm_engine import SETUP_HINT, VLLMEngine, VLLMSettings, vllm_available
from steadyrl.tools.sandbox import ToolResult

needs_vllm = pytest.mark.skipif(not vllm_available(), reason=f"vLLM is not installed here; {SETUP_HINT}")

LOGP_TOL = 1e-4
ARCH = TinyArchConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
OUTPUT = "7"


class Recorder:
    """A runner stub: records the codes it is asked to run and answers each with stdout ``OUTPUT``."""

    def __init__(self) -> None:
        self.codes: list[str] = []

    def map(self, codes: Sequence[str]) -> list[ToolResult]:
        self.codes.extend(codes)
        return [ToolResult(stdout=OUTPUT + "\n", stderr="", truncated=False, returncode=0, error=None,
                           duration_s=0.0, isolation="rlimits") for _ in codes]  # fmt: skip


class ScriptedEngine(VLLMEngine):
    """A VLLMEngine without a server: each ``generate`` request answers row r with the next chunk of its script,
    cut where vLLM would stop (the first stop or trigger token, or ``max_tokens``); log-prob of token y: −y/1000."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, scripts: list[list[int]], version: int = 5) -> None:
        self.tokenizer, self.stop_ids, self.version = tokenizer, [tokenizer.eos_token_id], version
        self.device, self.max_model_len, self._triggers = torch.device("cpu"), 512, {}
        self.scripts = dict(enumerate(scripts))
        self.prompts: dict[int, list[int]] = {}
        self.requests: list[dict[str, Any]] = []

    def _call(self, op: str, payload: Any = None, *, timeout: float | None = None) -> Any:
        assert op == "generate"
        self.requests.append(payload)
        stop = set(payload["params"]["stop_token_ids"])
        out = []
        for ctx, m in zip(payload["rows"], payload["max_tokens"], strict=True):
            row = next(i for i, p in self.prompts.items() if ctx[: len(p)] == p)
            script = self.scripts[row]
            taken = []
            while script and len(taken) < m:
                taken.append(script.pop(0))
                if taken[-1] in stop:
                    break
            out.append((taken, [-y / 1000 for y in taken], None))  # no top-k log-probs asked
        return out


def test_turn_logic_on_scripted_vllm_answers() -> None:
    tok = build_char_tokenizer()
    texts = [
        "Let ```python\nprint(3+4)\n``` so\nit is 7",  # one call (opening fence first), then the answer and EOS
        "no tool 7",  # no call, EOS
        "```python\nx```" + "tail" * 20,  # one call, then the answer runs out of the token budget (truncated)
    ]
    scripts = [tok.encode(t, add_special_tokens=False) + ([tok.eos_token_id] if i < 2 else [])
               for i, t in enumerate(texts)]  # fmt: skip
    eng = ScriptedEngine(tok, [list(s) for s in scripts])
    prompts_ids = [tok(p)["input_ids"] for p in ["1+2=", "3+4=", "5+6="]]
    eng.prompts = dict(enumerate(prompts_ids))
    runner = Recorder()
    tools = ToolUse(runner=runner, max_turns=3, max_total_tokens=64, max_tool_tokens=4)
    out = eng.generate_multiturn(["1+2=", "3+4=", "5+6="], group_size=1, tools=tools, seed=0)
    r = out.rollouts
    assert runner.codes == ["print(3+4)", "x"]
    # each model turn needs one request per trigger token ('`') plus one; every request carries per-row budgets
    assert all(len(q["max_tokens"]) == len(q["rows"]) == len(q["seeds"]) for q in eng.requests)
    tool_turn = tok.encode(ToolCallFormat().output_template.format(output=OUTPUT), add_special_tokens=False)
    for i, (script, calls) in enumerate(zip(texts, [1, 0, 1], strict=True)):
        ids = r.response_ids[i][r.response_mask[i] | r.tool_mask[i]].tolist()
        tool = r.tool_mask[i]
        assert int(tool.sum()) == len(tool_turn) * calls == int(out.row_metrics.tool_tokens[i])
        assert int(out.row_metrics.tool_calls[i]) == calls
        if calls:
            first = script.index("```", script.index("```") + 3) + 3
            model1 = tok.encode(script[:first], add_special_tokens=False)
            assert ids[: len(model1) + len(tool_turn)] == model1 + tool_turn
            assert tool.nonzero().squeeze(-1).tolist() == list(range(len(model1), len(model1) + len(tool_turn)))
        assert bool((r.versions[i][tool] == TOOL_VERSION).all()) and bool((r.behav_logp[i][tool] == 0).all())
        sampled = r.response_ids[i][r.response_mask[i]]
        assert torch.equal(r.behav_logp[i][r.response_mask[i]], -sampled.float() / 1000)
        assert bool((r.versions[i][r.response_mask[i]] == 5).all())
    assert out.final_texts[0] == " so\nit is 7" and out.final_texts[1] == "no tool 7"
    assert out.row_metrics.turns.tolist() == [2, 1, 2]
    assert r.truncated.tolist() == [False, False, True]
    n3 = int(r.response_mask[2].sum() + r.tool_mask[2].sum())
    turn1 = len(tok.encode("```python\nx```", add_special_tokens=False))
    assert n3 == 64 and out.final_texts[2] == ("tail" * 20)[: 64 - turn1 - len(tool_turn)]


def test_trigger_tokens_are_those_that_can_close_a_call() -> None:
    tok = build_char_tokenizer()
    eng = ScriptedEngine(tok, [])
    assert eng.trigger_ids("```") == {tok.convert_tokens_to_ids("`")}
    specials = set(tok.all_special_ids)  # "<pad>", "<eos>", ... contain ">" too (a harmless extra stop)
    assert eng.trigger_ids("</c>") == {tok.convert_tokens_to_ids(">")} | specials


@needs_vllm
def test_tool_trajectories_have_the_learners_logprobs() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(ARCH, tokenizer=tok, seed=0).eval()
    prompts = ["12+34=", "5+6=", "7", "88+1="]
    with VLLMEngine(model, tok, settings=VLLMSettings(max_model_len=96, kv_cache_gb=0.25), version=3) as eng:
        # a call format of the two characters this random model writes most, so calls happen
        single = eng.generate(prompts, group_size=8, max_new_tokens=32, seed=0)
        counts = torch.bincount(single.response_ids[single.response_mask], minlength=len(tok))
        counts[tok.all_special_ids] = 0
        a, b = (tok.decode([int(i)]) for i in counts.topk(2).indices)
        fmt = ToolCallFormat(open=a, close=b, output_template="[{output}]")
        runner = Recorder()
        tools = ToolUse(runner=runner, max_turns=3, max_total_tokens=48, max_tool_tokens=4, tool_format=fmt)
        for params in ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}):
            out = eng.generate_multiturn(prompts, group_size=4, tools=tools, seed=1, **params)  # type: ignore[arg-type]
            r = out.rollouts
            assert int(out.row_metrics.tool_calls.sum()) >= 2 and bool(r.tool_mask.any())
            with torch.no_grad():
                ref = sequence_logprobs(model, r, **params).logp  # type: ignore[arg-type]
            assert float((ref - r.behav_logp)[r.response_mask].abs().max()) <= LOGP_TOL
            assert bool((r.versions[r.response_mask] == 3).all()) and bool((r.versions[r.tool_mask] == -2).all())
        again = eng.generate_multiturn(prompts, group_size=4, tools=tools, seed=1, **params)  # type: ignore[arg-type]
        assert torch.equal(again.rollouts.response_ids, r.response_ids)  # reproducible on one machine


@needs_vllm
def test_train_with_vllm_and_tools_logs_tool_metrics(tiny_overrides: list[str], tmp_path: Path) -> None:
    """The chain_sum_tool tiny job (warm-started to call the tool) for 2 lag-runtime steps with the vLLM engine."""
    from steadyrl.train.entry import main
    from steadyrl.train.metrics import read_metrics
    from tests.train.test_tools_run import tool_overrides

    overrides = [*tool_overrides(tiny_overrides), "model.arch.num_heads=1", "steps=2", "rollout.engine=vllm",
                 "runtime.mode=lag", f"out_dir={tmp_path}"]  # fmt: skip
    assert main(overrides) == 0
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert {"tool/calls_mean", "tool/errors", "tool/tokens_mean", "turns/mean"} <= set(r)
        assert r["tool/calls_mean"] > 0.5 and r["turns/mean"] > 1.5  # measured: ~1 call per trajectory
        assert r["mismatch/max_abs_dlogp"] < 1e-3  # sampled by the engine, on the trainer's weights (tool turns too)


@needs_vllm
@pytest.mark.slow
def test_local_runtime_samples_tool_turns_with_vllm(tiny_overrides: list[str], tmp_path: Path) -> None:
    """worker.py's vLLM tools branch: a sampler process with the engine and the sandbox pool."""
    from steadyrl.train.entry import main
    from steadyrl.train.metrics import read_metrics
    from tests.train.test_tools_run import tool_overrides

    overrides = [*tool_overrides(tiny_overrides), "model.arch.num_heads=1", "steps=3", "rollout.engine=vllm",
                 "runtime.mode=local", "runtime.concurrent.inflight=false", "pool.policy=max_staleness",
                 "pool.max_staleness=1",
                 f"out_dir={tmp_path}"]  # fmt: skip
    assert main(overrides) == 0
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 3 and all(r["tool/calls_mean"] > 0.5 for r in steps)
    assert max(r["sample/version"] for r in steps) >= 1  # batches sampled after a weight update
