"""lm-eval with its repeated work done once (`pipeline/lmeval_fast.py`) gives the answers plain lm-eval gives."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from conftest import FAST
from lm_eval import utils
from realmodel import smollm2_shrunk

from pipeline import lmeval_fast
from pipeline.config import load_config
from pipeline.evaluate import run_eval, settings, write_tasks


@pytest.fixture(scope="module")
def real_tokenizer_model(tmp_path_factory) -> Path:
    """SmolLM2's real tokenizer and chat template on its weights cut to 2 layers."""
    return smollm2_shrunk(tmp_path_factory.mktemp("smollm2"))


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_scores_and_answers_equal_plain_lm_evals(model, tiny_base, real_tokenizer_model, tmp_path, monkeypatch):
    cfg = load_config(["recipe=tiny", *FAST, "eval.tasks=[tiny_gsm_val,tiny_gsm]", "eval.limit=24",
                       "eval.max_gen_toks=40", f"output_root={tmp_path}", f"cache_dir={tmp_path / 'cache'}"])
    tasks = write_tasks(cfg, tmp_path / "tasks")
    path = tiny_base if model == "tiny" else real_tokenizer_model
    compiled = lmeval_fast._template.cache_info()
    fast = run_eval(path, settings(cfg, "sft"), tasks, tmp_path / "fast", cfg.model)
    after = lmeval_fast._template.cache_info()
    assert after.hits - compiled.hits > 48 * 2  # at least the prompt and the target of each of the 48 problems
    assert utils.apply_template is not lmeval_fast.render  # lm-eval's own again outside `applied()`
    monkeypatch.setattr(lmeval_fast, "applied", contextlib.nullcontext)
    plain = run_eval(path, settings(cfg, "sft"), tasks, tmp_path / "plain", cfg.model)
    assert fast["metrics"] == plain["metrics"] and fast["samples"] == {"tiny_gsm_val": 24, "tiny_gsm": 24}
    for task in ("tiny_gsm_val", "tiny_gsm"):
        rows = [[json.loads(line) for line in (tmp_path / run / f"samples_{task}.jsonl").open()]
                for run in ("fast", "plain")]
        assert [r["resps"] for r in rows[0]] == [r["resps"] for r in rows[1]]
        assert [r["filtered_resps"] for r in rows[0]] == [r["filtered_resps"] for r in rows[1]]
        assert any(r["resps"][0][0].strip() for r in rows[0])  # the model wrote something to compare
