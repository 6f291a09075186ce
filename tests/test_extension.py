"""Recipe extensions (pipeline/extension.py): the embedded demo is one, a user's module works the same way, and
nothing of the demo reaches the product or a run of another recipe."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.data.mixtures import load_mixture
from pipeline.errors import ConfigError
from pipeline.evaluation.lmeval import write_tasks

ROOT = Path(__file__).resolve().parents[1]


def test_no_product_module_knows_the_demo():
    """Outside pipeline/tiny/ no module imports it or names it, but for the default recipe's name."""
    offenders = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        if "tiny" in path.relative_to(ROOT / "pipeline").parts:
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"tiny", line, re.I) and not line.startswith("DEFAULT_RECIPE = "):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_another_recipe_generates_nothing_of_the_demo(tmp_path):
    cfg = load_config(["recipe=smollm2", f"output_root={tmp_path}"])
    assert "tiny" not in cfg and not cfg.extension
    tasks = write_tasks(cfg, tmp_path / "tasks")
    assert not list(tasks.glob("tiny*")) and (tasks / "gsm8k_local.yaml").is_file()
    assert not list(tmp_path.rglob("tiny-data-*"))


def test_the_demo_adds_its_section_tasks_and_data(tmp_path):
    cfg = load_config(["recipe=tiny", f"output_root={tmp_path}", "tiny.test_examples=7"])
    assert cfg.extension == "pipeline.tiny" and cfg.tiny.test_examples == 7
    tasks = write_tasks(cfg, tmp_path / "tasks")
    assert {p.name for p in tasks.glob("tiny*")} == {"tiny_gsm.yaml", "tiny_gsm_val.yaml", "tiny_gsm_bpb.yaml",
                                                        "tiny_gsm_val_bpb.yaml"}
    test_file = re.search(r"test: (\S+)", (tasks / "tiny_gsm.yaml").read_text()).group(1)
    assert len(Path(test_file).read_text().splitlines()) == 7


def test_a_users_extension_brings_its_section_and_generator(tmp_path, monkeypatch):
    (tmp_path / "myext.py").write_text(textwrap.dedent('''
        import json
        from dataclasses import dataclass
        from pathlib import Path

        SECTION = "mine"

        @dataclass
        class Settings:
            rows: int = 3

        def _rows(cfg, split):
            out = Path(cfg.output_root) / f"{split}.jsonl"
            out.write_text("".join(json.dumps({"text": f"row {i}"}) + "\\n" for i in range(cfg.mine.rows)))
            return out

        GENERATORS = {"mine": _rows}
    '''))
    (tmp_path / "mix.yaml").write_text("sources:\n  - generator: mine\n    split: train\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(["recipe=smollm2", "extension=myext", "mine.rows=5", f"output_root={tmp_path}"])
    assert sorted(r["text"] for r in load_mixture(str(tmp_path / "mix.yaml"), cfg)) == [f"row {i}" for i in range(5)]
    with pytest.raises(ConfigError, match="unknown config key 'mine.rowz'"):
        load_config(["recipe=smollm2", "extension=myext", "mine.rowz=5"])
    with pytest.raises(ConfigError, match="unknown generator 'mine'"):
        load_mixture(str(tmp_path / "mix.yaml"), load_config(["recipe=smollm2", f"output_root={tmp_path}"]))
    sys.modules.pop("myext", None)


def test_an_extension_that_cannot_be_imported_is_bad_input():
    with pytest.raises(ConfigError, match="extension 'no_such_module' cannot be imported"):
        load_config(["recipe=smollm2", "extension=no_such_module"])
