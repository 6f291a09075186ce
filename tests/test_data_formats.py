"""A stage's `data` key: one dataset in a format TRL documents (https://huggingface.co/docs/trl/dataset_formats),
from a local .jsonl / .json / .parquet / .csv file or folder or a Hub dataset (through `hub_mirror`), read as a
one-source mixture; the formats each stage kind trains on, refused rows named by file and line before any model
loads, and tool-calling rows rendered through chat templates that take tools."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import trl
from conftest import ROOT
from transformers import AutoTokenizer
from trl.data_utils import is_conversational, unpair_preference_dataset

from pipeline.chain import preflight
from pipeline.config import load_config
from pipeline.data import chat, formats, sources, tokcache
from pipeline.data.mixtures import fingerprints, head, load_mixture, load_spec
from pipeline.errors import ConfigError
from pipeline.settings import Data, data_source, kinds
from pipeline.tiny.model import CHAT_TEMPLATE, build_tokenizer

FIXTURES = ROOT / "tests" / "fixtures" / "hub"
QWEN = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"  # Qwen2.5's template, shipped with TRL
SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE, GREEN = [{"role": "assistant", "content": "It is blue."}], [{"role": "assistant", "content": "It is green."}]
# TRL's examples of each format, one file each: (format, form, rows)
FORMS = [
    ("language modeling", "standard", [{"text": "The sky is blue."}, {"text": "Grass is green."}]),
    ("conversational", "conversational", [{"messages": SKY + BLUE}]),
    ("prompt-completion", "standard", [{"prompt": "The sky is", "completion": " blue."}]),
    ("prompt-completion", "conversational", [{"prompt": SKY, "completion": BLUE}]),
    ("preference", "standard", [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}]),
    ("preference", "conversational", [{"prompt": SKY, "chosen": BLUE, "rejected": GREEN}]),
    ("preference", "implicit prompt", [{"chosen": SKY + BLUE, "rejected": SKY + GREEN}]),
    ("unpaired preference", "standard", [{"prompt": "The sky is", "completion": " blue.", "label": True},
                                         {"prompt": "The sky is", "completion": " green.", "label": False}]),
    ("unpaired preference", "conversational", [{"prompt": SKY, "completion": GREEN, "label": False}]),
    ("prompt with answer", "standard", [{"prompt": "What is 2 + 3?", "answer": "#### 5"}]),
    ("prompt-only", "conversational", [{"prompt": SKY}]),
]
ACCEPTS = {"sft": {"conversational", "prompt-completion"},
           "midtrain": {"language modeling", "conversational", "prompt-completion"},
           "dpo": {"preference"}, "orpo": {"preference"}, "reward": {"preference"},
           "kto": {"preference", "unpaired preference"}, "ppo": {"prompt with answer"}, "grpo": {"prompt with answer"}}
# a stage that trains on each format, with the settings it needs for it
READER = {"language modeling": ("midtrain", []), "conversational": ("sft", []), "prompt-completion": ("sft", []),
          "preference": ("dpo", []), "unpaired preference": ("kto", []), "prompt with answer": ("grpo", []),
          "prompt-only": ("grpo", ["grpo.reward=model"])}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
WEATHER = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_weather", "content": "18C and windy"},
    {"role": "assistant", "content": "It is 18C and windy in Paris."}], "tools": TOOLS}
CLOCK = {"messages": [
    {"role": "user", "content": "Time in Lima?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_time",
                                                                          "arguments": {"zone": "America/Lima",
                                                                                        "format": 24}}}]},
    {"role": "tool", "name": "get_time", "content": "14:05"},
    {"role": "assistant", "content": "It is 14:05 in Lima."}],
    "tools": json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])}


def _write(path: Path, rows: list[dict]) -> Path:
    """`rows` as the file `path` (its suffix: jsonl, json, parquet or csv)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, stage: str, data: str, *overrides: str):
    """The tiny recipe running only `stage`, on `data` (its mixture cleared)."""
    return load_config(["recipe=tiny", f"output_root={tmp_path / 'runs'}", f"hub_mirror={tmp_path / 'hub'}",
                        f"stages=[{stage}]", f"{stage}.mixture=", f"{stage}.data={data}", "dpo.on_policy.enabled=false",
                        *overrides])


def test_a_data_value_is_a_hub_id_or_a_local_path():
    assert sources.parse("openai/gsm8k@main:train") == {"hub": "openai/gsm8k", "name": "main", "split": "train"}
    assert sources.parse("trl-lib/Capybara") == {"hub": "trl-lib/Capybara", "name": "", "split": "train"}
    assert sources.parse("org/name:train[:-500]") == {"hub": "org/name", "name": "", "split": "train[:-500]"}
    for local in ("./mine.jsonl", "/data/prefs", "~/rows.csv", "rows.parquet"):
        assert sources.parse(local) == {"path": local}
    with pytest.raises(ConfigError, match=r"'sft.data' is 'not a dataset!': neither a local file or folder"):
        sources.parse("not a dataset!", "sft.data")


@pytest.mark.parametrize(("overrides", "expected"), [
    (["sft.data=./mine.jsonl"], "'sft' sets both data (./mine.jsonl) and mixture (tiny_sft)"),
    (["sft.mixture="], "'sft' has no data: set 'sft.data'"),
    (["sft.data_columns={prompt: question}"], "'sft.data_columns' maps the columns of 'sft.data', which is not set"),
    (["sft.mixture=", "sft.data=a/b", "sft.data_columns={question: prompt}"],
     "'sft.data_columns' maps unknown target(s) question"),
    (["sft.sweep={data: [a/b, c/d]}", "sft.gate.metric=x"], "'sft.sweep.data': sweep a training setting"),
])
def test_data_with_mixture_or_neither_is_refused_when_the_config_loads(overrides, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(["recipe=tiny", *overrides])


def test_data_and_mixture_together_exit_2_in_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "pipeline" / "run.py"), "recipe=tiny", "sft.data=org/chats"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: 'sft' sets both data (org/chats) and mixture (tiny_sft): data reads one dataset, a mixture blends "
        "several; keep one (sft.mixture= clears the recipe's mixture)"]


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "form", "rows"), FORMS, ids=[f"{f} ({form})" for f, form, _ in FORMS])
def test_each_format_reads_alike_from_every_file_type_and_a_hub_copy(tmp_path, fmt, form, rows):
    """jsonl, json, parquet, csv (plain strings only) and a Hub dataset's local copy give the same normalised rows,
    which fit exactly the stage kinds that train on the format; a stage that trains on it passes the preflight."""
    stem = f"{fmt} {form}".replace(" ", "_")
    plain = all(isinstance(v, str | bool) for row in rows for v in row.values())
    files = [_write(tmp_path / f"{stem}.{ext}", rows) for ext in ("jsonl", "json", "parquet", *["csv"] * plain)]
    _write(tmp_path / "hub" / "acme" / "formats" / stem / "train.jsonl", rows)
    stage, settings = READER[fmt]
    cfg = _cfg(tmp_path, stage, str(files[0]), *settings)
    assert preflight.stage_rows(cfg)[stage] and len(fingerprints(data_source(cfg[stage]), cfg)) == 1
    read = {}
    for value in [*map(str, files), f"acme/formats@{stem}:train"]:
        read[value] = [row for _, row in head(Data(value, {}), cfg)]
        loaded = load_mixture(Data(value, {}), cfg)  # what the stage trains on: the same rows, shuffled
        assert sorted(map(_key, loaded)) == sorted(map(_key, read[value])), value
    first, *others = read.values()
    assert all(o == first for o in others), read
    cfg = load_config(["recipe=tiny"])
    for kind, accepted in ACCEPTS.items():
        assert all(formats.fits(row, kinds()[kind].formats(cfg[kind])) == (fmt in accepted) for row in first), kind
    chats = ("messages", "prompt", "completion", "chosen", "rejected")
    assert all(is_conversational({k: row[k]}) for row in first for k in row if k in chats)  # TRL's conversational


def _key(row: dict) -> str:
    return json.dumps(dict(row), sort_keys=True)


def _head(path: Path, rows: list[dict]) -> list[dict]:
    return [row for _, row in head(Data(str(_write(path, rows)), {}), load_config(["recipe=tiny"]))]


def test_rows_are_normalised_as_trl_trains_them(tmp_path):
    (completion,) = _head(tmp_path / "pc.jsonl", FORMS[2][2])  # one chat: assistant-only loss is on the completion
    assert completion == {"messages": [{"role": "user", "content": "The sky is"},
                                       {"role": "assistant", "content": " blue."}]}
    good, bad = _head(tmp_path / "unpaired.csv", FORMS[7][2])  # the label cells "True" / "False"
    assert good["label"] is True and bad["label"] is False and bad["completion"] == [
        {"role": "assistant", "content": " green."}] and bad["prompt"] == [{"role": "user", "content": "The sky is"}]
    (implicit,) = _head(tmp_path / "implicit.jsonl", FORMS[6][2])
    assert implicit == {"prompt": SKY, "chosen": BLUE, "rejected": GREEN}


def test_gsm8k_from_the_hub_with_a_column_map_gives_rl_prompts(tmp_path):
    cfg = load_config(["recipe=tiny", f"hub_mirror={FIXTURES}", "stages=[grpo]", "grpo.mixture=",
                       "grpo.data=openai/gsm8k@main:test", "grpo.data_columns={prompt: question, answer: answer}",
                       f"output_root={tmp_path}"])
    rows = preflight.stage_rows(cfg)["grpo"]
    assert rows[0][0] == "openai/gsm8k[main/test] row 1" and "####" in rows[0][1]["answer"]
    assert load_spec(data_source(cfg.grpo)).sources[0].hub == "openai/gsm8k"
    published = (FIXTURES / "openai/gsm8k/main/test-00000-of-00001.jsonl").read_text().splitlines()
    assert len(load_mixture(data_source(cfg.grpo), cfg)) == len(published)


def test_a_folder_is_one_source_per_file(tmp_path):
    _write(tmp_path / "chats" / "a.jsonl", FORMS[1][2])
    _write(tmp_path / "chats" / "b.parquet", FORMS[1][2] * 2)
    (tmp_path / "chats" / "notes.txt").write_text("not data")
    cfg = _cfg(tmp_path, "sft", str(tmp_path / "chats"))
    spec = load_spec(data_source(cfg.sft))
    assert [Path(s.path).name for s in spec.sources] == ["a.jsonl", "b.parquet"]
    assert len(load_mixture(data_source(cfg.sft), cfg)) == 3
    assert [fp["file"] for fp in fingerprints(data_source(cfg.sft), cfg)] == [Path(s.path).name for s in spec.sources]


def test_a_row_the_stage_cannot_train_on_is_refused_naming_file_line_and_formats(tmp_path):
    chats = _write(tmp_path / "chats.jsonl", FORMS[1][2] * 3)
    with pytest.raises(ConfigError) as err:
        preflight.stage_rows(_cfg(tmp_path, "dpo", str(chats)))
    assert str(err.value) == (
        f"stage 'dpo' (dpo) trains on preference (prompt, chosen, rejected; or chosen, rejected sharing an implicit "
        f"prompt) rows; {chats}:1 (data {chats}) is conversational (messages; a prompt-completion row becomes one)")
    text = _write(tmp_path / "docs.csv", FORMS[0][2])
    with pytest.raises(ConfigError, match=rf"stage 'sft' \(sft\) trains on conversational \(messages\) or "
                                          rf"prompt-completion \(prompt, completion\) rows; {text}:2 .* is language "
                                          r"modeling \(text\)"):
        preflight.stage_rows(_cfg(tmp_path, "sft", str(text)))
    assert preflight.stage_rows(_cfg(tmp_path, "sft", str(text), "sft.format=text", "sft.assistant_only_loss=false"))


def test_a_file_of_two_formats_and_a_bad_cell_are_named_by_line(tmp_path):
    mixed = _write(tmp_path / "mixed.jsonl", [*FORMS[1][2], *FORMS[1][2], {"text": "a document"}])
    with pytest.raises(ConfigError, match=rf"{mixed}:3 is language modeling \(text\), but {mixed}:1 is "
                                          "conversational .*: a file holds rows of one format"):
        fingerprints(Data(str(mixed), {}), load_config(["recipe=tiny"]))
    labels = _write(tmp_path / "labels.csv", [{"prompt": "p", "completion": "c", "label": "true"},
                                              {"prompt": "p", "completion": "d", "label": "maybe"}])
    with pytest.raises(ConfigError, match=rf"{labels}:3: label must be true \(a desirable completion\) or false, "
                                          "got a string"):
        load_mixture(Data(str(labels), {}), load_config(["recipe=tiny"]))


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> Path:
    """A folder with the tiny recipe's tokenizer (its ChatML template, `{% generation %}` markers), trained on a
    few rows."""
    data, out = tmp_path_factory.mktemp("tok_data"), tmp_path_factory.mktemp("tok")
    for split in ("pretrain", "sft", "general"):
        _write(data / f"{split}.jsonl", [{"messages": SKY + BLUE} if split == "sft" else {"text": "18C and windy."}])
    build_tokenizer(data, 400, out)
    return out


def _with(folder: Path, template: str = ""):
    """The tokenizer in `folder`, with `template` (model.chat_template's values) when given."""
    return chat.apply_template(AutoTokenizer.from_pretrained(folder), template)


def test_tool_calling_rows_keep_their_calls_through_arrow(tmp_path):
    rows = load_mixture(Data(str(_write(tmp_path / "tools.jsonl", [WEATHER, CLOCK])), {}), load_config(["recipe=tiny"]))
    got = {r["messages"][0]["content"]: r for r in rows}
    weather, clock = got["Weather in Paris?"], got["Time in Lima?"]
    assert weather["messages"][1]["tool_calls"] == WEATHER["messages"][1]["tool_calls"]  # no other row's null fields
    assert clock["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"zone": "America/Lima", "format": 24}
    assert json.loads(weather["tools"]) == TOOLS and json.loads(clock["tools"])[0]["function"]["name"] == "get_time"
    assert weather["messages"][2] == {"role": "tool", "content": "18C and windy", "name": "get_weather"}


def test_a_template_that_takes_tools_renders_them_and_trains_the_calls(tmp_path, tiny_tok):
    hub = tmp_path / "hub" / "acme" / "tools" / "train.parquet"
    datasets.Dataset.from_list([WEATHER | {"tools": json.dumps(TOOLS)}, CLOCK]).to_parquet(str(hub))  # null-filled
    cfg = _cfg(tmp_path, "sft", "acme/tools", f"model.chat_template={QWEN}")
    rows = [r for _, r in preflight.stage_rows(cfg)["sft"]]
    tok = _with(tiny_tok, str(QWEN))
    for row in rows:
        chat.render_row(tok, cfg.sft, row, "stage 'sft'")
    weather = next(r for r in rows if r["messages"][0]["content"].startswith("Weather"))
    out = chat.tokenise_masked(tok, weather["messages"], {}, "row 1", weather["tools"])
    trained = tok.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])
    context = tok.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if not m])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
                       "It is 18C and windy in Paris.<|im_end|>")
    assert '"name": "get_weather", "description": "The weather in a city"' in context  # the tools, in the system turn
    assert "<tool_response>\n18C and windy\n</tool_response>" in context and "null" not in context
    unmasked = tokcache.tokenise_chat(weather, 0, tok, False, "stage 01-sft (data acme/tools)")
    assert unmasked["input_ids"] == out["input_ids"]


def test_a_template_without_tools_is_refused_naming_stage_template_and_row(tmp_path, tiny_tok):
    tools = _write(tmp_path / "tools.jsonl", [WEATHER])
    assert _with(tiny_tok).chat_template == CHAT_TEMPLATE  # the tiny recipe's own template: no tools
    cfg = _cfg(tmp_path, "sft", str(tools), f"model.name_or_path={tiny_tok}")
    with pytest.raises(ConfigError) as err:
        preflight.chat_template(cfg, preflight.stage_rows(cfg))
    assert str(err.value) == (
        f"stage 'sft': the chat template of {tiny_tok} cannot render {tools}:1: the tool 'get_weather' is missing from "
        "the chat template's text: the template takes no tools (apply_chat_template's tools=, tool_calls, tool "
        "turns); set model.chat_template to a template that renders them")
    (row,) = _head(tmp_path / "again.jsonl", [WEATHER])
    with pytest.raises(ConfigError, match=r"stage 01-sft \(data x\) row 1: the tool 'get_weather' is missing"):
        tokcache.tokenise_chat(row, 0, _with(tiny_tok), True, "stage 01-sft (data x)")  # a base built by the recipe
    with pytest.raises(ConfigError, match=r"row 1: the row's tool calling \('dict object' has no attribute 'content'\) "
                                          "is missing"):  # a template that fails on a tool call with no content
        chat.render(_with(tiny_tok), WEATHER["messages"], {}, where="row 1")


def test_kto_unpairs_preference_pairs_into_its_unpaired_format(tmp_path):
    """KTO trains on unpaired rows as they are, and on pairs through TRL's `unpair_preference_dataset`: both give
    the same rows."""
    cfg = load_config(["recipe=tiny"])
    pairs = load_mixture(Data(str(_write(tmp_path / "pairs.jsonl", FORMS[5][2])), {}), cfg)
    rows = [{"prompt": SKY, "completion": BLUE, "label": True}, {"prompt": SKY, "completion": GREEN, "label": False}]
    unpaired = load_mixture(Data(str(_write(tmp_path / "unpaired.jsonl", rows)), {}), cfg)
    assert sorted(map(_key, unpair_preference_dataset(pairs))) == sorted(map(_key, unpaired))
