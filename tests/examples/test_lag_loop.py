"""examples/lag_loop.py, the lag-k loop of one's own around compute_loss: it runs as documented, for every preset."""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest

from steadyrl.methods import PRESETS
from steadyrl.methods.resolve import required_inputs, resolve_method

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lag_loop.py"


def test_vcpo_runs_as_a_script_with_its_controller_and_gradient_norms() -> None:
    """A fresh interpreter (compute_loss's input checks on), VCPO at lag 4: its ESS step size acts every step."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(EXAMPLE), "--method", "vcpo", "--steps", "12", "--prompts", "8"],
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    lines = out.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["0", "10", "11"]
    assert "lag 4" in lines[-1] and "vcpo/ess_scale" in lines[-1], out.stdout
    assert time.monotonic() - start < 60


#: Presets whose loss reads critic values (the example has no critic: it says so, tested below).
NEEDS_CRITIC = {p.name for p in PRESETS if "values" in required_inputs(resolve_method(p.name))}


@pytest.mark.parametrize("method", [p.name for p in PRESETS if p.name not in NEEDS_CRITIC] + ["seq_tis+gac"])
def test_every_preset_runs(method: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--method", method, "--steps", "2", "--prompts", "2", "--group", "3", "--tokens", "2", "--lag", "1"]
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("step   1  lag 1  reward ")


def test_copc_says_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--method", "copc"])
    with pytest.raises(SystemExit, match="copc needs critic values"):
        runpy.run_path(str(EXAMPLE), run_name="__main__")
