"""TrainConfig: shipped configs load, defaults equal configs/default.yaml, errors name the key, --help is complete."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import pytest
import yaml

from steadyrl.config.io import ConfigError, _all_keys, format_help, load_config
from steadyrl.config.train import TrainConfig
from steadyrl.train.entry import main

CONFIGS = sorted(p for p in resources.files("steadyrl.configs").iterdir() if p.name.endswith(".yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(TrainConfig, path=str(path))
    assert cfg.method.resolve().name == cfg.method.name


def test_default_yaml_is_the_built_in_default() -> None:
    path = resources.files("steadyrl.configs") / "default.yaml"
    assert load_config(TrainConfig, path=str(path)) == TrainConfig()


def test_issue_keys_are_top_level_and_overrides_reach_sections() -> None:
    cfg = load_config(
        TrainConfig,
        overrides=[
            "task=chain_sum", "model.warm_start.target_accuracy=0.2", "method=seq_tis+gac", "method.seq_tis.cap=4",
            "runtime.lag.k=32", "steps=5", "seed=3", "out_dir=runs/x", "group_size=4", "prompts_per_step=8", "lr=1e-4",
            "optim.weight_decay=0.1", "eval.every=10",
        ],
    )
    assert (cfg.runtime.lag.k, cfg.steps, cfg.seed, str(cfg.out_dir), cfg.group_size, cfg.prompts_per_step) == (
        32, 5, 3, "runs/x", 4, 8
    )
    assert cfg.lr == 1e-4 and cfg.optim.weight_decay == 0.1 and cfg.eval.every == 10
    assert cfg.model.warm_start.target_accuracy == 0.2
    spec = cfg.method.resolve()
    assert spec.corrections[0].cap == 4 and [c.type for c in spec.controllers] == ["gac"]
    assert cfg.batch_size == 32


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["lagg=3"], r"unknown key 'lagg'; did you mean 'runtime.lag.k'\?\n.*valid keys at the top level: .*lr"),
        (["optim.lr=0.1"], r"unknown key 'optim.lr'; did you mean 'critic.lr' or 'lr'"),
        (["runtime.lag.k=-1"], r"invalid value for 'runtime.lag.k': .*greater than or equal to 0 \(got -1\)"),
        (["runtime.lag.schedule=async"], r"'runtime.lag.schedule': Input should be 'pipeline' or 'periodic' \(got 'as"),
        (["task=sudoku"], r"'task'.*expected tags: 'chain_sum', 'basic_arithmetic', 'countdown'"),
        (["task.max_term=4"], r"unknown key 'task.max_term'; did you mean 'task.max_terms'"),
        (["method=seq_tiss"], r"unknown method 'seq_tiss' \(did you mean 'seq_tis'\?\)"),
        (["method.seq_tis.capp=2"], r"method.*seq_tis.capp|capp"),
        (["optim.minibatches=3"], r"optim.minibatches \(3\) must divide prompts_per_step \(64\)"),
        (["runtime.lag.schedule=periodic"], r"runtime.lag.k \(16\) applies to runtime.lag.schedule=pipeline"),
        (["eval.n=600"], r"eval.n \(600\) exceeds the task's held-out set task.eval_size \(512\)"),
        (["lr=fast"], r"invalid value for 'lr': Input should be a valid number.*\(got 'fast'\)"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(TrainConfig, overrides=overrides)


def test_a_method_needing_inputs_the_learner_cannot_make_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import steadyrl.config.train as config_module

    monkeypatch.setattr(config_module, "PROVIDED_INPUTS", config_module.PROVIDED_INPUTS - {"sum_p2"})
    with pytest.raises(ConfigError, match=r"method 'otb' needs batch inputs \['sum_p2'\]"):
        load_config(TrainConfig, overrides=["method=otb"])


def test_every_preset_is_accepted() -> None:
    from steadyrl.methods import PRESETS

    for preset in PRESETS:
        assert load_config(TrainConfig, overrides=[f"method={preset.name}"]).method.name == preset.name


def test_bad_yaml_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "run.yaml"
    bad.write_text("lag: 4\nsteps: [\n")
    with pytest.raises(ConfigError, match=r"run\.yaml', line 3, column 1: not valid YAML"):
        load_config(TrainConfig, path=bad)


def test_cli_exits_2_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lagg=3"]) == 2
    assert "unknown key 'lagg'" in capsys.readouterr().err
    assert main([str(tmp_path / "none.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["grpo_lag00"]) == 2
    assert "neither a file nor a shipped config (default, grpo_lag0" in capsys.readouterr().err
    assert main(["--frobnicate"]) == 2
    assert main(["runtime.lag.k=4", f"out_dir={tmp_path}", "--print-config"]) == 0
    assert "  lag:\n    k: 4\n" in capsys.readouterr().out


def test_without_a_config_file_overrides_edit_the_main_job(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["task.max_terms=3", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["task"] | {"max_terms": 2} == TrainConfig().model_dump(mode="json")["task"]
    assert printed["task"]["max_terms"] == 3 and printed["task"]["min_digits"] == 2
    assert main(["task=countdown", "--print-config"]) == 0  # a new task name starts the section afresh
    assert yaml.safe_load(capsys.readouterr().out)["task"]["name"] == "countdown"


def test_a_shipped_config_is_found_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["seq_tis_lag32", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "    k: 32\n" in printed and "out_dir: runs/seq_tis-lag32" in printed


def test_help_documents_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for key in _all_keys(TrainConfig):
        assert f" {key} " in text or f" {key}\n" in text or f"{key}  [" in text, key
    assert text.count("\n") > 60
    chain_sum = text.split("when task.name=chain_sum:")[1].split("when task.name=")[0]
    assert re.search(r"task\.min_digits +int \(>= 1, <= 9\) = 2\n", chain_sum)  # the main job's value, not the class's
    assert format_help(TrainConfig) in text
