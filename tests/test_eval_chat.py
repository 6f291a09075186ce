"""Eval on chat models: gsm8k_local's 5-shot, chat-template, multi-turn few-shot path, the template's switches
(`eval.chat_template_kwargs`) reaching lm-eval's rendering, lm-eval's warnings in the log, the format recorded."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from conftest import ROOT

from pipeline import logs
from pipeline.config import load_config
from pipeline.evaluation.lmeval import describe_format, prompt_format, run_eval, settings, write_tasks
from pipeline.tiny.model import CHAT_TEMPLATE

pytestmark = pytest.mark.slow
FIXTURES = ROOT / "tests" / "fixtures" / "hub"
# The tiny ChatML template with a SmolLM3-style switch: `enable_thinking=false` adds a /no_think system turn.
THINK_SWITCH = ("{%- if enable_thinking is defined and not enable_thinking -%}"
                "{{- '<|im_start|>system\n/no_think<|im_end|>\n' -}}{%- endif -%}")


def test_gsm8k_local_five_shot_multiturn_with_template_switches(tmp_path, tiny_base, capfd):
    model = tmp_path / "model"
    shutil.copytree(tiny_base, model)
    (model / "chat_template.jinja").write_text(THINK_SWITCH + CHAT_TEMPLATE)
    cfg = load_config(["recipe=tiny", "eval.tasks=[gsm8k_local]", "eval.num_fewshot=5", "eval.limit=2",
                       "eval.max_gen_toks=4", "eval.chat_template_kwargs={enable_thinking: false}",
                       f"hub_mirror={FIXTURES}", f"output_root={tmp_path}"])  # GSM8K: openai/gsm8k via the mirror
    ev = settings(cfg, "sft")
    saved = {n: list(logging.getLogger(n).handlers) for n in ("pipeline", *logs.LIBRARIES)}
    logs.setup(tmp_path / "pipeline.log", main=True)  # as a run sets it up
    try:
        result = run_eval(model, ev, write_tasks(cfg, tmp_path / "tasks"), tmp_path / "eval", cfg.model)
    finally:
        logging.captureWarnings(False)
        for name, handlers in saved.items():
            for handler in logging.getLogger(name).handlers:
                handler.close()
            logging.getLogger(name).handlers = handlers
    assert result["samples"] == {"gsm8k_local": 2}
    assert result["prompt_format"] == "chat, 5-shot multi-turn, enable_thinking=False"
    assert describe_format(prompt_format(settings(cfg, None))) == "plain, 5-shot"  # the base row's format
    first = json.loads((tmp_path / "eval/samples_gsm8k_local.jsonl").read_text().splitlines()[0])
    prompt = first["arguments"][0][0]
    train = [json.loads(line)["question"] for line in
             (FIXTURES / "openai/gsm8k/main/train-00000-of-00001.jsonl").read_text().splitlines()]
    assert prompt.startswith("<|im_start|>system\n/no_think<|im_end|>\n<|im_start|>user\n")
    assert prompt.count("<|im_start|>user\n") == prompt.count("<|im_start|>assistant\n") == 6  # 5 shots + the question
    assert sum(q in prompt for q in train) == 5 and first["doc"]["question"].startswith("Janet")
    assert prompt.endswith(f"Question: {first['doc']['question']}\nAnswer:<|im_end|>\n<|im_start|>assistant\n")
    terminal = capfd.readouterr().err
    assert "not of type `str`" not in terminal and "already-initialized model" not in terminal
    logged = (tmp_path / "pipeline.log").read_text()
    assert "not of type `str`" in logged and "already-initialized model" in logged
