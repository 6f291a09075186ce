"""The tiny setup's data: GSM8K-style synthetic splits, seeded and generated locally (no Hub, no torch),
cached under `<cache_dir>/tiny-data-<hash>/<split>.jsonl`. Mixtures read them as `generator: tiny`.

Splits: `pretrain` (general text, problem statements, arithmetic facts), `sft` (chat problems
with worked answers), `reasoning` (harder worked problems, chat), `arithmetic` (worked `<<a+b=c>>` drills),
`general` (plain text), `test` and `validation` (held-out problems in GSM8K's columns `question` /
`answer`; tasks tiny_gsm and tiny_gsm_val),
`gsm_train` (the SFT problems in GSM8K's columns, for few-shot examples), `prefs` (prompt / chosen /
rejected) and `rl` (prompt / answer).

Held out means held out: a problem's arithmetic signature (start value, then each operation with its operand)
decides its split family by a hash: a tenth of all signatures is the test's, another tenth the validation's,
the rest training's. Test and validation problems therefore share no signature with each other or with any
training problem (names and items alone never make a problem new); every training split, the pretraining
text's problem statements included, draws only training signatures.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline import keys
from pipeline.data.chat import template_text
from pipeline.files import atomic_dir, fingerprint
from pipeline.fingerprints import fingerprint_view
from pipeline.runfolder import cache_dir
from pipeline.settings import ModelConfig
from pipeline.tiny.settings import TinyConfig

NAMES = ["Tom", "Mia", "Sam", "Ava", "Leo", "Zoe", "Max", "Ivy", "Ben", "Amy", "Dan", "Eva"]
ITEMS = ["apple", "book", "coin", "pen", "card", "shell", "stamp", "marble", "cookie", "flower"]
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit", "duck", "goat"]
ADJS = ["small", "happy", "quiet", "brown", "old", "quick", "lazy", "bright"]
PLACES = ["in the garden", "by the river", "near the house", "on the hill", "in the park"]
VERBS = ["sleeps", "runs", "sits", "plays", "waits", "eats", "walks", "looks around"]
DATA_VERSION = 6  # bump when the generator changes, so caches are rebuilt
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
    return {"question": question, "answer": "\n".join(work) + f"\n#### {value}", "result": value,
            "signature": signature(work)}


def signature(work: list[str]) -> str:
    """The arithmetic of a worked answer without its names and items: `4*2|8+3|11-5` (each step's expression)."""
    return "|".join(line.split("<<", 1)[1].split("=", 1)[0] for line in work)


def family(sig: str) -> str:
    """The split family of a signature: `test` (a tenth of them), `validation` (another tenth) or `train`."""
    bucket = int(hashlib.sha256(sig.encode()).hexdigest(), 16) % 10
    return {0: "test", 5: "validation"}.get(bucket, "train")


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


def draw(rng: random.Random, n: int, steps: Callable[[], int], split: str) -> list[dict]:
    """`n` distinct problems whose signatures belong to `split`'s family (`family`)."""
    out, questions = [], set()
    while len(out) < n:
        problem = make_problem(rng, steps())
        if family(problem["signature"]) == split and problem["question"] not in questions:
            questions.add(problem["question"])
            out.append(problem)
    return out


def _gsm(problems: list[dict]) -> list[dict]:
    return [{"question": p["question"], "answer": p["answer"]} for p in problems]


def build_splits(params: dict) -> dict[str, list[dict]]:
    """All synthetic splits for the given data parameters (deterministic in `params['seed']`); `test` and
    `validation` share no arithmetic signature with each other or with any training split (`family`)."""
    rng = random.Random(params["seed"])
    steps = lambda: rng.randint(1, 3)  # noqa: E731
    test = draw(rng, params["test_examples"], steps, "test")
    sft = draw(rng, params["sft_examples"], steps, "train")
    reasoning = draw(rng, params["midtrain_examples"], lambda: rng.randint(2, 3), "train")
    prefs = draw(rng, params["sft_examples"] // 4, steps, "train")
    rl = draw(rng, params["sft_examples"] // 4, steps, "train")
    pretrain = []
    for i in range(params["pretrain_examples"]):
        if i % 3 == 0:
            pretrain.append({"text": draw(rng, 1, steps, "train")[0]["question"]})
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
        "test": _gsm(test),
        "gsm_train": _gsm(sft),
        "prefs": [{"prompt": [{"role": "user", "content": p["question"]}],
                   "chosen": [{"role": "assistant", "content": p["answer"]}],
                   "rejected": [{"role": "assistant", "content": wrong_answer(rng, p)}]} for p in prefs],
        "rl": [{"prompt": [{"role": "user", "content": p["question"]}], "answer": str(p["result"])} for p in rl],
    }
    return {**splits, "validation": _gsm(draw(rng, params["validation_examples"], steps, "validation"))}


def tiny_key(tiny: dict, model_cfg: Any, seed: int) -> dict:
    """What the tiny base model depends on (`pipeline.keys`' rule): every tiny setting, the `model.*` settings its
    pretraining runs with (precision, dtype, attention kernel, the chat template's text), the training seed and the
    versions of the libraries that train it."""
    model = fingerprint_view(OmegaConf.to_container(model_cfg) if isinstance(model_cfg, DictConfig) else
                             dict(model_cfg), ModelConfig)
    loader = {k: v for k, v in model.items() if k not in ("name_or_path", "tokenizer", "chat_template", "revision")}
    if model.get("chat_template"):
        loader["chat_template"] = hashlib.sha256(template_text(model["chat_template"]).encode()).hexdigest()
    return {**fingerprint_view(tiny, TinyConfig), "version": DATA_VERSION, "pretrain_seed": seed, "model": loader,
            "libraries": keys.versions(keys.TRAINING)}


def tiny_dir(cache: Path, tiny: dict, model_cfg: Any, seed: int) -> Path:
    """The cache folder of this tiny setup's tokenizer and model, keyed by `tiny_key`."""
    return Path(cache) / f"tiny-{keys.key(tiny_key(tiny, model_cfg, seed))}"


def data_dir(cache: Path, tiny: dict, build: bool = True) -> Path:
    """Write the synthetic splits (once; not when `build` is false: a plan writes nothing) and return their folder."""
    params = {k: tiny[k] for k in DATA_KEYS}
    out = Path(cache) / f"tiny-data-{fingerprint({**params, 'version': DATA_VERSION})}"
    if build and not out.is_dir():
        with atomic_dir(out, first_wins=True) as tmp:  # any rank, any run: the first complete one is kept
            for split, rows in build_splits(params).items():
                with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in rows)
    return out


def split_file(cfg: DictConfig, split: str) -> Path:
    """The `generator: tiny` data source: the file of `split` for this run's tiny settings (generated once, but by a
    plan)."""
    return data_dir(cache_dir(cfg), OmegaConf.to_container(cfg.tiny), build=not cfg.plan.enabled) / f"{split}.jsonl"
