"""On-policy preference pairs for verifiable (GSM8K-style) tasks: sample k answers, pair a right with a wrong one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pipeline.evaluation.gsm import is_correct
from pipeline.generation import engines
from pipeline.generation.generate import generate
from pipeline.train.models import load_model, load_tokenizer
from pipeline.train.precision import inference_dtype

Chat = list[dict]


def sample_answers(model: Any, tokenizer: Any, prompts: list[Chat], k: int, max_new_tokens: int,
                   temperature: float, batch_size: int, seed: int) -> list[list[str]]:
    """For each chat prompt, `k` sampled completions (new tokens only, special tokens skipped)."""
    torch.manual_seed(seed)
    return generate(model, tokenizer, prompts, batch_size, max_new_tokens, k=k, do_sample=True,
                    temperature=temperature)


def build_pairs(prompts: list[Chat], answers: list[str], samples: list[list[str]],
                reference_chosen: bool = False) -> tuple[list[dict], dict]:
    """One {prompt, chosen, rejected} pair per prompt with both a correct and a wrong sample (with
    `reference_chosen`, a prompt with wrong samples only pairs its reference answer with one), plus stats."""
    pairs: list[dict] = []
    correct = all_correct = all_wrong = 0
    for prompt, answer, group in zip(prompts, answers, samples, strict=True):
        right = [s for s in group if is_correct(s, answer)]
        wrong = [s for s in group if not is_correct(s, answer)]
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
                    backend: str = "hf", reference_chosen: bool = False) -> tuple[list[dict], dict]:
    """Sample from the model at `model_path` under its chat template as the stage trains it (`model.*` settings)
    and build pairs. `hf`: the model loaded in `model.precision`'s inference dtype; `vllm`: a vLLM engine (its
    start counted in `sampling_s`)."""
    tokenizer = load_tokenizer(model_path, model_cfg)
    started = time.perf_counter()
    if backend == "vllm":
        with engines.engine(model_path, seed) as llm:
            samples = engines.sample(llm, prompts, k, max_new_tokens, temperature, tokenizer.chat_template)
    else:
        model = load_model(model_path, model_cfg, dtype=inference_dtype(model_cfg.precision))
        if torch.cuda.is_available():
            model.to("cuda")
        samples = sample_answers(model, tokenizer, prompts, k, max_new_tokens, temperature, batch_size, seed)
    pairs, stats = build_pairs(prompts, answers, samples, reference_chosen)
    generated = sum(len(tokenizer(s, add_special_tokens=False).input_ids) for group in samples for s in group)
    return pairs, {**stats, "backend": backend, "generated_tokens": generated,
                   "sampling_s": round(time.perf_counter() - started, 2)}
