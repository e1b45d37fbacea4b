"""Thin adapters that bring steadyrl's methods into other RL frameworks (docs/integrations.md).

Each framework has its own submodule, imported on demand: ``steadyrl.integrations.trl`` (TRL's ``GRPOTrainer``),
``.verl`` (verl's policy-loss and advantage registries), ``.openrlhf`` (a ``PolicyLoss`` module), ``.skyrl``
(SkyRL's ``PolicyLossRegistry`` / ``AdvantageEstimatorRegistry``) and ``.areal`` (a ``loss_fn`` for AReaL's
``TrainEngine.train_batch`` on packed inputs, and a ``PPOActor``). Importing ``steadyrl`` or this package imports no
framework; importing a submodule whose framework is missing raises an ``ImportError`` whose one line says what to
install.
"""

__all__: list[str] = []
