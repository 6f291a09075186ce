"""Data exactly as published: Hub-shaped fixtures read through the recipes' own `hub:` path (`hub_mirror`),
and every prompt / chosen / rejected form brought to a form TRL accepts (DPO training, prompt-only sampling)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
from conftest import ROOT
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl.data_utils import apply_chat_template, is_conversational, maybe_apply_chat_template

from pipeline.config import load_config
from pipeline.data.mixtures import fingerprints, hub_source, load_mixture, normalise
from pipeline.generation.generator import Generator
from pipeline.keys import path_digest

FIXTURES = ROOT / "tests" / "fixtures" / "hub"
MESSAGES = datasets.List({"content": datasets.Value("string"), "role": datasets.Value("string")})
KWARGS = ("custom_instructions", "enable_thinking", "python_tools", "xml_tools")


def _cfg(tmp_path: Path):
    return load_config(["recipe=smol", f"hub_mirror={FIXTURES}", f"output_root={tmp_path}"])


def _mixture(tmp_path: Path, sources: list[dict]) -> str:
    path = tmp_path / f"mix{len(list(tmp_path.glob('mix*')))}.yaml"
    path.write_text(OmegaConf.to_yaml({"sources": sources}))
    return str(path)


def _is_chat(value, roles: set[str]) -> bool:
    return isinstance(value, list) and {m["role"] for m in value} <= roles and all(m["content"] for m in value)


def test_fixtures_have_the_published_columns_and_types(tmp_path):
    cfg = _cfg(tmp_path)
    pref = datasets.load_dataset(**hub_source("HuggingFaceTB/smoltalk2", "Preference", [], cfg),
                                 split="llama_3.1_tulu_3_8b_preference_mixture_no_think")
    assert list(pref.features) == ["chosen", "rejected", "prompt", "chat_template_kwargs", "source"]
    assert pref.features["chosen"] == pref.features["rejected"] == MESSAGES
    assert pref.features["prompt"] == datasets.Value("string")
    assert list(pref.features["chat_template_kwargs"]) == list(KWARGS) and pref[0]["chat_template_kwargs"][
        "xml_tools"] is None
    sft = datasets.load_dataset(**hub_source("HuggingFaceTB/smoltalk2", "SFT", [], cfg), split="s1k_1.1_think")
    assert list(sft.features) == ["messages", "chat_template_kwargs", "source"] and sft.features["messages"] == MESSAGES
    gsm = datasets.load_dataset(**hub_source("openai/gsm8k", "main", [], cfg), split="test")
    assert gsm.features == datasets.Features(question=datasets.Value("string"), answer=datasets.Value("string"))


@pytest.mark.slow
def test_recipe_mixtures_load_from_the_mirror(tmp_path):
    cfg = _cfg(tmp_path)
    sft = load_mixture("smol_sft", cfg)
    assert sorted(sft.column_names) == ["chat_template_kwargs", "messages"]  # `source` dropped
    assert all(_is_chat(r["messages"], {"user", "assistant"}) and r["messages"][-1]["role"] == "assistant"
               for r in sft)
    assert {tuple(r["chat_template_kwargs"]) for r in sft} == {KWARGS}
    assert {r["chat_template_kwargs"]["enable_thinking"] for r in sft} == {True, False}
    mid = load_mixture("smol_mid", cfg)
    assert mid.column_names == ["messages"] and len(mid) == 4
    pref = load_mixture("smol_pref", cfg)
    for row in pref:
        assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]
        assert len(row["chosen"]) == len(row["rejected"]) == 1 and row["chosen"][0]["role"] == "assistant"
    rl = load_mixture("gsm8k_rl", cfg)
    assert len(rl) == 8 and all(_is_chat(r["prompt"], {"user"}) and "####" in r["answer"] for r in rl)
    zen = {"hub": "trl-internal-testing/zen", "split": "train"}
    both = load_mixture(_mixture(tmp_path, [{**zen, "name": "standard_prompt_only"},
                                            {**zen, "name": "conversational_prompt_only"}]), cfg)
    assert len(both) == 6 and all(_is_chat(r["prompt"], {"user"}) for r in both)
    fps = fingerprints("smol_pref", cfg)
    copy = path_digest(FIXTURES / "HuggingFaceTB" / "smoltalk2")  # the mirror's copy by its contents, not its place
    assert [fp["mirror"] for fp in fps] == [copy] * 2 and fps[0]["name"] == "Preference"


Q, S, GOOD, BAD = "What is 2 + 3?", "Answer briefly.", "2 + 3 = 5", "2 + 3 = 6"
PROMPTS = {"string": Q, "messages": [{"role": "user", "content": Q}], "absent": None}


def _reply(form: str, text: str):
    user, answer = {"role": "user", "content": Q}, {"role": "assistant", "content": text}
    return {"string": text, "answer turns": [answer], "whole conversation": [user, answer],
            "with system": [{"role": "system", "content": S}, user, answer]}[form]


FORMS = [(p, c, r) for p in PROMPTS for c in ("string", "answer turns", "whole conversation", "with system")
         for r in ("string", "answer turns", "whole conversation", "with system")
         if p != "absent" or (c == r and c in ("whole conversation", "with system"))]


def _row(form: tuple[str, str, str]) -> dict:
    prompt, chosen, rejected = form
    row = {"chosen": _reply(chosen, GOOD), "rejected": _reply(rejected, BAD)}
    return row if PROMPTS[prompt] is None else {"prompt": PROMPTS[prompt], **row}


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS, ids=["/".join(f) for f in FORMS])
def test_every_preference_form_becomes_trl_conversational(form, tiny_base):
    row = normalise(_row(form), {}, "x")
    system = [{"role": "system", "content": S}] if "with system" in form else []
    assert row == {"prompt": [*system, {"role": "user", "content": Q}],
                   "chosen": [{"role": "assistant", "content": GOOD}],
                   "rejected": [{"role": "assistant", "content": BAD}]}
    assert all(is_conversational({key: row[key]}) for key in row)  # every key: TRL inspects any one of them
    text = apply_chat_template(row, AutoTokenizer.from_pretrained(tiny_base))
    assert text["prompt"].endswith(f"{Q}<|im_end|>\n<|im_start|>assistant\n")
    assert text["chosen"].startswith(GOOD) and text["rejected"].startswith(BAD)


def _dpo_step(model_dir: Path, data, out: Path) -> float:
    args = DPOConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, max_length=128,
                     report_to="none", use_cpu=True, save_strategy="no", logging_steps=1)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=data,
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    return trainer.train().training_loss


@pytest.mark.slow
def test_dpo_trains_on_every_form_and_on_smoltalk2_preference_rows(tmp_path, tiny_base):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps(_row(f)) + "\n" for f in FORMS))
    mixed = load_mixture(_mixture(tmp_path, [{"path": str(rows)}]), _cfg(tmp_path))
    assert len(mixed) == len(FORMS)
    assert math.isfinite(_dpo_step(tiny_base, mixed, tmp_path / "forms"))
    published = load_mixture("smol_pref", _cfg(tmp_path))  # string prompt, whole conversations, template kwargs
    assert math.isfinite(_dpo_step(tiny_base, published, tmp_path / "smoltalk2"))


@pytest.mark.slow
def test_prompt_only_rows_reach_sampling_and_trl_as_chats(tmp_path, tiny_base):
    cfg = _cfg(tmp_path)
    string_prompts = load_mixture("gsm8k_rl", cfg)  # the question, a string in the published data
    conversations = load_mixture(_mixture(tmp_path, [{"hub": "trl-internal-testing/zen", "split": "train",
                                                      "name": "conversational_prompt_only"}]), cfg)
    tok = AutoTokenizer.from_pretrained(tiny_base)
    model = AutoModelForCausalLM.from_pretrained(tiny_base)
    for data in (string_prompts, conversations):
        prompts = list(data["prompt"])
        rendered = [maybe_apply_chat_template({"prompt": p}, tok)["prompt"] for p in prompts]  # GRPO's rendering
        assert all(r.startswith("<|im_start|>user\n") and r.endswith("<|im_start|>assistant\n") for r in rendered)
        samples = Generator(tok, model, batch_size=4, seed=0).generate(prompts, 3, k=2, temperature=1.0)
        assert [len(s) for s in samples] == [2] * len(prompts)
