"""On-policy preference pairs for verifiable (GSM8K-style) tasks: sample k answers, pair a right with a wrong one."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.gsm import is_correct

Chat = list[dict]


def sample_answers(model: Any, tokenizer: Any, prompts: list[Chat], k: int, max_new_tokens: int,
                   temperature: float, batch_size: int, seed: int) -> list[list[str]]:
    """For each chat prompt, `k` sampled completions (new tokens only, special tokens skipped)."""
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    model.eval()
    torch.manual_seed(seed)
    out: list[list[str]] = []
    try:
        with torch.no_grad():
            for start in range(0, len(texts), batch_size):
                enc = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(model.device)
                gen = model.generate(**enc, do_sample=True, temperature=temperature, num_return_sequences=k,
                                     max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     eos_token_id=tokenizer.eos_token_id)
                decoded = tokenizer.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                out.extend(decoded[i:i + k] for i in range(0, len(decoded), k))
    finally:
        tokenizer.padding_side = side
    return out


def build_pairs(prompts: list[Chat], answers: list[str], samples: list[list[str]]) -> tuple[list[dict], dict]:
    """One {prompt, chosen, rejected} pair per prompt with both a correct and a wrong sample, plus stats."""
    pairs: list[dict] = []
    correct = all_correct = all_wrong = 0
    for prompt, answer, group in zip(prompts, answers, samples, strict=True):
        right = [s for s in group if is_correct(s, answer)]
        wrong = [s for s in group if not is_correct(s, answer)]
        correct += len(right)
        all_correct += not wrong
        all_wrong += not right
        if right and wrong:
            pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": right[0]}],
                          "rejected": [{"role": "assistant", "content": wrong[0]}]})
    total = sum(len(g) for g in samples)
    stats = {"prompts": len(prompts), "samples": total, "correct_rate": correct / total if total else 0.0,
             "pairs": len(pairs), "all_correct": all_correct, "all_wrong": all_wrong}
    return pairs, stats


def on_policy_pairs(model_path: str | Path, prompts: list[Chat], answers: list[str], k: int, max_new_tokens: int,
                    temperature: float, batch_size: int, seed: int) -> tuple[list[dict], dict]:
    """Load the model at `model_path` (bf16 on capable GPUs, fp32 otherwise), sample and build pairs."""
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    if cuda:
        model.to("cuda")
    started = time.perf_counter()
    samples = sample_answers(model, tokenizer, prompts, k, max_new_tokens, temperature, batch_size, seed)
    pairs, stats = build_pairs(prompts, answers, samples)
    return pairs, {**stats, "sampling_s": round(time.perf_counter() - started, 2)}
