"""The core installs alone: ``import steadyrl`` and its core commands need no extra, and whatever needs one says, in
one line, which ``pip install 'steadyrl[...]'`` brings it. Missing packages are simulated in a fresh interpreter
(``sys.modules[name] = None`` makes both ``import`` and the check fail, as for a package that is not installed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from steadyrl.base.extras import EXTRAS, MissingExtraError, install_line, missing_modules, require_extra

#: Every package of the train extra, blocked.
BLOCK_TRAIN = f"import sys\nEXTRAS = {list(EXTRAS['train'])!r}\nfor m in EXTRAS: sys.modules[m] = None\n"


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TRAIN + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_require_extra_names_the_missing_modules_and_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    assert install_line("train") == "pip install 'steadyrl[train]'"
    require_extra("train", "x", ("json",))  # present: nothing happens
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert missing_modules("wandb") == ["wandb"]
    line = r"^log\.wandb needs wandb \(not installed\): pip install 'steadyrl\[wandb\]'$"
    with pytest.raises(MissingExtraError, match=line):
        require_extra("wandb", "log.wandb")
    assert issubclass(MissingExtraError, ImportError)


def test_the_core_runs_without_the_train_extra() -> None:
    """Gradient norms, controllers by name, `steadyrl methods` and `steadyrl demo` (compute_loss) import none of it."""
    out = run(
        """
        import torch, steadyrl
        from steadyrl.cli import main
        model = torch.nn.Linear(3, 4)
        logp_fn = lambda m: torch.log_softmax(m(torch.ones(2, 5, 3)), -1)[..., 0]
        norms = steadyrl.per_trajectory_grad_sq_norms(model, logp_fn, torch.ones(2, 5, dtype=torch.bool))
        assert norms.shape == (2,) and steadyrl.control.build_controllers("seq_tis+gac")
        assert main(["methods"]) == 0 and main(["demo", "--methods", "seq_tis", "--lags", "0"]) == 0
        print("ok", [m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in EXTRAS])
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "ok []"


@pytest.mark.parametrize("command", ["train", "sweep", "report"])
def test_a_command_without_its_extra_prints_the_install_line(command: str) -> None:
    out = run(f"from steadyrl.cli import main\nraise SystemExit(main([{command!r}, '--help']))")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"steadyrl {command} needs {', '.join(EXTRAS['train'])} (not installed): pip install 'steadyrl[train]'"
    ]


def test_a_package_without_its_extra_fails_with_one_line() -> None:
    packages = ["train", "models", "rollout", "tasks", "runtime", "sweep", "pool"]
    out = run(
        f"""
        import importlib
        for p in {packages!r}:
            try:
                importlib.import_module("steadyrl." + p)
            except ImportError as e:
                print(type(e).__name__, e)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == len(packages) * [
        "MissingExtraError steadyrl's training stack (steadyrl.train, models, rollout, tasks, runtime, sweep) needs "
        "transformers (not installed): pip install 'steadyrl[train]'"
    ]
