"""Config errors are one clear line, exit code 2, before any model (or torch) loads."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields

import pytest
from conftest import ROOT
from omegaconf import OmegaConf

from pipeline.config import load_config
from pipeline.data.mixtures import load_spec, stage_mixtures
from pipeline.errors import ConfigError
from pipeline.recipe_files import available_recipes
from pipeline.settings import is_section, kind_of, stage_names

CASES = [
    (["sft.learnin_rate=3e-4"], "unknown config key 'sft.learnin_rate'", "did you mean 'sft.learning_rate'"),
    (["sft.lr=1"], "unknown config key 'sft.lr'", "did you mean 'sft.learning_rate'?"),  # not 'lora': initials
    (["sft.epochs=2"], "unknown config key 'sft.epochs'", "did you mean 'sft.num_train_epochs'?"),
    (["dpo.lora.rank=8"], "unknown config key 'dpo.lora.rank'", "did you mean 'dpo.lora.r'?"),
    (["lr=1"], "unknown config key 'lr'", "did you mean 'sft.learning_rate'?"),  # a stage key named at the top
    (["sft.eval.task=[x]"], "unknown config key 'sft.eval.task'", "did you mean 'sft.eval.tasks'?"),
    (["recipe=nope"], "unknown recipe 'nope'", "available: "),
    (["sft.learning_rate=fast"], "bad value for 'sft.learning_rate'", "'fast' is not a number"),
    (["sft.max_steps=1.5"], "bad value for 'sft.max_steps'", "'1.5' is not a whole number"),
    (["sft.packing=maybe"], "bad value for 'sft.packing'", "'maybe' is not true or false"),
    (["stages=sft"], "bad value for 'stages'", "'sft' is not a list, e.g. [a,b]"),
    (["sft.lora=8"], "'sft.lora' in command line is a section", "sft.lora.KEY=value"),
    (["report_to=[tensorbord]"], "unknown tracker 'tensorbord'", "did you mean 'tensorboard'?"),
    (["stages=[sft,dpx]"], "unknown stage 'dpx'", "or a section of your own naming its kind: dpx: {kind: sft"),
    (["sft.kind=dpo"], "'sft.kind' is 'dpo': a section's kind is fixed", "name a new section for another kind"),
    (["stages=[sft,x]", "x.kind=spt"], "'x.kind' is 'spt': not a stage kind", "did you mean 'sft'?"),
    (["stages=[]"], "'stages' is empty", "sft"),
    (["redo=[sfft]"], "unknown stage 'sfft'", "did you mean 'sft'"),
    (["modle.name_or_path=x"], "unknown config key 'modle'", "did you mean 'model'"),
    (["sft.packing_strategy=best"], "'sft.packing_strategy' is 'best'", "bfd"),
    (["sft.train_sampling_strategy=sorted"], "'sft.train_sampling_strategy' is 'sorted'", "group_by_length"),
    (["sft.matmul_precision=bf16"], "'sft.matmul_precision' is 'bf16'", "highest, high, medium"),
    (["tiny.matmul_precision=low"], "'tiny.matmul_precision' is 'low'", "medium"),
    (["sft.max_length=0"], "'sft.max_length' must be > 0", ""),
    (["sft.gate.test=better"], "'sft.gate.test' is 'better'", "no_significant_drop, non_inferior, superior"),
    (["sft.gate.test=non_inferior", "sft.gate.max_drop=null"], "'sft.gate.test' is non_inferior",
     "set 'sft.gate.max_drop'"),
    (["sft.eval.limit={gsm8k_local_val: x}"], "'sft.eval.limit' is {gsm8k_local_val: x}", "a mapping task -> number"),
    (["eval.limit=-1"], "'eval.limit' is -1", "0: all"),
    (["eval.tasks=[gsm8k_local_val]", "eval.limit={gsm8k_local_vla: 9}"], "'eval.limit' names task 'gsm8k_local_vla'",
     "did you mean 'gsm8k_local_val'?"),
    (["oops"], "not key=value", ""),
    (["run_name=/etc"], "'run_name' is '/etc': name one folder inside output_root", "output_root says where"),
    (["run_name=."], "'run_name' is '.'", ""),
    (["run_name=.."], "'run_name' is '..'", ""),
    (["run_name=a/b"], "'run_name' is 'a/b'", ""),
    (["sft.save_steps=0"], "'sft.save_steps' must be > 0, got 0", ""),
    (["collective_timeout_s=-5"], "'collective_timeout_s' must be > 0 seconds, got -5", ""),
    (["prep_timeout_s=-1"], "'prep_timeout_s' must be > 0 seconds, got -1", ""),
    (["seed=-7"], "'seed' must be in [0, 2**32)", "got -7"),
]


@pytest.mark.parametrize(("argv", "first", "second"), CASES)
def test_bad_config_is_one_clear_error(argv, first, second):
    with pytest.raises(ConfigError) as err:
        load_config(argv)
    message = str(err.value)
    assert first in message and second in message
    assert "\n" not in message
    plain = re.sub(r"TRL's \w+Config\b", "", message)  # the TRL class a stage's other keys pass to
    assert not re.search(r"Config\b|Float|Integer|\bstr\b|<class", plain), message  # no Python class names


def test_cli_exits_2_before_torch_is_imported():
    code = (
        "import sys; from pipeline.run import main; rc = main(['eval.taks=[x]']); "
        "assert 'torch' not in sys.modules, 'torch imported before the config error'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["error: unknown config key 'eval.taks' in command line; did you mean 'eval.tasks'?"]


def test_stage_kinds_register_themselves_and_each_has_a_section():
    """Every module of pipeline/stages/ that defines KIND (or KINDS) is a kind, with a config section of its name;
    a chain may hold several stages of one kind, each a section naming it."""
    from pipeline.settings import kinds

    assert set(kinds()) == {"sft", "midtrain", "dpo", "kto", "orpo", "reward", "ppo", "grpo"}
    assert type(kinds()["reward"]).__module__ == "pipeline.stages.reward_model"
    cfg = load_config(["recipe=tiny", "stages=[sft,sft_long]", "sft_long.kind=sft", "sft_long.mixture=tiny_sft",
                       "sft_long.max_length=512"])
    assert set(kinds()) <= set(stage_names(cfg)) and "sft_long" in stage_names(cfg)
    assert kind_of(cfg, "sft_long") is kinds()["sft"] and cfg.sft_long.max_length == 512
    assert cfg.sft_long.learning_rate == pytest.approx(2e-5)  # the kind's defaults, not the recipe's sft section


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_shipped_recipe_and_its_mixtures_validate(recipe):
    cfg = load_config([f"recipe={recipe}"])
    assert cfg.run_name == recipe
    for stage in cfg.stages:
        assert stage in stage_names(cfg)
        for mixture in stage_mixtures(cfg, stage):
            assert load_spec(mixture).sources


def test_every_shipped_mixture_parses():
    for path in sorted((ROOT / "data_mixtures").glob("*.yaml")):
        assert load_spec(str(path)).sources, path


def test_overrides_apply_and_config_is_read_only():
    cfg = load_config(["recipe=tiny", "sft.learning_rate=3e-4", "stages=[sft]", "run_name=try2"])
    assert cfg.sft.learning_rate == pytest.approx(3e-4)
    assert list(cfg.stages) == ["sft"] and cfg.run_name == "try2"
    with pytest.raises(Exception):  # noqa: B017 - omegaconf raises its own read-only error type
        cfg.sft.learning_rate = 1.0


def test_smol_recipe_has_published_settings():
    cfg = load_config(["recipe=smol"])
    assert cfg.model.name_or_path == "HuggingFaceTB/SmolLM3-3B-Base"
    assert cfg.sft.learning_rate == pytest.approx(2e-5) and cfg.sft.lr_scheduler_type == "cosine_with_min_lr"
    assert cfg.sft.assistant_only_loss and cfg.midtrain.packing_strategy == "wrapped"
    assert cfg.dpo.loss_type == ["apo_zero"] and cfg.dpo.beta == pytest.approx(0.05)
    assert 0.05 in cfg.dpo.sweep.beta and 1e-6 in cfg.dpo.sweep.learning_rate
    assert cfg.dpo.merge.stage == "midtrain" and cfg.dpo.merge.weight == pytest.approx(0.1)
    assert list(load_config(["recipe=smollm3"]).stages) == ["midtrain", "sft", "dpo"]


@pytest.mark.parametrize("recipe", available_recipes())
def test_every_shipped_recipe_has_gates_its_eval_produces(recipe, tmp_path):
    """Its tasks are known and its gates read metrics they produce (any task's: tests/test_eval_tasks.py)."""
    from pipeline.chain.dryrun import eval_tasks, gate_metrics
    from pipeline.evaluation.lmeval import write_tasks

    cfg = load_config([f"recipe={recipe}", f"output_root={tmp_path}"])
    tasks = write_tasks(cfg, tmp_path / "tasks")
    eval_tasks(cfg, tasks)  # each raises ConfigError otherwise
    gate_metrics(cfg, tasks)


def test_length_grouped_sampling_reaches_the_trainer(tmp_path):
    from pipeline.stages.sft import sft_args

    cfg = load_config(["recipe=tiny", "sft.train_sampling_strategy=group_by_length"])
    assert sft_args(cfg.sft, tmp_path, 0, "fp32").train_sampling_strategy == "group_by_length"
    assert sft_args(cfg.midtrain, tmp_path, 0, "fp32").train_sampling_strategy == "random"



def _choice_fields(section, key: str):
    """(dotted key, choices) of every field under `section` that declares the values it takes."""
    for f in fields(OmegaConf.get_type(section)):
        if is_section(section[f.name]):
            yield from _choice_fields(section[f.name], f"{key}.{f.name}")
        elif f.metadata.get("choices"):
            yield f"{key}.{f.name}", f.metadata["choices"]


def test_every_field_that_declares_its_choices_refuses_another_value_naming_them():
    cfg = load_config(["recipe=tiny"])
    found = [kc for name in cfg if is_section(cfg[name]) for kc in _choice_fields(cfg[name], name)]
    assert {"model.precision", "sft.format", "dpo.on_policy.backend", "ppo.kl_estimator", "sft.gate.action",
            "eval.backend", "tiny.matmul_precision"} <= {key for key, _ in found}
    for key, choices in found:
        assert OmegaConf.select(cfg, key) in (*choices, None), key  # the defaults are among them
        with pytest.raises(ConfigError) as err:
            load_config(["recipe=tiny", f"{key}=bogus"])
        assert str(err.value) == f"'{key}' is 'bogus'; choose one of {', '.join(choices)}"


def test_a_value_is_judged_by_the_choices_of_its_own_field():
    """SFT declares its samplers; DPO passes TRL's `train_sampling_strategy` through, which takes `sequential` too."""
    assert load_config(["recipe=tiny", "dpo.train_sampling_strategy=sequential"]).dpo.train_sampling_strategy == \
        "sequential"
    with pytest.raises(ConfigError, match="'sft.train_sampling_strategy' is 'sequential'; choose one of random, "):
        load_config(["recipe=tiny", "sft.train_sampling_strategy=sequential"])
