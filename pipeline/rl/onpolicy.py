"""On-policy preference pairs for verifiable tasks: sample k answers, pair a right with a wrong one (a verifier,
`pipeline.evaluation.verifiers`, scores them: 1 or more is right)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pipeline.evaluation import verifiers
from pipeline.generation import generator

Chat = list[dict]


def build_pairs(prompts: list[Chat], answers: list[str], samples: list[list[str]], reference_chosen: bool = False,
                verify: verifiers.Verifier = verifiers.gsm8k) -> tuple[list[dict], dict]:
    """One {prompt, chosen, rejected} pair per prompt with both a right and a wrong sample as `verify` scores them
    (with `reference_chosen`, a prompt with wrong samples only pairs its reference answer with one), plus stats."""
    pairs: list[dict] = []
    correct = all_correct = all_wrong = 0
    scores = iter(verify([s for group in samples for s in group],  # one call for every sample
                         [a for a, group in zip(answers, samples, strict=True) for _ in group]))
    for prompt, answer, group in zip(prompts, answers, samples, strict=True):
        judged = [(s, next(scores)) for s in group]
        right = [s for s, score in judged if score >= 1]
        wrong = [s for s, score in judged if score < 1]
        correct += len(right)
        all_correct += not wrong
        all_wrong += not right
        chosen = right[0] if right else answer if reference_chosen else None
        if chosen is not None and wrong:
            pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": wrong[0]}]})
    total = sum(len(g) for g in samples)
    stats = {"prompts": len(prompts), "samples": total, "correct_rate": correct / total if total else 0.0,
             "pairs": len(pairs), "all_correct": all_correct, "all_wrong": all_wrong,
             "reference_pairs": all_wrong if reference_chosen else 0}
    return pairs, stats


def on_policy_pairs(model_path: str | Path, model_cfg: Any, prompts: list[Chat], answers: list[str], k: int,
                    max_new_tokens: int, temperature: float, batch_size: int, seed: int,
                    backend: str = "hf", reference_chosen: bool = False,
                    reward: str = "gsm8k") -> tuple[list[dict], dict]:
    """Sample `k` answers per prompt from the model at `model_path` under its chat template as the stage trains it
    (`model.*` settings) with the one generator (`generator.load`: `hf` or `vllm`, its start counted in
    `sampling_s`), and build pairs, right and wrong as the verifier `reward` (`verifiers.load`) judges them."""
    started = time.perf_counter()
    with generator.load(model_path, model_cfg, backend, seed, batch_size=batch_size) as gen:
        samples = gen.generate(prompts, max_new_tokens, k, temperature)
        tokenizer = gen.tokenizer
    pairs, stats = build_pairs(prompts, answers, samples, reference_chosen, verifiers.load(reward, "on_policy.reward"))
    generated = sum(len(tokenizer(s, add_special_tokens=False).input_ids) for group in samples for s in group)
    return pairs, {**stats, "backend": backend, "generated_tokens": generated,
                   "sampling_s": round(time.perf_counter() - started, 2)}
