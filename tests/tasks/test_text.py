"""Text helpers: completion cleaning and answer extraction (hand-written inputs and expected outputs)."""

from __future__ import annotations

import pytest

from steadyrl.tasks.text import (
    DEFAULT_STOP_TEXTS,
    after_last,
    clean_completion,
    fill_template,
    gsm8k_final_number,
    last_boxed,
    template_fields,
)


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("11", "11"),
        ("  11 \n", "11"),
        ("11</s>", "11"),
        ("11<eos><pad><pad>", "11"),
        (" 11 <|endoftext|>12</s>", "11"),
        ("\t11\n</s>junk", "11"),
        ("</s>11", ""),
        ("", ""),
    ],
)
def test_clean_completion(raw: str, clean: str) -> None:
    assert clean_completion(raw) == clean


def test_clean_completion_custom_stop_texts() -> None:
    assert clean_completion("11|x", stop_texts=("|",)) == "11"
    assert clean_completion("11</s>", stop_texts=()) == "11</s>"
    assert "</s>" in DEFAULT_STOP_TEXTS


@pytest.mark.parametrize(
    ("text", "tail"), [("12+3=15,15-4=11;11", "11"), ("a;b; c ", "c"), ("11", "11"), ("x;", "")]
)
def test_after_last(text: str, tail: str) -> None:
    assert after_last(text, separator=";") == tail


@pytest.mark.parametrize(
    ("solution", "number"),
    [
        ("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("#### -5", "-5"),
        ("#### $18.50", "18.50"),
        ("#### 3 #### 4", "4"),
        ("no marker 72", None),
        ("#### none", None),
    ],
)
def test_gsm8k_final_number(solution: str, number: str | None) -> None:
    assert gsm8k_final_number(solution) == number


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{ {a}^{2} }", "{a}^{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$ done", "5"),
        ("\\boxed{\\frac{1}{2}", None),
        ("\\boxed{}", None),
        ("no box", None),
        ("\\boxedx", None),
    ],
)
def test_last_boxed(solution: str, answer: str | None) -> None:
    assert last_boxed(solution) == answer


def test_templates() -> None:
    assert template_fields("Q: {question}\nA: ") == ["question"]
    assert template_fields("{{literal}} {question} {other}") == ["question", "other"]
    assert fill_template("Q: {question} {{x}}", question="1+1?") == "Q: 1+1? {x}"
