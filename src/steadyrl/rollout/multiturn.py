"""Multi-turn, tool-integrated sampling: the model writes, a closed tool call runs in the sandbox, its output is
appended as a tool turn, and generation continues (SimpleTIR-style fenced Python blocks by default).

Per row, a trajectory is ``prompt · m_1 · o_1 · m_2 · o_2 · … · m_K`` where each model turn m_k is sampled and each
tool turn o_k is the tokenized output of the code that m_k closed. A model turn ends at EOS (the trajectory is done),
when it closes a tool call (``ToolCallFormat.open`` … ``close``; the code between them runs), or when the response
reaches ``max_total_tokens`` (truncated). A tool call closed in the last allowed turn (``max_turns``), or with no
token of the budget left, is not run: no turn would read its output, so the trajectory ends there, truncated. All
rows' calls of one turn run in parallel in the sandbox pool.

Every sampled token is drawn exactly as :func:`steadyrl.rollout.sampler.generate` draws it (same sampling
distribution, :mod:`steadyrl.rollout.distribution`, the caller's generator) and records log μ of that distribution.
Tool output is encoded by :func:`steadyrl.rollout.framing.encode_tool_text`: a special-token string in it
(``<|im_end|>``, ``<|im_start|>user``) is tokenized as ordinary text: a tool cannot forge an end-of-turn or role token.
Tool-output tokens are part of the context (attended, and counted in the position ids) but were not sampled:
``response_mask`` is False there, ``behav_logp`` is 0, the version is ``TOOL_VERSION`` (−2), and
``Rollouts.tool_mask`` marks them. The response mask is therefore **not a prefix**; the attention mask of a trajectory
is ``[prompt_mask; response_mask | tool_mask]`` and its position ids are ``cumsum(attention) − 1``, the rule of
:mod:`steadyrl.rollout.rollouts` applied to that attention mask, which the learner's recompute
(:func:`steadyrl.rollout.logprobs.sequence_logprobs`) applies too: at unchanged weights it gives back ``behav_logp``.

Rewards come from the final answer only: :attr:`MultiTurnRollouts.final_texts` (the last model turn, after the last
tool output) is what :func:`score_final` hands the task's verifier, so a tool's output can never be scored as the
model's answer.

Each model turn starts with one prefill over the whole context so far (prompt and earlier turns, left-padded), then
decodes with a KV cache; with ``before_forward``, each token records the version of the forward it was drawn from.
Confidence: [exact] (μ is defined by this code; no paper formula involved).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from steadyrl.base.device import host_rows
from steadyrl.rollout.distribution import SamplingParams, check_sampling_params, entropy_from_log_probs
from steadyrl.rollout.distribution import sampling_log_probs as _sampling_log_probs
from steadyrl.rollout.framing import encode_tool_text
from steadyrl.rollout.rollouts import PAD_VERSION, TOOL_VERSION, Rollouts
from steadyrl.rollout.sampler import cache_kwarg, decode_mask, encode_prompts, positions_from_mask, stop_token_ids
from steadyrl.rollout.scored import score_rollouts
from steadyrl.rollout.tool_metrics import RowMetrics, tool_summary
from steadyrl.tools.sandbox import ToolResult

if TYPE_CHECKING:
    from steadyrl.tasks import Problem, Task


class ToolRunner(Protocol):
    """Runs a batch of code strings at once (a :class:`steadyrl.tools.SandboxPool`)."""

    def map(self, codes: Sequence[str]) -> list[ToolResult]: ...


class SharedCalls:
    """A :class:`ToolRunner` that runs each distinct code of one ``map`` once and hands every caller its result.

    The G rollouts of a prompt often write the same call; sharing its result is exact for deterministic code (the
    arithmetic tools) and saves a sandbox start per duplicate (about 0.1 s each). Code that reads a clock or a random
    source gets one draw per distinct code and turn instead of one per trajectory.
    """

    def __init__(self, runner: ToolRunner) -> None:
        self.runner = runner

    def map(self, codes: Sequence[str]) -> list[ToolResult]:
        """``runner.map`` of the distinct codes (first-seen order), fanned back out to ``codes``' order."""
        distinct = list(dict.fromkeys(codes))
        results = dict(zip(distinct, self.runner.map(distinct), strict=True))
        return [results[c] for c in codes]


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model opens and closes a tool call, and how the output is written back (SimpleTIR-style defaults).

    Attributes:
        open: text that opens a call; the code starts right after it.
        close: text that closes it (searched for after ``open``); the code is what lies between.
        output_template: the tool turn appended after a call; ``{output}`` is replaced by the tool's output.
    """

    open: str = "```python"
    close: str = "```"
    output_template: str = "\n```output\n{output}\n```\n"

    def __post_init__(self) -> None:
        if not self.open or not self.close:
            raise ValueError("ToolCallFormat.open and .close must be non-empty")
        if self.output_template.count("{output}") != 1:
            raise ValueError("ToolCallFormat.output_template must contain '{output}' exactly once")

    def find_call(self, text: str) -> str | None:
        """The code of the first closed call in ``text`` (None while no call is closed)."""
        start = text.find(self.open)
        if start < 0:
            return None
        body_start = start + len(self.open)
        end = text.find(self.close, body_start)
        return None if end < 0 else text[body_start:end].strip("\n")


def format_tool_output(result: ToolResult) -> str:
    """What the model reads back: stdout, and on failure stderr plus one line naming the limit that ended it."""
    text = result.stdout
    if result.error is not None:
        text += result.stderr
        note = {
            "timeout": "TimeoutError: the code ran past its wall-clock limit and was stopped",
            "cpu": "TimeoutError: the code used up its CPU-time limit and was stopped",
            "output_limit": "(output truncated: the code printed too much and was stopped)",
        }.get(result.error)
        if note:
            text += ("" if not text or text.endswith("\n") else "\n") + note
    return text.strip("\n")


class MultiTurnRollouts(NamedTuple):
    """Rollouts with tool turns (``rollouts.tool_mask`` marks the tool output), per-row metrics and each row's last
    model turn."""

    rollouts: Rollouts
    row_metrics: RowMetrics
    final_texts: list[str]  # text of each row's last model turn (after its last tool output; no EOS)

    @property
    def tool_mask(self) -> Bool[Tensor, "N T"]:
        """``rollouts.tool_mask``: True on tool-output tokens."""
        return self.rollouts.tool_mask  # type: ignore[return-value]

    def summary(self) -> dict[str, float]:
        """Batch metrics (:func:`steadyrl.rollout.tool_metrics.tool_summary`): ``tool/calls_mean``, ``tool/errors``,
        ``tool/timeouts``, ``tool/tokens_mean``, ``turns/mean``, ``response/context_len_mean``."""
        return tool_summary(self.row_metrics, self.rollouts)


def score_final(task: Task, problems: Sequence[Problem], out: MultiTurnRollouts) -> Float[Tensor, " N"]:
    """The task's verifier reward of each row's final answer (its last model turn, :attr:`final_texts`); row i
    answers ``problems[group_ids[i]]``. Tool output is never scored."""
    final = dataclasses.replace(out.rollouts, texts=list(out.final_texts))
    return score_rollouts(task, problems, final)


@dataclass(frozen=True)
class ToolUse:
    """Everything a sampler needs to run tool turns, besides the model and the sampling distribution."""

    runner: ToolRunner
    max_turns: int
    max_total_tokens: int
    max_tool_tokens: int = 256
    tool_format: ToolCallFormat = field(default_factory=lambda: ToolCallFormat())

    def generate(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                 **kwargs: object) -> MultiTurnRollouts:  # fmt: skip
        """:func:`generate_multiturn` with these settings (``kwargs``: its sampling arguments)."""
        return generate_multiturn(
            model, tokenizer, prompts, sandbox=self.runner, max_turns=self.max_turns,
            max_total_tokens=self.max_total_tokens, max_tool_tokens=self.max_tool_tokens, tool_format=self.tool_format,
            **kwargs,  # type: ignore[arg-type]
        )  # fmt: skip


@dataclass
class TurnRow:
    """One trajectory while it is built (Python lists; tensors are made once at the end)."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    turn_start: int = 0  # index in ``ids`` where the current model turn began
    done: bool = False
    truncated: bool = False
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    turns: int = 0

    def append(self, token: int, *, sampled: bool, logp: float, version: int, entropy: float) -> None:
        self.ids.append(token)
        self.sampled.append(sampled)
        self.logps.append(logp)
        self.versions.append(version)
        self.entropies.append(entropy)


def check_multiturn_request(
    prompts: Sequence[str], *, group_size: int, max_turns: int, max_total_tokens: int, max_tool_tokens: int
) -> None:
    """The argument checks every multi-turn sampler makes (transformers and vLLM): a prompt, and each limit ≥ 1."""
    if not prompts:
        raise ValueError("generate_multiturn needs at least one prompt")
    for name, value in {"group_size": group_size, "max_turns": max_turns, "max_total_tokens": max_total_tokens,
                        "max_tool_tokens": max_tool_tokens}.items():  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def generate_multiturn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    *,
    group_size: int,
    sandbox: ToolRunner,
    max_turns: int,
    max_total_tokens: int,
    max_tool_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator,
    version: int,
    tool_format: ToolCallFormat | None = None,
    use_cache: bool = True,
    record_entropy: bool = False,
    eos_token_ids: Sequence[int] | None = None,
    before_forward: Callable[[], int] | None = None,
    prepared_masks: bool | None = None,
) -> MultiTurnRollouts:
    """Sample ``group_size`` tool-using trajectories per prompt; N = ``len(prompts) * group_size`` rows.

    Args:
        model, tokenizer, prompts, group_size, temperature, top_p, top_k, generator, version, use_cache,
            record_entropy, eos_token_ids, before_forward: as in :func:`steadyrl.rollout.sampler.generate`.
        sandbox: runs each turn's tool calls (all rows at once), e.g. a :class:`steadyrl.tools.SandboxPool`.
        max_turns: model turns per trajectory (≥ 1; 1 = no tool call is ever run).
        max_total_tokens: cap on a response's tokens, sampled and tool output together.
        max_tool_tokens: cap on the tokens of one tool output (its body is cut; the template stays).
        tool_format: call and output markers (default :class:`ToolCallFormat`).
        prepared_masks: give each one-token decode step its 4-D attention mask ready-made
            (:func:`~steadyrl.rollout.sampler.decode_mask`), so ``transformers`` does not read the padding mask on
            the host at every forward: None (default) does so on a GPU; True forces it (tests). Each decoded token
            then costs one host read, of the tokens, log μ and entropies together (the tool-call check reads the
            text on the host).

    Returns:
        :class:`MultiTurnRollouts`; its ``rollouts.texts`` are whole transcripts (model and tool turns, no EOS).
    """
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    check_sampling_params(params)
    fmt = tool_format or ToolCallFormat()
    check_multiturn_request(prompts, group_size=group_size, max_turns=max_turns, max_total_tokens=max_total_tokens,
                            max_tool_tokens=max_tool_tokens)  # fmt: skip
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to its EOS) before sampling")
    stop_ids = stop_token_ids(model, tokenizer) if eos_token_ids is None else list(eos_token_ids)
    if not stop_ids or any(i is None for i in stop_ids):
        raise ValueError("no EOS token id: pass eos_token_ids or use a tokenizer with an eos_token")
    device = next(model.parameters()).device
    pad_id = int(tokenizer.pad_token_id)
    enc = encode_prompts(tokenizer, prompts, device=device)
    prompt_ids = enc.ids.repeat_interleave(group_size, dim=0)
    prompt_mask = enc.mask.repeat_interleave(group_size, dim=0)
    rows = [TurnRow(prompt=ids[m].tolist()) for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
    versions_of = before_forward or (lambda: version)
    for turn in range(1, max_turns + 1):
        active = [r for r in rows if not r.done]
        if not active:
            break
        with torch.no_grad():
            calls = _model_turn(
                model, tokenizer, active, params=params, fmt=fmt, max_total_tokens=max_total_tokens,
                stop_ids=set(stop_ids), pad_id=pad_id, generator=generator, use_cache=use_cache,
                record_entropy=record_entropy, before_forward=versions_of, device=device,
                prepared_masks=device.type == "cuda" if prepared_masks is None else prepared_masks,
            )  # fmt: skip
        run_tool_calls(calls, last_turn=turn == max_turns, sandbox=sandbox, tokenizer=tokenizer, fmt=fmt,
                   max_tool_tokens=max_tool_tokens, max_total_tokens=max_total_tokens)  # fmt: skip
    return assemble_multiturn(rows, prompt_ids, prompt_mask, tokenizer, stop_ids, pad_id, group_size, record_entropy)


def _model_turn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[TurnRow],
    *,
    params: SamplingParams,
    fmt: ToolCallFormat,
    max_total_tokens: int,
    stop_ids: set[int],
    pad_id: int,
    generator: torch.Generator,
    use_cache: bool,
    record_entropy: bool,
    before_forward: Callable[[], int],
    device: torch.device,
    prepared_masks: bool,
) -> list[tuple[TurnRow, str]]:
    """Sample one model turn for every row in ``rows``; returns the (row, code) of each row that closed a call."""
    contexts = [r.prompt + r.ids for r in rows]
    width = max(len(c) for c in contexts)
    ids = torch.tensor([[pad_id] * (width - len(c)) + c for c in contexts], device=device)
    mask = torch.tensor([[False] * (width - len(c)) + [True] * len(c) for c in contexts], device=device)
    context_len = mask.sum(dim=-1)
    budgets = [max_total_tokens - len(r.ids) for r in rows]
    for r in rows:
        r.turn_start, r.turns = len(r.ids), r.turns + 1
    cache_kw = {cache_kwarg(model): DynamicCache(config=model.config)} if use_cache else {}
    logits_version = before_forward()
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions_from_mask(mask),
                use_cache=use_cache, logits_to_keep=1, **cache_kw)  # fmt: skip
    logits = out.logits[:, -1]
    finished = [False] * len(rows)
    calls: list[tuple[TurnRow, str]] = []
    for t in range(max(budgets)):
        log_mu = _sampling_log_probs(logits, params=params)  # [A, V], log μ
        token = torch.multinomial(log_mu.exp(), 1, generator=generator).squeeze(-1)  # y_t ~ μ
        values = [token, log_mu.gather(-1, token.unsqueeze(-1)).squeeze(-1)]  # y_t, log μ(y_t)
        if record_entropy:
            values.append(entropy_from_log_probs(log_mu))  # H(μ)
        host = host_rows(values)  # the step's one host read
        logp, entropy = host[1], host[2] if record_entropy else [0.0] * len(rows)
        ended = torch.tensor(finished, device=device) if any(finished) else None
        fed = token if ended is None else token.masked_fill(ended, pad_id)  # ended rows are fed padding (discarded)
        for a, row in enumerate(rows):
            if finished[a]:
                continue
            y = int(host[0][a])
            row.append(y, sampled=True, logp=logp[a], version=logits_version, entropy=entropy[a])
            if y in stop_ids:
                finished[a] = row.done = True
                continue
            code = fmt.find_call(tokenizer.decode(row.ids[row.turn_start :]))
            if code is not None:
                finished[a] = True
                calls.append((row, code))
            elif t + 1 == budgets[a]:
                finished[a] = row.done = row.truncated = True
        if all(finished):
            break
        ids = torch.cat([ids, fed.unsqueeze(-1)], dim=-1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        logits_version = before_forward()
        if use_cache:  # feed only the new token at position context_len + t
            out = model(input_ids=fed.unsqueeze(-1),
                        attention_mask=decode_mask(mask, model) if prepared_masks else mask.long(),
                        position_ids=(context_len + t).unsqueeze(-1), use_cache=True, logits_to_keep=1,
                        **cache_kw)  # fmt: skip
        else:  # recompute the whole sequence (reference path)
            out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions_from_mask(mask),
                        use_cache=False, logits_to_keep=1)  # fmt: skip
        logits = out.logits[:, -1]
    return calls


def run_tool_calls(
    calls: list[tuple[TurnRow, str]],
    *,
    last_turn: bool,
    sandbox: ToolRunner,
    tokenizer: PreTrainedTokenizerBase,
    fmt: ToolCallFormat,
    max_tool_tokens: int,
    max_total_tokens: int,
) -> None:
    """Run one turn's closed calls (all rows at once in ``sandbox``) and append their tool turns; a call closed in
    the last turn, or with no token of the budget left, is not run and ends its row, truncated."""
    runnable = [(row, code) for row, code in calls if not last_turn and len(row.ids) < max_total_tokens]
    for row, _ in calls:
        if last_turn or len(row.ids) >= max_total_tokens:  # no turn or no room to read the output
            row.done = row.truncated = True
    if runnable:
        results = sandbox.map([code for _, code in runnable])
        for (row, _), result in zip(runnable, results, strict=True):
            _append_tool_turn(row, result, tokenizer, fmt, max_tool_tokens, max_total_tokens)


def _append_tool_turn(
    row: TurnRow,
    result: ToolResult,
    tokenizer: PreTrainedTokenizerBase,
    fmt: ToolCallFormat,
    max_tool_tokens: int,
    max_total_tokens: int,
) -> None:
    """Append the tool turn (template around the output, the output cut to ``max_tool_tokens``) as context tokens;
    the output is framed by :func:`steadyrl.rollout.framing.encode_tool_text`, so it holds no special token."""
    row.calls += 1
    row.errors += result.error is not None
    row.timeouts += result.error == "timeout"
    head, tail = fmt.output_template.split("{output}")
    body = encode_tool_text(tokenizer, format_tool_output(result))[:max_tool_tokens]  # never a special token
    tokens = tokenizer.encode(head, add_special_tokens=False) + body + tokenizer.encode(tail, add_special_tokens=False)
    room = max_total_tokens - len(row.ids)
    for y in tokens[:room]:
        row.append(y, sampled=False, logp=0.0, version=TOOL_VERSION, entropy=0.0)
    if len(row.ids) >= max_total_tokens:  # no room left to answer
        row.done = row.truncated = True


def assemble_multiturn(
    rows: list[TurnRow],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    tokenizer: PreTrainedTokenizerBase,
    stop_ids: Sequence[int],
    pad_id: int,
    group_size: int,
    record_entropy: bool,
) -> MultiTurnRollouts:
    device = prompt_ids.device
    T = max(len(r.ids) for r in rows)

    def padded(attr: str, fill: float | int | bool, dtype: torch.dtype) -> Tensor:
        """The per-row lists ``attr`` right-padded with ``fill`` to T, as one [N, T] tensor."""
        values = [getattr(r, attr) + [fill] * (T - len(r.ids)) for r in rows]
        return torch.tensor(values, dtype=dtype, device=device)

    response_ids = padded("ids", pad_id, torch.long)
    sampled = padded("sampled", False, torch.bool)
    real = torch.tensor([[True] * len(r.ids) + [False] * (T - len(r.ids)) for r in rows], device=device)
    tool_mask = real & ~sampled
    texts, finals = [], []
    for r in rows:
        keep = [y for y in r.ids if y not in stop_ids]
        texts.append(tokenizer.decode(keep, skip_special_tokens=True))
        last_tool = max((i for i, s in enumerate(r.sampled) if not s), default=-1)
        finals.append(tokenizer.decode([y for y in r.ids[last_tool + 1 :] if y not in stop_ids],
                                       skip_special_tokens=True))  # fmt: skip
    N = len(rows)
    rollouts = Rollouts(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=sampled,
        behav_logp=padded("logps", 0.0, torch.float32),
        versions=padded("versions", PAD_VERSION, torch.long),
        group_ids=torch.arange(N, device=device) // group_size,
        truncated=torch.tensor([r.truncated for r in rows], device=device),
        texts=texts,
        pad_id=pad_id,
        behav_entropy=padded("entropies", 0.0, torch.float32) if record_entropy else None,
        tool_mask=tool_mask,
    )
    counts = {k: torch.tensor([getattr(r, k) for r in rows], device=device) for k in ("calls", "errors", "timeouts")}
    metrics = RowMetrics(
        tool_calls=counts["calls"],
        tool_errors=counts["errors"],
        tool_timeouts=counts["timeouts"],
        turns=torch.tensor([r.turns for r in rows], device=device),
        tool_tokens=tool_mask.sum(dim=-1),
    )
    return MultiTurnRollouts(rollouts, metrics, finals)
