"""Framework-qualified method names (``verl:vanilla``, ``trl:dapo``, ...): resolution, composition, overrides, errors,
and where a method name is read (``compute_loss``, ``steadyrl train``'s config, ``steadyrl methods``, the ledger).
Their parity with the frameworks: tests/parity/test_framework_names.py."""

from __future__ import annotations

import json

import pytest
import torch

from steadyrl import compute_loss, resolve_method
from steadyrl.cli import main
from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.methods.frameworks import FRAMEWORK_LOSSES, FRAMEWORKS, FrameworkLoss
from steadyrl.methods.spec import GAC
from steadyrl.train.ledger import corrects_behavior


def test_a_qualified_name_is_its_preset_with_the_rows_options() -> None:
    m = resolve_method("verl:vanilla")
    assert m.name == "verl:vanilla" and m.objective.type == "ppo_clip" and m.agg == "token-mean"
    assert (m.objective.clip_low, m.objective.clip_high, m.objective.dual_clip) == (0.2, 0.2, 3.0)
    trl = resolve_method("trl:grpo")
    assert trl.agg == "seq-mean-token-mean" and trl.objective.empty_rows == "count" and trl.advantage.eps == 1e-4
    assert resolve_method("trl:dr_grpo").norm_len == 512
    assert resolve_method("skyrl:gspo").objective.form == "token"


@pytest.mark.parametrize("row", FRAMEWORK_LOSSES, ids=[r.qualified for r in FRAMEWORK_LOSSES])
def test_every_row_resolves_to_its_preset_with_its_options(row: FrameworkLoss) -> None:
    assert resolve_method(row.qualified) == resolve_method(row.preset, row.options).model_copy(
        update={"name": row.qualified}
    )


def test_qualified_names_compose_and_take_overrides() -> None:
    m = resolve_method("verl:vanilla+gac", {"gac.alpha": 0.5, "objective.clip_high": 0.28})
    assert isinstance(m.controllers[0], GAC) and m.controllers[0].alpha == 0.5
    assert m.objective.clip_high == 0.28 and m.objective.dual_clip == 3.0
    assert resolve_method("verl:vanilla+token_tis").corrections[0].type == "token_tis"
    with pytest.raises(ValueError, match="cannot compose 'trl:grpo' with 'seq_tis': both set 'objective'"):
        resolve_method("trl:grpo+seq_tis")


def test_an_agg_override_follows_the_frameworks_aggregation_setting() -> None:
    """verl's trainer counts all-masked rows under its seq-mean modes: ``method.agg`` brings that along, unless the
    override sets ``empty_rows`` itself; an aggregation the row does not list is a plain override."""
    m = resolve_method("verl:vanilla", {"agg": "seq-mean-token-mean"})
    assert m.agg == "seq-mean-token-mean" and m.objective.empty_rows == "count"
    mine = resolve_method("verl:vanilla", {"agg": "seq-mean-token-mean", "objective.empty_rows": "skip"})
    assert mine.objective.empty_rows == "skip"
    assert resolve_method("openrlhf:ppo", {"agg": "seq-mean-token-mean"}).objective.empty_rows == "skip"
    plain = resolve_method("verl:cispo", {"agg": "seq-mean-token-mean"})
    assert plain.agg == "seq-mean-token-mean"
    assert resolve_method("ppo", {"agg": "seq-mean-token-mean"}).objective.empty_rows == "skip"  # presets: unchanged


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("verl:nosuch", r"unknown verl loss 'nosuch' in method 'verl:nosuch'; verl losses steadyrl reproduces: "
                        r"verl:vanilla, verl:gspo"),
        ("verl:vanila", r"\(did you mean 'vanilla'\?\)"),
        ("nosuch:vanilla", r"unknown framework 'nosuch' .*frameworks with qualified names: verl, trl, openrlhf, "
                           r"areal, skyrl"),
        ("verll:vanilla", r"\(did you mean 'verl'\?\)"),
        ("trl:dapo+verl:nosuch", "unknown verl loss 'nosuch'"),
        ("vanila", r"a framework's loss by name: verl:vanilla, trl:dapo"),
    ],
)  # fmt: skip
def test_a_bad_qualified_name_names_what_is_allowed(name: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_method(name)


def test_compute_loss_takes_a_qualified_name() -> None:
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    batch = {"logp": logp, "behav_logp": logp.detach() - 0.1, "mask": torch.ones(3, 4, dtype=torch.bool),
             "advantages": torch.randn(3, generator=g, dtype=torch.float64)}  # fmt: skip
    out = compute_loss("trl:dapo", batch, overrides={"advantage.type": "given"})
    same = compute_loss("ppo", batch, overrides={"advantage.type": "given"})
    assert torch.equal(out.loss, same.loss)


def test_steadyrl_train_accepts_a_qualified_name() -> None:
    cfg = load_config(TrainConfig, overrides=["method=verl:vanilla", "method.agg=seq-mean-token-mean"])
    spec = cfg.method.resolve()
    assert spec.name == "verl:vanilla" and spec.objective.empty_rows == "count"


def test_the_ledger_reads_a_qualified_names_preset() -> None:
    assert corrects_behavior(resolve_method("skyrl:rollout_is"))  # the rollout_is preset corrects in its loss
    assert not corrects_behavior(resolve_method("trl:dapo"))


def test_steadyrl_methods_lists_the_qualified_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    plain = capsys.readouterr().out
    assert main(["methods", "--frameworks"]) == 0
    table = capsys.readouterr().out
    assert main(["methods", "--frameworks", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [e["name"] for e in entries] == [row.qualified for row in FRAMEWORK_LOSSES]
    for row in FRAMEWORK_LOSSES:
        assert row.qualified in plain and f"{row.qualified}  (" in table
    assert "verl:vanilla  (verl 0.9.1: actor_rollout_ref.actor.policy_loss.loss_mode=vanilla)" in table
    assert "GRPOConfig(loss_type='cispo', epsilon_high=5.0)" in table
    assert "with actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean: method.agg=seq-mean-token-mean" in table
    assert all(e["tests"] and e["framework"] == FRAMEWORKS[e["name"].split(":")[0]].version for e in entries)
