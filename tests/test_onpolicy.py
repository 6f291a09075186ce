"""GSM8K answer checking and on-policy preference pairs (tiny random Llama, CPU, no Hub)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.evaluation.gsm import extract_answer, is_correct
from pipeline.generation.generator import Generator
from pipeline.rl.onpolicy import build_pairs, on_policy_pairs
from pipeline.settings import ModelConfig
from pipeline.tiny.data import data_dir
from pipeline.tiny.model import build_tokenizer

TINY = {"seed": 0, "sft_examples": 50, "midtrain_examples": 10, "general_examples": 10, "pretrain_examples": 30,
        "test_examples": 5, "validation_examples": 5}


def test_extract_answer():
    assert extract_answer("She adds them up.\n#### 1,234") == "1234"
    assert extract_answer("#### -5.") == "-5"
    assert extract_answer("#### $12") is None  # strict-match: '$' right after the marker is no number
    assert extract_answer("the answer is 7") is None
    assert extract_answer("#### 3\nwait, no\n#### 4") == "4"


def test_is_correct():
    assert is_correct("x #### 72", "Natalia sold 48/2 = 24 clips...\n#### 72")
    assert is_correct("x #### 72.0", "72")
    assert is_correct("x #### 1,000", "1000")
    assert not is_correct("x #### 71", "72")
    assert not is_correct("no marker 72", "72")


def test_build_pairs():
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    answers = ["10", "Work...\n#### 20", "30"]
    samples = [["#### 9", "#### 10", "#### 11", "so #### 10"],  # mixed
               ["#### 20", "#### 20.0", "#### 20", "#### 20"],  # all correct
               ["nothing", "#### 31", "#### 29", "#### 3"]]  # all wrong
    pairs, stats = build_pairs(prompts, answers, samples)
    assert len(pairs) == 1
    pair = pairs[0]
    assert pair["prompt"] == prompts[0]
    assert pair["chosen"] == [{"role": "assistant", "content": "#### 10"}]
    assert pair["rejected"] == [{"role": "assistant", "content": "#### 9"}]
    for p in pairs:
        answer = answers[prompts.index(p["prompt"])]
        assert is_correct(p["chosen"][0]["content"], answer)
        assert not is_correct(p["rejected"][0]["content"], answer)
    assert stats == {"prompts": 3, "samples": 12, "correct_rate": 6 / 12, "pairs": 1, "all_correct": 1,
                     "all_wrong": 1, "reference_pairs": 0}
    assert stats["pairs"] + stats["all_correct"] + stats["all_wrong"] == stats["prompts"]
    pairs, stats = build_pairs(prompts, answers, samples, reference_chosen=True)  # the all-wrong prompt pairs too
    assert [p["prompt"] for p in pairs] == [prompts[0], prompts[2]] and stats["reference_pairs"] == 1
    assert pairs[1]["chosen"] == [{"role": "assistant", "content": "30"}]
    assert pairs[1]["rejected"] == [{"role": "assistant", "content": "nothing"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with the project's tiny tokenizer, saved to disk; plus the `rl` rows."""
    root = tmp_path_factory.mktemp("onpolicy")
    data = data_dir(root, TINY)
    tok = build_tokenizer(data, 300, root / "model")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(root / "model")
    rows = [json.loads(line) for line in open(data / "rl.jsonl", encoding="utf-8")][:3]
    return root / "model", model, tok, rows


def test_generator_samples_k_answers_per_prompt_seeded(tiny_model):
    _, model, tok, rows = tiny_model
    prompts = [r["prompt"] for r in rows]
    gen = Generator(tok, model, batch_size=2, seed=3)
    model.train()
    first = gen.generate(prompts, 8, k=2, temperature=1.0)
    assert len(first) == len(prompts)
    assert all(len(group) == 2 and all(isinstance(s, str) for s in group) for group in first)
    assert gen.generate(prompts, 8, k=2, temperature=1.0) == first
    assert tok.padding_side == "right" and model.training  # both restored after left-padded generation
    assert [len(group) for group in gen.generate(prompts, 8)] == [1] * len(prompts)  # greedy: one answer each


def test_on_policy_pairs(tiny_model):
    path, _, _, rows = tiny_model
    model_cfg = OmegaConf.structured(ModelConfig(name_or_path=str(path)))
    pairs, stats = on_policy_pairs(path, model_cfg, [r["prompt"] for r in rows], [r["answer"] for r in rows], k=2,
                                   max_new_tokens=8, temperature=1.0, batch_size=3, seed=0)
    assert stats["prompts"] == len(rows) and stats["samples"] == len(rows) * 2
    assert stats["pairs"] == len(pairs)
