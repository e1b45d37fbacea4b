"""Baselines and advantages: what each response (or token) is credited with before a loss weighs it.

Modules: ``grpo`` (group-relative advantages, GRPO / Dr.GRPO / batch scaling, and the shared ``adv/`` metrics),
``opob`` (VCPO's off-policy optimal baseline), ``otb`` (optimal token baseline), ``vtrace`` (V-trace and COPC
token-level TD targets), ``vaco`` (VACO's one-step V-trace re-alignment of group advantages). Every result is
detached: advantages and value targets enter the losses as constants.
"""
