"""Sweep files: grid expansion, variants, run names, config hashes, errors that name the key, shipped sweeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import TrainConfig
from steadyrl.sweep.config import (
    MAX_NAME,
    SweepConfig,
    SweepError,
    Variant,
    config_hash,
    expand,
    flatten,
    load_sweep,
    run_name,
)
from steadyrl.sweep.entry import resolve_sweep_path, shipped_sweeps, sweep_main
from tests.sweep.conftest import plan


def test_grid_is_the_product_in_written_order_times_seeds_plus_include(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": ["grpo", "seq_tis"], "lag": [0, 4]}, include=[{"method": ["vcpo"]}],
                 seeds=[3, 1])
    names = [s.entry.name for s in specs]
    assert names == [
        "method=grpo,lag=0,seed=3", "method=grpo,lag=0,seed=1", "method=grpo,lag=4,seed=3", "method=grpo,lag=4,seed=1",
        "method=seq_tis,lag=0,seed=3", "method=seq_tis,lag=0,seed=1", "method=seq_tis,lag=4,seed=3",
        "method=seq_tis,lag=4,seed=1", "method=vcpo,seed=3", "method=vcpo,seed=1",
    ]  # fmt: skip
    first = specs[0]
    cfg = first.config
    assert (cfg.method.name, cfg.runtime.lag.k, cfg.seed, cfg.steps) == ("grpo", 0, 3, 6)
    assert first.config.runtime.threads == 1 and first.config.log.progress is False
    assert first.out_dir == tmp_path / "sweep" / "method=grpo,lag=0,seed=3"
    last = specs[-1].config
    assert last.method.name == "vcpo" and last.runtime.lag.k == 16  # include: the base config's lag
    assert [s.entry.reference for s in specs] == [True, True] + [False] * 8
    # the train command's arguments give back the same config
    again = load_config(TrainConfig, path=first.config_path, overrides=list(first.overrides))
    assert again == first.config


def test_variant_sets_several_keys_and_its_name_labels_the_run(tmp_path: Path) -> None:
    guard = {"name": "seq_tis_guard", "overrides": {"method": "seq_tis", "guard.mode": "rollback"}}
    beta = {"name": "oapl_b", "overrides": {"method": {"name": "oapl", "objective": {"beta2": 0.1}}}}
    specs = plan(tmp_path, grid={"method": ["seq_tis", guard, beta]})
    by = {s.entry.method: s for s in specs}
    assert list(by) == ["seq_tis", "seq_tis_guard", "oapl_b"]
    assert by["seq_tis_guard"].config.method.name == "seq_tis"
    assert by["seq_tis_guard"].config.guard.mode == "rollback" and by["seq_tis"].config.guard.mode == "warn"
    assert by["oapl_b"].config.method.name == "oapl" and by["oapl_b"].config.method.options == {"objective.beta2": 0.1}
    assert by["seq_tis_guard"].entry.name == "method=seq_tis_guard,seed=0"
    assert len({s.entry.config_hash for s in specs}) == 3


def test_variant_without_its_key_sets_the_key_to_its_name_and_pseudo_keys_only_label(tmp_path: Path) -> None:
    specs = plan(tmp_path, grid={"method": [{"name": "vcpo", "overrides": {"lr": 1e-4}}],
                                 "variant": [{"name": "guarded", "overrides": {"guard.mode": "stop"}},
                                             {"name": "plain"}]})
    assert [s.config.method.name for s in specs] == ["vcpo", "vcpo"]
    assert [s.config.lr for s in specs] == [1e-4, 1e-4]
    assert [s.config.guard.mode for s in specs] == ["stop", "warn"]
    assert [s.entry.labels for s in specs] == [{"method": "vcpo", "variant": "guarded"},
                                               {"method": "vcpo", "variant": "plain"}]


def test_base_nested_and_dotted_keys_and_the_name_first(tmp_path: Path) -> None:
    assert flatten({"task": {"max_terms": 3, "name": "chain_sum"}, "lag": 2}) == [
        ("task.name", "chain_sum"), ("task.max_terms", 3), ("lag", 2)]
    specs = plan(tmp_path, base={"task": {"max_terms": 3, "name": "chain_sum"}, "optim.betas": [0.9, 0.99]})
    cfg = specs[0].config
    assert cfg.task.max_terms == 3 and cfg.optim.betas == (0.9, 0.99)


def test_run_names_are_safe_and_bounded() -> None:
    name = run_name([("method", "seq_tis+gac"), ("lr", "0.0003"), ("seed", "0")])
    assert name == "method=seq_tis+gac,lr=0.0003,seed=0"
    assert run_name([("out", "a/b c:d"), ("seed", "1")]) == "out=a_b_c_d,seed=1"
    long = run_name([("method", "x" * 300), ("seed", "0")])
    other = run_name([("method", "x" * 300), ("seed", "1")])
    assert len(long) == MAX_NAME and long != other and "/" not in long


def test_config_hash_ignores_outputs_and_threads_but_not_the_experiment(tmp_path: Path) -> None:
    a = plan(tmp_path, grid={"lr": [1e-3, 2e-3]})
    b = expand(SweepConfig(out_dir=tmp_path / "elsewhere", threads=2, grid={"lr": [1e-3]},
                           base={"steps": 6, "eval.every": 2, "checkpoint.every": 7, "log.plot": False}))
    assert a[0].entry.config_hash == b[0].entry.config_hash != a[1].entry.config_hash
    assert len(a[0].entry.config_hash) == 10
    dump = a[0].config.model_dump(mode="json")
    assert config_hash(dump) == config_hash(a[0].config)
    assert config_hash({**dump, "seed": 1}) != config_hash(dump)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"base": {"seed": 1}}, "list the seeds under `seeds`"),
        ({"grid": {"out_dir": ["x"]}}, "'out_dir' cannot be set here"),
        ({"base": {"runtime": {"threads": 4}}}, "use the sweep's `threads`"),
        ({"grid": {"lag": []}}, "grid.lag: the list of values is empty"),
        ({"grid": {"method": ["grpo", {"name": "grpo", "overrides": {"lr": 1.0}}]}}, "the same label ['grpo']"),
        ({"grid": {"variant": ["a"]}}, "must be a variant"),
        ({"include": [{"seed": [1]}]}, "include[0].seed"),
        ({"seeds": [1, 1]}, "each seed must appear once"),
    ],
)
def test_bad_sweep_fields_are_rejected_with_the_key(fields: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SweepConfig(**fields)
    assert message in str(err.value)


def test_unknown_keys_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'job'.*did you mean 'jobs'"):
        load_sweep(None, ["job=2"])
    with pytest.raises(ConfigError, match="invalid value for 'threads'"):
        load_sweep(None, ["threads=0"])
    with pytest.raises(SweepError, match=r"run method=nope,seed=0: .*method"):
        plan(tmp_path, grid={"method": ["nope"]})
    with pytest.raises(SweepError, match="unknown key 'lrr'"):
        plan(tmp_path, base={"lrr": 1})
    with pytest.raises(ValueError, match="extra"):
        Variant(name="a", overridez={})  # type: ignore[call-arg]


def test_cli_errors_are_plain_words(tmp_path: Path, capsys) -> None:
    assert sweep_main(["grid.method=[grpo,nope]", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("steadyrl sweep: run method=nope,seed=0") and "nope" in err
    assert sweep_main(["no_such_sweep"]) == 2
    err = capsys.readouterr().err
    assert "neither a file nor a shipped sweep (" in err and "lag64_methods" in err
    assert sweep_main(["--bogus"]) == 2
    assert sweep_main(["--help"]) == 0
    out = capsys.readouterr().out
    for key in SweepConfig.model_fields:
        assert f"\n  {key} " in out
    assert sweep_main(["grid.method=[grpo,vcpo]", "seeds=[0,1]", f"out_dir={tmp_path}", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[0].startswith("fresh   missing") and out[0].endswith("method=grpo,seed=0")
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_shipped_lag64_sweep_reproduces_the_leads_comparison() -> None:
    assert "lag64_methods" in shipped_sweeps()
    path = resolve_sweep_path("lag64_methods")
    specs = expand(load_sweep(path, []), sweep_file=path)
    assert len(specs) == 24
    by = {(s.entry.method, s.entry.seed): s.config for s in specs}
    assert sorted({m for m, _ in by}) == sorted([
        "vcpo", "gac", "gmc_grpo", "oapl", "seq_tis", "tic_grpo", "vaco", "pnpo", "seq_tis_guard", "oapl_beta2_0.1",
        "seq_tis_lr1.5e-4", "grpo",
    ])  # fmt: skip
    for (method, seed), cfg in by.items():
        lr = 1.5e-4 if method == "seq_tis_lr1.5e-4" else 3e-4
        assert (cfg.steps, cfg.prompts_per_step, cfg.lr, cfg.seed) == (300, 16, lr, seed)
        assert cfg.runtime.lag.k == (0 if method == "grpo" else 64)
    assert by["seq_tis_guard", 0].method.name == "seq_tis" and by["seq_tis_guard", 0].guard.mode == "rollback"
    assert by["oapl_beta2_0.1", 1].method.options == {"objective.beta2": 0.1}
    assert [s.entry.reference for s in specs].count(True) == 2


def test_every_shipped_sweep_loads() -> None:
    for name, path in shipped_sweeps().items():
        assert expand(load_sweep(path, []), sweep_file=path), name
