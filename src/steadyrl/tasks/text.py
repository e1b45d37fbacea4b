"""Text helpers shared by the tasks: cleaning a completion, and pulling a final answer out of a written solution."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

#: Texts that end a completion when a decoder leaves special tokens in (EOS and padding of common tokenizers).
#: Everything from the first occurrence of any of them on is dropped before scoring.
DEFAULT_STOP_TEXTS: tuple[str, ...] = ("</s>", "<eos>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<pad>")

#: GSM8K writes the final answer after this marker, on the solution's last line.
GSM8K_ANSWER_MARKER = "####"

#: LaTeX commands whose argument is a boxed final answer (MATH uses ``\boxed``; a few solutions use ``\fbox``).
BOXED_COMMANDS: tuple[str, ...] = ("\\boxed", "\\fbox")

#: The one placeholder a prompt template must contain.
TEMPLATE_FIELD = "question"

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*)?\.?\d+")


def clean_completion(completion: str, *, stop_texts: Sequence[str] = DEFAULT_STOP_TEXTS) -> str:
    """The completion cut at the first stop text (if any) and stripped of surrounding whitespace."""
    cut = len(completion)
    for stop in stop_texts:
        pos = completion.find(stop)
        if stop and pos != -1:
            cut = min(cut, pos)
    return completion[:cut].strip()


def after_last(text: str, *, separator: str) -> str:
    """What follows the last ``separator`` in ``text`` (stripped), or all of ``text`` when it has none."""
    return text.rpartition(separator)[2].strip()


def gsm8k_final_number(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, commas removed (``"#### 1,000"`` → ``"1000"``).

    None when there is no marker or no number after it.
    """
    _, marker, tail = solution.rpartition(GSM8K_ANSWER_MARKER)
    if not marker:
        return None
    match = _NUMBER.search(tail)
    return match.group(0).replace(",", "") if match else None


def last_boxed(solution: str) -> str | None:
    """The argument of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``solution``, braces matched.

    ``\\boxed 5`` (argument without braces) gives the token after the space. None when there is no box or its
    braces do not close.
    """
    start = max(solution.rfind(cmd) for cmd in BOXED_COMMANDS)
    if start == -1:
        return None
    command = next(cmd for cmd in BOXED_COMMANDS if solution.startswith(cmd, start))
    rest = solution[start + len(command) :]
    if rest.startswith(" "):
        token = rest.strip().split("$")[0].split()
        return token[0] if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            inner = rest[1:i].strip()
            return inner or None
    return None


def template_fields(template: str) -> list[str]:
    """The replacement fields of a ``str.format`` template, in order (``"Q: {question}"`` → ``["question"]``)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def fill_template(template: str, *, question: str) -> str:
    """``template`` with its ``{question}`` placeholder replaced by ``question``."""
    return template.format(**{TEMPLATE_FIELD: question})
