"""Reading other frameworks' logs: verl's file logger JSONL, a CSV export, OpenRLHF's ``train/`` keys, renamed to
steadyrl's names so the same rules judge them; the command's exit status and help."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadyrl.check.logs import RunLogError, read_run
from steadyrl.check.rules import check_table
from steadyrl.cli import main


def verl_rows(idle: bool) -> list[dict]:
    """verl with one update per batch and no rollout correction: k3 KL grows, the clip never acts."""
    return [{"step": s, "data": {"training/global_step": s, "rollout_corr/k3_kl": 0.02 * s * s,
                                 "actor/pg_clipfrac": 0.0 if idle else 0.03, "actor/pg_loss": 0.1,
                                 "actor/grad_norm": 1.0, "critic/score/mean": 0.5}} for s in range(1, 8)]  # fmt: skip


def test_verl_file_logger_idle_clip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in verl_rows(idle=True)))
    log = read_run(path)
    assert log.framework == "verl" and log.rows[0]["kl/k3"] == 0.02 and "loss/clip_frac" in log.rows[0]
    f = {x.rule: x for x in check_table(log.rows, log.facts)}["idle_clip"]
    assert (f.verdict, f.step) == ("FAIL", 2)  # the series form: KL 0.08 > 0.05 and growing, clip fraction 0
    assert main(["check", "run", str(path)]) == 1
    assert main(["check", "run", str(path), "--corrects-mu", "yes"]) == 0  # IS against μ: the clip need not act
    path.write_text("".join(json.dumps(r) + "\n" for r in verl_rows(idle=False)))
    assert main(["check", "run", str(path)]) == 0


def test_verl_rollout_correction_is_read_from_the_log(tmp_path: Path) -> None:
    rows = verl_rows(idle=True)
    for r in rows:
        r["data"]["rollout_corr/rollout_is_mean"] = 1.0
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = read_run(tmp_path)  # the directory's single JSONL
    assert log.facts.corrects_behavior is True


def test_openrlhf_csv_export(tmp_path: Path) -> None:
    lines = ["train/global_step,train/ppo_clip_ratio,train/vllm_kl,train/policy_loss,train/actor_lr"]
    lines += [f"{s},0.0,{0.1 * s},0.2,1e-6" for s in range(1, 5)] + ["2,0.0,0.1,,1e-6"]  # a resumed step 2
    (tmp_path / "export.csv").write_text("\n".join(lines) + "\n")
    log = read_run(tmp_path / "export.csv")
    assert log.framework == "openrlhf" and log.rows[0]["step"] == 1 and log.rows[0]["kl/k1"] == 0.1
    assert log.facts.corrects_behavior is True  # vllm_kl is logged only with its IS correction on
    f = {x.rule: x for x in check_table(log.rows, log.facts)}
    assert f["idle_clip"].verdict == "PASS" and (f["counters"].verdict, f["counters"].step) == ("FAIL", 2)


def test_unreadable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(RunLogError):
        read_run(tmp_path)
    assert main(["check", "run", str(tmp_path / "missing")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_help_lists_the_command(capsys: pytest.CaptureFixture) -> None:
    assert main(["--help"]) == 0
    assert "check" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["check", "run", "--help"])
    assert "--staleness-bound" in capsys.readouterr().out


def test_metric_names_write_a_framework_s_keys_beside_steadyrl_s(tmp_path: Path) -> None:
    """``log.metric_names=verl``: the inverse of the key map, never overwriting a steadyrl key; the log still reads
    as steadyrl's, with the same verdicts."""
    from steadyrl.config.io import load_config
    from steadyrl.config.train import TrainConfig
    from steadyrl.train.metric_names import framework_names

    assert load_config(TrainConfig, overrides=["log.metric_names=verl"]).log.metric_names == "verl"
    with pytest.raises(ValueError, match="metric_names"):
        load_config(TrainConfig, overrides=["log.metric_names=megatron"])
    record = {"step": 3, "kl/k3": 0.4, "loss/clip_frac": 0.0, "loss": 1.5, "loss/policy": 0.2, "lag/max": 2}
    verl = framework_names(record, "verl")
    assert verl["rollout_corr/k3_kl"] == 0.4 and verl["actor/pg_clipfrac"] == 0.0 and verl["actor/pg_loss"] == 0.2
    assert "training/global_step" not in verl and verl["step"] == 3
    assert framework_names(record, "trl")["loss"] == 1.5  # TRL's "loss" would be our loss/policy: ours stays
    assert framework_names(record, "steadyrl") == record
    rows = [framework_names(record | {"step": s, "loss/total": 1.0, "sample/version": 0}, "verl") for s in range(3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_run(tmp_path).framework == "steadyrl"
