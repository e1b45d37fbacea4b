"""Method resolution, composition, overrides, and the catalog the CLI prints."""

from __future__ import annotations

import json

import pytest

from steadyrl import resolve_method
from steadyrl.cli import main
from steadyrl.methods.spec import GAC, SeqTIS

ISSUE_NAMES = [
    "grpo",
    "ppo",
    "token_tis",
    "seq_tis",
    "token_mis",
    "seq_mis",
    "geo_mis",
    "icepop",
    "decoupled_ppo",
    "m2po",
    "tic_grpo",
    "gmc_grpo",
    "vcpo",
    "gac",
    "oapl",
    "vaco",
    "copc",
    "estr",
    "prefix_ratio",
    "kl_in_reward",
    "otb",
]


def test_composition_concatenates_corrections_and_controllers() -> None:
    m = resolve_method("seq_tis+gac", {"seq_tis.cap": 4, "gac.alpha": 0.5})
    assert m.corrections == (SeqTIS(cap=4.0),)
    assert isinstance(m.controllers[0], GAC) and m.controllers[0].alpha == 0.5
    assert m.objective.type == "reinforce"


@pytest.mark.parametrize(
    ("spec", "overrides", "match"),
    [
        ("seq_tsi", None, "did you mean 'seq_tis'"),
        ("seq_tis", {"seq_tis.cap": -1}, r"corrections\.0\.seq_tis\.cap"),
        ("seq_tis", {"sq_tis.cap": 1}, "unknown method option 'sq_tis.cap'"),
        ("seq_tis", {"agg": "mean"}, "'token-mean', 'seq-mean-token-mean'"),
        ("seq_tis+gmc_grpo", None, "both set 'objective'"),
        ("grpo+grpo", None, "twice"),
        ("grpo", {"objective.clip_hgh": 0.3}, "clip_hgh"),
        ("vaco", {"recompute_prox": False}, r"advantage.type='vaco' .* set recompute_prox=True"),
        ("vaco", {"advantage.ratio": "mean"}, r"advantage\.vaco\.ratio: Input should be 'geometric' or 'product'"),
    ],
)
def test_errors_name_the_field_and_the_choices(spec: str, overrides: dict | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_method(spec, overrides)


def test_objective_type_override_replaces_the_component() -> None:
    m = resolve_method("grpo", {"objective.type": "gspo", "objective.clip_high": 1e-3})
    assert m.objective.type == "gspo" and m.objective.clip_high == 1e-3


def test_methods_json_lists_every_issue_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    names = {e["name"] for e in entries}
    assert set(ISSUE_NAMES) <= names
    for e in entries:
        assert e["summary"] and e["confidence"] in ("exact", "reference-code", "reconstructed")
        assert e["paper"] is None or (len(e["paper"]) == 10 and e["paper"][4] == ".")
        assert e["paper"] is not None or e["source"], e["name"]


def test_methods_table_and_demo_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    assert "vcpo" in capsys.readouterr().out
    assert main(["demo", "--lags", "0", "32", "--methods", "grpo", "seq_tis", "geo_mis"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "32 "))]
    ess = {(r[0], r[1]): float(r[2]) for r in rows}
    assert ess[("0", "grpo")] == 1.0
    assert ess[("32", "grpo")] < 0.5  # staleness collapses the ESS


def test_unknown_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trian"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_entropy_options_resolve_on_any_method_and_the_catalog_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    from steadyrl.config.train import MethodConfig

    m = resolve_method("seq_tis+gac", {"entropy.coef": 0.01, "entropy.agg": "token-mean", "gac.alpha": 0.5})
    assert (m.entropy.coef, m.entropy.agg, m.entropy.mask) == (0.01, "token-mean", "kept")
    assert MethodConfig(name="grpo", entropy={"coef": 0.02}).resolve().entropy.coef == 0.02  # method.entropy.coef=
    a = resolve_method("grpo+adaptive_entropy", {"adaptive_entropy.target": 1.5})
    assert a.controllers[0].type == "adaptive_entropy" and a.controllers[0].target == 1.5  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"entropy\.coeff: Extra inputs are not permitted"):
        resolve_method("grpo", {"entropy.coeff": 0.01})
    with pytest.raises(ValueError, match=r"entropy\.mask: Input should be 'kept' or 'input'"):
        resolve_method("grpo", {"entropy.mask": "all"})
    with pytest.raises(ValueError, match=r"coef_min=0\.5 must not exceed coef_max=0\.1"):
        resolve_method("grpo+adaptive_entropy", {"adaptive_entropy.coef_min": 0.5, "adaptive_entropy.coef_max": 0.1})
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "method.entropy.coef" in out and "method.adaptive_entropy.target" in out and "adaptive_entropy " in out
    assert main(["methods", "--json"]) == 0
    entries = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert entries["grpo"]["spec"]["entropy"]["coef"] == 0.0 and "entropy" in entries["adaptive_entropy"]["needs"]
