"""Reuse that is never wrong, through `smol-pipeline` as users type it: the quickstart under a `.cache` folder
scores every stage itself, an edited eval task is scored anew without retraining, and an edited mixture is
refused naming the stage (then retrained with `redo=`)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
from conftest import FAST, ROOT

from pipeline.config import load_config
from pipeline.tiny.data import split_file

pytestmark = pytest.mark.slow
CLI = str(Path(sys.executable).with_name("smol-pipeline"))
ONE_STAGE = [*FAST, "stages=[sft]", "sft.max_steps=10"]


def smol(*args: str) -> subprocess.CompletedProcess:
    """`smol-pipeline ARGS` from the checkout, as the README runs it."""
    return subprocess.run([CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def scorings(text: str, stage: str) -> list[str]:
    """How `stage` got its scores in a run's log: `scored in` or `scores reused`, once per scoring."""
    return re.findall(rf"{stage} (scored in|scores reused)", text)


@pytest.fixture
def own_cache(tmp_path, cache_dir, tiny_base) -> Path:
    """The session's tiny base and data without its scores: a model another test trained the same way would
    rightly have its scores reused, and these tests count scorings."""
    own = tmp_path / "cache"
    for folder in Path(cache_dir).glob("tiny-*"):
        shutil.copytree(folder, own / folder.name)
    return own


def test_the_quickstart_under_a_cache_folder_scores_each_stage_itself(tmp_path, own_cache):
    cache_dir = own_cache
    out = tmp_path / "home" / ".cache" / "smol" / "runs"  # as under ~/.cache: every model's files below a .cache
    proc = smol("recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert scorings(proc.stderr, "01-sft") == ["scored in"] and scorings(proc.stderr, "02-midtrain") == ["scored in"]


def _task(folder: Path, cache_dir: Path, prompt: str) -> Path:
    """A user's lm-eval task (eval.include_path) on the FAST tiny test split, zero-shot, with `prompt` around the
    question."""
    data = split_file(load_config(["recipe=tiny", f"cache_dir={cache_dir}", *FAST]), "test")
    gsm8k = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_gsm.yaml").write_text(
        f"include: {gsm8k}\ntask: my_gsm\ndataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n"
        f"    train: {data}\n    test: {data}\ndoc_to_text: \"{prompt}\"\nnum_fewshot: 0\n")
    return folder


def test_an_edited_task_is_scored_anew_without_retraining(tmp_path, own_cache):
    cache_dir = own_cache
    tasks = _task(tmp_path / "tasks", cache_dir, "{{question}}")
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *ONE_STAGE,
            f"eval.include_path={tasks}", "eval.tasks=[my_gsm]", "sft.gate.metric=my_gsm/exact_match,strict-match"]
    first = smol(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert scorings(first.stderr, "00-base") == ["scored in"] and scorings(first.stderr, "01-sft") == ["scored in"]
    again = smol(*args)
    assert scorings(again.stderr, "00-base") == [] and "reusing finished stage" in again.stderr  # nothing changed
    _task(tmp_path / "tasks", cache_dir, "Question: {{question}}")
    edited = smol(*args)
    assert edited.returncode == 0, edited.stderr[-3000:]
    assert scorings(edited.stderr, "00-base") == ["scored in"] and scorings(edited.stderr, "01-sft") == ["scored in"]
    assert "sft: training" not in edited.stderr  # scored anew, not retrained


def test_an_edited_mixture_is_refused_naming_the_stage_then_redone(tmp_path, own_cache):
    cache_dir = own_cache
    mixture = tmp_path / "mine.yaml"
    source = "sources:\n  - generator: tiny\n    split: sft\n    weight: {}\n"
    mixture.write_text(source.format(1.0))
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *ONE_STAGE, f"sft.mixture={mixture}"]
    first = smol(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    mixture.write_text(source.format(0.25))
    refused = smol(*args)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "stage 01-sft already finished" in refused.stderr and "its data" in refused.stderr
    assert "redo=[sft]" in refused.stderr
    redone = smol(*args, "redo=[sft]")
    assert redone.returncode == 0, redone.stderr[-3000:]
    assert "sft: training" in redone.stderr and scorings(redone.stderr, "01-sft") == ["scored in"]
    config = tmp_path / "tiny" / "stages" / "01-sft" / "model" / "config.json"
    config.write_text(config.read_text() + "\n")  # a finished stage's model edited by hand
    edited = smol(*args)
    assert edited.returncode == 2, edited.stderr[-3000:]
    assert "stage 01-sft finished, but" in edited.stderr and "is not the model saved there" in edited.stderr
