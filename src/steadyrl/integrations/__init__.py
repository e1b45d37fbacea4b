"""Thin adapters that bring steadyrl's methods into other RL frameworks (docs/integrations.md).

Each framework has its own submodule, imported on demand: ``steadyrl.integrations.trl`` (TRL's ``GRPOTrainer``).
Importing ``steadyrl`` or this package imports no framework; importing a submodule whose framework is missing raises
an ``ImportError`` whose one line says what to install. verl, SkyRL, AReaL and OpenRLHF are not done yet.
"""

__all__: list[str] = []
