"""Multi-turn tool rollouts: exact turn logic with a scripted model, masks/versions of tool tokens, equivalence with
``generate`` without tools, and a masked tool token leaving the loss and the ESS unchanged."""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerFast

import steadyrl
from steadyrl.rollout import generate
from steadyrl.rollout.multiturn import ToolCallFormat, format_tool_output, generate_multiturn
from steadyrl.rollout.rollouts import PAD_VERSION, TOOL_VERSION
from steadyrl.tools import SandboxConfig, SandboxPool, ToolResult

#: Logit of the scripted token (the others get 0): the script is followed with probability 1 − O(V·e^−30).
SCRIPT_LOGIT = 30.0


def model_turn_1(expr: str) -> str:
    return f"Let me compute.\n```python\nprint({expr})\n```"


class ScriptedLM(nn.Module):
    """A causal LM that writes ``model_turn_1``, then reads the tool output from its context and writes
    ``The answer is <output>.`` + EOS; anything off-script makes it write ``#``. Prompts are ``Q: <expr>\\n``.

    It only works with ``use_cache=False`` (it re-reads the whole attended context on every call), and checks that the
    position ids are ``cumsum(attention_mask) − 1`` on attended tokens.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        super().__init__()
        self.tok = tokenizer
        self.vocab = len(tokenizer)
        self.anchor = nn.Parameter(torch.zeros(()))  # gives the module a device
        self.forwards = 0

    def next_text(self, context: str) -> str | None:
        """The scripted continuation's next character (None: EOS)."""
        head, _, response = context.partition("\n")
        expr = head.removeprefix("Q: ")
        first = model_turn_1(expr)
        if len(response) < len(first):
            return first[len(response)] if first.startswith(response) else "#"
        if not response.startswith(first):
            return "#"
        match = re.match(r"\n```output\n(.*?)\n```\n", response[len(first) :], re.S)
        if match is None:
            return "#"
        second = f"The answer is {match.group(1)}."
        tail = response[len(first) + match.end() :]
        if tail == second:
            return None
        return second[len(tail)] if second.startswith(tail) and len(tail) < len(second) else "#"

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                use_cache: bool = False, logits_to_keep: int = 1, **_: Any) -> SimpleNamespace:  # fmt: skip
        assert not use_cache, "ScriptedLM re-reads the whole context: use_cache=False"
        self.forwards += 1
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab)
        for i in range(input_ids.shape[0]):
            real = attention_mask[i].bool()
            assert torch.equal(position_ids[i][real], torch.arange(int(real.sum()))), "positions skip a token"
            text = self.tok.decode(input_ids[i][real].tolist(), skip_special_tokens=True)
            nxt = self.next_text(text)
            token = self.tok.eos_token_id if nxt is None else self.tok.convert_tokens_to_ids(nxt)
            logits[i, 0, token] = SCRIPT_LOGIT
        return SimpleNamespace(logits=logits)


class NoTools:
    """A tool runner that must not be called."""

    def map(self, codes: Sequence[str]) -> list[ToolResult]:
        raise AssertionError(f"unexpected tool calls {codes}")


@pytest.fixture(scope="module")
def pool() -> SandboxPool:
    with SandboxPool(SandboxConfig(workers=4, timeout_s=1.0)) as p:
        yield p  # type: ignore[misc]


def run(tokenizer: PreTrainedTokenizerFast, sandbox: Any, exprs: list[str], **kw: Any):  # type: ignore[no-untyped-def]
    defaults: dict[str, Any] = {"group_size": 2, "max_turns": 3, "max_total_tokens": 400, "version": 7}
    return generate_multiturn(
        ScriptedLM(tokenizer), tokenizer, [f"Q: {e}\n" for e in exprs], sandbox=sandbox,
        generator=torch.Generator().manual_seed(0), use_cache=False, **{**defaults, **kw},
    )  # fmt: skip


def test_tool_call_runs_and_the_model_reads_its_output(tokenizer: PreTrainedTokenizerFast, pool: SandboxPool) -> None:
    out = run(tokenizer, pool, ["6*7", "2**10"])
    r = out.rollouts
    first, answers = [model_turn_1("6*7")] * 2 + [model_turn_1("2**10")] * 2, ["42"] * 2 + ["1024"] * 2
    for i in range(4):
        tool = f"\n```output\n{answers[i]}\n```\n"
        final = f"The answer is {answers[i]}."
        assert r.texts[i] == first[i] + tool + final
        assert out.final_texts[i] == final
        n1, nt, n2 = len(first[i]), len(tool), len(final) + 1  # + EOS
        L = n1 + nt + n2
        expected_tool = torch.zeros(r.response_ids.shape[1], dtype=torch.bool)
        expected_tool[n1 : n1 + nt] = True
        expected_policy = torch.zeros_like(expected_tool)
        expected_policy[:L] = True
        expected_policy[n1 : n1 + nt] = False
        assert torch.equal(out.tool_mask[i], expected_tool)
        assert torch.equal(r.response_mask[i], expected_policy)  # not a prefix: the tool turn is a hole
        assert (r.behav_logp[i][expected_tool] == 0).all()
        assert (r.behav_logp[i][expected_policy] > -1e-6).all()  # the script's tokens: log μ ≈ 0
        assert (r.versions[i][expected_tool] == TOOL_VERSION).all()
        assert (r.versions[i][expected_policy] == 7).all()
        assert (r.versions[i][L:] == PAD_VERSION).all()
        assert r.response_ids[i, L - 1] == tokenizer.eos_token_id
    assert not r.truncated.any()
    m = out.row_metrics
    assert m.tool_calls.tolist() == [1] * 4 and m.turns.tolist() == [2] * 4
    assert m.tool_errors.tolist() == [0] * 4 and m.tool_timeouts.tolist() == [0] * 4
    assert torch.equal(m.tool_tokens, out.tool_mask.sum(-1))
    summary = out.summary()
    assert summary["tool/calls_mean"] == 1.0 and summary["turns/mean"] == 2.0 and summary["tool/errors"] == 0
    context = r.prompt_mask.sum(-1) + r.response_mask.sum(-1) + out.tool_mask.sum(-1)
    assert summary["response/context_len_mean"] == pytest.approx(float(context.float().mean()))


def test_tool_errors_and_timeouts_are_counted(tokenizer: PreTrainedTokenizerFast, pool: SandboxPool) -> None:
    out = run(tokenizer, pool, ["1/0", "__import__('time').sleep(30)"], group_size=1)
    assert out.row_metrics.tool_errors.tolist() == [1, 1]
    assert out.row_metrics.tool_timeouts.tolist() == [0, 1]
    assert out.final_texts[0].endswith("ZeroDivisionError: division by zero.")
    assert "TimeoutError" in out.final_texts[1]
    assert out.summary()["tool/timeouts"] == 1.0 and out.summary()["tool/errors"] == 2.0


def test_last_turn_call_is_not_run(tokenizer: PreTrainedTokenizerFast) -> None:
    out = run(tokenizer, NoTools(), ["6*7"], group_size=1, max_turns=1)
    assert out.rollouts.texts == [model_turn_1("6*7")]
    assert out.rollouts.truncated.tolist() == [True]
    assert out.row_metrics.tool_calls.tolist() == [0] and out.row_metrics.turns.tolist() == [1]
    assert not out.tool_mask.any() and out.rollouts.response_mask.all()


def test_token_budget_cuts_the_tool_turn_and_the_answer(tokenizer: PreTrainedTokenizerFast, pool: SandboxPool) -> None:
    n1 = len(model_turn_1("6*7"))
    out = run(tokenizer, pool, ["6*7"], group_size=1, max_total_tokens=n1 + 5)
    r = out.rollouts
    assert r.response_ids.shape[1] == n1 + 5 and r.truncated.tolist() == [True]
    assert out.tool_mask[0].sum() == 5 and r.response_mask[0].sum() == n1  # no room left to answer
    out = run(tokenizer, pool, ["'x' * 1000"], group_size=1, max_tool_tokens=10)
    assert out.final_texts[0] == "The answer is xxxxxxxxxx."  # the output body cut to 10 tokens, template kept


def test_without_tool_calls_it_samples_exactly_like_generate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompts = ["12+34=", "7*8="]
    kw: dict[str, Any] = {"group_size": 3, "temperature": 0.9, "top_k": 20, "version": 4}
    ref = generate(model, tokenizer, prompts, max_new_tokens=16, generator=torch.Generator().manual_seed(5), **kw)
    for use_cache in (True, False):
        out = generate_multiturn(model, tokenizer, prompts, sandbox=NoTools(), max_turns=1, max_total_tokens=16,
                                 generator=torch.Generator().manual_seed(5), use_cache=use_cache, **kw)  # fmt: skip
        r = out.rollouts
        assert torch.equal(r.response_ids, ref.response_ids)
        assert torch.equal(r.response_mask, ref.response_mask)
        torch.testing.assert_close(r.behav_logp, ref.behav_logp, atol=1e-5, rtol=0)
        assert torch.equal(r.versions, ref.versions) and torch.equal(r.truncated, ref.truncated)
        assert r.texts == ref.texts and torch.equal(r.group_ids, ref.group_ids)
        assert not out.tool_mask.any()


def test_tool_call_format() -> None:
    fmt = ToolCallFormat()
    assert fmt.find_call("thinking ```python\nx = 1\nprint(x)\n``` more") == "x = 1\nprint(x)"
    assert fmt.find_call("```python\nprint(1)\n") is None
    assert fmt.find_call("``` not python ```") is None
    assert ToolCallFormat(open="<code>", close="</code>").find_call("a<code>1+1</code>") == "1+1"
    with pytest.raises(ValueError, match="output_template"):
        ToolCallFormat(output_template="no slot")
    timeout = ToolResult("partial\n", "", False, -9, "timeout", 1.0, "namespaces")
    note = "TimeoutError: the code ran past its wall-clock limit and was stopped"
    assert format_tool_output(timeout) == "partial\n" + note


#: Methods whose loss needs only rewards and group ids (token-level, sequence-level and prefix corrections).
METHODS = ["grpo", "seq_tis", "token_tis", "icepop", "m2po", "geo_mis", "gspo", "prefix_ratio"]


@pytest.mark.parametrize("method", METHODS)
def test_masked_tool_tokens_change_neither_loss_nor_ess(
    method: str, tokenizer: PreTrainedTokenizerFast, pool: SandboxPool
) -> None:
    out = run(tokenizer, pool, ["6*7", "3+4"])
    r, tool = out.rollouts, out.tool_mask
    assert tool.any()
    g = torch.Generator().manual_seed(1)
    behav = r.behav_logp.double() - torch.rand(r.behav_logp.shape, generator=g, dtype=torch.float64)
    logp = (behav + 0.3 * torch.randn(behav.shape, generator=g, dtype=torch.float64)) * r.response_mask
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)

    def loss_and_ess(logp: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, versions: torch.Tensor):  # type: ignore[no-untyped-def]
        leaf = logp.clone().requires_grad_(True)
        batch = {"logp": leaf, "behav_logp": behav, "mask": mask, "rewards": rewards, "group_ids": r.group_ids,
                 "versions": versions, "learner_version": 9}  # fmt: skip
        loss, metrics = steadyrl.compute_loss(method, batch)
        loss.backward()
        return loss.detach(), metrics["is/ess_ratio"], leaf.grad

    loss, ess, grad = loss_and_ess(logp, behav, r.response_mask, r.versions)
    assert (grad[tool] == 0).all()
    # 1) any values at the tool tokens: nothing changes
    noise = 10 * torch.randn(behav.shape, generator=g, dtype=torch.float64)
    loss2, ess2, _ = loss_and_ess(torch.where(tool, noise, logp), torch.where(tool, -noise, behav), r.response_mask,
                                  torch.where(tool, 0, r.versions))  # fmt: skip
    assert torch.equal(loss, loss2) and torch.equal(ess, ess2)
    # 2) the same trajectories with the tool tokens cut out (policy tokens packed into a prefix): the same loss
    keep = [row.nonzero().flatten() for row in r.response_mask]
    T = max(len(k) for k in keep)

    def pack(x: torch.Tensor, fill: float | int) -> torch.Tensor:
        return torch.stack([torch.cat([x[i, k], x.new_full((T - len(k),), fill)]) for i, k in enumerate(keep)])

    packed_mask = torch.stack([torch.arange(T) < len(k) for k in keep])
    loss3, ess3, _ = loss_and_ess(pack(logp, 0.0), pack(behav, 0.0), packed_mask, pack(r.versions, PAD_VERSION))
    torch.testing.assert_close(loss3, loss, atol=1e-12, rtol=0)
    torch.testing.assert_close(ess3, ess, atol=1e-12, rtol=0)


@pytest.mark.parametrize("record_entropy", [False, True])
def test_one_host_read_per_decoded_token(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch, record_entropy: bool
) -> None:
    """The tool-call check reads each new token's text on the host: one read per decoded token (the tokens, log μ
    and the entropies together), none per row. With the decode masks prepared (the GPU form) ``transformers`` adds
    none per forward; the samples are those of the default form."""
    from tests.rollout.test_lagged_reads import _counted_reads

    def sample(budget: int, prepared: bool) -> Any:  # EOS only: the random model's rows run to the budget
        return generate_multiturn(model, tokenizer, ["12+34=", "7*8="], group_size=3, sandbox=NoTools(), max_turns=1,
                                  max_total_tokens=budget, generator=torch.Generator().manual_seed(5), version=0,
                                  eos_token_ids=[tokenizer.eos_token_id], record_entropy=record_entropy,
                                  prepared_masks=prepared)  # fmt: skip

    counts = {}
    for budget in (4, 16):
        with _counted_reads(monkeypatch) as reads, torch.no_grad():
            out = sample(budget, prepared=True)
        counts[budget] = (len(reads), out.rollouts.response_ids.shape[1])
    assert counts[16][1] - counts[4][1] == 12, counts  # twelve more tokens decoded ...
    assert counts[16][0] - counts[4][0] <= 12, counts  # ... at most one more read each (6 rows)
    ref, prepared = sample(16, prepared=False), sample(16, prepared=True)
    assert torch.equal(ref.rollouts.response_ids, prepared.rollouts.response_ids)
    torch.testing.assert_close(prepared.rollouts.behav_logp, ref.rollouts.behav_logp, atol=1e-5, rtol=0)
