"""The embedded tiny setup: GSM8K-style synthetic data, a local BPE tokenizer and a tiny Llama.

Everything is seeded and built locally (no Hub), cached under `<cache_dir>/tiny-<hash>/`:
`data/<split>.jsonl` for the splits below, `tokenizer/`, and `base/` (a tiny model pretrained
briefly on the synthetic corpus, so post-training starts from a model that has seen text).

Splits: `pretrain` (general text, problem statements, arithmetic facts), `sft` (chat problems
with worked answers), `reasoning` (harder worked problems, chat), `arithmetic` (worked `<<a+b=c>>` drills),
`general` (plain text),
`test` (held-out problems in GSM8K's columns `question`/`answer`, disjoint from all training
splits), `gsm_train` (the SFT problems in GSM8K's columns, for few-shot examples), `prefs`
(prompt/chosen/rejected) and `rl` (prompt/answer).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.files import atomic_dir, fingerprint

NAMES = ["Tom", "Mia", "Sam", "Ava", "Leo", "Zoe", "Max", "Ivy", "Ben", "Amy", "Dan", "Eva"]
ITEMS = ["apple", "book", "coin", "pen", "card", "shell", "stamp", "marble", "cookie", "flower"]
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit", "duck", "goat"]
ADJS = ["small", "happy", "quiet", "brown", "old", "quick", "lazy", "bright"]
PLACES = ["in the garden", "by the river", "near the house", "on the hill", "in the park"]
VERBS = ["sleeps", "runs", "sits", "plays", "waits", "eats", "walks", "looks around"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}{{- '\n' -}}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
DOC_SEP = "<|endoftext|>"
DATA_VERSION = 5  # bump when the generator changes, so caches are rebuilt
DATA_KEYS = ("seed", "sft_examples", "midtrain_examples", "general_examples", "pretrain_examples", "test_examples")


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


def build_splits(params: dict) -> dict[str, list[dict]]:
    """All synthetic splits for the given data parameters (deterministic in `params['seed']`)."""
    rng = random.Random(params["seed"])
    test, seen = [], set()
    while len(test) < params["test_examples"]:
        problem = make_problem(rng, rng.randint(1, 3))
        if problem["question"] not in seen:
            seen.add(problem["question"])
            test.append({"question": problem["question"], "answer": problem["answer"]})

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
    return {
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


def tiny_dir(cache_dir: Path, tiny: dict) -> Path:
    """The cache folder of this tiny setup (keyed by all tiny settings)."""
    return Path(cache_dir) / f"tiny-{fingerprint({**tiny, 'version': DATA_VERSION})}"


def data_dir(cache_dir: Path, tiny: dict) -> Path:
    """Write the synthetic splits (once) and return their folder."""
    params = {k: tiny[k] for k in DATA_KEYS}
    out = Path(cache_dir) / f"tiny-data-{fingerprint({**params, 'version': DATA_VERSION})}"
    if not out.is_dir():
        with atomic_dir(out) as tmp:
            for split, rows in build_splits(params).items():
                with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in rows)
    return out


def build_tokenizer(data: Path, vocab_size: int, out: Path) -> None:
    """Train a byte-level BPE tokenizer (digits split one by one) with a ChatML template into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def corpus():
        for split in ("pretrain", "sft", "general"):
            for line in open(data / f"{split}.jsonl", encoding="utf-8"):
                row = json.loads(line)
                yield row.get("text") or "\n".join(m["content"] for m in row["messages"])

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [DOC_SEP, "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token=DOC_SEP)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def ensure_base_model(cache_dir: Path, tiny: Any, model_cfg: Any, seed: int) -> Path:
    """The tiny base checkpoint, built once: tokenizer, random init, short causal-LM pretraining.

    The pretraining is the pipeline's own text-training path and runs collectively on all ranks;
    only the main process writes files.
    """
    from accelerate import PartialState
    from omegaconf import OmegaConf

    from pipeline.config import TrainConfig
    from pipeline.training import load_tokenizer, train

    params = OmegaConf.to_container(tiny)
    root = tiny_dir(cache_dir, params)
    if (root / "model").is_dir():
        return root / "model"
    init = root / "init"
    with PartialState().main_process_first():
        data = data_dir(cache_dir, params)
        if not init.is_dir():
            with atomic_dir(init) as tmp:
                build_tokenizer(data, tiny.vocab_size, tmp)
                _init_model(tmp, params)
    settings = OmegaConf.structured(TrainConfig(
        mixture="tiny pretrain", format="text", packing_strategy="wrapped", assistant_only_loss=False,
        activation_checkpointing=False, learning_rate=tiny.pretrain_learning_rate, lr_scheduler_type="cosine",
        warmup_ratio=0.05, max_grad_norm=1.0, max_steps=tiny.pretrain_steps, logging_steps=50,
        per_device_train_batch_size=tiny.pretrain_batch_size, max_length=tiny.pretrain_max_length,
        save_steps=tiny.pretrain_steps))
    rows = [json.loads(line) for line in open(data / "pretrain.jsonl", encoding="utf-8")]
    import datasets

    tok = load_tokenizer(init, model_cfg, need_template=False)
    metrics = train(settings, model_cfg, init, tok, datasets.Dataset.from_list(rows), root, seed, cache_dir)
    if PartialState().is_main_process:
        from pipeline.files import write_json

        write_json(root / "pretrain.json", metrics)
    return root / "model"


def _init_model(path: Path, tiny: dict) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=tiny["hidden_size"], num_hidden_layers=tiny["num_layers"],
        num_attention_heads=tiny["num_heads"], num_key_value_heads=tiny["num_heads"],
        intermediate_size=tiny["intermediate_size"], max_position_embeddings=tiny["max_position_embeddings"],
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(tiny["seed"])
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)

