"""The ``rollout`` section: what the config refuses with the vLLM engine, the settings it hands the engine, and the
one-line error where vLLM is missing. Runs in every interpreter (vLLM is never imported)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from steadyrl.config.io import ConfigError, load_config
from steadyrl.config.train import RolloutConfig, TrainConfig, VLLMConfig
from steadyrl.rollout.vllm_engine import (
    SETUP_HINT,
    VLLMSettings,
    engine_from_config,
    server_devices,
    vllm_available,
)
from steadyrl.train.entry import main


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["method=estr"], r"behavior entropy"),
        (["method=score_centering"], r"objective\.top_k=0 \(the exact form\).*method\.objective\.top_k=16"),
        (["runtime.mode=local", "runtime.lag.k=0"], r"runtime\.concurrent\.inflight=false"),
        (["rollout.vllm.kv_cache_gb=0"], r"rollout\.vllm\.kv_cache_gb"),
        (["rollout.engine=sglang"], r"rollout\.engine"),
        (["rollout.vllm.dtype=int8"], r"rollout\.vllm\.dtype"),
    ],
)
def test_vllm_engine_refuses_what_it_cannot_do(overrides: list[str], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(TrainConfig, overrides=["rollout.engine=vllm", *overrides])


def test_what_the_vllm_engine_accepts() -> None:
    cfg = load_config(TrainConfig, overrides=["rollout.engine=vllm", "runtime.mode=local", "runtime.lag.k=0",
                                              "runtime.concurrent.inflight=false"])  # fmt: skip
    assert cfg.rollout.engine == "vllm"
    assert load_config(TrainConfig, overrides=["tools.enabled=true"]).rollout.engine == "transformers"
    tools = load_config(TrainConfig, overrides=["rollout.engine=vllm", "tools.enabled=true"])  # multi-turn on vLLM
    assert tools.rollout.engine == "vllm" and tools.tools.enabled
    # score centering's top-k form: the engine records the behavior distribution's top-k
    sc = load_config(TrainConfig, overrides=["rollout.engine=vllm", "method=score_centering",
                                             "method.objective.top_k=16"])  # fmt: skip
    assert sc.method.resolve().objective.top_k == 16  # type: ignore[union-attr]


def test_settings_are_the_sections_fields() -> None:
    names = {f.name for f in dataclasses.fields(VLLMSettings)} - {"startup_timeout_s"}
    assert names == set(VLLMConfig.model_fields)
    vllm = VLLMConfig(dtype="bfloat16", kv_cache_gb=None, max_model_len=96, max_num_seqs=8)
    s = VLLMSettings.from_config(vllm)
    assert (s.dtype, s.kv_cache_gb, s.max_model_len, s.max_num_seqs) == ("bfloat16", None, 96, 8)
    assert engine_from_config(RolloutConfig(), model=None, tokenizer=None) is None  # type: ignore[arg-type]


@pytest.mark.skipif(vllm_available(), reason="checks the error shown where vLLM is missing; it is installed here")
def test_train_without_vllm_fails_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout.engine=vllm", "runtime.lag.k=0", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"steadyrl train: {SETUP_HINT}" and "bash scripts/setup_vllm.sh" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_settings_resolve_per_device() -> None:
    """``dtype=auto`` and ``enforce_eager=null`` are float32 and eager on the CPU, bfloat16 and CUDA graphs on a GPU;
    an explicit value wins on either."""
    auto = VLLMSettings()
    assert auto.resolved(torch.device("cpu")) == ("float32", True)
    assert auto.resolved(torch.device("cuda", 1)) == ("bfloat16", False)
    fixed = VLLMSettings(dtype="float16", enforce_eager=True)
    assert fixed.resolved(torch.device("cuda")) == ("float16", True)


@pytest.mark.parametrize(
    ("device", "visible", "expected"),
    [
        ("cpu", "", {}),
        ("cuda", "", {"CUDA_VISIBLE_DEVICES": "0"}),
        ("cuda:1", "", {"CUDA_VISIBLE_DEVICES": "1"}),
        ("cuda:1", "4,6", {"CUDA_VISIBLE_DEVICES": "6"}),  # torch's cuda:1 is the second GPU this process sees
    ],
)
def test_the_server_sees_the_policys_gpu(device: str, visible: str, expected: dict[str, str]) -> None:
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    assert server_devices(torch.device(device), env) == expected


def test_a_gpu_the_process_cannot_see_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cuda:2.*CUDA_VISIBLE_DEVICES=4,6.*cuda:0 … cuda:1"):
        server_devices(torch.device("cuda:2"), {"CUDA_VISIBLE_DEVICES": "4,6"})
