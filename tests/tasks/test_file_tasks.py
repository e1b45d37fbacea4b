"""gsm8k and math from local files: problems, math-verify scoring, and DatasetError messages (file + line)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from steadyrl.tasks import DatasetError, Gsm8kConfig, MathConfig, build_task
from steadyrl.tasks.file_tasks import Gsm8kTask, MathTask

GSM8K_TRAIN = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A shop sells 1,000 pens a day. How many in one day?", "answer": "It sells 1,000 pens.\n#### 1,000"},
    {"question": "Tom has 5 apples and eats 7. How many now?", "answer": "5 - 7 = -2\n#### -2"},
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
]
GSM8K_EVAL = [
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},  # also in train: dropped from train
    {"question": "What is 10 - 1?", "answer": "#### 9"},
]
MATH_ROWS = [
    {"problem": "Compute $\\frac{2}{4}$.", "solution": "We simplify: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$."},
    {"problem": "Solve $x + 1 = 3$.", "solution": "So $x = \\boxed{2}$."},
    {"problem": "Point?", "solution": "It is $\\boxed{(3, -\\frac{\\pi}{2})}$."},
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def gsm8k(tmp_path: Path) -> Gsm8kTask:
    cfg = Gsm8kConfig(train_path=_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN),
                      eval_path=_jsonl(tmp_path / "eval.jsonl", GSM8K_EVAL))
    task = build_task(cfg)
    assert isinstance(task, Gsm8kTask)
    return task


@pytest.fixture
def math_task(tmp_path: Path) -> MathTask:
    task = build_task(MathConfig(train_path=_jsonl(tmp_path / "train.jsonl", MATH_ROWS),
                                 eval_path=_jsonl(tmp_path / "eval.jsonl", MATH_ROWS[:1] + MATH_ROWS[2:])))
    assert isinstance(task, MathTask)
    return task


def test_gsm8k_problems(gsm8k: Gsm8kTask) -> None:
    evals = gsm8k.problems("eval", 2, seed=0)
    assert [p.answer for p in evals] == ["7", "9"]
    assert evals[0].prompt == "Question: What is 3 + 4?\nAnswer: "
    assert [p.uid for p in evals] == ["gsm8k/eval/0", "gsm8k/eval/1"]
    train = gsm8k.problems("train", 3, seed=0)
    assert sorted(p.answer for p in train) == ["-2", "1000", "72"]  # "What is 3 + 4?" is held out
    assert {p.uid for p in train} == {"gsm8k/train/0", "gsm8k/train/1", "gsm8k/train/2"}
    for problem in train + evals:
        assert gsm8k.score(problem, gsm8k.demonstration(problem)) == 1.0
        assert set(problem.prompt + gsm8k.demonstration(problem)) <= set(gsm8k.alphabet)


def test_train_order_is_seeded_and_cycles(gsm8k: Gsm8kTask) -> None:
    assert gsm8k.problems("train", 7, seed=4) == gsm8k.problems("train", 7, seed=4)
    orders = {tuple(p.uid for p in gsm8k.problems("train", 3, seed=s)) for s in range(10)}
    assert len(orders) > 1
    long = gsm8k.problems("train", 7, seed=4)
    assert len({p.uid for p in long[:3]}) == 3 and len({p.uid for p in long[3:6]}) == 3  # one epoch each
    assert gsm8k.problems("eval", 2, seed=0) == gsm8k.problems("eval", 2, seed=9)  # the eval file is the eval set
    with pytest.raises(ValueError, match=r"2 eval rows, but 3 eval problems were asked for: set eval.n <= 2"):
        gsm8k.problems("eval", 3, seed=0)


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("72", 1.0),
        (" 72 </s>", 1.0),
        ("The answer is 72", 1.0),
        ("48+24=72\n#### 72<eos>", 1.0),
        ("#### 72\nQuestion: what is 5+5? 10", 1.0),  # read at the marker, not at the last number
        ("72.0", 1.0),
        ("73", 0.0),
        ("#### 7", 0.0),
        ("", 0.0),
        ("no number", 0.0),
    ],
)
def test_gsm8k_score(gsm8k: Gsm8kTask, completion: str, score: float) -> None:
    natalia = next(p for p in gsm8k.problems("train", 3, seed=0) if p.answer == "72")
    assert gsm8k.score(natalia, completion) == score


def test_gsm8k_comma_answer(gsm8k: Gsm8kTask) -> None:
    pens = next(p for p in gsm8k.problems("train", 3, seed=0) if p.answer == "1000")
    assert gsm8k.score(pens, "1000") == 1.0
    assert gsm8k.score(pens, "#### 1,000") == 1.0
    assert gsm8k.score(pens, "100") == 0.0


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("\\boxed{\\frac{1}{2}}", 1.0),
        ("The answer is $\\boxed{\\dfrac{1}{2}}$.</s>", 1.0),
        ("\\boxed{0.5}", 1.0),
        ("$\\frac12$", 1.0),
        ("\\boxed{2}", 0.0),
        ("\\boxed{\\frac{1}{3}}", 0.0),
        ("", 0.0),
    ],
)
def test_math_score(math_task: MathTask, completion: str, score: float) -> None:
    half = math_task.problems("eval", 1, seed=0)[0]
    assert half.answer == "\\frac{1}{2}"
    assert math_task.score(half, completion) == score


def test_math_problems(math_task: MathTask) -> None:
    train = math_task.problems("train", 1, seed=0)
    assert [p.answer for p in train] == ["2"]  # the other two rows are in the eval file
    assert train[0].prompt == "Problem: Solve $x + 1 = 3$.\nSolution: "
    for problem in train + math_task.problems("eval", 2, seed=0):
        assert math_task.score(problem, math_task.demonstration(problem)) == 1.0
        assert set(problem.prompt + math_task.demonstration(problem)) <= set(math_task.alphabet)


def test_custom_fields_and_template(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"q": "1+1?", "sol": "two\n#### 2"}])
    task = build_task(Gsm8kConfig(train_path=path, question_field="q", answer_field="sol",
                                  prompt_template="{{Q}} {question} =>"))
    (problem,) = task.problems("train", 1, seed=0)
    assert problem.prompt == "{Q} 1+1? =>"
    assert problem.answer == "2"
    with pytest.raises(ValueError, match="no eval_path"):
        task.problems("eval", 1, seed=0)


GOOD = json.dumps({"question": "q", "answer": "#### 1"})


@pytest.mark.parametrize(
    ("lines", "where", "reason"),
    [
        ([GOOD, '{"question": "q", "answer": '], "line 2", "bad JSON"),
        ([GOOD, "", json.dumps({"answer": "#### 1"})], "line 3", "missing field 'question'"),
        ([json.dumps({"question": "q"})], "line 1", "missing field 'answer'"),
        ([GOOD, json.dumps({"question": 5, "answer": "#### 1"})], "line 2", "field 'question' is int"),
        ([GOOD, GOOD, json.dumps({"question": "q", "answer": "it is 5"})], "line 3", "no answer in field 'answer'"),
        ([json.dumps({"question": "q", "answer": "#### five"})], "line 1", "no answer"),
        ([GOOD, "[1, 2]"], "line 2", "expected a JSON object"),
    ],
)
def test_gsm8k_bad_rows(tmp_path: Path, lines: list[str], where: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    task = build_task(Gsm8kConfig(train_path=path))
    with pytest.raises(DatasetError, match=reason) as info:
        task.problems("train", 1, seed=0)
    assert str(path) in str(info.value) and f"{where}:" in str(info.value)
    assert info.value.path == path and info.value.where == where


@pytest.mark.parametrize(
    ("solution", "reason"),
    [
        ("no box here", "no answer in field 'solution'"),
        ("\\boxed{\\frac{1}{2}", "no answer"),  # braces never close
        ("so \\boxed }", "cannot parse the reference answer"),  # extracted, but math-verify reads nothing
    ],
)
def test_math_bad_rows(tmp_path: Path, solution: str, reason: str) -> None:
    path = _jsonl(tmp_path / "m.jsonl", [*MATH_ROWS, {"problem": "p", "solution": solution}])
    task = build_task(MathConfig(eval_path=path))
    with pytest.raises(DatasetError, match=reason) as info:
        task.problems("eval", 4, seed=0)
    assert str(path) in str(info.value) and "line 4:" in str(info.value)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DatasetError, match="no rows"):
        build_task(Gsm8kConfig(train_path=path)).problems("train", 1, seed=0)


def test_build_reads_nothing(tmp_path: Path) -> None:
    task = build_task(MathConfig(train_path=tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError):
        task.problems("train", 1, seed=0)


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed: Parquet is read")
def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        build_task(Gsm8kConfig(train_path=path)).problems("train", 1, seed=0)


def test_parquet_rows_are_numbered_from_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Parquet path with a stand-in for pyarrow (absent from the pinned environment): rows, and row numbers."""
    records = [GSM8K_TRAIN[0], {"question": "q", "answer": "nothing"}]

    class _Table:
        def to_pylist(self) -> list[dict]:
            return records

    parquet = types.ModuleType("pyarrow.parquet")
    parquet.read_table = lambda path: _Table()  # type: ignore[attr-defined]
    pyarrow = types.ModuleType("pyarrow")
    pyarrow.parquet = parquet  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyarrow", pyarrow)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    path = tmp_path / "train.parquet"
    with pytest.raises(DatasetError, match="no answer") as info:
        build_task(Gsm8kConfig(train_path=path)).problems("train", 1, seed=0)
    assert info.value.where == "row 2" and f"{path}, row 2:" in str(info.value)
    records.pop()
    (problem,) = build_task(Gsm8kConfig(train_path=path)).problems("train", 1, seed=0)
    assert problem.answer == "72" and problem.meta["where"] == "row 1"


def test_scoring_works_off_the_main_thread(gsm8k: Gsm8kTask) -> None:
    """math-verify's SIGALRM timeout is only set in the main thread; elsewhere scoring runs without one."""
    problem = next(p for p in gsm8k.problems("train", 3, seed=0) if p.answer == "72")
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(gsm8k.score, problem, "#### 72").result() == 1.0
        assert pool.submit(gsm8k.score, problem, "71").result() == 0.0


def test_real_parquet_matches_jsonl(tmp_path: Path) -> None:
    """Parquet (pinned pyarrow) gives the same problems as the same rows in JSONL; a bad row names its row."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_TRAIN), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_EVAL), tmp_path / "eval.parquet")
    from_parquet = build_task(Gsm8kConfig(train_path=tmp_path / "train.parquet", eval_path=tmp_path / "eval.parquet"))
    from_jsonl = build_task(
        Gsm8kConfig(
            train_path=_jsonl(tmp_path / "train.jsonl", GSM8K_TRAIN),
            eval_path=_jsonl(tmp_path / "eval.jsonl", GSM8K_EVAL),
        )
    )
    for split, n in (("train", 3), ("eval", 2)):
        a = from_parquet.problems(split, n, seed=0)
        b = from_jsonl.problems(split, n, seed=0)
        assert [(p.prompt, p.answer) for p in a] == [(p.prompt, p.answer) for p in b]
    bad = [*GSM8K_TRAIN[:2], {"question": "No answer marker", "answer": "just text"}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    task = build_task(Gsm8kConfig(train_path=tmp_path / "bad.parquet"))
    with pytest.raises(DatasetError, match=r"bad\.parquet, row 3"):
        task.problems("train", 2, seed=0)
