"""steadyrl: reinforcement learning of language models on stale rollouts."""

__version__ = "0.1.0"
