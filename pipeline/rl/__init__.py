"""Reinforcement learning and rewards: the actor-critic PPO loop (`actor_critic`), sequence rewards (`rewards`),
held-out scoring (`heldout`) and DPO's on-policy pairs judged by a verifier (`onpolicy`); they generate through
`pipeline.generation.generator`."""
