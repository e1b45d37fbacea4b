"""``task=reasoning_gym``: config errors name the field, a few datasets pose and score with their own scorer, answer
extraction (boxed, answer tag, plain), chat rendering, splits and determinism, the eval guard, the dataset listing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import TrainConfig
from steadyrl.models.tokenizer import build_char_tokenizer
from steadyrl.tasks import ChatTemplateError, ReasoningGymTask, ReasoningGymTaskConfig, build_task, parse_task_config
from steadyrl.tasks.reasoning_gym_task import (
    DEFAULT_INSTRUCTIONS,
    EVALUATING_SCORERS,
    extract_answer,
    safe_for_eval,
)
from steadyrl.tasks.rg_catalog import LIST_COMMAND, dataset_names, main

#: ChatML-like: ``<|im_start|>role\ncontent<|im_end|>\n`` per message, then the assistant header.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Small eval sets keep generation fast.
EVAL_SIZE = 16


def make_task(dataset: str, *, tokenizer: Any = None, **fields: Any) -> ReasoningGymTask:
    """The task of ``task=reasoning_gym task.dataset=<dataset>`` with ``fields``, a small eval set."""
    cfg = parse_task_config({"name": "reasoning_gym", "dataset": dataset, "eval_size": EVAL_SIZE, **fields})
    task = build_task(cfg, tokenizer=tokenizer)
    assert isinstance(task, ReasoningGymTask)
    return task


def _error(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        parse_task_config({"name": "reasoning_gym", **data})
    return str(info.value)


# --- config ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({"dataset": "gsm_symbolc"}, ["reasoning_gym.dataset", "did you mean 'gsm_symbolic'", LIST_COMMAND]),
        ({"dataset": "arithmetic"}, ["reasoning_gym.dataset", "'basic_arithmetic'"]),
        ({"dataset": "qqqqqq"}, ["reasoning_gym.dataset", "106 datasets", LIST_COMMAND]),
        ({}, ["reasoning_gym.dataset", "Field required"]),
        ({"dataset": "gcd", "config": {"min_numbers": 1}}, ["reasoning_gym.config", "min_numbers must be at least 2"]),
        ({"dataset": "gcd", "config": {"bogus": 1}}, ["reasoning_gym.config", "no option 'bogus'", "min_numbers"]),
        ({"dataset": "gcd", "config": {"seed": 3}}, ["reasoning_gym.config", "seed cannot be set in task.config"]),
        ({"dataset": "basic_arithmetic", "config": {"min_digits": 3, "max_digits": 2}},
         ["reasoning_gym.config", "max_digits must be >= min_digits"]),
        ({"dataset": "gcd", "size": 0}, ["reasoning_gym.size"]),
        ({"dataset": "gcd", "size": 8, "eval_size": 9}, ["eval_size (9) must be <= size (8)"]),
        ({"dataset": "gcd", "answer_format": "json"}, ["reasoning_gym.answer_format"]),
        ({"dataset": "gcd", "system_prompt": "Be brief."}, ["system_prompt", "chat=true"]),
        ({"dataset": "gcd", "bogus": 1}, ["reasoning_gym.bogus", "Extra inputs"]),
    ],
)
def test_bad_configs_name_the_field(data: dict[str, Any], names: list[str]) -> None:
    message = _error(data)
    for name in names:
        assert name in message, message


def test_config_keys_on_the_command_line_name_the_dotted_key() -> None:
    with pytest.raises(ConfigError, match=r"'task\.dataset': unknown reasoning-gym dataset 'gcdd'"):
        load_config(TrainConfig, overrides=["task=reasoning_gym", "task.dataset=gcdd"])
    with pytest.raises(ConfigError, match=r"'task\.config': reasoning-gym's gcd rejects"):
        load_config(TrainConfig, overrides=["task=reasoning_gym", "task.dataset=gcd", "task.config.min_numbers=0"])
    # chat needs a tokenizer with a template: the default (character-level) model is refused up front.
    with pytest.raises(ConfigError, match=r"task\.chat=true"):
        load_config(TrainConfig, overrides=["task=reasoning_gym", "task.dataset=gcd", "task.chat=true", "eval.n=4"])
    cfg = load_config(TrainConfig, overrides=["task=reasoning_gym", "task.dataset=gcd", "task.config.max_value=50",
                                              "task.eval_size=8", "eval.n=8"])  # fmt: skip
    assert isinstance(cfg.task, ReasoningGymTaskConfig)
    assert (cfg.task.dataset, cfg.task.config, cfg.task.answer_format) == ("gcd", {"max_value": 50}, "boxed")


def test_defaults_are_documented_and_round_trip() -> None:
    for field_name, field in ReasoningGymTaskConfig.model_fields.items():
        assert field.description, field_name
    cfg = parse_task_config({"name": "reasoning_gym", "dataset": "gcd", "config": {"max_value": 50}})
    assert parse_task_config(json.loads(cfg.model_dump_json())) == cfg
    assert cfg.chat is False and cfg.instruction is None and cfg.size == 2**20


# --- datasets and their scorers -------------------------------------------------------------------------------

#: (dataset, options, a wrong answer for the first eval problem, as the model would write it in a box)
DATASETS = [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}, "\\boxed{100}"),
    ("gcd", {}, "\\boxed{0}"),
    ("gsm_symbolic", {}, "\\boxed{-1}"),
    ("countdown", {"min_numbers": 3, "max_numbers": 3}, "\\boxed{1 + 1}"),
]


@pytest.mark.parametrize(("dataset", "options", "wrong"), DATASETS)
def test_datasets_pose_and_score_with_their_own_scorer(dataset: str, options: dict[str, Any], wrong: str) -> None:
    task = make_task(dataset, config=options)
    problems = task.problems("eval", 4, seed=0)
    for problem in problems:
        entry = problem.meta["entry"]
        assert problem.prompt == entry["question"].rstrip() + "\n\n" + DEFAULT_INSTRUCTIONS["boxed"] + "\n"
        assert problem.answer == entry["answer"]
        assert task.demonstration(problem) == f"\\boxed{{{problem.answer}}}"
        assert task.score(problem, task.demonstration(problem)) == 1.0
        assert task.score(problem, f"Let me think.\n... so the answer is \\boxed{{{problem.answer}}}.</s>") == 1.0
        assert task.score(problem, problem.answer) == 0.0  # no box: no answer
    assert task.score(problems[0], wrong) == 0.0
    assert problems[0].uid == f"reasoning_gym/{dataset}/eval/0/0"


def test_partial_credit_passes_the_scorers_fraction() -> None:
    # gsm_symbolic's scorer gives 0.01 to a number that is wrong.
    strict, partial = make_task("gsm_symbolic"), make_task("gsm_symbolic", partial_credit=True)
    problem = strict.problems("eval", 1, seed=0)[0]
    assert strict.score(problem, "\\boxed{-1}") == 0.0
    assert partial.score(problem, "\\boxed{-1}") == pytest.approx(0.01)
    assert partial.score(problem, f"\\boxed{{{problem.answer}}}") == 1.0


def test_answer_tag_and_plain_formats() -> None:
    tagged = make_task("gcd", answer_format="answer_tag")
    problem = tagged.problems("eval", 1, seed=0)[0]
    assert problem.prompt.endswith("\n\nProvide your final answer between <answer> and </answer> tags.\n")
    assert tagged.demonstration(problem) == f"<answer>{problem.answer}</answer>"
    assert tagged.score(problem, f"<answer>0</answer> no: <answer> {problem.answer} </answer>") == 1.0
    assert tagged.score(problem, f"\\boxed{{{problem.answer}}}") == 0.0
    plain = make_task("gcd", answer_format="plain")
    problem = plain.problems("eval", 1, seed=0)[0]
    assert problem.prompt == problem.meta["entry"]["question"] + "\n"  # no instruction: the question as posed
    assert plain.demonstration(problem) == problem.answer
    assert plain.score(problem, f" {problem.answer}\n<eos>") == 1.0
    assert plain.score(problem, "") == 0.0
    custom = make_task("gcd", instruction="Answer in a box.")
    assert custom.problems("eval", 1, seed=0)[0].prompt.endswith("\n\nAnswer in a box.\n")


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("first \\boxed{3}, then \\boxed{4}", "4"),  # the last box wins
        ("\\boxed{ {a}{b} } end", "{a}{b}"),
        ("\\boxed 7", "7"),
        ("no box here: 42", None),
        ("\\boxed{unclosed", None),
        ("\\boxed{}", None),
    ],
)
def test_boxed_extraction(text: str, answer: str | None) -> None:
    assert extract_answer(text, "boxed") == answer


def test_boxed_scoring_nested_last_and_missing() -> None:
    task = make_task("gcd")
    problem = task.problems("eval", 1, seed=0)[0]
    right = f"\\boxed{{{problem.answer}}}"
    assert task.score(problem, f"\\boxed{{0}} was wrong; {right}") == 1.0
    assert task.score(problem, f"{right} ... or maybe \\boxed{{0}}") == 0.0
    assert task.score(problem, "I cannot tell.") == 0.0


def test_dataset_without_reference_answer() -> None:
    # rush_hour's entries carry no answer (its scorer replays a move list): no demonstration, scoring still works.
    task = make_task("rush_hour")
    problem = task.problems("eval", 1, seed=0)[0]
    assert problem.answer == "" and not problem.meta["has_answer"]
    with pytest.raises(ValueError, match="no reference answer"):
        task.demonstration(problem)
    assert task.score(problem, "\\boxed{A+1}") == 0.0


# --- the guard of scorers that evaluate the answer ------------------------------------------------------------


def test_evaluating_scorers_are_registered_datasets() -> None:
    assert set(EVALUATING_SCORERS) <= set(dataset_names())


@pytest.mark.parametrize(
    ("answer", "safe"),
    [
        ("[[1, 2], [3, 4]]", True),
        ("x**2/2 + sin(x) + C", True),
        ("abs(x) + pow(x, 2)", True),
        ("__import__('os').system('true')", False),
        ("open('f', 'w').write('x')", False),
        ("(open)('f')", False),
        ("().__class__", False),
        ("1" * 20_000, False),
    ],
)
def test_safe_for_eval(answer: str, safe: bool) -> None:
    assert safe_for_eval(answer) is safe


def test_guarded_scorer_never_sees_code(monkeypatch: pytest.MonkeyPatch) -> None:
    task = make_task("spiral_matrix")
    problem = task.problems("eval", 1, seed=0)[0]
    assert task.score(problem, task.demonstration(problem)) == 1.0
    dataset = task._dataset(problem.meta["rg_seed"])
    monkeypatch.setattr(dataset, "score_answer", lambda answer, entry: pytest.fail(f"scorer called on {answer!r}"))
    assert task.score(problem, "\\boxed{__import__('os').getcwd()}") == 0.0
    countdown = make_task("countdown")
    problem = countdown.problems("eval", 1, seed=0)[0]
    assert countdown.score(problem, "\\boxed{exec('1')}") == 0.0


def test_a_scorer_that_raises_scores_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    task = make_task("gcd")
    problem = task.problems("eval", 1, seed=0)[0]

    def broken(answer: str, entry: Any) -> float:
        raise KeyError("metadata")

    monkeypatch.setattr(task._dataset(problem.meta["rg_seed"]), "score_answer", broken)
    assert task.score(problem, task.demonstration(problem)) == 0.0


# --- chat rendering -------------------------------------------------------------------------------------------


def chat_tokenizer() -> Any:
    tok = build_char_tokenizer()
    tok.chat_template = CHATML
    return tok


def test_chat_prompt_is_the_rendered_template() -> None:
    task = make_task("gcd", chat=True, system_prompt="Be brief.", tokenizer=chat_tokenizer())
    problem = task.problems("eval", 1, seed=0)[0]
    user = problem.meta["entry"]["question"] + "\n\n" + DEFAULT_INSTRUCTIONS["boxed"]
    assert problem.prompt == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert task.score(problem, f"Reasoning...\\boxed{{{problem.answer}}}<|im_end|>") == 1.0
    # Without a system prompt: only the user message.
    bare = make_task("gcd", chat=True, tokenizer=chat_tokenizer()).problems("eval", 1, seed=0)[0]
    assert bare.prompt.startswith("<|im_start|>user\n") and bare.prompt.endswith("<|im_start|>assistant\n")


def test_chat_without_a_template_is_an_error() -> None:
    with pytest.raises(ChatTemplateError, match=r"has none .*set task\.chat=false \(the prompt is then the plain"):
        make_task("gcd", chat=True, tokenizer=build_char_tokenizer())
    with pytest.raises(ChatTemplateError, match="pass the run's tokenizer"):
        make_task("gcd", chat=True)


# --- splits and determinism -----------------------------------------------------------------------------------


def test_splits_are_disjoint_deterministic_and_prefix_stable() -> None:
    # GCDs of two numbers up to 6 repeat often (about 30 distinct questions), so the held-out filter has draws to skip.
    options = {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 6}
    task = make_task("gcd", config=options)
    again = make_task("gcd", config=options)
    train, eval_set = task.problems("train", 60, seed=3), task.problems("eval", EVAL_SIZE, seed=3)
    assert not {p.prompt for p in train} & {p.prompt for p in eval_set}
    assert train == again.problems("train", 60, seed=3) and eval_set == again.problems("eval", EVAL_SIZE, seed=3)
    assert task.problems("train", 20, seed=3) == train[:20]
    assert [p.prompt for p in task.problems("eval", 8, seed=4)] != [p.prompt for p in eval_set[:8]]
    other = make_task("lcm", config=options).problems("eval", 8, seed=3)  # another dataset: another stream
    assert other[0].meta["rg_seed"] != eval_set[0].meta["rg_seed"]
    assert int(train[-1].uid.rsplit("/", 1)[1]) > 59  # some train draws were skipped as eval prompts


def test_a_stream_holds_size_items() -> None:
    task = make_task("gcd", size=EVAL_SIZE + 4)
    assert len(task.problems("train", 3, seed=0)) == 3
    with pytest.raises(ValueError, match=r"task\.size"):
        task.problems("train", 50, seed=0)
    with pytest.raises(ValueError, match="eval_size"):
        task.problems("eval", EVAL_SIZE + 1, seed=0)


def test_a_dataset_that_refuses_the_size_names_the_keys() -> None:
    task = make_task("word_ladder")  # refuses 2**20 items in its constructor
    with pytest.raises(ValueError, match=r"task\.config / task\.size: reasoning-gym could not build word_ladder"):
        task.problems("eval", 1, seed=0)


def test_alphabet_covers_sampled_prompts_and_demonstrations() -> None:
    task = make_task("gcd")
    alphabet = task.alphabet
    assert alphabet == "".join(sorted(set(alphabet)))
    for problem in task.problems("eval", 8, seed=0):
        assert set(problem.prompt) | set(task.demonstration(problem)) <= set(alphabet)


# --- the listing ------------------------------------------------------------------------------------------------


def test_listing_prints_every_dataset_with_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "gsm_symbolic: " in out and "min_numbers=2" in out
    assert main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows) == set(dataset_names()) and rows["gcd"]["options"]["min_numbers"] == 2
