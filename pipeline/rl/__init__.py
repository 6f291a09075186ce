"""Reinforcement learning and sampling: the actor-critic PPO loop (`actor_critic`), sequence rewards
(`rewards`), left-padded batched generation (`generation`), held-out scoring (`heldout`) and on-policy
preference pairs for DPO (`onpolicy`)."""
