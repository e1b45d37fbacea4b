"""The AReaL adapter against the real AReaL 1.0.4 engine path, on CPU (a one-process gloo group, no GPU).

(1) For every steadyrl method AReaL can host: AReaL's own pieces run the update exactly as ``FSDPEngine.train_batch``
    does — the actor's micro-batch split (``split_padded_tensor_dict_into_mb_list``), the engine's packing into 1-D
    inputs with ``cu_seqlens`` (``pack_tensor_dict``), the global loss weight (``compute_total_loss_weight``), and
    ``FSDPEngine._compute_logprobs_and_loss`` itself (AReaL's log-prob gather, its call of ``loss_fn`` and its
    ``loss_weight_fn`` scaling) on the logits of a tiny bigram model — and the summed loss and its gradient equal
    ``steadyrl.compute_loss`` on the padded batch (built here, no AReaL in the reference) to 1e-6, with a stale
    sampler simulated (μ ≠ π_prox ≠ π_θ).
(2) ``PPOActor`` (the two-line change) through a stand-in engine built from the same AReaL pieces: the ESS step size
    scales the step's lr and restores it, GAC skips or projects, metrics reach AReaL's ``stats_tracker``.
(3) The traps and refusals: ``use_decoupled_loss=false`` (μ overwritten by π_prox), AReaL's loss-only options,
    methods AReaL cannot host; ``import steadyrl`` imports no AReaL.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("areal", reason="the AReaL adapter tests need areal==1.0.4 (requirements/integrations/areal.txt)")

from areal.api.cli_args import MicroBatchSpec, PPOActorConfig
from areal.engine.core.train_engine import compute_total_loss_weight
from areal.engine.fsdp_engine import FSDPEngine, FSDPTrainContext
from areal.utils import stats_tracker
from areal.utils.data import MicroBatchList, pack_tensor_dict, split_padded_tensor_dict_into_mb_list

from steadyrl import compute_loss, resolve_method
from steadyrl.integrations import areal as sareal
from steadyrl.methods import PRESETS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

B, S, V, PROMPT = 8, 10, 11, 3
TEMP = 0.8
VERSION = 5
HOSTED = [p.name for p in PRESETS if sareal.supported(p.name)[0]]
NOT_HOSTED = [p.name for p in PRESETS if not sareal.supported(p.name)[0]]
BATCH_COUPLED = {"m2po", "m2po_clip", "bapo"}  # budgets or bounds over the batch: one micro-batch
MILD = {"geo_mis": 0.002, "rejection": 0.1}  # filters that drop everything at the default staleness


@pytest.fixture(scope="module", autouse=True)
def gloo_group(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """AReaL all-reduces the loss weight over its data-parallel group: a one-process gloo group on CPU."""
    if dist.is_initialized():  # pragma: no cover - another module left one
        yield None
        return
    path = Path(tmp_path_factory.mktemp("gloo")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def model(seed: int = 0) -> torch.nn.Embedding:
    """A bigram 'language model': logits of the next token = an embedding of the current one (float64)."""
    torch.manual_seed(seed)
    return torch.nn.Embedding(V, V).double()


def stale_data(emb: torch.nn.Embedding, seed: int = 0, behav_noise: float = 0.4) -> dict[str, Any]:
    """Right-padded [B, S] data as AReaL's update receives it (loss_mask and log-probs already rolled by −1)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(PROMPT + 3, S + 1, (B,), generator=g)
    pos = torch.arange(S).unsqueeze(0)
    attn = pos < lens.unsqueeze(1)
    ids = torch.randint(0, V, (B, S), generator=g) * attn
    loss_mask = (pos >= PROMPT - 1) & (pos <= lens.unsqueeze(1) - 2)  # position t scores token t + 1
    with torch.no_grad():
        theta = padded_logp(emb, ids)
    noise = lambda s: s * torch.randn(B, S, generator=g, dtype=torch.float64)  # noqa: E731
    prox = (theta + noise(0.1)) * loss_mask
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S) * loss_mask
    return {
        "input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask.to(torch.int32),
        "logprobs": (prox + noise(behav_noise)) * loss_mask, "prox_logp": prox, "advantages": adv.contiguous(),
        "versions": torch.where(loss_mask, torch.randint(0, VERSION, (B, S), generator=g), -1),
        "ref_logp": (theta + noise(0.3)) * loss_mask,
    }  # fmt: skip


def padded_logp(emb: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Reference π_θ [B, S]: log softmax(logits / T) of the next token in the same row (written here, not AReaL's)."""
    logits = emb(ids) / TEMP
    labels = torch.roll(ids, shifts=-1, dims=-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def fake_engine_self() -> types.SimpleNamespace:
    """The attributes ``FSDPEngine._compute_logprobs_and_loss`` reads, with AReaL's own log-prob methods bound."""
    fake = types.SimpleNamespace(
        config=types.SimpleNamespace(is_critic=False, temperature=TEMP), enable_tree_training=False,
        parallel_helper=types.SimpleNamespace(tp_size=1, sp_size=1),
    )  # fmt: skip
    fake._compute_logprobs_entropy = functools.partial(FSDPEngine._compute_logprobs_entropy, fake)
    fake._get_vocab_min_max_logits = functools.partial(FSDPEngine._get_vocab_min_max_logits, fake)
    return fake


def areal_train_batch(emb: torch.nn.Embedding, data: dict[str, Any], loss: sareal.LossFn, n_mbs: int) -> torch.Tensor:
    """``FSDPEngine.train_batch`` steps 1–3 with AReaL's functions (no optimizer step); returns Σ of the mb losses."""
    split = split_padded_tensor_dict_into_mb_list(dict(data), mb_spec=MicroBatchSpec(n_mbs=n_mbs))
    assert len(split.mbs) == n_mbs
    mb_list = MicroBatchList(data=data, mb_spec=split.mb_spec, mbs=[pack_tensor_dict(mb) for mb in split.mbs],
                             group_lens=split.group_lens)  # fmt: skip
    total_weight = compute_total_loss_weight(mb_list, loss.loss_weight, dist.group.WORLD)
    fake, total = fake_engine_self(), torch.zeros((), dtype=torch.float64)
    for mb in mb_list.mbs:
        assert mb["input_ids"].dim() == 1 and "cu_seqlens" in mb  # packed 1-D, as the engine hands it
        logits = emb(mb["input_ids"])  # [N, V]: the engine's forward on the packed micro-batch
        ctx = FSDPTrainContext(model_inputs={"input_ids": mb["input_ids"]}, mb_input=mb, pad_length=0)
        total = total + FSDPEngine._compute_logprobs_and_loss(
            fake, logits, ctx, loss, loss.loss_weight, total_weight, loss_multiplier=1.0
        )
    return total


def reference(method: str, emb: torch.nn.Embedding, data: dict[str, Any], overrides: dict[str, Any]) -> Any:
    mask = data["loss_mask"].bool()
    batch = {
        "logp": padded_logp(emb, data["input_ids"]), "behav_logp": data["logprobs"], "prox_logp": data["prox_logp"],
        "mask": mask, "advantages": data["advantages"], "versions": data["versions"], "learner_version": VERSION,
        "ref_logp": data["ref_logp"],
    }  # fmt: skip
    return compute_loss(resolve_method(method, {"advantage.type": "given", **overrides}), batch)


# ---------------------------------------------------------------------------------------------------- (1) same loss
@pytest.mark.parametrize("method", HOSTED)
def test_areal_engine_path_equals_compute_loss(method: str) -> None:
    emb = model()
    data = stale_data(emb, behav_noise=MILD.get(method, 0.4))
    overrides: dict[str, Any] = {}
    if resolve_method(method).agg == "seq-mean-token-sum-norm":
        overrides["norm_len"] = S  # a constant length: the micro-batches' padded widths differ
    ref = reference(method, emb, data, overrides)
    masked = float(ref.metrics["loss/masked_frac"])
    assert masked < 1.0, "every token masked: the comparison would be 0 = 0"
    n_mbs = 1 if masked > 0 or method in BATCH_COUPLED else 2  # masking reweights micro-batches (module docstring)
    loss = sareal.LossFn(method, overrides)
    loss.learner_version = VERSION
    total = areal_train_batch(emb, data, loss, n_mbs)

    assert float(total.detach()) == pytest.approx(float(ref.loss.detach()), abs=1e-6, rel=0)
    (g_areal,) = torch.autograd.grad(total, emb.weight)
    (g_ref,) = torch.autograd.grad(ref.loss, emb.weight)
    torch.testing.assert_close(g_areal, g_ref, atol=1e-6, rtol=1e-5)  # AReaL's log-softmax runs in float32
    if sareal.needs_behavior(loss.method) and method not in MILD:
        assert float(ref.metrics["is/ess_ratio"]) < 0.999, "the simulated staleness must show"


def test_unpack_places_each_sequence_in_its_row() -> None:
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    x = torch.arange(8.0, requires_grad=True)
    out = sareal.unpack(x, cu, 4, fill=-1.0)
    expected = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [4, 5, 6, 7]], dtype=torch.float32)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones(8))


@pytest.mark.parametrize(("agg", "expected"), [("token-mean", 6), ("seq-mean-token-mean", 2),
                                               ("seq-mean-token-sum-norm", 3)])  # fmt: skip
def test_loss_weight_matches_the_aggregation(agg: str, expected: int) -> None:
    """Packed mask of 3 sequences, the middle one without trained tokens: tokens, non-empty sequences, sequences."""
    mb = {"loss_mask": torch.tensor([1, 1, 0, 0, 0, 1, 1, 1, 1]), "cu_seqlens": torch.tensor([0, 3, 5, 9])}
    assert int(sareal.LossFn("grpo", {"agg": agg}).loss_weight(mb)) == expected


# ---------------------------------------------------------------------------------------------------- (2) the actor
class StandInEngine:
    """The TrainEngine surface PPOActor uses, built from AReaL's split/pack/weight/loss code and a real AdamW."""

    def __init__(self, emb: torch.nn.Embedding, lr: float = 0.1) -> None:
        self.model = emb
        self.optimizer = torch.optim.AdamW(emb.parameters(), lr=lr)
        self.lrs: list[float] = []
        self.steps = 0

    def train(self) -> None:
        self.model.train()

    def get_version(self) -> int:
        return VERSION

    def train_batch(self, mb: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> dict[str, float]:
        self.optimizer.zero_grad()
        areal_train_batch(self.model, mb, loss_fn, n_mbs=1).backward()
        before = self.model.weight.detach().clone()
        self.optimizer.step()  # AReaL's engine.optimizer_step clips, then calls this
        self.steps += 1
        return {"update_successful": float(not torch.equal(before, self.model.weight.detach())), "grad_norm": 0.0}


def _record_lr(engine: StandInEngine) -> None:
    """Record the lr each AdamW step actually uses (inside the adapter's wrapper, so after the ESS scaling)."""
    inner = torch.optim.AdamW.step

    def step(self: torch.optim.Optimizer, *a: Any, **k: Any) -> Any:
        engine.lrs.append(self.param_groups[0]["lr"])
        return inner(self, *a, **k)

    engine.optimizer.step = types.MethodType(step, engine.optimizer)  # type: ignore[method-assign]


def make_actor(method: str, **config: Any) -> tuple[sareal.PPOActor, StandInEngine]:
    emb = model(1)
    engine = StandInEngine(emb)
    _record_lr(engine)
    cfg = PPOActorConfig(**{"use_decoupled_loss": True, "ppo_n_minibatches": 2, **config})
    return sareal.PPOActor(cfg, engine, method=method), engine


def test_actor_ess_step_size_scales_and_restores_the_lr() -> None:
    actor, engine = make_actor("ess_lr")
    stats_tracker.export_all(reset=True)
    actor.ppo_update([stale_data(engine.model, seed=7)])
    assert engine.steps == 2 and len(engine.lrs) == 2  # two micro-batches, each an optimizer step in AReaL
    exported = stats_tracker.export_all(reset=True)
    scale = exported["ppo_actor/update/steadyrl/vcpo/ess_scale"]
    assert 0.0 < scale < 1.0
    assert all(lr < 0.1 for lr in engine.lrs)  # the steps ran at lr · scale
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # restored
    assert any(k.endswith("steadyrl/is/ess_ratio") for k in exported)


def test_actor_gac_can_skip_a_step() -> None:
    actor, engine = make_actor("gac", ppo_n_minibatches=1)
    actor.steadyrl_loss.step_control.controllers[0].spec = actor.steadyrl_loss.method.controllers[0].model_copy(
        update={"tau_proj": -1.0, "tau_skip": -1.0}
    )  # every cosine is above the thresholds: the second step must be skipped
    data = stale_data(engine.model, seed=3)
    actor.ppo_update([dict(data)])
    first = engine.model.weight.detach().clone()
    actor.ppo_update([dict(data)])
    last = actor.steadyrl_loss.step_control.last
    assert last["steadyrl/gac/skipped"] == 1.0
    assert torch.equal(first, engine.model.weight.detach()), "a skipped step leaves the weights untouched"


# ---------------------------------------------------------------------------------------------------- (3) refusals
def test_behavior_methods_need_decoupled_loss() -> None:
    with pytest.raises(ValueError, match=r"actor\.use_decoupled_loss=true"):
        sareal.PPOActor(PPOActorConfig(use_decoupled_loss=False), StandInEngine(model()), method="seq_tis")
    sareal.PPOActor(PPOActorConfig(use_decoupled_loss=False), StandInEngine(model()), method="ppo")  # reads no μ


@pytest.mark.parametrize(("field", "value"), [("use_sapo_loss", True), ("m2_threshold", 0.04), ("c_clip", 3.0)])
def test_loss_only_options_refused(field: str, value: Any) -> None:
    cfg = PPOActorConfig(use_decoupled_loss=False, **{field: value})  # AReaL refuses SAPO with the decoupled loss
    with pytest.raises(ValueError, match=rf"actor\.{field}="):
        sareal.PPOActor(cfg, StandInEngine(model()), method="ppo")


def test_reference_model_needed_for_kl_in_loss() -> None:
    emb = model()
    data = pack_tensor_dict({k: v for k, v in stale_data(emb).items() if k != "ref_logp"})
    with pytest.raises(ValueError, match=r"ref_logp"):
        sareal.LossFn("kl_in_loss")(emb(data["input_ids"])[:, 0], None, data)


@pytest.mark.parametrize("method", NOT_HOSTED)
def test_not_hosted_methods_raise_naming_why(method: str) -> None:
    ok, reason = sareal.supported(method)
    assert not ok and reason
    with pytest.raises(ValueError, match=rf"method '{method}' cannot run as an AReaL loss_fn: "):
        sareal.LossFn(method)


def test_expected_split_of_the_catalog() -> None:
    assert set(NOT_HOSTED) == {
        "gmc_grpo", "vcpo", "opob", "oapl", "vaco", "copc", "brace", "estr", "kl_in_reward", "otb", "score_centering",
        "clip_cov", "kl_cov",  # batch-wide covariance ranking; AReaL hands the loss one micro-batch
        "rloo", "reinforce_pp", "reinforce_pp_baseline",  # AReaL's loss input carries its own advantages only
        "adaptive_entropy",  # the adapter feeds no entropy to the loss
    }  # fmt: skip


def test_import_steadyrl_imports_no_areal() -> None:
    code = "import sys, steadyrl, steadyrl.integrations; print('areal' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_areal_is_a_one_line_import_error() -> None:
    code = "import sys; sys.modules['areal'] = None\nimport steadyrl.integrations.areal"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: steadyrl.integrations.areal needs AReaL: pip install 'steadyrl[areal]' (")
