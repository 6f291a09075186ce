"""Held-out scoring for RL stages: the mean `#### N` reward (`verifiers.gsm8k`) of greedy answers to held-out
problems (those the recipe's extension ships, GSM8K-style; none otherwise)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from pipeline.evaluation.verifiers import gsm8k
from pipeline.extension import heldout_problems
from pipeline.generation.generator import Generator
from pipeline.rl.rewards import as_chat


def heldout_rows(cfg: DictConfig) -> list[dict]:
    """The held-out problems as {prompt (chat), answer}; empty when the recipe's extension ships none."""
    return [{"prompt": as_chat(r["question"]), "answer": r["answer"]} for r in heldout_problems(cfg)]


def greedy_reward(model: Any, tok: Any, rows: list[dict], max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean verifiable reward (exact `#### N` match) of greedy answers to `rows`; NaN without rows."""
    if not rows:
        return float("nan")
    outs = Generator(tok, model, batch_size=batch_size).generate([r["prompt"] for r in rows], max_new_tokens)
    return sum(gsm8k([o[0] for o in outs], [r["answer"] for r in rows])) / len(rows)
