"""A lag-k RL loop of one's own around ``steadyrl.compute_loss``: any method by name, controllers, gradient norms.

The sampler runs the policy of ``--lag`` optimizer steps ago (a ring of weight snapshots), as an asynchronous trainer
would; the learner scores the sampled tokens with the current policy and takes one step of the method's loss. The
task: prompts ``a+b=`` (one digit each), reward 1 when the first answer character is the last digit of a+b, 0.2 for
any other digit. The policy is steadyrl's embedded tiny Llama (random init; needs ``pip install 'steadyrl[train]'``
for transformers); everything else is the core: ``compute_loss``, ``control.build_controllers``,
``per_trajectory_grad_sq_norms``.

    python examples/lag_loop.py --method vcpo --lag 4
    python examples/lag_loop.py --method seq_tis+gac --lag 16
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import time

import torch
import torch.nn.functional as F

import steadyrl
from steadyrl.core.objectives.score_centering import centering_term
from steadyrl.methods import required_inputs
from steadyrl.models import TinyArchConfig, build_char_tokenizer, build_tiny_model

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--method", default="vcpo", help="a preset or composition (steadyrl methods lists them)")
p.add_argument("--lag", type=int, default=4, help="the sampler's policy is this many optimizer steps old")
p.add_argument("--steps", type=int, default=150)
p.add_argument("--prompts", type=int, default=16, help="prompts per step")
p.add_argument("--group", type=int, default=8, help="responses per prompt (G)")
p.add_argument("--tokens", type=int, default=3, help="response tokens (T)")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
torch.manual_seed(args.seed)
torch.set_num_threads(1)  # matrices this small run fastest on one thread (more threads only contend)

spec = steadyrl.resolve_method(args.method)  # unknown names fail here, with a suggestion
need = set(required_inputs(spec))
if "values" in need:
    raise SystemExit(f"{args.method} needs critic values (batch key 'values'): `steadyrl train method=copc` has one")
controllers = steadyrl.control.build_controllers(spec)  # e.g. VCPO's ESS-scaled step size, GAC
tok = build_char_tokenizer()
model = build_tiny_model(TinyArchConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
                         tokenizer=tok, seed=args.seed)  # fmt: skip
sampler = copy.deepcopy(model).eval()  # runs the lagged weights
ref = copy.deepcopy(model).eval().requires_grad_(False)  # a frozen reference for the KL presets
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
params = list(model.parameters())
snapshots: collections.deque = collections.deque(maxlen=args.lag + 1)  # (version, weights) of the last lag+1 steps
digits = torch.tensor([tok.convert_tokens_to_ids(str(d)) for d in range(10)])


def response_logits(m: torch.nn.Module, ids: torch.Tensor, P: int) -> torch.Tensor:
    """Logits at the positions that predict the response tokens ids[:, P:] (prompts all have length P)."""
    return m(input_ids=ids).logits[:, P - 1 : -1].float()


def token_logp(m: torch.nn.Module, ids: torch.Tensor, P: int) -> torch.Tensor:
    """log π(y_t) [B, T] of the response tokens ids[:, P:] under ``m``, with gradient."""
    return F.log_softmax(response_logits(m, ids, P), -1).gather(-1, ids[:, P:, None]).squeeze(-1)


def sample(prompts: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """T tokens from the sampler: ids [B, P+T], their log μ [B, T], the entropy of μ at each step [B, T] and μ's
    log-probs over the vocabulary [B, T, V] (score centering)."""
    ids, logps, ents, dists = prompts, [], [], []
    with torch.no_grad():
        for _ in range(T):
            logprobs = F.log_softmax(sampler(input_ids=ids).logits[:, -1].float(), dim=-1)
            nxt = torch.multinomial(logprobs.exp(), 1)
            ids = torch.cat([ids, nxt], dim=1)
            logps.append(logprobs.gather(1, nxt).squeeze(1))
            ents.append(-(logprobs.exp() * logprobs).sum(-1))
            dists.append(logprobs)
    return ids, torch.stack(logps, 1), torch.stack(ents, 1), torch.stack(dists, 1)


start = time.time()
for step in range(args.steps):
    snapshots.append((step, copy.deepcopy(model.state_dict())))
    behav_version, weights = snapshots[0]  # the oldest kept: `lag` steps old once the ring is full
    sampler.load_state_dict(weights)

    a, b = torch.randint(0, 10, (2, args.prompts))
    texts = [f"{x}+{y}=" for x, y in zip(a.tolist(), b.tolist(), strict=True)]
    prompts = tok(texts, return_tensors="pt").input_ids.repeat_interleave(args.group, 0)  # [B, P], G per prompt
    P, B, T = prompts.shape[1], prompts.shape[0], args.tokens
    ids, behav_logp, behav_entropy, behav_dist = sample(prompts, T)
    first = ids[:, P]
    answer = digits[((a + b) % 10).repeat_interleave(args.group)]
    rewards = torch.where(first == answer, 1.0, torch.where(torch.isin(first, digits), 0.2, 0.0))
    mask = torch.ones(B, T, dtype=torch.bool)
    logp_fn = functools.partial(token_logp, ids=ids, P=P)  # model ↦ log π(y_t) [B, T]: compute_loss's `logp`

    batch = {
        "behav_logp": behav_logp, "mask": mask, "rewards": rewards,
        "group_ids": torch.arange(args.prompts).repeat_interleave(args.group),
        "versions": torch.full((B, T), behav_version), "learner_version": step,
    }  # fmt: skip
    if "grad_sq_norms" in need:  # VCPO / OPOB: ‖∇θ Σ_t log π(y_i,t)‖² per trajectory (one forward + one backward)
        batch["grad_sq_norms"] = steadyrl.per_trajectory_grad_sq_norms(model, logp_fn, mask)
    if "ref_logp" in need:
        with torch.no_grad():
            batch["ref_logp"] = logp_fn(ref)
    if "behav_entropy" in need:
        batch["behav_entropy"] = behav_entropy
    if "sum_p2" in need:  # OTB: Σ_v π(v)² of the current policy at each token
        with torch.no_grad():
            batch["sum_p2"] = F.softmax(response_logits(model, ids, P), -1).square().sum(-1)
    if "centering" in need:  # score centering: Σ_v sg(μ_v w_v) log π_θ(v), exact form on μ's full distribution
        log_pi = F.log_softmax(response_logits(model, ids, P), -1).reshape(B * T, -1)  # with gradient
        term = centering_term(behav_logp=behav_dist.reshape(B * T, -1), head_ids=None, weight=spec.objective.weight)
        batch["centering"] = term(log_pi, torch.arange(B * T)).reshape(B, T)
    if "entropy" in need:  # an entropy bonus: H(π_θ) at each token, with gradient
        log_pi = F.log_softmax(response_logits(model, ids, P), -1)
        batch["entropy"] = -(log_pi.exp() * log_pi).sum(-1)
    batch |= steadyrl.control.loss_inputs(controllers, device=mask.device)  # e.g. the adaptive entropy coefficient
    batch["logp"] = logp_fn(model)
    if "prox_logp" in need:  # one update per batch: the proximal policy is the current one
        batch["prox_logp"] = batch["logp"].detach()

    loss, metrics = steadyrl.compute_loss(spec, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    control: dict[str, torch.Tensor] = {}
    for c in controllers:  # may rescale the step size or the gradient, or ask to skip the step
        control |= c.before_step(optimizer=opt, params=params, metrics=metrics)
    if float(control.get("control/skip_step", 0)) == 0:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    for c in controllers:
        c.after_step(optimizer=opt)

    if step % 10 == 0 or step == args.steps - 1:
        extra = "".join(f"  {k} {float(v):.3f}" for k, v in control.items())
        print(f"step {step:3d}  lag {step - behav_version}  reward {rewards.mean():.3f}  loss {loss.item():+.4f}"
              f"  is/ess_ratio {float(metrics['is/ess_ratio']):.3f}{extra}  ({time.time() - start:.0f} s)")  # fmt: skip
