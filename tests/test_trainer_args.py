"""A stage's `trainer` mapping: its fields reach the TRL config the stage builds; unknown fields, fields our config
sets and values TRL refuses stop the run before it starts (exit 2); an empty mapping leaves fingerprints alone."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from omegaconf import OmegaConf

from pipeline.config import ConfigError, fingerprint_view, load_config, stage_section
from pipeline.files import fingerprint
from pipeline.stages import trl_args
from pipeline.stages.dpo import dpo_args
from pipeline.stages.sft import sft_args

TINY = ["recipe=tiny", "stages=[sft,midtrain,dpo]"]


def test_pass_through_values_reach_the_built_trl_config(tmp_path):
    cfg = load_config([*TINY, "sft.trainer.neftune_noise_alpha=5", "sft.trainer.save_total_limit=1",
                       "dpo.trainer.label_smoothing=0.1"])
    trl_args.check(cfg)
    sft = sft_args(cfg.sft, tmp_path, 0, "fp32")
    assert sft.neftune_noise_alpha == 5 and sft.save_total_limit == 1  # added, and over what the pipeline computes
    assert sft.learning_rate == pytest.approx(cfg.sft.learning_rate)
    assert sft_args(cfg.midtrain, tmp_path, 0, "fp32").neftune_noise_alpha is None  # one stage's mapping only
    dpo = dpo_args(cfg.dpo, tmp_path, 0, "fp32")
    assert dpo.label_smoothing == pytest.approx(0.1) and dpo.beta == pytest.approx(cfg.dpo.beta)


def test_unknown_field_exits_2_with_a_suggestion(tmp_path):
    proc = run_cli("recipe=tiny", "sft.trainer.neftune_nosie_alpha=5", f"output_root={tmp_path}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown config key 'sft.trainer.neftune_nosie_alpha'" in proc.stderr
    assert "did you mean 'sft.trainer.neftune_noise_alpha'?" in proc.stderr
    run = tmp_path / "tiny"  # refused by the preflight: the run folder says why, nothing was loaded or scored
    assert not (run / "stages").exists() and json.loads((run / "outcome.json").read_text())["outcome"] == "bad_input"


@pytest.mark.parametrize(("override", "owner"), [
    ("sft.trainer.learning_rate=1e-3", "'sft.learning_rate'"),
    ("dpo.trainer.beta=0.5", "'dpo.beta'"),
    ("sft.trainer.output_dir=/tmp/x", "'output_root / run_name'"),
    ("midtrain.trainer.warmup_steps=5", "'midtrain.warmup_ratio'"),
    ("sft.trainer.bf16=true", "'model.precision'"),
])
def test_a_field_our_config_sets_is_refused_naming_our_setting(override, owner):
    with pytest.raises(ConfigError, match="is set by the pipeline from") as err:
        trl_args.check(load_config([*TINY, override]))
    assert owner in str(err.value)


@pytest.mark.parametrize(("override", "expected"), [
    ("sft.trainer.neftune_noise_alpha=abc", "bad value for 'sft.trainer.neftune_noise_alpha': 'abc' is not a number "
                                            "or null"),
    ("sft.trainer.dataset_text_field=3", "bad value for 'sft.trainer.dataset_text_field': 3 is not text"),
    ("dpo.trainer.optim=adamw_nope", "TRL's DPOConfig refuses it: adamw_nope is not one of ['adamw_torch', "),
    ("ppo.trainer.vf_coef=0.1", "'ppo.trainer' is not available"),
])
def test_bad_values_and_ppo_are_one_clear_error(override, expected):
    stages = "stages=[sft,dpo,ppo]"
    with pytest.raises(ConfigError) as err:
        trl_args.check(load_config([*TINY, stages, override]))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_an_empty_mapping_leaves_the_stage_fingerprint_unchanged():
    cfg = load_config(TINY)
    schema = OmegaConf.get_type(cfg.sft)
    without = {k: v for k, v in OmegaConf.to_container(cfg.sft, resolve=True).items()
               if k not in ("trainer", "eval", "gate")}
    assert fingerprint(stage_section(cfg, "sft")) == fingerprint(fingerprint_view(without, schema))
    changed = stage_section(load_config([*TINY, "sft.trainer.neftune_noise_alpha=5"]), "sft")
    assert changed["trainer"] == {"neftune_noise_alpha": 5}
    assert fingerprint(changed) != fingerprint(stage_section(cfg, "sft"))
