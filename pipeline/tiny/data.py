"""The tiny setup's data: GSM8K-style synthetic splits, seeded and generated locally (no Hub, no torch),
cached under `<cache_dir>/tiny-data-<hash>/<split>.jsonl`. Mixtures read them as `generator: tiny`.

Splits: `pretrain` (general text, problem statements, arithmetic facts), `sft` (chat problems
with worked answers), `reasoning` (harder worked problems, chat), `arithmetic` (worked `<<a+b=c>>` drills),
`general` (plain text), `test` and `validation` (held-out problems in GSM8K's columns `question` /
`answer`, disjoint from each other and from all training splits; tasks tiny_gsm and tiny_gsm_val),
`gsm_train` (the SFT problems in GSM8K's columns, for few-shot examples), `prefs` (prompt / chosen /
rejected) and `rl` (prompt / answer).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.config import cache_dir, fingerprint_view
from pipeline.files import atomic_dir, fingerprint
from pipeline.tiny.settings import TinyConfig

NAMES = ["Tom", "Mia", "Sam", "Ava", "Leo", "Zoe", "Max", "Ivy", "Ben", "Amy", "Dan", "Eva"]
ITEMS = ["apple", "book", "coin", "pen", "card", "shell", "stamp", "marble", "cookie", "flower"]
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit", "duck", "goat"]
ADJS = ["small", "happy", "quiet", "brown", "old", "quick", "lazy", "bright"]
PLACES = ["in the garden", "by the river", "near the house", "on the hill", "in the park"]
VERBS = ["sleeps", "runs", "sits", "plays", "waits", "eats", "walks", "looks around"]
DATA_VERSION = 5  # bump when the generator changes, so caches are rebuilt
DATA_KEYS = ("seed", "sft_examples", "midtrain_examples", "general_examples", "pretrain_examples", "test_examples",
             "validation_examples")


def make_problem(rng: random.Random, steps: int) -> dict:
    """One GSM8K-style word problem with `steps` arithmetic steps, `<<a+b=c>>` notes and `#### N`."""
    name, friend = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    value = rng.randint(2, 9)
    story, work = [f"{name} has {value} {item}s."], []
    for _ in range(steps):
        op = rng.choice("+-*") if value <= 9 else rng.choice("+-")
        if op == "+":
            b = rng.randint(1, 6)
            story.append(f"Then {name} gets {b} more {item}s.")
            expr, new = f"{value}+{b}", value + b
        elif op == "-" and value > 1:
            b = rng.randint(1, min(value - 1, 6))
            story.append(f"Then {name} gives {b} {item}s to {friend}.")
            expr, new = f"{value}-{b}", value - b
        else:
            b = rng.randint(2, 3) if value <= 6 else 2
            story.append(f"Then the number of {item}s {name} has becomes {b} times as large.")
            expr, new = f"{value}*{b}", value * b
        work.append(f"{name} has {expr} = <<{expr}={new}>>{new} {item}s.")
        value = new
    question = " ".join(story) + f" How many {item}s does {name} have now?"
    return {"question": question, "answer": "\n".join(work) + f"\n#### {value}", "result": value}


def wrong_answer(rng: random.Random, problem: dict) -> str:
    """The problem's worked answer with the final result (and last step) off by a small amount."""
    lines = problem["answer"].split("\n")
    bad = problem["result"] + rng.choice([-3, -2, -1, 1, 2, 3])
    last = lines[-2].rsplit(">>", 1)[0].rsplit("=", 1)[0]
    lines[-2] = f"{last}={bad}>>{bad} " + lines[-2].rsplit(" ", 1)[1]
    lines[-1] = f"#### {bad}"
    return "\n".join(lines)


def arithmetic_drill(rng: random.Random, n: int = 8) -> str:
    """`n` worked arithmetic facts in GSM8K's `<<a+b=c>>c` annotation, over the problems' ranges."""
    facts = []
    for _ in range(n):
        op = rng.choice("+-*")
        a = rng.randint(1, 12) if op == "*" else rng.randint(1, 45)
        b = rng.randint(2, 3) if op == "*" else rng.randint(1, min(9, a) if op == "-" else 9)
        c = a + b if op == "+" else a - b if op == "-" else a * b
        facts.append(f"{a}{op}{b} = <<{a}{op}{b}={c}>>{c}.")
    return " ".join(facts)


def general_text(rng: random.Random) -> str:
    """A few plain sentences of general (non-reasoning) text."""
    sentences = []
    for _ in range(rng.randint(3, 6)):
        animal, adj = rng.choice(ANIMALS), rng.choice(ADJS)
        sentences.append(f"The {adj} {animal} {rng.choice(VERBS)} {rng.choice(PLACES)}.")
    return " ".join(sentences)


def _chat(problem: dict) -> dict:
    return {"messages": [{"role": "user", "content": problem["question"]},
                         {"role": "assistant", "content": problem["answer"]}]}


def _held_out(rng: random.Random, n: int, seen: set[str]) -> list[dict]:
    """`n` new problems in GSM8K's columns, none of whose questions is in `seen` (which they join)."""
    out = []
    while len(out) < n:
        problem = make_problem(rng, rng.randint(1, 3))
        if problem["question"] not in seen:
            seen.add(problem["question"])
            out.append({"question": problem["question"], "answer": problem["answer"]})
    return out


def build_splits(params: dict) -> dict[str, list[dict]]:
    """All synthetic splits for the given data parameters (deterministic in `params['seed']`).

    `test` is drawn first and `validation` last, each disjoint from every other split's problems.
    """
    rng = random.Random(params["seed"])
    seen: set[str] = set()
    test = _held_out(rng, params["test_examples"], seen)

    def fresh(n: int, steps: Callable[[], int]) -> list[dict]:
        out = []
        while len(out) < n:
            problem = make_problem(rng, steps())
            if problem["question"] not in seen:
                out.append(problem)
        return out

    sft = fresh(params["sft_examples"], lambda: rng.randint(1, 3))
    reasoning = fresh(params["midtrain_examples"], lambda: rng.randint(2, 3))
    prefs = fresh(params["sft_examples"] // 4, lambda: rng.randint(1, 3))
    rl = fresh(params["sft_examples"] // 4, lambda: rng.randint(1, 3))
    pretrain = []
    for i in range(params["pretrain_examples"]):
        if i % 3 == 0:
            pretrain.append({"text": fresh(1, lambda: rng.randint(1, 3))[0]["question"]})
        elif i % 3 == 1:
            a, b, k = rng.randint(0, 40), rng.randint(0, 9), rng.randint(2, 3)
            pretrain.append({"text": f"{a}+{b}={a + b}. {a + b}-{b}={a}. {b}*{k}={b * k}."})
        else:
            pretrain.append({"text": general_text(rng)})
    splits = {
        "pretrain": pretrain,
        "sft": [_chat(p) for p in sft],
        "reasoning": [_chat(p) for p in reasoning],
        "general": [{"text": general_text(rng)} for _ in range(params["general_examples"])],
        "arithmetic": [{"text": arithmetic_drill(rng)} for _ in range(params["midtrain_examples"])],
        "test": test,
        "gsm_train": [{"question": p["question"], "answer": p["answer"]} for p in sft],
        "prefs": [{"prompt": [{"role": "user", "content": p["question"]}],
                   "chosen": [{"role": "assistant", "content": p["answer"]}],
                   "rejected": [{"role": "assistant", "content": wrong_answer(rng, p)}]} for p in prefs],
        "rl": [{"prompt": [{"role": "user", "content": p["question"]}], "answer": str(p["result"])} for p in rl],
    }
    seen |= {p["question"] for p in sft + reasoning + prefs + rl} | {row["text"] for row in pretrain}
    return {**splits, "validation": _held_out(rng, params["validation_examples"], seen)}


def tiny_dir(cache: Path, tiny: dict, seed: int) -> Path:
    """The cache folder of this tiny setup's tokenizer and model, keyed by all tiny settings and the training
    seed its pretraining ran with."""
    key = {**fingerprint_view(tiny, TinyConfig), "version": DATA_VERSION, "pretrain_seed": seed}
    return Path(cache) / f"tiny-{fingerprint(key)}"


def data_dir(cache: Path, tiny: dict) -> Path:
    """Write the synthetic splits (once) and return their folder."""
    params = {k: tiny[k] for k in DATA_KEYS}
    out = Path(cache) / f"tiny-data-{fingerprint({**params, 'version': DATA_VERSION})}"
    if not out.is_dir():
        with atomic_dir(out, first_wins=True) as tmp:  # any rank, any run: the first complete one is kept
            for split, rows in build_splits(params).items():
                with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in rows)
    return out


def split_file(cfg: DictConfig, split: str) -> Path:
    """The `generator: tiny` data source: the file of `split` for this run's tiny settings (generated once)."""
    return data_dir(cache_dir(cfg), OmegaConf.to_container(cfg.tiny)) / f"{split}.jsonl"
