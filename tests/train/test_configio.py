"""YAML + key=value loading of a pydantic model, with errors that name the key (a small model, no training code)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from steadyrl.config.io import ConfigError, format_help, load_config, parse_override


class _S(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Adder(_S):
    name: Literal["adder"] = "adder"
    terms: int = Field(2, ge=1, description="number of terms")


class Counter(_S):
    name: Literal["counter"] = "counter"
    target: int = Field(10, ge=1, description="target")


class Optim(_S):
    weight_decay: float = Field(0.0, ge=0, description="decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="betas")


class Root(_S):
    task: Annotated[Adder | Counter, Field(discriminator="name")] = Field(default_factory=Adder, description="task")
    optim: Optim = Field(default_factory=Optim, description="optimizer")
    lr: float = Field(1e-3, gt=0, description="learning rate")
    mode: Literal["a", "b"] = Field("a", description="mode")
    out_dir: Path = Field(Path("runs/x"), description="where")


def test_overrides_parse_values_as_yaml() -> None:
    assert parse_override("lr=3e-4") == (["lr"], 3e-4)
    assert parse_override("optim.betas=[0.5,0.6]") == (["optim", "betas"], [0.5, 0.6])
    assert parse_override("out_dir=runs/a") == (["out_dir"], "runs/a")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("lr")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_override("optim.betas=[1,")


def test_file_then_overrides_in_order(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("lr: 0.01\noptim:\n  weight_decay: 0.1\ntask: counter\n")
    cfg = load_config(Root, path=f, overrides=["optim.betas=[0.5,0.6]", "lr=0.02", "task.target=7"])
    assert cfg.lr == 0.02 and cfg.optim.weight_decay == 0.1 and cfg.optim.betas == (0.5, 0.6)
    assert isinstance(cfg.task, Counter) and cfg.task.target == 7


def test_bare_value_on_a_named_section_sets_its_name_and_a_new_name_starts_afresh(tmp_path: Path) -> None:
    assert load_config(Root, overrides=["task.terms=3", "task=adder"]).task == Adder(terms=3)
    assert load_config(Root, overrides=["task.terms=3", "task.name=adder"]).task == Adder(terms=3)
    assert load_config(Root, overrides=["task.terms=3", "task=counter"]).task == Counter()
    f = tmp_path / "c.yaml"
    f.write_text("task:\n  name: adder\n  terms: 5\n")
    assert load_config(Root, path=f, overrides=["task.name=counter", "task.target=4"]).task == Counter(target=4)
    assert load_config(Root, path=f, overrides=["task=adder"]).task == Adder(terms=5)


def test_unknown_key_lists_valid_keys_and_suggests() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(Root, overrides=["optim.weight_decy=0.1"])
    text = str(err.value)
    assert "unknown key 'optim.weight_decy'" in text and "did you mean 'optim.weight_decay'" in text
    assert "valid keys under 'optim': betas, weight_decay" in text
    with pytest.raises(ConfigError, match=r"did you mean 'lr'"):
        load_config(Root, overrides=["optim.lr=0.1"])  # same name at another level
    with pytest.raises(ConfigError, match=r"unknown key 'task.target'.*\n.*valid keys under 'task': name, terms"):
        load_config(Root, overrides=["task.target=3"])  # a key of another variant of the union


def test_bad_values_name_the_key_and_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"invalid value for 'lr': .*greater than 0 \(got -1\)"):
        load_config(Root, overrides=["lr=-1"])
    with pytest.raises(ConfigError, match=r"invalid value for 'mode': Input should be 'a' or 'b' \(got 'c'\)"):
        load_config(Root, overrides=["mode=c"])
    with pytest.raises(ConfigError, match=r"'task'.*expected tags: 'adder', 'counter'"):
        load_config(Root, overrides=["task=multiplier"])
    with pytest.raises(ConfigError, match=r"'lr' is a value, not a section"):
        load_config(Root, overrides=["lr.x=1"])


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Root, path=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: 0.1\noptim: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml', line \d+, column \d+: not valid YAML"):
        load_config(Root, path=bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml'.*must be a mapping"):
        load_config(Root, path=listing)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("lr: 0.1\noptim:\n  weight_decay: -2\n")
    with pytest.raises(ConfigError, match=r"wrong\.yaml[\s\S]*'optim.weight_decay'"):
        load_config(Root, path=wrong)


def test_help_lists_every_key_with_type_default_and_description() -> None:
    text = format_help(Root)
    for key in ("lr", "mode", "out_dir", "optim.weight_decay", "optim.betas", "task.terms", "task.target"):
        assert f"  {key} " in text or f" {key} " in text, key
    assert "float (> 0) = 0.001" in text
    assert "a|b = a" in text
    assert "task.name = adder|counter" in text
    assert "learning rate" in text and "number of terms" in text
