"""Policy objectives and per-sample filters: what the learner minimizes on a (possibly stale) batch.

Modules: ``ppo`` (PPO-clip with optional dual clip, the REINFORCE surrogate, GSPO's sequence-ratio clip), ``m2po``
(M2PO's second-moment token mask and its clip-narrowing rule), ``tic_grpo`` (trajectory-ratio clip), ``gmc_grpo``
(group-mass-capped trajectory weights), ``oapl`` (OAPL's squared-error objective, no importance ratio) and
``filters`` (VACO, COPC and ESTR keep masks that return ``Corrected``). Every loss returns ``LossOutput``; gradients
flow only through ``logp`` (π_θ), never through ``prox_logp`` or ``behav_logp``.
"""
