"""``benchmarks/peer_trl.py`` on a random tiny model: both trainers run, the forced budget makes both generate exactly
``budget`` tokens per row, and every reported time is a positive finite number (docs/scale.md, "Speed against TRL on
the CPU")."""

from __future__ import annotations

import argparse
import math
from types import ModuleType

import pytest

from tests.benchmark_scripts import load_benchmark


def _load_script() -> ModuleType:
    return load_benchmark("peer_trl")


@pytest.mark.slow
def test_tiny_run_measures_both_trainers_on_equal_token_counts(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("trl", reason="TRL is the peer being measured")
    peer = _load_script()
    args = argparse.Namespace(steps=2, tokens="3,5", free="3", repeats=1, seed=0, tiny=True)
    results = peer.run(args)
    printed = capsys.readouterr().out
    assert [(s.tokens, s.forced) for s in results] == [(3, False), (5, True)]
    rows = peer.PROMPTS * peer.GROUP
    for setting, pair in results.items():
        assert set(pair) == {"steadyrl", "trl"}
        for summary in pair.values():
            assert summary.n == 1  # 2 steps, the first dropped
            for value in (summary.step_s, summary.gen_s, summary.learn_s, summary.step_cpu, summary.gen_cpu):
                assert math.isfinite(value) and value > 0
            assert summary.tokens <= rows * setting.tokens
        if setting.forced:  # the stop token is outside the vocabulary: every row runs to the budget on both sides
            assert pair["steadyrl"].tokens == pair["trl"].tokens == rows * setting.tokens
    assert "ratio" in printed and "5 forced" in printed and "learner %peak" in printed
