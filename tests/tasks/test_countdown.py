"""countdown: compact prompt, scorer (with the sympy guard), and the JSONL cache (reuse, extension, location)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import steadyrl.tasks.countdown as countdown_module
from steadyrl.tasks import CountdownConfig, Problem, build_task
from steadyrl.tasks.countdown import CountdownTask, is_safe_expression
from steadyrl.tasks.generated import stream_seed
from steadyrl.tasks.stream_cache import StreamCache, task_cache_dir

HANDFUL = 5


def _task(tmp_path: Path, **overrides: object) -> CountdownTask:
    settings: dict[str, object] = {"cache_dir": tmp_path, "eval_size": HANDFUL, **overrides}
    task = build_task(CountdownConfig.model_validate(settings))
    assert isinstance(task, CountdownTask)
    return task


class _Counter:
    """Wraps ``generate_entries`` and counts the entries it makes."""

    def __init__(self) -> None:
        self.made = 0
        self._real = countdown_module.generate_entries

    def __call__(self, dataset: object, *, start: int, stop: int) -> list[dict]:
        self.made += stop - start
        return self._real(dataset, start=start, stop=stop)


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> _Counter:
    wrapped = _Counter()
    monkeypatch.setattr(countdown_module, "generate_entries", wrapped)
    return wrapped


HAND = Problem(
    prompt="8,12,4>24:",
    answer="4+12+8",
    uid="hand/0",
    meta={"entry": {"answer": "4 + 12 + 8", "metadata": {"numbers": [8, 12, 4], "target": 24}}},
)


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("4+12+8", 1.0),
        (" 12 + 8 + 4 </s>", 1.0),
        ("12*8/4", 1.0),  # any expression that uses every number once and hits the target
        ("(12-8)*4+8", 0.0),  # uses 8 twice
        ("12+8", 0.0),  # misses a number
        ("12+8-4", 0.0),
        ("", 0.0),
        ("24", 0.0),
        ("__import__('os').getcwd()", 0.0),  # never reaches sympy's eval
        ("2**3**4", 0.0),
    ],
)
def test_score(tmp_path: Path, completion: str, score: float) -> None:
    assert _task(tmp_path).score(HAND, completion) == score


def test_partial_credit_keeps_reasoning_gym_format_reward(tmp_path: Path) -> None:
    task = _task(tmp_path, partial_credit=True)
    assert task.score(HAND, "12+8") == pytest.approx(0.05)
    assert task.score(HAND, "4+12+8") == 1.0


def test_safe_expression_guard() -> None:
    assert is_safe_expression("(13-10)*8")
    assert not is_safe_expression("x+1")
    assert not is_safe_expression("9**9")
    assert not is_safe_expression("1+" * 200 + "1")


def test_problems_prompt_answer_alphabet(tmp_path: Path) -> None:
    task = _task(tmp_path)
    problems = task.problems("train", HANDFUL, seed=0) + task.problems("eval", HANDFUL, seed=0)
    for problem in problems:
        meta = problem.meta["entry"]["metadata"]
        assert problem.prompt == ",".join(map(str, meta["numbers"])) + f">{meta['target']}:"
        assert " " not in problem.answer
        assert task.demonstration(problem) == problem.answer
        assert task.score(problem, problem.answer) == 1.0
        assert set(problem.prompt + problem.answer) <= set(task.alphabet)
    assert not {p.prompt for p in problems[:HANDFUL]} & {p.prompt for p in problems[HANDFUL:]}
    assert "-" in _task(tmp_path, operators=("+", "/")).alphabet  # reasoning-gym's fallback for "/"


def test_cache_reused_across_instances(tmp_path: Path, counter: _Counter) -> None:
    first = _task(tmp_path)
    train = first.problems("train", HANDFUL, seed=0)
    evals = first.problems("eval", HANDFUL, seed=0)
    made = counter.made
    assert made >= 2 * HANDFUL
    files = list(tmp_path.glob("countdown-*.jsonl"))
    assert len(files) == 2  # one file per stream (train, eval)
    line = json.loads(files[0].read_text().splitlines()[0])
    assert set(line) == {"answer", "metadata"}  # reasoning-gym's long question text is not kept

    second = _task(tmp_path)
    assert second.problems("train", HANDFUL, seed=0) == train
    assert second.problems("eval", HANDFUL, seed=0) == evals
    assert [p.meta for p in second.problems("train", HANDFUL, seed=0)] == [p.meta for p in train]
    assert counter.made == made  # nothing regenerated


def test_cache_extends_only_the_missing_tail(tmp_path: Path, counter: _Counter) -> None:
    task = _task(tmp_path)
    seed = 1
    eval_stream = task.cache_path(stream_seed(task="countdown", split="eval", seed=seed))
    task.problems("eval", 2, seed=seed)  # the eval set is generated whole
    assert len(eval_stream.read_text().splitlines()) == HANDFUL
    before = counter.made
    longer = _task(tmp_path, eval_size=HANDFUL + 3)
    longer.problems("eval", HANDFUL + 3, seed=seed)
    assert counter.made - before == 3
    assert len(eval_stream.read_text().splitlines()) == HANDFUL + 3


def test_cache_key_depends_on_settings_and_seed(tmp_path: Path) -> None:
    task = _task(tmp_path)
    assert task.cache_path(1) != task.cache_path(2)
    assert task.cache_path(1) != _task(tmp_path, max_target=90).cache_path(1)
    assert task.cache_path(1) == _task(tmp_path).cache_path(1)


def test_cache_directory_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEADYRL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert task_cache_dir() == tmp_path / "home" / ".cache" / "steadyrl" / "tasks"
    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path / "root"))
    assert task_cache_dir() == tmp_path / "root" / "tasks"
    assert task_cache_dir(tmp_path / "mine") == tmp_path / "mine"
    assert build_task(CountdownConfig()).cache_dir == tmp_path / "root" / "tasks"  # type: ignore[attr-defined]
    assert build_task(CountdownConfig(cache_dir=tmp_path / "x")).cache_dir == tmp_path / "x"  # type: ignore[attr-defined]


def test_stream_cache_trusts_lines_up_to_a_torn_one(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text(json.dumps({"i": 0}) + "\n" + json.dumps({"i": 1}) + "\n" + '{"i": 2, "tor')
    calls: list[tuple[int, int]] = []

    def generate(start: int, stop: int) -> list[dict]:
        calls.append((start, stop))
        return [{"i": i} for i in range(start, stop)]

    cache = StreamCache(path=path, generate=generate)
    assert cache.get(start=0, stop=4) == [{"i": i} for i in range(4)]
    assert calls == [(2, 4)]
    assert StreamCache(path=path, generate=generate).get(start=1, stop=3) == [{"i": 1}, {"i": 2}]
    assert calls == [(2, 4)]
    assert not list(tmp_path.glob("*.tmp"))
