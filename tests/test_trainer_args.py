"""TRL's own names: a stage key its settings do not declare, but the TRL config its kind builds has, reaches that
config under its own name; unknown keys, the folder the pipeline owns and values TRL refuses stop the run before it
starts (exit 2); fingerprints of unchanged settings are those of run folders made before."""

from __future__ import annotations

import pytest
import yaml
from conftest import run_cli
from omegaconf import OmegaConf

from pipeline.chain.preflight import trl_values
from pipeline.config import load_config
from pipeline.errors import ConfigError
from pipeline.files import fingerprint
from pipeline.fingerprints import stage_section, training_view
from pipeline.recipe_files import available_recipes
from pipeline.stages.dpo import dpo_args
from pipeline.stages.sft import sft_args

TINY = ["recipe=tiny", "stages=[sft,midtrain,dpo]"]

# The trainer keys of alignment-handbook's recipes/smollm3/sft/sft.yaml (commit 61d7a82), verbatim; its model keys
# (model_name_or_path, torch_dtype, attn_implementation, chat_template, ...) and data keys (dataset_mixture,
# dataset_num_proc) belong to the pipeline's `model` section and the stage's mixture.
HANDBOOK_SFT = """
assistant_only_loss: true
bf16: true
ddp_timeout: 18000
do_eval: false
eval_strategy: 'no'
gradient_accumulation_steps: 2
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: true
output_dir: data/SmolLM3-SFT
hub_strategy: every_save
learning_rate: 2.0e-05
log_level: info
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
packing: true
packing_strategy: ffd
max_grad_norm: 0.2
max_length: 65536
max_steps: -1
num_train_epochs: 5
overwrite_output_dir: true
per_device_train_batch_size: 1
push_to_hub: true
report_to:
- wandb
save_strategy: epoch
save_total_limit: 1
seed: 42
use_liger_kernel: true
warmup_ratio: 0.03
run_name: smollm3-sft-training
average_tokens_across_devices: true
"""


def _stage(name: str, keys: dict) -> list[str]:
    """`keys` as command-line overrides of section `name` (values in YAML flow style)."""
    return [f"{name}.{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}"
            for k, v in keys.items()]


def test_a_handbook_stage_loads_under_trl_names_and_builds_its_config(tmp_path):
    keys = yaml.safe_load(HANDBOOK_SFT)
    with pytest.raises(ConfigError, match="unknown config key 'sft.overwrite_output_dir': neither the stage's "
                                          "settings nor TRL's SFTConfig have it"):
        load_config(["recipe=tiny", *_stage("sft", keys)])
    # what the pinned TRL 1.16 / transformers 5.19 themselves no longer take: transformers 5 removed
    # overwrite_output_dir, TRL renamed packing_strategy ffd to bfd
    del keys["overwrite_output_dir"]
    keys["packing_strategy"] = "bfd"
    cfg = load_config(["recipe=tiny", "stages=[sft]", "model.precision=bf16", *_stage("sft", keys)])
    on_cpu = OmegaConf.merge(cfg.sft, {"use_liger_kernel": False})  # Liger's kernels need CUDA; CI has none
    args = sft_args(on_cpu, tmp_path / "work", cfg.seed, cfg.model.precision)
    assert args.learning_rate == pytest.approx(2e-5) and args.gradient_accumulation_steps == 2
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and args.gradient_checkpointing_kwargs == {
        "use_reentrant": True}
    assert (args.hub_strategy, args.save_total_limit, args.log_level, args.run_name) == (
        "every_save", 1, "info", "smollm3-sft-training")
    assert args.bf16 and args.average_tokens_across_devices and args.report_to == ["wandb"]
    assert args.output_dir == str(tmp_path / "work")  # the pipeline's folder, not the handbook's


def test_pass_through_values_reach_the_built_trl_config(tmp_path):
    cfg = load_config([*TINY, "sft.neftune_noise_alpha=5", "sft.save_total_limit=1", "dpo.label_smoothing=0.1"])
    trl_values(cfg)
    sft = sft_args(cfg.sft, tmp_path, 0, "fp32")
    assert sft.neftune_noise_alpha == 5 and sft.save_total_limit == 1  # added, and over what the pipeline computes
    assert sft.learning_rate == pytest.approx(cfg.sft.learning_rate)
    assert sft_args(cfg.midtrain, tmp_path, 0, "fp32").neftune_noise_alpha is None  # one stage's keys only
    dpo = dpo_args(cfg.dpo, tmp_path, 0, "fp32")
    assert dpo.label_smoothing == pytest.approx(0.1) and dpo.beta == pytest.approx(cfg.dpo.beta)


@pytest.mark.slow
def test_unknown_field_exits_2_with_a_suggestion(tmp_path):
    proc = run_cli("recipe=tiny", "sft.neftune_nosie_alpha=5", f"output_root={tmp_path}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown config key 'sft.neftune_nosie_alpha'" in proc.stderr
    assert "did you mean 'sft.neftune_noise_alpha'?" in proc.stderr
    assert not (tmp_path / "tiny").exists()  # refused when the config loads, before any work


@pytest.mark.parametrize("override, expected", [
    ("sft.neftune_noise_alpha=abc", "bad value for 'sft.neftune_noise_alpha': 'abc' is not a number or null"),
    ("sft.dataset_text_field=3", "bad value for 'sft.dataset_text_field': 3 is not text"),
    ("ppo.vf_coeff=0.1", "unknown config key 'ppo.vf_coeff': neither the stage's settings (kind ppo runs its own "
                         "loop, not a TRL config) have it; did you mean 'ppo.vf_coef'?"),
])
def test_bad_keys_are_one_clear_error_when_the_config_loads(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config([*TINY, "stages=[sft,dpo,ppo]", override])
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_value_trl_refuses_is_one_clear_error_before_the_run():
    with pytest.raises(ConfigError) as err:
        trl_values(load_config([*TINY, "dpo.optim=adamw_nope"]))
    assert "bad value in 'dpo': TRL's DPOConfig refuses it: adamw_nope is not one of ['adamw_torch', " in str(err.value)


@pytest.mark.slow
def test_fingerprints_of_unchanged_settings_are_those_of_earlier_run_folders():
    """Each shipped recipe's stages hash as they did before stage kinds registered themselves and took TRL's names
    (values computed at 5165523). The smollm3 DPO stage sweeps one setting: its old sweep held a null for the other,
    so it differs, and is left out; smollm2_cpu's SFT settings were chosen since."""
    before = {"smol": ("2e6ab343001a68a5", "158154bd26019443", "67c5d01cc9936cd7"),
              "smollm2": ("d26bf1c8b1c45878", "abba680512b6606d", "632efd5aa7e6294c"),
              "smollm2_cpu": (None, "abba680512b6606d", None),
              "smollm3": ("2e6ab343001a68a5", "158154bd26019443", None),
              "tiny": ("0e28528ab511700c", "aa6c526f9d7ba8b9", "b1c72bc8ee700067")}
    assert set(before) <= set(available_recipes())
    for recipe, hashes in before.items():
        cfg = load_config([f"recipe={recipe}"])
        for name, expected in zip(("sft", "midtrain", "dpo"), hashes, strict=True):
            got = fingerprint(training_view(stage_section(cfg, name), OmegaConf.get_type(cfg[name])))
            assert expected is None or got == expected, (recipe, name)


def test_pass_through_keys_enter_the_fingerprint_unless_they_only_change_how_it_runs():
    cfg = load_config(TINY)
    plain = training_view(stage_section(cfg, "sft"), OmegaConf.get_type(cfg.sft))
    changed = load_config([*TINY, "sft.neftune_noise_alpha=5", "sft.logging_first_step=false"])
    view = training_view(stage_section(changed, "sft"), OmegaConf.get_type(changed.sft))
    assert view == {**plain, "neftune_noise_alpha": 5}


# A kind declares a setting its TRL config also has only for a reason listed here; `trl_config` passes each by its
# own name. Every kind's schedule (StageSettings: learning_rate, max_steps, ...) is declared for all kinds: PPO's
# own loop, the plan and the reports read it, and the recipes' defaults are not TRL's.
OVERLAPS = {
    "packing": "on by default (TRL: off); our packing (data/packing.py) decides what reaches TRL",
    "assistant_only_loss": "on by default (TRL: off); rows come tokenised with their masks (the trainer gets false)",
    "dataset_num_proc": "1 by default (TRL: None), the tokenising cache's processes too",
    "precompute_ref_log_probs": "on by default (TRL: off): the reference runs once per stage, not per candidate",
    "center_rewards_coefficient": "0 by default (TRL: None)",
    "num_generations": "4 by default (TRL: 8), sized for small models",
    "beta": "swept and reported (report_keys); GRPO's is 0.04 (TRL: 0)",
    "loss_type": "a list the reports join; swept by DPO recipes",
    "loss_weights": "empty by default, one weight per loss type (checked against loss_type before the run)",
    "activation_offloading": "refused before the run on CPU (precision.memory_args)",
    # at TRL's default, declared when finished run folders were fingerprinted: undeclared, a stage that leaves it
    # at its default would get another fingerprint
    "packing_strategy": "in finished run folders' fingerprints",
    "train_sampling_strategy": "in finished run folders' fingerprints",
    "desirable_weight": "in finished run folders' fingerprints",
    "undesirable_weight": "in finished run folders' fingerprints",
    "temperature": "in finished run folders' fingerprints",
}


def test_a_kind_redeclares_a_field_of_its_trl_config_only_for_a_listed_reason():
    from dataclasses import fields

    from pipeline.settings import StageSettings, kinds

    schedule = {f.name for f in fields(StageSettings)}
    found = {}
    for kind in kinds().values():
        trl = {f.name for f in fields(kind.config_class())} if kind.trl_config else set()
        for name in {f.name for f in fields(kind.settings)} & trl - schedule:
            found.setdefault(name, []).append(kind.name)
    assert set(found) == set(OVERLAPS), {"not listed": sorted(set(found) - set(OVERLAPS)),
                                         "listed, no longer declared": sorted(set(OVERLAPS) - set(found))}
