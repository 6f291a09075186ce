"""Data mixtures: local GSM8K through a column map, weights, and clear errors on bad rows."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf

from pipeline.config import load_config
from pipeline.data.mixtures import fingerprints, load_mixture, normalise
from pipeline.errors import ConfigError
from pipeline.tiny.data import ITEMS, NAMES, build_splits

GSM8K = ROOT / "tests" / "fixtures" / "gsm8k" / "train.jsonl"  # GSM8K's first 508 train rows, shipped
_TASK = ROOT / "eval/gsm8k_validation.py"
_spec = importlib.util.spec_from_file_location("gsm8k_validation", _TASK)
validation_slice = importlib.util.module_from_spec(_spec)  # the lm-eval helper of task gsm8k_local_val
_spec.loader.exec_module(validation_slice)
ROWS = validation_slice.ROWS


def _cfg(tmp_path: Path):
    return load_config(["recipe=tiny", f"output_root={tmp_path}"])


def _mixture(tmp_path: Path, sources: list[dict]) -> str:
    path = tmp_path / "mix.yaml"
    path.write_text(OmegaConf.to_yaml({"sources": sources}))
    return str(path)


def test_gsm8k_loads_through_the_shipped_mixture_from_a_plain_local_copy(tmp_path):
    copy = tmp_path / "hub" / "openai" / "gsm8k" / "main"  # hub_mirror layout without a card: <config>/<split>.jsonl
    copy.mkdir(parents=True)
    (copy / "train.jsonl").symlink_to(GSM8K)
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", f"hub_mirror={tmp_path / 'hub'}"])
    ds = load_mixture("gsm8k", cfg)
    assert len(ds) == 508 - ROWS and ds.column_names == ["messages"]  # the last ROWS: the validation slice
    roles = [m["role"] for m in ds[0]["messages"]]
    assert roles == ["user", "assistant"]
    assert re.search(r"\n#### -?[\d,.]+$", ds[0]["messages"][1]["content"])
    (fp,) = fingerprints("gsm8k", cfg)
    assert fp == {"hub": "openai/gsm8k", "name": "main", "split": f"train[:-{ROWS}]", "revision": "main",
                  "mirror": fp["mirror"], "weight": 1.0, "seed": 0,
                  "columns": {"user": "question", "assistant": "answer"}, "remove": []}
    (copy / "test.jsonl").write_text("{}\n")  # another split of the copy: not what this source reads
    shutil.copytree(tmp_path / "hub", tmp_path / "moved", symlinks=True)  # the copy elsewhere: the same rows
    moved = load_config(["recipe=tiny", f"output_root={tmp_path}", f"hub_mirror={tmp_path / 'moved'}"])
    assert fingerprints("gsm8k", moved)[0]["mirror"] == fp["mirror"]
    (tmp_path / "moved" / "openai" / "gsm8k" / "main" / "train.jsonl").unlink()
    (tmp_path / "moved" / "openai" / "gsm8k" / "main" / "train.jsonl").write_text(GSM8K.read_text()[:-1] + " \n")
    assert fingerprints("gsm8k", moved)[0]["mirror"] != fp["mirror"]


def test_remove_deletes_gsm8k_calculator_notes_from_hub_and_file_rows_and_changes_the_fingerprint(tmp_path):
    copy = tmp_path / "hub" / "openai" / "gsm8k" / "main"
    copy.mkdir(parents=True)
    (copy / "train.jsonl").symlink_to(GSM8K)
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", f"hub_mirror={tmp_path / 'hub'}"])
    notes = r"<<[^>]*>>"
    hub = {"hub": "openai/gsm8k", "name": "main", "split": "train[:8]", "columns": {"user": "question",
                                                                                     "assistant": "answer"}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = load_mixture(_mixture(tmp_path / "a", [hub]), cfg)
    stripped = load_mixture(_mixture(tmp_path / "b", [{**hub, "remove": [notes]}]), cfg)
    assert sum("<<" in r["messages"][1]["content"] for r in plain) == 8  # every one of GSM8K's first 8 has notes
    for before, after in zip(plain, stripped, strict=True):
        assert after["messages"][1]["content"] == re.sub(notes, "", before["messages"][1]["content"])
        assert after["messages"][0] == before["messages"][0]  # the question had none
    (fp,) = fingerprints(_mixture(tmp_path / "b", [{**hub, "remove": [notes]}]), cfg)
    assert fp["remove"] == [notes]  # a stage trained on other text is not reused
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "3*4=<<3*4=12>>12"}) + "\n")
    assert load_mixture(_mixture(tmp_path, [{"path": str(rows), "remove": [notes]}]), cfg)[0]["text"] == "3*4=12"
    with pytest.raises(ConfigError, match=r"source 0: remove pattern '<<\[' is not a regular expression"):
        fingerprints(_mixture(tmp_path, [{"path": str(rows), "remove": ["<<["]}]), cfg)


def test_weights_take_fractions_and_counts(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(10)))
    mix = _mixture(tmp_path, [{"path": str(rows), "weight": 0.5}, {"path": str(rows), "weight": 13}])
    ds = load_mixture(mix, _cfg(tmp_path))
    assert len(ds) == 5 + 13


@pytest.mark.parametrize(("content", "columns", "expected"), [
    ('{"text": "ok"}\n{"text": broken\n', {}, r"rows\.jsonl:2: malformed JSON line"),
    ('{"q": "a"}\n', {"user": "question", "assistant": "q"}, r"rows\.jsonl:1: row has no column 'question'"),
    ('{"messages": [{"role": "wizard", "content": "hi"}]}\n', {}, r"rows\.jsonl:1: unknown message role 'wizard'"),
    ('{"prompt": "p", "chosen": "same", "rejected": "same"}\n', {}, r"rows\.jsonl:1: .*chosen equal to rejected"),
    ("\n\n", {}, r"dataset .*rows\.jsonl is empty"),
])
def test_bad_rows_name_file_and_line(tmp_path, content, columns, expected):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(content)
    mix = _mixture(tmp_path, [{"path": str(rows), "columns": columns}])
    with pytest.raises(ConfigError, match=expected):
        load_mixture(mix, _cfg(tmp_path))


def test_missing_file_and_unknown_mixture_key(tmp_path):
    mix = _mixture(tmp_path, [{"path": str(tmp_path / "absent.jsonl")}])
    with pytest.raises(ConfigError, match="dataset file not found"):
        fingerprints(mix, _cfg(tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  - path: x.jsonl\n    colums: {}\n")
    with pytest.raises(ConfigError, match="unknown config key .*colums"):
        fingerprints(str(bad), _cfg(tmp_path))


def test_user_assistant_columns_build_a_chat():
    row = normalise({"question": "q?", "answer": "a"}, {"user": "question", "assistant": "answer"}, "x")
    assert row == {"messages": [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a"}]}


def test_tiny_splits_follow_gsm8k_format_and_test_is_disjoint():
    params = {"seed": 3, "sft_examples": 300, "midtrain_examples": 200, "general_examples": 10,
              "pretrain_examples": 30, "test_examples": 50, "validation_examples": 40}
    splits = build_splits(params)
    assert splits == build_splits(params)  # seeded
    test_q = {r["question"] for r in splits["test"]}
    train_q = {r["messages"][0]["content"] for k in ("sft", "reasoning") for r in splits[k]}
    train_q |= {r["prompt"][0]["content"] for k in ("prefs", "rl") for r in splits[k]}
    val_q = {r["question"] for r in splits["validation"]}
    assert len(test_q) == 50 and not test_q & train_q
    assert len(val_q) == 40 and not val_q & (test_q | train_q)
    for row in splits["test"]:
        *steps, final = row["answer"].split("\n")
        assert 1 <= len(steps) <= 3 and re.fullmatch(r"#### -?\d+", final)
        for step in steps:
            a, op, b, c = re.search(r"<<(\d+)([-+*])(\d+)=(-?\d+)>>", step).groups()
            assert eval(f"{a}{op}{b}") == int(c)  # noqa: S307 - digits and one operator, checked by the regex
    for pair in splits["prefs"]:
        assert pair["chosen"][0]["content"].split("#### ")[1] != pair["rejected"][0]["content"].split("#### ")[1]


def _arithmetic(answer: str) -> str:
    """A worked answer's operations and operands in order, read back from its `<<a+b=c>>` notes."""
    return "|".join(re.findall(r"<<([^=]+)=", answer))


def test_held_out_problems_share_no_arithmetic_with_training():
    params = {"seed": 0, "sft_examples": 4000, "midtrain_examples": 4000, "general_examples": 10,
              "pretrain_examples": 600, "test_examples": 500, "validation_examples": 300}  # the tiny recipe's sizes
    splits = build_splits(params)
    trained = {_arithmetic(r["messages"][1]["content"]) for k in ("sft", "reasoning") for r in splits[k]}
    trained |= {_arithmetic(r["chosen"][0]["content"]) for r in splits["prefs"]}
    trained |= {_arithmetic(r["answer"]) for r in splits["gsm_train"]}  # the few-shot examples
    test = {_arithmetic(r["answer"]) for r in splits["test"]}
    validation = {_arithmetic(r["answer"]) for r in splits["validation"]}
    assert len(test) > 100 and len(validation) > 100 and len(trained) > 3000
    assert not test & trained and not validation & trained and not test & validation
    # the RL prompts and the pretraining statements carry no worked answer: their stories give the operations
    words = re.compile(r"\b(?:" + "|".join(NAMES + ITEMS) + r")s?\b")
    held = {words.sub("", r["question"]) for r in splits["test"]}
    assert not held & {words.sub("", r["prompt"][0]["content"]) for r in splits["rl"]}


def test_gsm8k_validation_slice_is_held_out_of_every_gsm8k_mixture(tmp_path):
    import datasets

    copy = tmp_path / "hub" / "openai" / "gsm8k" / "main"
    copy.mkdir(parents=True)
    (copy / "train.jsonl").symlink_to(GSM8K)
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", f"hub_mirror={tmp_path / 'hub'}"])
    validation = validation_slice.last_rows(datasets.load_dataset("json", data_files=str(GSM8K), split="train"))
    held_out = set(validation["question"])
    assert len(held_out) == ROWS
    sft = {r["messages"][0]["content"] for r in load_mixture("gsm8k", cfg)}
    rl = {r["prompt"][0]["content"] for r in load_mixture("gsm8k_rl", cfg)}
    assert not held_out & sft and not held_out & rl and len(sft | held_out) == 508


@pytest.mark.parametrize(("row", "expected"), [
    ({"prompt": 7, "chosen": "x", "rejected": "y"}, "prompt must be a string or a list of {role, content} messages, "
                                                    "got a number"),
    ({"prompt": "p", "chat_template_kwargs": [1]}, "chat_template_kwargs must be a mapping, got a list"),
])
def test_a_row_of_the_wrong_shape_is_named_in_jsons_words(row, expected):
    with pytest.raises(ConfigError) as err:
        normalise(row, {}, "rows.jsonl:1")
    assert str(err.value) == f"rows.jsonl:1: {expected}"
