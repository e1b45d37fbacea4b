"""The configuration of ``steadyrl train``: one strict pydantic model, loaded from YAML plus ``key=value`` overrides.

Key scheme (one name per setting; a moved key's former name is read for one release, :mod:`steadyrl.config.renamed`):

* The keys a run is usually varied by are **top level**: ``task``, ``model``, ``method``, ``steps``, ``seed``,
  ``out_dir``, ``group_size``, ``prompts_per_step``, ``lr``, ``resume``, and where it runs: ``device``, ``precision``
  (the one setting of the training dtype; ``model.dtype`` may only repeat it).
* Everything else lives in a **section**, grouped by what it configures: ``rollout`` (the sampler: lengths,
  temperature, top-p/k, eval sampling ``rollout.eval``, the sampler processes' device and threads, the engine and
  ``rollout.vllm``), ``runtime`` (``mode``, then ``runtime.lag`` with the lag ``k`` and ``runtime.concurrent``),
  ``optim`` (``optim.muon``), ``proximal``, ``critic``, ``rac``, ``eval``, ``data``, ``checkpoint``, ``log``
  (``log.wandb``, ``log.mlflow``), ``guard``, ``pool`` (``pool.pace``), ``tools``; override with dotted keys
  (``optim.weight_decay=0.1``, ``runtime.lag.k=32``).
* ``task``, ``model``, ``method`` and ``proximal`` are sections with a ``name``; a bare value sets the name
  (``task=countdown``, ``method=seq_tis+gac``). A section with an ``enabled`` switch takes a bare true/false
  (``log.wandb=true``). Method options go under ``method`` with the method's own dotted names
  (``method.seq_tis.cap=4``, ``method.agg=token-mean``; see ``steadyrl methods``).

The field defaults are the README's main job; ``configs/default.yaml`` writes the same values out (a test checks it),
and ``steadyrl train`` without a config file loads that file, so ``task.max_terms=3`` edits the main job's task.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from steadyrl.base.device import DEVICE_PATTERN, PARAM_DTYPES, Precision
from steadyrl.config.critic import CriticConfig
from steadyrl.config.guard import GuardConfig
from steadyrl.config.renamed import RENAMED, move_renamed
from steadyrl.methods.resolve import behavior_record, required_inputs, resolve_method
from steadyrl.methods.spec import MethodSpec
from steadyrl.models import DEFAULT_MODEL_NAME, ModelConfig
from steadyrl.pool.config import PoolConfig
from steadyrl.rollout.multiturn import SharedCalls, ToolCallFormat, ToolRunner, ToolUse
from steadyrl.tasks.config import ChainSumConfig, TaskConfig
from steadyrl.tools.config import SandboxConfig

#: Batch tensors the learner of ``steadyrl train`` can hand to ``compute_loss`` (see ``steadyrl.train.learner``).
PROVIDED_INPUTS: frozenset[str] = frozenset(
    {
        "rewards", "group_ids", "versions", "learner_version", "prox_logp", "behav_entropy", "grad_sq_norms",
        "ref_logp", "values", "sum_p2", "centering", "entropy",
    }
)  # fmt: skip

#: The main job's task: chain_sum with two 2-digit terms (``47+85=`` → ``132``). On the embedded model, RL from the
#: warm start gains about +30 points here in 200 steps, against about +11 on the 2–3 terms of 1–2 digits of
#: ``ChainSumConfig()``, where RL plateaus near the warm start's greedy accuracy (measured; see the README).
MAIN_JOB_TASK = ChainSumConfig(min_terms=2, max_terms=2, min_digits=2, max_digits=2)

#: The placeholder of ``tools.output_template``.
OUTPUT_SLOT = "{output}"

#: Upper bounds that keep a value within what this single-process runtime can hold.
MAX_STEPS = 10_000_000
MAX_LAG = 100_000
MAX_BATCH = 65_536
MAX_NEW_TOKENS = 65_536


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Switchable(_Section):
    """A section with an ``enabled`` switch: a bare true/false stands for it (``log.wandb=true``, ``tools=true``), in
    files and overrides (:mod:`steadyrl.config.io`) as in a mapping validated directly."""

    @model_validator(mode="before")
    @classmethod
    def _bare_value_is_enabled(cls, data: Any) -> Any:
        return {"enabled": data} if isinstance(data, bool) else data


class MethodConfig(_Section):
    """The RL method: a preset or ``+`` composition and its options (validated by ``steadyrl.methods``)."""

    name: str = Field(
        "seq_tis+ess_lr",
        min_length=1,
        description="Preset or composition, e.g. grpo, seq_tis, vcpo,"
        " seq_tis+ess_lr, seq_tis+gac (`steadyrl methods` lists them).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Method options by dotted name, e.g. {seq_tis.cap: 4, agg: token-mean}; they may also be "
        "written directly under `method` (method.seq_tis.cap=4).",
    )

    @model_validator(mode="before")
    @classmethod
    def _collect_options(cls, data: Any) -> Any:
        """Every key under ``method`` other than ``name`` is a method option; nested mappings become dotted names."""
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {"name": data["name"]} if "name" in data else {}
        options: dict[str, Any] = {}

        def flatten(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for k, v in value.items():
                    flatten(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                options[prefix] = value

        flatten("", data.get("options") or {})
        flatten("", {k: v for k, v in data.items() if k not in ("name", "options")})
        out["options"] = options
        return out

    def resolve(self) -> MethodSpec:
        """The validated method spec (raises ``ValueError`` naming the bad option)."""
        return resolve_method(self.name, self.options)

    @model_validator(mode="after")
    def _method_resolves_and_is_trainable(self) -> MethodConfig:
        spec = self.resolve()
        missing = sorted(set(required_inputs(spec)) - PROVIDED_INPUTS)
        if missing:
            raise ValueError(
                f"method {self.name!r} needs batch inputs {missing} that `steadyrl train` does not produce "
                f"(it provides {', '.join(sorted(PROVIDED_INPUTS))})"
            )
        return self


class VLLMConfig(_Section):
    """How the vLLM engine is built when ``rollout.engine=vllm`` (docs/vllm.md); unused otherwise."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the engine's weights and activations (the trainer keeps the precision's); auto: "
        "float32 on the CPU, bfloat16 on a GPU. Lower precision shows up in mismatch/*.",
    )
    kv_cache_gb: float | None = Field(
        1.0,
        gt=0,
        le=65_536,
        description="KV-cache memory in GiB (CPU RAM, or device memory on a GPU); null: vLLM sizes it from "
        "gpu_memory_utilization.",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        le=10_000_000,
        description="Longest prompt + response in tokens (null: the model's max_position_embeddings).",
    )
    enforce_eager: bool | None = Field(
        None,
        description="No CUDA graphs or torch.compile (fast start-up; false decodes faster after a slower start); "
        "null: true on the CPU, false on a GPU.",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Fraction of device memory (CPU: RAM) vLLM may take when kv_cache_gb is null; keep room for the "
        "learner when both share a GPU.",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="Rows decoded together (null: vLLM's default)."
    )


class EvalSamplingConfig(_Section):
    """How the held-out eval samples (``eval.*`` says when and on how many problems)."""

    greedy: bool = Field(False, description="Greedy decoding (top_k = 1) instead of sampling.")
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature of the eval (ignored if greedy).")


class RolloutConfig(_Section):
    """The sampler: how it draws G responses per prompt, where it runs, and which engine runs it.

    ``engine=transformers`` (default): :func:`steadyrl.rollout.sampler.generate` in the sampler's own process.
    ``engine=vllm``: :class:`steadyrl.rollout.vllm_engine.VLLMEngine`, a ``vllm.LLM`` in a child process with weights
    updated in place (needs vLLM: ``bash scripts/setup_vllm.sh``, then ``.venv-vllm/bin/steadyrl``), built as
    ``rollout.vllm.*`` says.
    """

    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="transformers: steadyrl's own KV-cache sampler; vllm: a vLLM engine (CPU build here, the device "
        "where vLLM finds one). vllm adds the mismatch/* metrics in runtime.mode=lag.",
    )
    max_new_tokens: int = Field(
        12,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="Response length cap (tokens, EOS included); a response that hits it is truncated (reward as "
        "scored).",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        le=100,
        description="Sampling temperature; the learner's log-probs use the same temperature, so at lag 0 the "
        "importance ratio is 1.",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus truncation (1 = off). behav_logp is recorded under the truncated distribution, so "
        "top_p < 1 is itself an off-policy mismatch.",
    )
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0 = off).")
    eval: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig, description="How the held-out eval samples.")
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|learner|auto|cuda|cuda:\d+)$",
        description="runtime.mode=local/ray: where each sampler process generates: cpu (float32), learner (the "
        "learner's device and precision), auto, cuda or cuda:N (the learner's precision; under bf16-mixed the "
        "sampler's linear layers hold bfloat16 weights). runtime.mode=lag samples beside the learner.",
    )
    threads: int = Field(
        1, ge=1, le=1024, description="runtime.mode=local/ray: torch CPU threads of each sampler process."
    )
    batch: int = Field(
        0,
        ge=0,
        le=MAX_BATCH,
        description="runtime.mode=local/ray: groups (prompts) a sampler generates per call (0: prompts_per_step / "
        "runtime.concurrent.samplers, at least 1).",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="engine=vllm: how the vLLM engine is built.")

    def resolved_batch(self, prompts_per_step: int, samplers: int) -> int:
        """``batch`` with 0 resolved to its default."""
        return self.batch or max(1, prompts_per_step // samplers)


class MuonConfig(_Section):
    """Muon's settings when ``optim.name=muon`` (torch.optim.Muon on the hidden 2-D weight matrices)."""

    lr: float | None = Field(None, gt=0, le=1, description="Muon's learning rate (None: the run's lr, which the "
                             "match_rms_adamw adjustment makes comparable; ours).")  # fmt: skip
    momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum (torch's and Jordan et al.'s default "
                            "0.95).")  # fmt: skip
    nesterov: bool = Field(True, description="Nesterov momentum (torch's default).")
    weight_decay: float | None = Field(None, ge=0, le=10, description="Muon's decoupled weight decay (None: "
                                       "optim.weight_decay; ours).")  # fmt: skip
    ns_steps: int = Field(5, ge=1, le=20, description="Newton–Schulz steps (torch's default).")
    adjust_lr: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw",
        description="The update's scale, Keller Jordan's sqrt(max(1, A/B)) (original) or "
        "Moonshot's 0.2·sqrt(max(A, B)) that matches AdamW's update RMS (arXiv 2502.16982; ours).",
    )


class OptimConfig(_Section):
    """The optimizer (AdamW, or Muon + AdamW) and the optimization phase of each learner step (the learning rate is
    the top-level ``lr``)."""

    #: ``optim.name=muon`` keeps the section's other keys (they apply to the AdamW part as well).
    keeps_keys_on_rename: ClassVar[bool] = True

    name: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw: AdamW on every parameter. muon: "
        "torch.optim.Muon on the hidden 2-D weight matrices and AdamW on the "
        "embeddings, the output layer, norms and biases (arXiv 2610.20256, "
        "2607.16169; steadyrl.train.optim).",
    )
    muon: MuonConfig = Field(default_factory=MuonConfig, description="optim.name=muon: Muon's settings.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (β1, β2).")
    eps: float = Field(1e-8, gt=0, le=1, description="AdamW ε.")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW decoupled weight decay.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this (None: no clip).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear lr warm-up over this many optimizer steps.")
    updates_per_batch: int = Field(
        1,
        ge=1,
        le=1024,
        description="Passes over each batch (PPO epochs); > 1 makes "
        "the learner recompute prox_logp before the first pass.",
    )
    minibatches: int = Field(
        1,
        ge=1,
        le=MAX_BATCH,
        description="Optimizer steps per pass; the batch is split by groups, so it must divide prompts_per_step.",
    )
    microbatch_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 40,
        description="Token budget of one forward/backward "
        "(rows × padded prompt+response length); the optimizer step's batch is "
        "split into micro-batches that fit and the gradient is accumulated exactly "
        "(steadyrl.train.microbatch; docs/scale.md): one forward per micro-batch when no row's "
        "loss gradient reads another row's log-probs (checked every step), else two. None: one pass. VCPO/OPOB's "
        "gradient-norm pass splits itself further past optim.norm_pass_logits.",
    )
    norm_pass_logits: int = Field(
        1 << 28,
        ge=1,
        le=1 << 50,
        description="The most logits (rows × padded prompt+response length × vocabulary) "
        "VCPO/OPOB's per-trajectory gradient-norm pass holds at once on a model whose output layer "
        "cannot run in vocabulary chunks (elsewhere the pass holds no logits): there it keeps the "
        "layer's whole output and gradient (about 3 float32 copies: 3 GiB at the default), so past "
        "this it runs per micro-batch (metric train/norm_microbatches; docs/scale.md). Each extra "
        "micro-batch costs a forward and backward of the model.",
    )
    share_prompts: bool = Field(
        True,
        description="Learner forwards run each distinct prompt once and its G "
        "responses against its KV cache (steadyrl.rollout.logprobs; the same log-probs and "
        "gradient up to float rounding). False: one forward over [prompt; response] per row.",
    )
    fused: bool = Field(
        False,
        description="PyTorch's fused AdamW kernel (CPU and CUDA): 2.7× faster on 135M "
        "parameters on one CPU thread (benchmarks/cpu_kernels.py, docs/scale.md), equal to the default "
        "for-loop AdamW to ~2e-7 but not bit for bit (the shipped results were measured with false).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the "
        "backward instead of storing them (transformers gradient checkpointing, "
        "non-reentrant): less memory, about one more forward of time.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {value}")
        return value


class RacConfig(_Switchable):
    """Retroactive Advantage Correction (arXiv 2606.27580; the authors' ``rac`` primitive): applied when a batch's
    true reward arrives ``task.reward_delay`` steps late. Defaults are the authors' constants."""

    enabled: bool = Field(
        True,
        description="Apply the correction when a delayed reward arrives (false: the late "
        "reward is ignored and the proxy stands, the no-correction baseline).",
    )
    alpha: float = Field(1.0, ge=0, le=1000, description="α of δ_i = α·(r_slow,i − b_i).")
    tau_age: float = Field(50.0, gt=0, le=1e9, description="τ_age of the age discount exp(−Δ/τ_age).")
    rho_bar: float = Field(1.2, gt=0, le=1e6, description="ρ̄ of the sequence ratio min(ρ̄, π_{t+Δ}(y)/μ(y)).")
    max_abs: float = Field(5.0, gt=0, le=1e6, description="The batch of corrections is rescaled so max |c| ≤ this.")


class EvalConfig(_Section):
    """Held-out accuracy on a fixed set of eval problems: at step 0, every ``every`` steps and at the end (how it
    samples: ``rollout.eval.*``)."""

    every: int = Field(
        25, ge=0, le=MAX_STEPS, description="Evaluate every this many learner steps (0: only at step 0 and at the end)."
    )
    n: int = Field(
        512,
        ge=1,
        le=1_000_000,
        description="Number of held-out problems (the same set at every eval). "
        "Keep it >= 256: at 512 the standard error of an accuracy near 0.4 is about 0.02.",
    )
    batch_size: int = Field(512, ge=1, le=MAX_BATCH, description="Prompts per generate call during eval.")


class DataConfig(_Section):
    """Where training prompts come from."""

    train_pool: int = Field(
        8192,
        ge=1,
        le=10_000_000,
        description="Number of train problems drawn from the task "
        "once; steps walk through them in a seeded order, reshuffled every epoch.",
    )


class CheckpointConfig(_Section):
    """Periodic checkpoints under ``<out_dir>/checkpoints`` (atomic; the newest ``keep`` are kept)."""

    every: int = Field(
        100, ge=0, le=MAX_STEPS, description="Save every this many learner steps (0: only at the end and on Ctrl-C)."
    )
    keep: int = Field(2, ge=1, le=1000, description="Checkpoints to keep (older ones are deleted).")


class LagRuntimeConfig(_Section):
    """``runtime.mode=lag``: the exact-lag emulation's staleness and the ring of stale weights it keeps."""

    k: int = Field(
        16,
        ge=0,
        le=MAX_LAG,
        description="Policy lag k: step t's batch is sampled by the weights of step max(0, t − k) (pipeline "
        "schedule; 0 = synchronous on-policy).",
    )
    schedule: Literal["pipeline", "periodic"] = Field(
        "pipeline",
        description="pipeline: step t samples with the weights of step max(0, t − k) (PipelineRL-k); periodic: the "
        "sampler takes the learner's weights every refresh_every steps (OAPL's setting; k must be 0).",
    )
    refresh_every: int = Field(50, ge=1, le=MAX_STEPS, description="Steps between sampler refreshes (periodic only).")
    snapshot_memory_gb: float | None = Field(
        None,
        gt=0,
        le=1 << 20,
        description="RAM for the ring of stale weights (k+1 copies in the model's dtype); copies past it go to "
        "snapshot_dir as memory-mapped safetensors. None: half the RAM available at start. A ring that fits neither "
        "is an error before step 0.",
    )
    snapshot_dir: Path | None = Field(
        None,
        description="Where snapshots past snapshot_memory_gb are written (None: <out_dir>/snapshots; deleted as the "
        "ring moves on).",
    )


class ConcurrentRuntimeConfig(_Section):
    """``runtime.mode=local`` and ``ray``: sampler processes (actors) running concurrently with the learner; their
    sampling settings are ``rollout.*``, the pool between them and the learner ``pool.*``."""

    samplers: int = Field(1, ge=1, le=1024, description="Number of sampler processes (actors).")
    sync: bool = Field(
        False,
        description="Synchronous mode in the same runtime: samplers generate step t's batch only after the learner "
        "published step t's weights, and the learner waits for it (lag 0; the fair baseline for wall-clock "
        "comparisons).",
    )
    inflight: bool = Field(
        True,
        description="In-flight weight updates: a sampler loads newer weights between decode steps of a batch (the KV "
        "cache is kept) and every token records the version that produced it (PipelineRL, AReaL). False: weights "
        "change only between calls.",
    )
    stall_timeout_s: float = Field(
        600.0,
        gt=0,
        le=1e6,
        description="The learner gives up with an error after waiting this long for a batch with no group arriving.",
    )
    ray_address: str | None = Field(
        None,
        description="ray: address of an existing cluster (e.g. 'ray://head:10001' or 'auto'); None starts a local "
        "Ray with num_cpus = samplers + 1, no dashboard.",
    )


class RuntimeConfig(_Section):
    """How rollouts are produced: ``lag`` (exact-lag emulation, one process), ``local`` (concurrent sampler processes
    on this machine) or ``ray`` (sampler actors on a Ray cluster); each mode's settings are its sub-section. See
    docs/runtime.md."""

    mode: Literal["lag", "local", "ray"] = Field(
        "lag",
        description="lag: deterministic emulation of a sampler running exactly runtime.lag.k steps ahead (one "
        "process); local: runtime.concurrent.samplers sampler processes run concurrently with the learner, staleness "
        "comes from real timing and the pool.* policy; ray: the same roles as Ray actors "
        "(runtime.concurrent.ray_address).",
    )
    threads: int = Field(
        2,
        ge=0,
        le=1024,
        description="torch CPU threads of the learner process (0: torch's default); each sampler process has "
        "rollout.threads and the warm start model.warm_start.threads. Byte-identical metrics need the same thread "
        "count.",
    )
    deterministic: bool = Field(
        True,
        description="torch.use_deterministic_algorithms (warn_only) during the run: with 2+ threads the CPU's "
        "default index_put_ accumulate (the backward of indexing) adds in thread order, so two runs of one config "
        "differed at float rounding from step 13 (docs/results.md, Reproducibility). false: torch's defaults.",
    )
    lag: LagRuntimeConfig = Field(default_factory=LagRuntimeConfig, description="runtime.mode=lag: the lag k and "
                                  "the snapshot ring.")  # fmt: skip
    concurrent: ConcurrentRuntimeConfig = Field(
        default_factory=ConcurrentRuntimeConfig, description="runtime.mode=local/ray: the sampler processes."
    )


class ToolsConfig(_Switchable):
    """Tool-integrated rollouts: the model may call a sandboxed Python interpreter (``steadyrl.rollout.multiturn``).

    When enabled, every sampler (runtime lag, local and ray) and the held-out eval generate with
    ``generate_multiturn``: a closed call (``call_open`` code ``call_close``) runs in a :class:`SandboxPool` the
    sampler owns, its output is appended as a tool turn (attended, never trained on: ``tool_mask``), and generation
    continues, up to ``max_turns`` model turns and ``max_total_tokens`` response tokens (``rollout.max_new_tokens``
    is then unused). Rewards score the last model turn only. See docs/tools.md.
    """

    enabled: bool = Field(
        False,
        description="Sample multi-turn trajectories with the Python tool (off: single-turn "
        "sampling, the model's tool calls are plain text).",
    )
    max_turns: int = Field(3, ge=1, le=1024, description="Model turns per trajectory (1: no call is ever run).")
    max_total_tokens: int = Field(
        96,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="Cap on a response's tokens, sampled "
        "and tool output together; a trajectory that reaches it is truncated.",
    )
    max_tool_tokens: int = Field(
        32,
        ge=1,
        le=MAX_NEW_TOKENS,
        description="Output budget: tokens of one tool output kept (the rest is cut; the output template stays).",
    )
    share_calls: bool = Field(
        False,
        description="Run each distinct code of one turn once and give its result to "
        "every trajectory that wrote it (exact for deterministic code; saves ~0.1 s per "
        "duplicate sandbox start).",
    )
    call_open: str = Field("```python", min_length=1, description="Text that opens a tool call (the code follows).")
    call_close: str = Field("```", min_length=1, description="Text that closes a call (searched after call_open).")
    output_template: str = Field(
        "\n```output\n{output}\n```\n",
        description="The tool turn appended after a "
        "call; {output} (exactly once) is replaced by the tool's stdout (and, on failure, "
        "stderr and the limit that stopped it).",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="Limits and isolation of each call and the workers of the pool (steadyrl.tools).",
    )

    @field_validator("output_template")
    @classmethod
    def _one_output_slot(cls, value: str) -> str:
        if value.count(OUTPUT_SLOT) != 1:
            raise ValueError(f"must contain {OUTPUT_SLOT} exactly once, got {value!r}")
        return value

    @model_validator(mode="after")
    def _tool_output_fits(self) -> ToolsConfig:
        if self.max_tool_tokens >= self.max_total_tokens:
            raise ValueError(
                f"max_tool_tokens ({self.max_tool_tokens}) must be < max_total_tokens ({self.max_total_tokens}): "
                "one tool output would fill the whole response"
            )
        return self

    def call_format(self) -> ToolCallFormat:
        """The call and output markers as :class:`~steadyrl.rollout.multiturn.ToolCallFormat`."""
        return ToolCallFormat(open=self.call_open, close=self.call_close, output_template=self.output_template)

    def tool_use(self, runner: ToolRunner) -> ToolUse:
        """What a sampler needs to run tool turns with ``runner`` (e.g. a ``SandboxPool(self.sandbox)``)."""
        shared = SharedCalls(runner) if self.share_calls else runner
        return ToolUse(runner=shared, max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                       max_tool_tokens=self.max_tool_tokens, tool_format=self.call_format())  # fmt: skip


class WandbConfig(_Switchable):
    """Weights & Biases: every metrics record (step = learner step) and the resolved config; files in
    ``<out_dir>/wandb`` (needs requirements/logging.txt)."""

    enabled: bool = Field(False, description="Log the run to W&B.")
    project: str = Field(
        "steadyrl",
        min_length=1,
        max_length=128,
        pattern=r"^[^/\\#?%:]+$",
        description="W&B project; the run is named after out_dir.",
    )
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline",
        description="offline: no account or network, upload later with `wandb sync <out_dir>/wandb/"
        "offline-run-*`; online: stream to the W&B server (needs `wandb login`); disabled: a no-op run.",
    )


class MlflowConfig(_Switchable):
    """MLflow: the flattened config as params and every metrics record as metrics (step = learner step; needs
    requirements/logging.txt)."""

    enabled: bool = Field(False, description="Log the run to MLflow.")
    uri: str | None = Field(
        None,
        min_length=1,
        description="Tracking URI (a server http://..., sqlite:///path.db, ...); None = sqlite:///<out_dir>/mlflow.db, "
        "no server.",
    )
    experiment: str = Field(
        "steadyrl",
        min_length=1,
        max_length=500,
        description="Experiment (created if missing); the run is named after out_dir.",
    )


class LogConfig(_Section):
    """Outputs besides metrics.jsonl."""

    tensorboard: bool = Field(False, description="Also write TensorBoard events to <out_dir>/tb.")
    progress: bool = Field(True, description="Show a progress bar (ETA, reward, ESS ratio, accuracy).")
    plot: bool = Field(True, description="Write <out_dir>/plot.png at the end (and on resume/interrupt).")
    timings: Literal["metrics", "separate"] = Field(
        "metrics",
        description="Where the wall-clock keys time/* go: into metrics.jsonl, or into timings.jsonl so that "
        "metrics.jsonl is byte-identical between two runs of the same config and seed.",
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="Weights & Biases; a bare value sets enabled (log.wandb=true)."
    )
    mlflow: MlflowConfig = Field(
        default_factory=MlflowConfig, description="MLflow; a bare value sets enabled (log.mlflow=true)."
    )
    metric_names: Literal["steadyrl", "verl", "trl", "openrlhf"] = Field(
        "steadyrl",
        description="Also write each metric under that framework's key name where it has one (verl: "
        "kl/k3 also as rollout_corr/k3_kl, ...), so its dashboards read a steadyrl run; steadyrl's keys stay. "
        "The names are steadyrl.train.metric_names' maps (docs/check.md).",
    )


class ProximalConfig(_Section):
    """π_prox of the loss and the mismatch split it enables (arXiv 2605.12070)."""

    #: ``proximal=ewma`` keeps ``proximal.beta`` given before it.
    keeps_keys_on_rename: ClassVar[bool] = True

    name: Literal["current", "behavior_snapshot", "ewma"] = Field(
        "current",
        description="current (the learner's weights at the batch's first optimizer step: recomputed, or "
        "π_θ detached with one update per batch) | behavior_snapshot (each token's log-prob under its behavior "
        "version's weights, recomputed by the trainer from the lag ring's snapshot; runtime.mode=lag) | ewma "
        "(PPO-EWMA: an exponentially weighted average of the weights, proximal.beta). Both repairs log "
        "kl/discrepancy and kl/staleness.",
    )
    beta: float = Field(
        0.9,
        ge=0,
        lt=1,
        description="proximal=ewma: β of W ← βW + 1, θ_ewma ← (βW_prev/W)θ_ewma + "
        "θ/W after each optimizer step (PPO-EWMA, Hilton et al. 2021; the value 0.9 is ours).",
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_value_is_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class TrainConfig(_Section):
    """Everything ``steadyrl train`` needs. Field defaults are the README's main job."""

    #: Former dotted names of moved keys → their current ones (read for one more release; unknown-key hints).
    former_keys: ClassVar[dict[str, str]] = RENAMED

    task: TaskConfig = Field(
        default_factory=lambda: MAIN_JOB_TASK, description="The verifiable task (see its name's keys)."
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="The policy: the embedded default (warm-started and cached) or a local Hugging Face directory.",
    )
    method: MethodConfig = Field(default_factory=MethodConfig, description="The RL method and its options.")
    device: str = Field(
        "auto",
        description="Where the learner, its optimizer "
        "state, the critic and the transformers sampler run: auto (the GPU where there is one) | cpu "
        "| cuda | cuda:N.",
    )
    precision: Precision = Field(
        "fp32",
        description="fp32 | bf16-mixed (bf16 autocast forward, fp32 weights and "
        "AdamW) | bf16 (bf16 weights); the output layer and every log-prob are fp32 in all "
        "three (steadyrl.base.device).",
    )
    steps: int = Field(200, ge=1, le=MAX_STEPS, description="Learner steps (each: sample a batch, optimize on it).")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the model, problem order, sampling and eval.")
    out_dir: Path = Field(
        Path("runs/default"), description="Output directory: metrics.jsonl, config.yaml, plot.png, checkpoints/."
    )
    group_size: int = Field(8, ge=1, le=MAX_BATCH, description="Responses per prompt (G), the GRPO group.")
    prompts_per_step: int = Field(
        64,
        ge=1,
        le=MAX_BATCH,
        description="Prompts per learner step; the batch has prompts_per_step × group_size responses.",
    )
    lr: float = Field(
        3e-4,
        gt=0,
        le=1,
        description="AdamW learning rate (after warm-up; controllers such as the ESS step size scale it per step).",
    )
    resume: bool = Field(False, description="Continue the run in out_dir from its latest valid checkpoint.")
    overwrite: bool = Field(False, description="Delete an existing run in out_dir instead of refusing to start.")
    proximal: ProximalConfig = Field(
        default_factory=ProximalConfig,
        description="π_prox, the proximal policy of the loss (a bare value sets its name: proximal=ewma).",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="The sampler: sampling settings, eval sampling, its device and its engine (transformers or vllm).",
    )
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer settings.")
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description="COPC's value head (used only by methods whose advantage needs critic values).",
    )
    rac: RacConfig = Field(
        default_factory=RacConfig,
        description="Retroactive Advantage Correction of rewards that arrive late (task.reward_delay > 0 only).",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompts.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="How rollouts are produced: runtime.mode, then each mode's settings (runtime.lag.*, "
        "runtime.concurrent.*).",
    )
    log: LogConfig = Field(default_factory=LogConfig, description="Logging outputs.")
    guard: GuardConfig = Field(
        default_factory=GuardConfig,
        description="Collapse guard: watch ESS ratio, mismatch KL and gradient norm; warn, stop or roll back on alarm.",
    )
    pool: PoolConfig = Field(
        default_factory=PoolConfig,
        description="local/ray: the rollout pool between samplers and learner, and its staleness policy.",
    )
    tools: ToolsConfig = Field(
        default_factory=ToolsConfig,
        description="Tool-integrated (multi-turn) rollouts with a sandboxed Python interpreter; off by default.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Keys written under their former names move to the current ones, with a one-line notice each
        (:mod:`steadyrl.config.renamed`)."""
        return move_renamed(data) if isinstance(data, dict) else data

    @field_validator("device")
    @classmethod
    def _device_is_known(cls, value: str) -> str:
        if not DEVICE_PATTERN.match(value):
            raise ValueError(f"device {value!r} is not one of auto, cpu, cuda, cuda:N (e.g. cuda:1)")
        return value

    @model_validator(mode="after")
    def _one_precision(self) -> TrainConfig:
        """``precision`` decides the parameter dtype; ``model.dtype`` may repeat it, never contradict it."""
        wanted = PARAM_DTYPES[self.precision]
        if self.model.dtype is not None and self.model.dtype != wanted:
            raise ValueError(
                f"model.dtype={self.model.dtype} conflicts with precision={self.precision} (whose weights are "
                f"{wanted}): precision is the one setting of the training dtype; drop model.dtype, or set "
                f"precision={'bf16' if self.model.dtype == 'bfloat16' else 'fp32'}"
            )
        return self

    @model_validator(mode="after")
    def _minibatches_divide_prompts(self) -> TrainConfig:
        if self.prompts_per_step % self.optim.minibatches:
            raise ValueError(
                f"optim.minibatches ({self.optim.minibatches}) must divide prompts_per_step ({self.prompts_per_step}):"
                " minibatches split the batch by groups"
            )
        return self

    @model_validator(mode="after")
    def _behavior_snapshot_needs_the_ring(self) -> TrainConfig:
        if self.proximal.name == "behavior_snapshot" and self.runtime.mode != "lag":
            raise ValueError(
                f"proximal=behavior_snapshot needs the snapshot ring of runtime.mode=lag (got runtime.mode="
                f"{self.runtime.mode}); the {self.runtime.mode} runtime keeps no copy of past weights: use "
                "runtime.mode=lag, or proximal=ewma"
            )
        return self

    @model_validator(mode="after")
    def _lag_belongs_to_pipeline(self) -> TrainConfig:
        lag = self.runtime.lag
        if lag.schedule == "periodic" and lag.k != 0:
            raise ValueError(
                f"runtime.lag.k ({lag.k}) applies to runtime.lag.schedule=pipeline; the periodic schedule's staleness "
                "is set by runtime.lag.refresh_every (set runtime.lag.k=0)"
            )
        return self

    @model_validator(mode="after")
    def _lag_belongs_to_lag_mode(self) -> TrainConfig:
        if self.runtime.mode != "lag" and self.runtime.lag.k != 0:
            raise ValueError(
                f"runtime.lag.k ({self.runtime.lag.k}) sets the exact staleness of runtime.mode=lag; in runtime.mode="
                f"{self.runtime.mode} staleness comes from real timing: set runtime.lag.k=0 and bound it with "
                "pool.policy=max_staleness pool.max_staleness=S (or runtime.concurrent.sync=true for lag 0)"
            )
        return self

    @model_validator(mode="after")
    def _pool_sizes_fit_the_batch(self) -> TrainConfig:
        P = self.prompts_per_step
        if self.pool.resolved_capacity(P) < P:
            raise ValueError(f"pool.capacity ({self.pool.capacity}) must be >= prompts_per_step ({P}) or 0 (default)")
        if self.pool.resolved_target(P) < P:
            raise ValueError(
                f"pool.pace.target_occupancy ({self.pool.pace.target_occupancy}) must be >= prompts_per_step ({P}) "
                "or 0 (default: 2 × prompts_per_step)"
            )
        return self

    @model_validator(mode="after")
    def _behavior_distribution_is_recorded(self) -> TrainConfig:
        """Score centering needs the behavior distribution per token: the samplers of single-turn runs record it,
        the vLLM engine its top-k only."""
        record = behavior_record(self.method.resolve())
        if record is None:
            return self
        name = self.method.name
        if self.rollout.engine == "vllm" and record == 0:
            raise ValueError(f"method {name!r} with objective.top_k=0 (the exact form) needs the full behavior "
                             "distribution at each token, which the vLLM engine does not return: set "
                             "method.objective.top_k=16 (the top-k form; any k >= 1), or use "
                             "rollout.engine=transformers")  # fmt: skip
        if self.tools.enabled:
            raise ValueError(f"method {name!r} needs the behavior distribution at each token, which multi-turn tool "
                             "runs do not record yet: set tools.enabled=false")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _engine_supports_the_run(self) -> TrainConfig:
        if self.rollout.engine != "vllm":
            return self
        if "behav_entropy" in required_inputs(self.method.resolve()):
            raise ValueError(f"method {self.method.name!r} needs the behavior entropy, which rollout.engine=vllm does "
                             "not return: use rollout.engine=transformers")  # fmt: skip
        concurrent = self.runtime.concurrent
        if self.runtime.mode != "lag" and concurrent.inflight and not concurrent.sync:
            raise ValueError("runtime.concurrent.inflight=true is not possible with rollout.engine=vllm (one vLLM "
                             "generate call runs with one set of weights; tokens carry the version at the call): set "
                             "runtime.concurrent.inflight=false")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _eval_set_fits_task(self) -> TrainConfig:
        eval_size = getattr(self.task, "eval_size", None)
        if eval_size is not None and self.eval.n > eval_size:
            raise ValueError(f"eval.n ({self.eval.n}) exceeds the task's held-out set task.eval_size ({eval_size})")
        return self

    @model_validator(mode="after")
    def _chat_prompts_fit_the_model(self) -> TrainConfig:
        """task.chat needs a model with a chat template (error); a tool run of gsm8k/math whose prompt never shows
        the call format gets a warning (a real model will not guess it)."""
        if getattr(self.task, "chat", False) and self.model.name == DEFAULT_MODEL_NAME:
            raise ValueError(
                "task.chat=true renders prompts with the model tokenizer's chat template, and the default model "
                "(model.name=default, character-level) has none: set model.name to an instruct checkpoint directory "
                "(e.g. model.name=/path/to/Qwen2.5-0.5B-Instruct) or task.chat=false"
            )
        if self.tools.enabled and self.task.name in ("gsm8k", "math"):
            shown = (getattr(self.task, "system_prompt", None) or "") + getattr(self.task, "prompt_template", "")
            if self.tools.call_open not in shown:
                warnings.warn(
                    f"tools.enabled with task {self.task.name}: the prompt never shows the model the tool's call "
                    f"format (neither task.system_prompt nor task.prompt_template contains tools.call_open "
                    f"{self.tools.call_open!r}); see steadyrl.tasks.prompts and the shipped config "
                    f"{self.task.name}_tool",
                    UserWarning,
                    stacklevel=2,
                )
        return self

    @property
    def batch_size(self) -> int:
        """Responses per learner step: prompts_per_step × group_size."""
        return self.prompts_per_step * self.group_size
