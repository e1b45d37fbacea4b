"""Moved config keys: each former name, on the command line and in a file, resolves to the same config as its current
name, with one line naming the new key; both names at once must agree; one precision setting."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from steadyrl.config.io import ConfigError, format_help, load_config
from steadyrl.config.renamed import RENAMED, RenamedKeyWarning, move_renamed, renamed_message
from steadyrl.config.train import TrainConfig

#: Former key → (a valid value that differs from the default, overrides it needs to be valid).
EXAMPLES: dict[str, tuple[Any, tuple[str, ...]]] = {
    "sampling.max_new_tokens": (9, ()),
    "sampling.temperature": (0.7, ()),
    "sampling.top_p": (0.9, ()),
    "sampling.top_k": (5, ()),
    "eval.greedy": (True, ()),
    "eval.temperature": (0.5, ()),
    "runtime.sampler_device": ("learner", ()),
    "runtime.sampler_threads": (2, ()),
    "runtime.sampler_batch": (3, ()),
    "rollout.dtype": ("bfloat16", ()),
    "rollout.kv_cache_gb": (2.0, ()),
    "rollout.max_model_len": (64, ()),
    "rollout.enforce_eager": (True, ()),
    "rollout.gpu_memory_utilization": (0.3, ()),
    "rollout.max_num_seqs": (4, ()),
    "lag": (3, ()),
    "runtime.schedule": ("periodic", ("runtime.lag.k=0",)),
    "runtime.refresh_every": (7, ()),
    "runtime.snapshot_memory_gb": (1.5, ()),
    "runtime.snapshot_dir": ("/tmp/snapshots", ()),
    "runtime.samplers": (2, ()),
    "runtime.sync": (True, ()),
    "runtime.inflight": (False, ()),
    "runtime.stall_timeout_s": (30.0, ()),
    "runtime.ray_address": ("auto", ()),
    "proximal_beta": (0.5, ("proximal=ewma",)),
    "log.wandb_project": ("proj", ()),
    "log.wandb_mode": ("online", ()),
    "log.mlflow_uri": ("sqlite:///x.db", ()),
    "log.mlflow_experiment": ("exp", ()),
    "optim.muon_lr": (0.01, ("optim.name=muon",)),
    "optim.muon_momentum": (0.9, ("optim.name=muon",)),
    "optim.muon_nesterov": (False, ("optim.name=muon",)),
    "optim.muon_weight_decay": (0.1, ("optim.name=muon",)),
    "optim.muon_ns_steps": (3, ("optim.name=muon",)),
    "optim.muon_adjust_lr": ("original", ("optim.name=muon",)),
    "pool.target_occupancy": (128, ()),
    "pool.pace_lambda": (2.0, ()),
    "pool.pace_score": ("version_gap", ()),
    "pool.pace_gamma": (2.0, ()),
    "pool.pace_ema": (0.5, ()),
}


def _nested(key: str, value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return out


def _load(overrides: list[str], path: Path | None = None) -> tuple[TrainConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(TrainConfig, path=path, overrides=overrides)
    return cfg, [str(w.message) for w in caught if issubclass(w.category, RenamedKeyWarning)]


def test_every_renamed_key_has_an_example() -> None:
    assert set(EXAMPLES) == set(RENAMED)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_former_key_gives_the_same_config_and_one_message(old: str, tmp_path: Path) -> None:
    new = RENAMED[old]
    value, needs = EXAMPLES[old]
    shown = yaml.safe_dump(value).strip().removesuffix("...").strip()
    base, _ = _load(list(needs))
    current, notes = _load([*needs, f"{new}={shown}"])
    assert notes == []
    assert current != base, f"{new}={shown} should change the config"
    # on the command line
    former, notes = _load([*needs, f"{old}={shown}"])
    assert former == current
    assert notes == [renamed_message(old, new)]
    # in a file (nested as it was written)
    data = _nested(old, value)
    for item in needs:
        key, _, raw = item.partition("=")
        data.update(_nested(key, yaml.safe_load(raw)) if "." not in key else {})
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    extra = [n for n in needs if "." in n.partition("=")[0]]
    from_file, notes = _load(extra, path)
    assert from_file == current
    assert notes == [renamed_message(old, new)]


def test_the_message_is_one_line_naming_both_keys() -> None:
    message = renamed_message("lag", "runtime.lag.k")
    assert "\n" not in message and "'lag'" in message and "'runtime.lag.k'" in message


def test_the_command_line_prints_the_rename_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from steadyrl.cli import main

    assert main(["train", "lag=3", "--print-config"]) == 0
    captured = capsys.readouterr()
    assert "    k: 3\n" in captured.out
    assert captured.err.strip().splitlines() == [f"steadyrl: {renamed_message('lag', 'runtime.lag.k')}"]


def test_both_names_in_one_file_must_agree(tmp_path: Path) -> None:
    """Overrides apply in order (the last of ``lag=4 runtime.lag.k=8`` wins); one file holding both names of a
    setting must give them one value."""
    assert _load(["lag=4", "runtime.lag.k=8"])[0].runtime.lag.k == 8
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump({"lag": 4, "runtime": {"lag": {"k": 4}}}))
    assert _load([], path)[0].runtime.lag.k == 4
    path.write_text(yaml.safe_dump({"lag": 4, "runtime": {"lag": {"k": 8}}}))
    with pytest.raises(ValueError, match=r"'lag' and 'runtime.lag.k' are the same setting .* keep 'runtime.lag.k'"):
        load_config(TrainConfig, path=path)


def test_a_misspelt_former_name_suggests_the_current_key() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'rollout.temprature'; did you mean 'rollout.temperature'"):
        load_config(TrainConfig, overrides=["sampling.temprature=0.5"])


def test_a_saved_config_with_former_names_still_loads(tmp_path: Path) -> None:
    """A run directory's ``config.yaml`` written before the move resumes and reports as before."""
    old = {"lag": 2, "sampling": {"max_new_tokens": 9, "temperature": 1.0},
           "rollout": {"engine": "transformers", "dtype": "auto", "kv_cache_gb": 1.0},
           "runtime": {"mode": "lag", "schedule": "pipeline", "samplers": 1, "sync": False, "inflight": True},
           "log": {"wandb": False, "wandb_project": "steadyrl", "mlflow": False},
           "pool": {"pace_lambda": 1.0, "pace_score": "drift"},
           "proximal": "current", "proximal_beta": 0.9}  # fmt: skip
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(old))
    cfg, notes = _load([], path)
    assert cfg.runtime.lag.k == 2 and cfg.rollout.max_new_tokens == 9 and not cfg.log.wandb.enabled
    assert len(notes) == 13
    assert move_renamed(old, warn=False) == move_renamed(move_renamed(old, warn=False), warn=False)


def test_a_bare_switch_sets_enabled() -> None:
    cfg, _ = _load(["log.wandb=true", "log.wandb.project=p", "log.mlflow=false"])
    assert cfg.log.wandb.enabled and cfg.log.wandb.project == "p" and not cfg.log.mlflow.enabled
    cfg, _ = _load(["log.wandb.mode=online", "log.wandb=true"])
    assert cfg.log.wandb.enabled and cfg.log.wandb.mode == "online"


def test_precision_is_the_one_dtype_setting() -> None:
    assert _load(["precision=bf16", "model.dtype=bfloat16"])[0].model.dtype == "bfloat16"
    assert _load(["precision=bf16-mixed", "model.dtype=float32"])[0].model.dtype == "float32"
    with pytest.raises(ConfigError, match=r"model.dtype=bfloat16 conflicts with precision=fp32 .* set precision=bf16"):
        load_config(TrainConfig, overrides=["model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"model.dtype=float16 conflicts with precision=bf16"):
        load_config(TrainConfig, overrides=["precision=bf16", "model.dtype=float16"])


def test_help_is_grouped_like_the_config() -> None:
    text = format_help(TrainConfig)

    def line_of(key: str) -> int:  # a key's own line is indented two spaces per level
        match = re.search(rf"^{' ' * 2 * (key.count('.') + 1)}{re.escape(key)}[ \[]", text, re.M)
        assert match is not None, f"{key} is not listed in --help"
        return match.start()

    for old in RENAMED:
        assert re.search(rf"^ +{re.escape(old)} ", text, re.M) is None, f"former name {old} in --help"
    order = [line_of(k) for k in ("rollout", "rollout.temperature", "rollout.eval", "rollout.vllm",
                                  "rollout.vllm.dtype", "runtime", "runtime.lag", "runtime.lag.k", "runtime.concurrent",
                                  "runtime.concurrent.samplers")]  # fmt: skip
    assert order == sorted(order)


def test_a_checkpoint_written_before_the_move_resumes() -> None:
    """Resume compares the checkpoint's config with the run's: one saved in the former names (and with the float32
    ``model.dtype`` every resolved config then wrote) shows no change; a real change still does."""
    from steadyrl.config.io import flatten
    from steadyrl.train.loop import _config_changes

    new = TrainConfig().model_dump(mode="json")
    flat = flatten(new, opaque=("options",))
    old: dict[str, Any] = {}
    for key, value in flat.items():
        former = next((o for o, n in RENAMED.items() if n == key), key)
        old.update(_merge(old, _nested(former, value)))
    old["model"]["dtype"] = "float32"
    assert "lag" in old and "sampling" in old and "runtime" in old
    assert _config_changes(old, new) == []
    assert _config_changes(old, {**new, "seed": 1}) == ["seed"]


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
