"""Prompts for real (instruct) models: chat-template rendering of a task's prompt, and the tool instructions.

**Chat rendering** (``task.chat=true`` on ``gsm8k`` / ``math`` / ``reasoning_gym``): the filled ``prompt_template``
(``reasoning_gym``: the question and its answer instruction) becomes the user message, ``system_prompt`` (if set) a
system message before it, and the model tokenizer's chat template renders them with the generation prompt appended
(``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``), the way verl and TRL build the
prompt of a conversational dataset. Many templates (Llama 3, Gemma) write the BOS token
as text, and their tokenizers also add BOS when encoding: the rendered text then loses its leading BOS, so the encoded
prompt starts with exactly one (:func:`render_chat`).

**Tool instructions** (:data:`MATH_TOOL_SYSTEM_PROMPT`, :data:`GSM8K_TOOL_SYSTEM_PROMPT`): SimpleTIR-style
(Xue et al. 2025, arXiv:2509.02479: the model writes Python in a fenced block, the block's printed output comes back
in an ``output`` block, the reasoning continues). They describe the default call format of ``tools.*``
(``call_open`` ` ```python `, ``call_close`` ` ``` `, ``output_template`` ``\\n```output\\n{output}\\n```\\n``) and ask
for the answer in the form the scorers read: math-verify reads a ``\\boxed{...}`` first, and ``gsm8k`` reads the
number after a final ``####`` when there is one, else the same ``\\boxed{...}``. Only the last model turn is scored
(``steadyrl.rollout.multiturn.score_final``), so the prompts ask for the answer after the last output. The shipped
configs ``gsm8k_tool`` / ``math_tool`` carry these texts (a test checks they are equal).
Confidence: [reconstructed] (SimpleTIR's call format; the wording is ours, nothing was measured with a real model).
"""

from __future__ import annotations

from collections.abc import Mapping

from transformers import PreTrainedTokenizerBase

#: What every tool prompt says about the tool: the default call format of ``tools.*`` (``ToolCallFormat``), that each
#: call runs in a fresh interpreter (``steadyrl.tools.SandboxPool``: nothing is kept between calls), and that numpy and
#: sympy are there besides the standard library: the shipped ``gsm8k_tool`` / ``math_tool`` configs set
#: ``tools.sandbox.site_packages=true``, and both are dependencies of steadyrl (numpy directly, sympy through
#: math-verify), so the default interpreter has them. They import at the sandbox's ``namespaces`` level only (at
#: ``rlimits`` the audit hook blocks their ``ctypes`` loading; see :mod:`steadyrl.tools.sandbox`).
TOOL_INSTRUCTIONS = (
    "You can run Python code to help you. To run code, write it in a fenced block:\n"
    "```python\n"
    "print(2**10)\n"
    "```\n"
    "The code runs as soon as you close the block, and what it prints is shown to you in an output block:\n"
    "```output\n"
    "1024\n"
    "```\n"
    "Use print() to see a result. Every block runs in a fresh Python interpreter:\n"
    "variables and imports are not kept from one block to the next.\n"
    "The standard library, numpy and sympy are available.\n"
    "Reason step by step and use code where it helps."
)

#: System prompt of ``math`` with the tool: the final answer in ``\boxed{}`` (what math-verify reads first).
MATH_TOOL_SYSTEM_PROMPT = (
    TOOL_INSTRUCTIONS + "\nAfter your last code block, write the final answer in \\boxed{}, for example "
    "\\boxed{\\frac{1}{2}}."
)

#: System prompt of ``gsm8k`` with the tool: the final number in ``\boxed{}`` (``Gsm8kTask`` also reads ``#### n``).
GSM8K_TOOL_SYSTEM_PROMPT = (
    TOOL_INSTRUCTIONS + "\nAfter your last code block, write the final answer as a number in \\boxed{}, for example "
    "\\boxed{72}."
)

#: The chat roles of the rendered messages.
SYSTEM_ROLE, USER_ROLE = "system", "user"


class ChatTemplateError(ValueError):
    """``task.chat=true`` without a tokenizer that can render chat prompts (none given, or no chat template)."""


#: How a file task's instructions reach a model without a chat template (the end of a :class:`ChatTemplateError`).
FILE_TASK_NO_CHAT_HINT = "set task.chat=false and write the instructions into task.prompt_template"


def check_chat_tokenizer(
    tokenizer: PreTrainedTokenizerBase | None, *, task: str, no_chat_hint: str = FILE_TASK_NO_CHAT_HINT
) -> PreTrainedTokenizerBase:
    """``tokenizer`` when it can render chat prompts for ``task``; a :class:`ChatTemplateError` saying what to change
    otherwise (``no_chat_hint``: how to do without a chat template, the error's last words)."""
    if tokenizer is None:
        raise ChatTemplateError(
            f"task.chat=true ({task}) renders prompts with the model tokenizer's chat template: pass the run's "
            "tokenizer, build_task(cfg, tokenizer=tokenizer)"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        model = getattr(tokenizer, "name_or_path", "") or "<unnamed>"
        raise ChatTemplateError(
            f"task.chat=true ({task}) needs a tokenizer with a chat template, but the tokenizer of model {model!r} "
            "has none (a base model, or the embedded character-level default). Use an instruct/chat checkpoint "
            f"(its tokenizer_config.json or chat_template.jinja holds the template), or {no_chat_hint}"
        )
    return tokenizer


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether encoding a text (``tokenizer(text)``, as the samplers do) puts the BOS token in front."""
    if tokenizer.bos_token_id is None:
        return False
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def chat_messages(user: str, *, system_prompt: str | None) -> list[Mapping[str, str]]:
    """``[system?, user]`` messages: the system prompt (when set) first, then the user's text."""
    system = [] if system_prompt is None else [{"role": SYSTEM_ROLE, "content": system_prompt}]
    return [*system, {"role": USER_ROLE, "content": user}]


def render_chat(tokenizer: PreTrainedTokenizerBase, user: str, *, system_prompt: str | None = None) -> str:
    """The prompt text of one user message (after an optional system message) in ``tokenizer``'s chat template,
    generation prompt appended; without a leading BOS when the template writes one and encoding adds it again.

    ``tokenizer`` must have a chat template (:func:`check_chat_tokenizer`).
    """
    text = tokenizer.apply_chat_template(
        chat_messages(user, system_prompt=system_prompt), tokenize=False, add_generation_prompt=True
    )
    if not isinstance(text, str):  # a template or tokenizer that ignores tokenize=False
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and adds_bos(tokenizer):
        text = text[len(bos) :]
    return text
