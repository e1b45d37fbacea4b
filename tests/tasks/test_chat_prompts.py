"""Chat prompts of gsm8k/math (``task.chat``, ``task.system_prompt``): the exact rendered text, one BOS, the errors, the
train/eval overlap, and the TrainConfig rules (chat needs a chat model; a tool run whose prompt never shows the call
format warns). No download: the tokenizer is the character tokenizer with a small ChatML-like template."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import TrainConfig
from steadyrl.models.tokenizer import BOS_TOKEN, build_char_tokenizer
from steadyrl.tasks import ChatTemplateError, Gsm8kConfig, MathConfig, build_task, parse_task_config
from steadyrl.tasks.prompts import GSM8K_TOOL_SYSTEM_PROMPT, adds_bos, render_chat

#: ChatML-like: ``<|im_start|>role\ncontent<|im_end|>\n`` per message, then the assistant header.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The same, opening with the BOS token as text (as Llama 3's and Gemma's templates do).
CHATML_WITH_BOS = "{{ bos_token }}" + CHATML

TRAIN = [
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "What is 6 * 7?", "answer": "#### 42"},
]
EVAL = [{"question": "What is 3 + 4?", "answer": "#### 7"}, {"question": "What is 2 - 5?", "answer": "#### -3"}]


def chat_tokenizer(template: str = CHATML, *, split_special_tokens: bool = True) -> PreTrainedTokenizerFast:
    """The character tokenizer (adds ``<bos>`` when encoding) with ``template`` as its chat template."""
    tok = build_char_tokenizer()
    tok.chat_template = template
    tok.split_special_tokens = split_special_tokens
    return tok


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    return {"train_path": write_jsonl(tmp_path / "train.jsonl", TRAIN),
            "eval_path": write_jsonl(tmp_path / "eval.jsonl", EVAL)}  # fmt: skip


def test_chat_prompt_is_the_rendered_template(files: dict[str, Path]) -> None:
    task = build_task(Gsm8kConfig(**files, chat=True, system_prompt="Be brief.", prompt_template="Q: {question}"),
                      tokenizer=chat_tokenizer())  # fmt: skip
    (first, second) = task.problems("eval", 2, seed=0)
    assert first.prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nQ: What is 3 + 4?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert first.meta["question"] == "What is 3 + 4?" and second.answer == "-3"
    no_system = build_task(Gsm8kConfig(**files, chat=True), tokenizer=chat_tokenizer())
    assert no_system.problems("eval", 1, seed=0)[0].prompt == (
        "<|im_start|>user\nQuestion: What is 3 + 4?\nAnswer: <|im_end|>\n<|im_start|>assistant\n"
    )
    # The train question also in the eval file is held out (questions are compared), the rest is chat-rendered.
    train = task.problems("train", 3, seed=0)
    assert {p.answer for p in train} == {"42"}
    assert train[0].prompt == render_chat(chat_tokenizer(), "Q: What is 6 * 7?", system_prompt="Be brief.")


def test_without_chat_the_prompt_is_the_filled_template(files: dict[str, Path]) -> None:
    task = build_task(MathConfig(eval_path=write_jsonl(files["eval_path"].with_name("m.jsonl"),
                                                       [{"problem": "1+1?", "solution": "\\boxed{2}"}])),
                      tokenizer=chat_tokenizer())  # fmt: skip
    assert task.problems("eval", 1, seed=0)[0].prompt == "Problem: 1+1?\nSolution: "


def test_a_bos_the_template_writes_is_not_doubled() -> None:
    # Special-token text is parsed as the token here (as in most real tokenizers): "<bos>" typed would encode to BOS.
    tok = chat_tokenizer(CHATML_WITH_BOS, split_special_tokens=False)
    assert adds_bos(tok)
    text = render_chat(tok, "Hi", system_prompt="S")
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    raw = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert tok(raw)["input_ids"].count(tok.bos_token_id) == 2  # what stripping prevents
    # A tokenizer that does not add BOS keeps the template's.
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    assert not adds_bos(tok)
    kept = render_chat(tok, "Hi")
    assert kept.startswith(BOS_TOKEN) and tok(kept)["input_ids"].count(tok.bos_token_id) == 1


def test_chat_without_a_tokenizer_or_a_template_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    cfg = Gsm8kConfig(**files, chat=True)
    with pytest.raises(ChatTemplateError, match=r"task.chat=true \(gsm8k\).*build_task\(cfg, tokenizer=tokenizer\)"):
        build_task(cfg)
    plain = build_char_tokenizer()
    plain.save_pretrained(tmp_path / "char-model")
    plain = PreTrainedTokenizerFast.from_pretrained(tmp_path / "char-model")
    with pytest.raises(ChatTemplateError, match=r"task.chat=true.*char-model.*has none.*set task.chat=false"):
        build_task(cfg, tokenizer=plain)
    build_task(Gsm8kConfig(**files), tokenizer=plain)  # chat off: no template needed


def test_system_prompt_needs_chat() -> None:
    with pytest.raises(ValidationError, match=r"(?s)gsm8k.*system_prompt is the system message.*set chat=true"):
        parse_task_config({"name": "gsm8k", "eval_path": "e.jsonl", "system_prompt": "Be brief."})
    with pytest.raises(ValidationError, match=r"math\.system_prompt"):
        parse_task_config({"name": "math", "eval_path": "e.jsonl", "chat": True, "system_prompt": ""})


def test_train_config_refuses_chat_with_the_default_model() -> None:
    with pytest.raises(ConfigError, match=r"task.chat=true.*model.name=default.*set model.name"):
        load_config(TrainConfig, overrides=["task=gsm8k", "task.eval_path=e.jsonl", "task.chat=true"])
    cfg = load_config(TrainConfig, overrides=["task=gsm8k", "task.eval_path=e.jsonl", "task.chat=true",
                                              "model.name=/models/instruct"])  # fmt: skip
    assert cfg.task.chat


@pytest.mark.parametrize("task", ["gsm8k", "math"])
def test_tool_run_whose_prompt_hides_the_call_format_warns(task: str) -> None:
    base = [f"task={task}", "task.eval_path=e.jsonl", "tools.enabled=true"]
    with pytest.warns(UserWarning, match="the prompt never shows the model the tool's call format"):
        load_config(TrainConfig, overrides=base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(TrainConfig, overrides=base[:2])  # tools off: nothing to show
        cfg = TrainConfig.model_validate(
            {"task": {"name": task, "eval_path": "e.jsonl", "chat": True, "system_prompt": GSM8K_TOOL_SYSTEM_PROMPT},
             "model": {"name": "/models/instruct"}, "tools": {"enabled": True}}
        )  # fmt: skip
    assert cfg.tools.call_open in (cfg.task.system_prompt or "")
