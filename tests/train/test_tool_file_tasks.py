"""gsm8k and math with the Python tool for real (chat) models: the shipped ``gsm8k_tool`` / ``math_tool`` configs load,
``steadyrl train gsm8k_tool`` runs end to end on a tiny local chat checkpoint with the chat-rendered prompt, missing
placeholders fail with one clear line, and a scripted call → tool output → ``\\boxed{}`` transcript scores through
``score_final``. No download: the model is a random tiny Llama with the character tokenizer and a ChatML template."""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model
from steadyrl.rollout import multiturn
from steadyrl.rollout.multiturn import generate_multiturn, score_final
from steadyrl.tasks import Gsm8kConfig, MathConfig, Task, build_task
from steadyrl.tasks.prompts import GSM8K_TOOL_SYSTEM_PROMPT, MATH_TOOL_SYSTEM_PROMPT, render_chat
from steadyrl.tools import SandboxConfig, SandboxPool
from steadyrl.train.entry import main
from steadyrl.train.metrics import read_metrics
from tests.rollout.test_multiturn import ScriptedLM
from tests.tasks.test_chat_prompts import chat_tokenizer, write_jsonl

TOOL_METRICS = {"tool/calls_mean", "tool/errors", "tool/timeouts", "turns/mean", "response/context_len_mean"}
SHIPPED = {"gsm8k_tool": GSM8K_TOOL_SYSTEM_PROMPT, "math_tool": MATH_TOOL_SYSTEM_PROMPT}
ARCH = TinyArchConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=2048)
GSM8K_TRAIN = [
    {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3*4 = 12\n#### 12"},
    {"question": "A box holds 6 eggs. How many in 2 boxes?", "answer": "#### 12"},
    {"question": "Sam had 9 pens and lost 2. How many now?", "answer": "#### 7"},
]
GSM8K_EVAL = [{"question": "What is 5 + 8?", "answer": "#### 13"}, {"question": "What is 20 / 4?", "answer": "#### 5"}]
#: The scripted transcript: a call, the tool's output (written by the sandbox), the answer.
CALL, OUTPUT = "```python\nprint(3*4)\n```", "\n```output\n12\n```\n"


def shipped(name: str) -> str:
    return str(resources.files("steadyrl.configs") / f"{name}.yaml")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama and the character tokenizer with a ChatML chat template, saved like a hub checkpoint."""
    path = tmp_path_factory.mktemp("chat-model")
    tok = chat_tokenizer()
    build_tiny_model(ARCH, tokenizer=tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture
def gsm8k_files(tmp_path: Path) -> list[str]:
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN)
    return [f"task.train_path={train}", f"task.eval_path={write_jsonl(tmp_path / 'eval.jsonl', GSM8K_EVAL)}"]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_tool_configs_load_with_placeholders_overridden(name: str, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the prompt shows the call format: no warning
        cfg = load_config(TrainConfig, path=shipped(name), overrides=[
            "model.name=/models/Qwen2.5-0.5B-Instruct", f"task.train_path={tmp_path / 'train.jsonl'}",
            f"task.eval_path={tmp_path / 'test.parquet'}",
        ])  # fmt: skip
    assert cfg.task.name == name.removesuffix("_tool") and cfg.task.chat and cfg.tools.enabled
    assert cfg.task.system_prompt == SHIPPED[name]  # the YAML carries the module constant, word for word
    assert cfg.tools.call_open in cfg.task.system_prompt and "\\boxed{}" in cfg.task.system_prompt
    assert 1024 <= cfg.tools.max_total_tokens <= 2048 and cfg.tools.max_tool_tokens == 256 and cfg.tools.max_turns == 4
    assert cfg.model.name == "/models/Qwen2.5-0.5B-Instruct" and cfg.task.train_path == tmp_path / "train.jsonl"


def test_gsm8k_tool_runs_with_chat_prompts(
    chat_model: Path, gsm8k_files: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts: list[str] = []
    generate = multiturn.ToolUse.generate

    def spy(self: Any, model: Any, tokenizer: Any, batch: list[str], **kw: Any) -> Any:
        prompts.extend(batch)
        return generate(self, model, tokenizer, batch, **kw)

    monkeypatch.setattr(multiturn.ToolUse, "generate", spy)
    out = tmp_path / "run"
    argv = [
        "gsm8k_tool", f"model.name={chat_model}", *gsm8k_files, f"out_dir={out}", "runtime.mode=lag", "runtime.lag.k=1",
        "steps=2", "prompts_per_step=2", "group_size=2", "eval.n=2", "eval.every=0", "eval.batch_size=2",
        "data.train_pool=4", "tools.max_turns=2", "tools.max_total_tokens=24", "tools.max_tool_tokens=8",
        "tools.sandbox.workers=1", "runtime.threads=1", "log.progress=false", "log.plot=false", "checkpoint.every=0",
    ]  # fmt: skip
    assert main(argv) == 0
    records = read_metrics(out / "metrics.jsonl")
    steps = records[:-1]
    assert len(steps) == 2 and "eval/acc" in records[-1]
    for r in steps:
        assert r.keys() >= TOOL_METRICS, TOOL_METRICS - r.keys()
    tok = PreTrainedTokenizerFast.from_pretrained(chat_model)
    expected = {render_chat(tok, row["question"], system_prompt=GSM8K_TOOL_SYSTEM_PROMPT)
                for row in GSM8K_TRAIN + GSM8K_EVAL}  # fmt: skip
    assert prompts and set(prompts) <= expected  # every sampler and eval call saw the chat-rendered prompt
    assert any(p.endswith("<|im_start|>assistant\n") and "What is 5 + 8?" in p for p in prompts)  # the eval


def test_missing_placeholders_fail_with_one_line(
    chat_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = [f"out_dir={tmp_path / 'run'}", "log.progress=false", "overwrite=true"]
    assert main(["gsm8k_tool", *common]) == 2
    assert "model directory '/path/to/Qwen2.5-0.5B-Instruct' does not exist" in capsys.readouterr().err
    assert main(["math_tool", f"model.name={chat_model}", *common]) == 2
    err = capsys.readouterr().err
    assert "task.train_path: no such file '/path/to/math/train.jsonl'" in err and "Traceback" not in err


class ScriptedToolLM(ScriptedLM):
    """Writes ``CALL``, reads the tool output turn, then writes ``\\boxed{answer}`` + EOS (after ``prompt``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, *, prompt: str, answer: str) -> None:
        super().__init__(tokenizer)
        self.prompt, self.answer = prompt, answer

    def next_text(self, context: str) -> str | None:
        assert context.startswith(self.prompt)
        script = [CALL, OUTPUT, f"\\boxed{{{self.answer}}}"]
        response, written = context[len(self.prompt) :], ""
        for part in script:
            written += part
            if len(response) < len(written):  # inside this part (the tool's part is never asked for)
                return written[len(response)] if written.startswith(response) else "#"
        return None if response == written else "#"


def math_task(tmp_path: Path, tok: PreTrainedTokenizerFast) -> Task:
    rows = [{"problem": "Compute $3 \\cdot 4$.", "solution": "$3 \\cdot 4 = \\boxed{12}$."}]
    return build_task(MathConfig(eval_path=write_jsonl(tmp_path / "math.jsonl", rows), chat=True,
                                 system_prompt=MATH_TOOL_SYSTEM_PROMPT), tokenizer=tok)  # fmt: skip


def gsm8k_task(tmp_path: Path, tok: PreTrainedTokenizerFast) -> Task:
    rows = [{"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "#### 12"}]
    return build_task(Gsm8kConfig(eval_path=write_jsonl(tmp_path / "gsm8k.jsonl", rows), chat=True,
                                  system_prompt=GSM8K_TOOL_SYSTEM_PROMPT), tokenizer=tok)  # fmt: skip


@pytest.mark.parametrize("make_task", [gsm8k_task, math_task], ids=["gsm8k", "math"])
@pytest.mark.parametrize(("answer", "reward"), [("12", 1.0), ("13", 0.0)])
def test_call_output_boxed_answer_scores_on_the_last_turn(make_task: Any, answer: str, reward: float,
                                                         tmp_path: Path) -> None:  # fmt: skip
    tok = chat_tokenizer()
    task = make_task(tmp_path, tok)
    (problem,) = task.problems("eval", 1, seed=0)
    with SandboxPool(SandboxConfig(workers=1)) as pool:
        out = generate_multiturn(
            ScriptedToolLM(tok, prompt=problem.prompt, answer=answer), tok, [problem.prompt], group_size=1,
            sandbox=pool, max_turns=3, max_total_tokens=80, generator=torch.Generator().manual_seed(0), version=0,
            use_cache=False,
        )  # fmt: skip
    assert out.rollouts.texts == [CALL + OUTPUT + f"\\boxed{{{answer}}}"]  # the sandbox printed 12
    assert out.final_texts == [f"\\boxed{{{answer}}}"]
    assert score_final(task, [problem], out).tolist() == [reward]
