"""Assistant-only loss masks on real chat templates (decoded spans), and chat templates for base models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from realmodel import smollm2_checkpoint
from transformers import AutoTokenizer
from trl.data_utils import _tokenize

from pipeline.data import chat
from pipeline.errors import ConfigError
from pipeline.tiny.model import CHAT_TEMPLATE

FIXTURES = Path(__file__).parent / "fixtures"
TWO_TURNS = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 = 4.\n#### 4"},
             {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"}]


def masked_spans(tok, messages: list[dict], kwargs: dict | None = None) -> tuple[list[str], str]:
    """The decoded runs of trained tokens, and the decoded untrained rest (the context)."""
    out = chat.tokenise_masked(tok, messages, kwargs or {}, "test row 1")
    spans, run, rest = [], [], []
    for token, trained in zip(out["input_ids"], out["assistant_masks"], strict=True):
        if trained:
            run.append(token)
        else:
            rest.append(token)
            if run:
                spans.append(tok.decode(run))
                run = []
    return spans + ([tok.decode(run)] if run else []), tok.decode(rest)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (converted once and cached): its real tokenizer and chat template."""
    return smollm2_checkpoint()


def smollm2_tok(path: Path, template: str | None = None):
    """SmolLM2's tokenizer, with `template` in place of its own chat template when given."""
    tok = AutoTokenizer.from_pretrained(path)
    if template:
        tok.chat_template = template
    return tok


def test_marked_template_mask_equals_trls(smollm2):
    tok = smollm2_tok(smollm2, CHAT_TEMPLATE)  # the tiny template, with {% generation %} markers
    for messages in (TWO_TURNS[:2], TWO_TURNS, [{"role": "system", "content": "Be brief."}, *TWO_TURNS]):
        ours = chat.tokenise_masked(tok, messages, {}, "row")
        trl = _tokenize(tok, messages, return_assistant_tokens_mask=True, chat_template=None, tools=None)
        assert ours["input_ids"] == trl["input_ids"]
        assert ours["assistant_masks"] == trl["assistant_masks"]
        assert sum(ours["assistant_masks"]) > 0


def test_smollm2_template_trains_every_assistant_turn_not_its_default_system_prompt(smollm2):
    spans, context = masked_spans(smollm2_tok(smollm2), TWO_TURNS)
    assert spans == ["2+2 = 4.\n#### 4<|im_end|>", "6<|im_end|>"]
    assert context.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # inserted, untrained
    assert "What is 2+2?" in context and "<|im_start|>assistant\n" in context


def test_smollm3_style_think_template(smollm2):
    tok = smollm2_tok(smollm2, (FIXTURES / "smollm3_style.jinja").read_text())
    spans, context = masked_spans(tok, TWO_TURNS, {"enable_thinking": False, "xml_tools": None})
    assert spans == ["2+2 = 4.\n#### 4<|im_end|>", "6<|im_end|>"]  # the inserted empty think block is context
    assert "Reasoning Mode: /no_think" in context and context.count("<think>\n\n</think>\n") == 2
    thought = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\n1+1\n</think>\n2"}]
    spans, context = masked_spans(tok, thought, {"enable_thinking": True})
    assert spans == ["<think>\n1+1\n</think>\n2<|im_end|>"] and "Reasoning Mode: /think" in context
    system = [{"role": "system", "content": "Answer tersely. /no_think"}, *TWO_TURNS]
    spans, context = masked_spans(tok, system, {})  # the system message's /no_think wins over the default
    assert spans == ["2+2 = 4.\n#### 4<|im_end|>", "6<|im_end|>"]
    assert "## Metadata" in context and "Answer tersely." in context and "/no_think" in context


def test_template_that_rewrites_earlier_turns_is_refused_naming_the_row(smollm2):
    tok = smollm2_tok(smollm2, (  # drops earlier turns' think blocks, as Qwen3-style templates do
        "{%- for m in messages -%}{%- set c = m['content'] -%}"
        "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
        "{{- '<|im_start|>' + m['role'] + '\n' + c + '<|im_end|>\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"))
    thinking = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>x</think>1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "2"}]
    with pytest.raises(ConfigError, match="mixture m row 7: the chat template is not prefix-preserving"):
        chat.tokenise_masked(tok, thinking, {}, "mixture m row 7")
    assert masked_spans(tok, thinking[:2])[0] == ["<think>x</think>1<|im_end|>"]  # one turn: fine


def test_empty_assistant_turn_is_refused_naming_the_row(smollm2):
    empty = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]
    with pytest.raises(ConfigError, match="mixture gsm8k row 3 \\(user: 'q'\\): assistant turn 2 is empty"):
        chat.tokenise_masked(smollm2_tok(smollm2), empty, {}, "mixture gsm8k row 3")


@pytest.mark.slow
def test_chatml_on_a_tokenizer_without_its_markers_adds_them_as_special_tokens(tmp_path):
    tok = AutoTokenizer.from_pretrained(_base_without_template(tmp_path))
    assert len(tok.encode("<|im_end|>", add_special_tokens=False)) > 1 and not tok.chat_template
    chat.apply_template(tok, "chatml")
    assert len(tok.encode("<|im_end|>", add_special_tokens=False)) == 1 and tok.eos_token == "<|im_end|>"
    assert masked_spans(tok, TWO_TURNS[:2])[0] == ["2+2 = 4.\n#### 4<|im_end|>"]
    with pytest.raises(ConfigError, match="neither a built-in"):
        chat.apply_template(tok, "no-such-template")


@pytest.mark.slow
def test_base_model_learns_to_stop_on_the_added_end_of_turn_marker(tmp_path, cache_dir):
    import torch
    from transformers import AutoModelForCausalLM

    base = _base_without_template(tmp_path)
    rows = [{"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}]}] * 32
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mix.yaml").write_text(json.dumps({"sources": [{"path": str(tmp_path / "rows.jsonl")}]}))
    common = ["recipe=tiny", f"output_root={tmp_path}/runs", f"cache_dir={cache_dir}", f"model.name_or_path={base}",
              "stages=[sft]", f"sft.mixture={tmp_path}/mix.yaml", "eval.tasks=[]", "base_eval.tasks=[]",
              "sft.gate.metric=", "sft.max_length=32", "sft.packing=false", "sft.padding_free=false"]
    proc = run_cli(*common)
    assert proc.returncode == 2 and "has no chat template: set model.chat_template=chatml" in proc.stderr
    proc = run_cli(*common, "model.chat_template=chatml", "sft.max_steps=40", "sft.learning_rate=3e-3",
                   "sft.warmup_ratio=0", "sft.per_device_train_batch_size=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = Path(tmp_path, "runs").glob("*/stages/*-sft/model")
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [end] and tok.eos_token_id == end
    assert model.generation_config.eos_token_id == end and tok.chat_template == chat.CHATML
    prompt = tok.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    with torch.no_grad():
        new = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    assert new[-1].item() == end and tok.decode(new) == "hi there<|im_end|>"


def _base_without_template(tmp: Path) -> Path:
    """A small random Llama checkpoint whose tokenizer has no chat template and no ChatML markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp / "base-no-template"
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["say hi", "hi there", "What is 2+2? 2+2 = 4. And 3+3? 6"] * 10, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.save_pretrained(out)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(out)
    return out
