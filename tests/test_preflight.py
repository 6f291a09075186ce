"""The preflight (pipeline/chain/preflight.py): every check that needs no model, all problems in one error."""

from __future__ import annotations

import pytest
from conftest import FAST

from pipeline.chain import preflight
from pipeline.config import load_config
from pipeline.errors import BAD_INPUT, ConfigError
from pipeline.evaluation.lmeval import write_tasks


def _check(tmp_path, *overrides: str):
    cfg = load_config(["recipe=tiny", *FAST, f"output_root={tmp_path / 'runs'}", f"cache_dir={tmp_path / 'cache'}",
                       *overrides])
    return preflight.check(cfg, tmp_path / "runs" / "tiny", write_tasks(cfg, tmp_path / "tasks"), 1)


def test_a_sound_config_gives_the_stage_decisions(tmp_path):
    decisions = _check(tmp_path, "stages=[sft,dpo]")
    assert [(d.name, d.action) for d in decisions] == [("sft", "train"), ("dpo", "train")]


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        _check(tmp_path, "stages=[sft,ppo]", "model.attn_implementation=flash_attention_2",
               "sft.gate.metric=tiny_gsm/acc,none", "ppo.mixture=no_such_mixture", "sft.optim=adamw_nope")
    message = str(err.value)
    assert err.value.code == BAD_INPUT and "\n" not in message
    assert message.startswith("4 problems: (1) ")
    for part in ("TRL's SFTConfig refuses it: adamw_nope", "no_such_mixture",
                 "flash_attention_2 needs", "'sft.gate.metric' is 'tiny_gsm/acc,none'"):
        assert part in message, part


@pytest.mark.parametrize("overrides, expected", [
    (["stages=[ppo]", "ppo.rollout_batch_size=8", "ppo.num_minibatches=3", "ppo.gradient_accumulation_steps=1"],
     "= 3 x 1 = 3"),
    (["stages=[ppo]", "ppo.rollout_batch_size=8", "ppo.num_minibatches=2", "ppo.gradient_accumulation_steps=3"],
     "= 2 x 3 = 6"),
])
def test_ppo_batches_that_do_not_split_evenly(tmp_path, overrides, expected):
    """Checked when the config loads (the ppo kind's own check), before the preflight."""
    with pytest.raises(ConfigError, match="must be divisible") as err:
        _check(tmp_path, *overrides)
    assert str(err.value).endswith(expected)
