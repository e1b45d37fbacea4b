"""``pip install steadyrl`` into an environment that already has torch: exactly the core's packages are added.

Slow (about 1.5 minutes with a warm pip cache): builds the wheel from a copy of the sources, makes a fresh venv holding
the CPU build of torch 2.13.0 (by exact version, as scripts/setup.sh installs it), installs the wheel with plain pip
(dependencies resolved, ``--report`` read back) and runs, in that venv: every preset's ``compute_loss``, the
controllers by name, VCPO with the core's gradient-norm helper, the README's "own trainer" snippet as written (for
seq_tis, vcpo and seq_tis+gac), and ``steadyrl train`` without its extra. Then ``[train]`` on the same wheel (pinned
by requirements.lock) and a 2-step ``steadyrl train``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
#: What a plain install of the wheel may add beside torch: the core's requirements and their own.
CORE_ADDS = {"steadyrl", "numpy", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "jaxtyping",
             "wadler-lindig"}  # fmt: skip

#: The README snippet's free names: a toy policy of one's own (torch only) and a stale batch sampled from it.
PRELUDE = """
import torch
torch.manual_seed(0)
B, T, V = 8, 5, 7
model = torch.nn.Sequential(torch.nn.Embedding(V, 16), torch.nn.Tanh(), torch.nn.Linear(16, V))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
tokens = torch.randint(0, V, (B, T + 1))

def logp_fn(m):
    return torch.log_softmax(m(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

with torch.no_grad():
    behav_logp = (logp_fn(model) + 0.2 * torch.randn(B, T)).clamp(max=0.0)
mask = torch.arange(T) < torch.tensor([5, 3, 4, 5, 1, 5, 2, 5])[:, None]
rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0])
group_ids = torch.arange(B) // 4
"""

#: Inside the venv: every preset, the controllers by name, VCPO with the core helper.
CORE_CHECK = PRELUDE + """
import sys
import steadyrl
from steadyrl.methods import PRESETS, required_inputs
full = {"logp": logp_fn(model), "behav_logp": behav_logp, "mask": mask, "rewards": rewards, "group_ids": group_ids,
        "prox_logp": logp_fn(model).detach(), "versions": torch.zeros(B, T, dtype=torch.long), "learner_version": 3,
        "behav_entropy": torch.rand(B, T), "ref_logp": behav_logp.clone(), "values": torch.rand(B, T),
        "sum_p2": torch.rand(B, T) * 0.5 + 0.1,
        "centering": 0.9 * logp_fn(model), "entropy": torch.rand(B, T),
        "grad_sq_norms": steadyrl.per_trajectory_grad_sq_norms(model, logp_fn, mask)}
for p in PRESETS:
    need = set(required_inputs(steadyrl.resolve_method(p.name))) | {"logp", "behav_logp", "mask"}
    loss, metrics = steadyrl.compute_loss(p.name, {k: v for k, v in full.items() if k in need})
    assert torch.isfinite(loss), p.name
    steadyrl.control.build_controllers(p.name)
assert [type(c).__name__ for c in steadyrl.control.build_controllers("vcpo")] == ["EssStepSizeController"]
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "yaml", "tqdm", "matplotlib"))
print("core ok", len(PRESETS), heavy)
"""


def sh(*cmd: str | Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{cmd}: {out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


def readme_snippet() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use the losses in your own trainer") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def installed(py: Path) -> dict[str, str]:
    out = sh(py, "-m", "pip", "list", "--format", "json")
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out.stdout)}


def added(report: Path) -> dict[str, str]:
    items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in items}


def test_the_wheel_adds_only_the_core_and_runs_there(tmp_path: Path) -> None:
    src = tmp_path / "src"  # a clean copy: a stale build/ of the work tree must not leak into the wheel
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src)
    (wheel,) = (tmp_path / "dist").glob("steadyrl-*.whl")

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    sh(py, "-m", "pip", "install", "-q", TORCH)  # the CPU build on disk; never a bare `torch`
    before = installed(py)
    report = tmp_path / "core.json"
    sh(py, "-m", "pip", "install", "-q", wheel, "--report", report)
    new = added(report)
    assert set(new) == CORE_ADDS, f"added {sorted(new)}"
    assert not set(new) & set(before), "a plain install changed an installed version"
    after = installed(py)
    assert {k: v for k, v in after.items() if k in before} == before and after["torch"].startswith("2.13.0")

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = tmp_path / "run"
    run.mkdir()  # outside the repo: `import steadyrl` must find the installed wheel, not ./src
    out = sh(py, "-c", CORE_CHECK, cwd=run, env=env)
    assert out.stdout.strip().splitlines()[-1].startswith("core ok 58 []"), out.stdout

    snippet = readme_snippet()
    assert 'method = "seq_tis"' in snippet
    for method in ("seq_tis", "vcpo", "seq_tis+gac"):
        code = PRELUDE + snippet.replace('method = "seq_tis"', f"method = {method!r}") + "\nprint(float(loss))"
        out = sh(py, "-c", code, cwd=run, env=env)
        assert out.stdout.strip(), method

    cli = subprocess.run([bin_dir / "steadyrl", "train"], capture_output=True, text=True, cwd=run, env=env, timeout=120)
    assert cli.returncode == 1 and cli.stderr.strip().endswith("(not installed): pip install 'steadyrl[train]'")
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr

    # [train] on the same wheel, pinned by the lock (the versions the suite runs): torch stays, a 2-step run trains
    report = tmp_path / "train.json"
    sh(py, "-m", "pip", "install", "-q", f"{wheel}[train]", "-c", ROOT / "requirements.lock", "--report", report)
    assert "torch" not in added(report) and installed(py)["torch"] == after["torch"]
    overrides = textwrap.dedent(
        """
        steps=2 lag=1 prompts_per_step=4 group_size=2 eval.every=0 eval.n=8 checkpoint.every=0
        model.arch.hidden_size=16 model.arch.num_layers=1 model.arch.num_heads=1 model.arch.intermediate_size=16
        model.warm_start.max_steps=5 model.warm_start.eval_every=5 model.warm_start.eval_problems=8
        rollout.max_new_tokens=3 data.train_pool=16 runtime.threads=1 log.progress=false
        """
    ).split()
    out = sh(bin_dir / "steadyrl", "train", *overrides, f"out_dir={tmp_path / 'train'}",
             f"model.cache_dir={tmp_path / 'cache'}", cwd=run, env=env)  # fmt: skip
    assert (tmp_path / "train" / "metrics.jsonl").read_text().count("\n") >= 2, out.stdout[-2000:]
