"""``steadyrl check sweep`` on a sweep directory laid out as ``steadyrl sweep`` writes it (runs.json, sweep.yaml, each
run's resolved config.yaml and metrics.jsonl), the per-step prompt hashes from the runtimes' own problem order: a
fair sweep passes; an arm whose seed never arrived, and a fixed key that differs, fail."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from steadyrl.check.sweep import check_sweep
from steadyrl.cli import main
from steadyrl.config.io import load_config
from steadyrl.config.train import TrainConfig
from steadyrl.runtime.order import problem_order
from steadyrl.train.ledger import tensor_hash

METHODS, LRS, SEEDS, STEPS = ("grpo", "seq_tis"), (1e-3, 3e-3), (0, 1), 4
ACC = {("grpo", 0): 0.50, ("grpo", 1): 0.40, ("seq_tis", 0): 0.60, ("seq_tis", 1): 0.45}


def prompt_hash(cfg: TrainConfig, step: int) -> int:
    import torch

    order = problem_order(step, pool=cfg.data.train_pool, per_step=cfg.prompts_per_step, seed=cfg.seed)
    return tensor_hash(torch.tensor(order))


def write_sweep(root: Path, *, planted_seed: bool = False, planted_key: bool = False) -> Path:
    (root / "sweep.yaml").write_text(yaml.safe_dump({"grid": {"method": list(METHODS), "lr": list(LRS)},
                                                     "seeds": list(SEEDS), "out_dir": str(root)}))  # fmt: skip
    entries = []
    for method in METHODS:
        for lr in LRS:
            for seed in SEEDS:
                name = f"method={method},lr={lr:g},seed={seed}"
                real_seed = 1 if planted_seed and (method, lr, seed) == ("seq_tis", 1e-3, 0) else seed
                temp = 0.7 if planted_key and (method, lr, seed) == ("grpo", 3e-3, 1) else 1.0
                cfg = load_config(
                    TrainConfig,
                    overrides=[
                        f"method={method}",
                        f"lr={lr}",
                        f"seed={real_seed}",
                        f"rollout.temperature={temp}",
                        f"out_dir={root / name}",
                    ],
                )
                run = root / name
                run.mkdir()
                (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
                rows = [{"step": t, "loss": 0.1, "data/prompt_hash": prompt_hash(cfg, t)} for t in range(STEPS)]
                collapsed = method == "seq_tis" and lr == 3e-3 and seed == 1
                rows[-1]["guard/alarm"] = int(collapsed)
                rows.append({"step": STEPS, "eval/acc": ACC[method, seed] + (lr == 3e-3) * 0.01})
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                entries.append({"name": name, "labels": {"method": method, "lr": f"{lr:g}"}, "method": method,
                                "lag": 0, "seed": seed, "steps": STEPS, "config_hash": "x",
                                "reference": False})  # fmt: skip
    (root / "runs.json").write_text(json.dumps({"runs": entries}))
    return root


def by_rule(root: Path) -> dict:
    return {f.rule: f for f in check_sweep(root)}


def test_fair_sweep_passes_with_paired_differences_and_lr_range(tmp_path: Path) -> None:
    f = by_rule(write_sweep(tmp_path))
    assert {r: x.verdict for r, x in f.items()} == {"config_diff": "PASS", "seeds": "PASS", "data_order": "PASS",
                                                   "paired": "PASS", "lr_range": "PASS"}  # fmt: skip
    assert "varied: lr, method.name" in f["config_diff"].message
    # per seed: seq_tis − grpo at the same lr; the first arm (grpo, lr 1e-3) is the reference
    assert "lr=0.001,method=seq_tis: +0.100 +0.050 (mean +0.075, n=2)" in f["paired"].message
    assert "seq_tis: 0.001 of 2 lrs" in f["lr_range"].message and "grpo: 0.001, 0.003 of 2 lrs" in f["lr_range"].message
    assert main(["check", "sweep", str(tmp_path)]) == 0


def test_an_arm_with_another_data_seed_fails(tmp_path: Path) -> None:
    f = by_rule(write_sweep(tmp_path, planted_seed=True))
    assert f["seeds"].verdict == "FAIL" and "method=seq_tis,lr=0.001,seed=0" in f["seeds"].message
    assert f["data_order"].verdict == "FAIL" and f["data_order"].step == 0
    assert f["config_diff"].verdict == "PASS"  # the seed is checked per seed, not as a fixed key
    assert main(["check", "sweep", str(tmp_path)]) == 1


def test_a_fixed_key_that_differs_fails(tmp_path: Path) -> None:
    f = by_rule(write_sweep(tmp_path, planted_key=True))
    assert f["config_diff"].verdict == "FAIL" and "rollout.temperature" in f["config_diff"].message
    assert f["seeds"].verdict == "PASS" and f["data_order"].verdict == "PASS"


def test_concurrent_runtimes_are_not_held_to_one_data_order(tmp_path: Path) -> None:
    root = write_sweep(tmp_path, planted_seed=True)
    for cfg in root.glob("*/config.yaml"):
        data = yaml.safe_load(cfg.read_text())
        data["runtime"]["mode"] = "local"
        cfg.write_text(yaml.safe_dump(data))
    f = by_rule(root)
    assert f["data_order"].verdict == "SKIP" and f["seeds"].verdict == "FAIL"  # the seed check still holds


def test_a_sweep_with_an_unfair_arm_writes_its_findings_and_the_report_shows_them(tmp_path: Path) -> None:
    """``steadyrl sweep`` writes the arm checks when its runs end (``write_arms_check``); the report shows them."""
    import json

    from steadyrl.check.sweep import ARMS_FILE, write_arms_check
    from steadyrl.sweep.report import _arms_section

    root = write_sweep(tmp_path, planted_seed=True)
    findings = write_arms_check(root)
    written = json.loads((root / ARMS_FILE).read_text())
    assert [f["rule"] for f in written] == [f.rule for f in findings]
    assert {f["rule"]: f["verdict"] for f in written}["seeds"] == "FAIL"
    section = "".join(_arms_section(root))
    assert "Fair comparison" in section and "FAIL" in section
