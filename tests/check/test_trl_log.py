"""``steadyrl check run`` on a real 3-step CPU run of TRL's ``GRPOTrainer`` (its ``log_history`` in
``trainer_state.json``, TRL's own key names) and on steadyrl's run of the same data (TRL's trainer with steadyrl's
GRPO loss: the same seed, model, prompts and sampler; its metrics under steadyrl's names): the rules both logs can
judge give the same verdicts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

trl = pytest.importorskip("trl", reason="trl==1.16.0 (requirements.lock)")
datasets = pytest.importorskip("datasets", reason="TRL's trainer needs datasets")

from steadyrl.check.logs import read_run  # noqa: E402
from steadyrl.check.rules import check_table  # noqa: E402
from steadyrl.cli import main  # noqa: E402
from steadyrl.integrations import trl as strl  # noqa: E402
from steadyrl.models.tiny import TinyArchConfig, build_tiny_model  # noqa: E402
from steadyrl.models.tokenizer import build_char_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPTS = ["1+1=", "22+3=", "4+4=", "5+1111="]
ARCH = TinyArchConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def digits_reward(completions: list[str], **_: Any) -> list[float]:
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def run(cls: type, model_dir: Path, out: Path, **kw: Any) -> list[dict[str, Any]]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args = trl.GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=3,
        logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
        learning_rate=1e-3, seed=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer = cls(model=str(model_dir), reward_funcs=digits_reward, args=args,
                      train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
                      processing_class=build_char_tokenizer(), **kw)  # fmt: skip
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    trainer.state.save_to_json(str(out / "trainer_state.json"))
    return trainer.state.log_history


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tok = build_char_tokenizer()
    model_dir = tmp_path_factory.mktemp("model")
    build_tiny_model(ARCH, tokenizer=tok, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    trl_dir = tmp_path_factory.mktemp("trl")
    run(trl.GRPOTrainer, model_dir, trl_dir)
    history = run(strl.GRPOTrainer, model_dir, tmp_path_factory.mktemp("adapter"), method="grpo")
    ours = tmp_path_factory.mktemp("steadyrl")
    prefix = strl.METRIC_PREFIX
    rows = [{"step": r["step"], **{k[len(prefix) :]: v for k, v in r.items() if k.startswith(prefix)}}
            for r in history if any(k.startswith(prefix) for k in r)]  # fmt: skip
    (ours / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return trl_dir, ours


def test_trl_log_history_is_read_under_steadyrl_names(logs: tuple[Path, Path]) -> None:
    log = read_run(logs[0])
    assert log.framework == "trl" and log.source.name == "trainer_state.json"
    steps = [r for r in log.rows if "loss/clip_frac" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["loss/clip_frac"] == 0.0 for r in steps)  # one update per batch: TRL's clip never acts either


def test_same_verdicts_on_trl_and_steadyrl_logs_of_the_same_data(logs: tuple[Path, Path]) -> None:
    theirs, ours = (read_run(d) for d in logs)
    assert ours.framework == "steadyrl"
    a = {f.rule: f.verdict for f in check_table(theirs.rows, theirs.facts)}
    b = {f.rule: f.verdict for f in check_table(ours.rows, ours.facts)}
    both = [r for r in a if a[r] != "SKIP" and b[r] != "SKIP"]
    assert {"nan", "counters"} <= set(both)
    assert {r: a[r] for r in both} == {r: b[r] for r in both}
    assert b["idle_clip"] == "PASS"  # on-policy: steadyrl's mismatch KL is 0; TRL logs no mismatch KL off vLLM
    assert main(["check", "run", str(logs[0])]) == main(["check", "run", str(logs[1])]) == 0


def test_a_nan_and_a_reset_in_the_trl_log_are_caught(logs: tuple[Path, Path], tmp_path: Path) -> None:
    state = json.loads((logs[0] / "trainer_state.json").read_text())
    history = state["log_history"]
    history[1]["grad_norm"] = float("nan")
    history.append(dict(history[0]))  # a resume from the first step's checkpoint, logging step 1 again
    (tmp_path / "trainer_state.json").write_text(json.dumps(state))
    verdicts = {f.rule: (f.verdict, f.step) for f in check_table(read_run(tmp_path).rows, read_run(tmp_path).facts)}
    assert verdicts["nan"] == ("FAIL", 2) and verdicts["counters"][0] == "FAIL"
