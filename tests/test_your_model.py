"""docs/your-model-your-data.md, as written: its files are read from the page's fenced blocks whose info string names
one (```yaml title="my_recipe.yaml"```) and its commands from its bash block.

Every recipe on the page loads, reads its own data against its own folder from anywhere, and its rows fit its
stages. The worked example runs through `smol-pipeline` in the example's folder with two overrides, because there is
no Hub here: `model.name_or_path` is the tiny base (tests/conftest.py), and `eval.include_path` holds local stand-ins
for lm-eval's `hellaswag` and `arc_easy`, named as the registry names them (the run's `eval.include_path` is read
before the registry): each includes lm-eval's own task YAML and replaces only its data, the Hub dataset, by a few
local rows in the published columns. The Hub push is its upload plan (`report/hub.plan`), built from the finished run
folder with the page's `push_to_hub`: pushing needs the Hub (the run refuses `push_to_hub` offline, at start).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from pipeline.chain import preflight
from pipeline.config import load_config
from pipeline.evaluation.lmeval import expected_metrics, metric_splits, settings, write_tasks
from pipeline.report import hub
from pipeline.runfolder import StageRecord

PAGE = ROOT / "docs" / "your-model-your-data.md"
SMOL = Path(sys.executable).with_name("smol-pipeline")


def page_files(page: Path = PAGE) -> dict[str, str]:
    """The files a page shows, by name."""
    text = page.read_text(encoding="utf-8")
    return {m["name"]: m["body"] for m in re.finditer(r'^```\w+ title="(?P<name>[^"]+)"\n(?P<body>.*?)^```$', text,
                                                      re.M | re.S)}


def page_commands() -> list[list[str]]:
    """The `smol-pipeline` commands of the page's bash block, as argument lists."""
    (block,) = re.findall(r"^```bash\n(.*?)^```$", PAGE.read_text(encoding="utf-8"), re.M | re.S)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.startswith("smol-pipeline ")]


def write_example(folder: Path) -> Path:
    """The page's files, written into `folder`."""
    for name, body in page_files().items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(body, encoding="utf-8")
    return folder


def test_every_recipe_on_the_page_loads_and_reads_its_own_files_from_anywhere(tmp_path, monkeypatch):
    example = write_example(tmp_path / "example")
    monkeypatch.syspath_prepend(str(example))  # my_rewards, as PYTHONPATH=. gives it
    monkeypatch.chdir(tmp_path)  # not the recipes' folder: their relative paths are theirs
    recipes = {name: load_config([f"recipe={example / name}"]) for name in page_files()
               if name.endswith(".yaml") and "/" not in name}
    assert set(recipes) == {"my_recipe.yaml", "my_dpo.yaml", "my_grpo.yaml", "my_eval.yaml"}
    assert page_files(ROOT / "README.md") == {"my_recipe.yaml": page_files()["my_recipe.yaml"]}  # the README's copy
    read = {name: {stage: {where.rpartition(":")[0] for where, _ in rows}
                   for stage, rows in preflight.stage_rows(cfg).items()} for name, cfg in recipes.items()}
    chats = {str(example / "my_chats.jsonl")}
    assert read == {"my_recipe.yaml": {"sft": chats}, "my_eval.yaml": {"sft": chats},
                    "my_dpo.yaml": {"sft": chats, "dpo": {str(example / "my_pairs.jsonl")}},
                    "my_grpo.yaml": {"sft": chats, "grpo": {str(example / "my_prompts.jsonl")}}}
    own = recipes["my_eval.yaml"]
    ev = {**settings(own, "sft"), "tasks": ["my_qa"]}
    tasks = write_tasks(own, tmp_path / "tasks")
    assert own.sft.gate.metric in expected_metrics(ev, tasks) and metric_splits(ev, tasks) == {"my_qa": "validation"}


def stand_in_tasks(folder: Path) -> Path:
    """`hellaswag` and `arc_easy` on 20 local rows each: lm-eval's own task YAMLs, their data replaced."""
    import lm_eval

    registry = Path(lm_eval.__file__).parent / "tasks"
    folder.mkdir()
    sums = [(a, b) for a in range(2, 7) for b in range(3, 7)]
    hellaswag = [{"ind": i, "activity_label": "Adding numbers", "ctx_a": f"Tom adds {a} and {b}.", "ctx_b": "he gets",
                  "ctx": f"Tom adds {a} and {b}. he gets", "endings": [str(a + b + d - i % 4) for d in range(4)],
                  "source_id": f"sum-{i}", "split": "val", "split_type": "indomain", "label": str(i % 4)}
                 for i, (a, b) in enumerate(sums)]
    arc = [{"id": f"sum-{i}", "question": f"What is {a} + {b}?", "answerKey": "ABC"[i % 3],
            "choices": {"text": [str(a + b + d - i % 3) for d in range(3)], "label": ["A", "B", "C"]}}
           for i, (a, b) in enumerate(sums)]
    for task, split, rows, path in [("hellaswag", "validation", hellaswag, "hellaswag/hellaswag.yaml"),
                                    ("arc_easy", "test", arc, "arc/arc_easy.yaml")]:
        (folder / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{task}.yaml").write_text(json.dumps({
            "include": str(registry / path), "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(folder / f"{task}.jsonl")}},
            "training_split": None, "validation_split": split if split == "validation" else None}))
    return folder


@pytest.mark.slow
def test_the_worked_example_runs_as_written(tmp_path, tiny_base):
    example = write_example(tmp_path / "example")
    chats = example / "my_chats.jsonl"  # the page's two chats, and more of the same kind
    chats.write_text(chats.read_text() + "".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"{a + b}."}]}) + "\n"
        for a in range(1, 7) for b in range(1, 7)))
    plan, run = page_commands()[0], page_commands()[-1]
    (push,) = [a for a in run if a.startswith("push_to_hub=")]
    offline = [f"model.name_or_path={tiny_base}", f"eval.include_path={stand_in_tasks(tmp_path / 'tasks')}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    shown = subprocess.run([str(SMOL), *plan[1:]], cwd=example, capture_output=True, text=True, env=env, timeout=300)
    assert shown.returncode == 0 and f"data {chats} (train" in shown.stdout, shown.stdout + shown.stderr[-3000:]

    args = [*(a for a in run[1:] if a != push), *offline]
    proc = subprocess.run([str(SMOL), *args], cwd=example, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cfg = load_config([f"recipe={example / 'my_recipe.yaml'}", *offline, push])  # what the run pushes
    root, gated = example / "runs" / "my_recipe", cfg.sft.gate.metric
    sft = StageRecord.read(root / "stages" / "01-sft")
    assert sft.data == [{"file": chats.name, "sha256": hashlib.sha256(chats.read_bytes()).hexdigest(), "weight": 1.0,
                         "seed": 0, "columns": {}, "remove": []}], sft.data
    assert sft.metrics["steps"] == 3  # the page's 3 epochs: its 38 short chats pack into one batch
    assert sft.gate["metric"] == gated == "hellaswag/acc_norm,none" and sft.gate["verdict"] == "pass", sft.gate
    assert {t.partition("/")[0] for t in sft.scores()} == set(cfg.eval.tasks) == {"hellaswag", "arc_easy"}
    assert StageRecord.read(root / "stages" / "00-base").scores().keys() == sft.scores().keys()
    board = (root / "leaderboard.md").read_text()
    assert f"validation: `{gated}`; test: `arc_easy/acc_norm,none`" in board and "| 01-sft |" in board, board
    assert (root / "leaderboard.html").is_file() and (root / "stages/01-sft/model/README.md").is_file()

    uploads = hub.plan(cfg, root, [root / "stages" / "01-sft"])
    assert [u.target for u in uploads] == ["my-org/my-model@01-sft", "my-org/my-model@main"]
    assert all(u.folder == root / "stages/01-sft/model" and "model.safetensors" in u.files for u in uploads)
    assert 'model="my-org/my-model", revision="01-sft")' in uploads[0].card and 'model="my-org/my-model")' in \
        uploads[-1].card
