"""Reinforcement learning: the actor-critic PPO loop (`actor_critic`), sequence rewards (`rewards`) and held-out
scoring (`heldout`); they generate through `pipeline.generation.generator`."""
