"""Help that answers a newcomer: `--help` is the pipeline's usage (recipes, overrides, exit codes), then the
launcher's options; `help=true recipe=NAME` is that recipe's values, for the stages it runs."""

from __future__ import annotations

import re

import pytest
from omegaconf import OmegaConf

from pipeline.config import load_config
from pipeline.errors import NAMES
from pipeline.recipe_files import available_recipes
from pipeline.run import main
from pipeline.settings import stage_names


def _help(capsys, *argv: str) -> list[str]:
    assert main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def _leaves(node: dict, prefix: str = "") -> list[str]:
    return [k for key, v in node.items()
            for k in (_leaves(v, f"{prefix}{key}.") if isinstance(v, dict) and v else [f"{prefix}{key}"])]


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_flag_is_the_pipelines_usage(flag, capsys):
    lines = _help(capsys, flag)
    text = "\n".join(lines)
    assert lines[0].startswith("usage: smol-pipeline") and len(lines) < 80
    for recipe in available_recipes():
        assert any(line.startswith(f"  {recipe} ") for line in lines), recipe
    for example in ("stages=[sft,dpo]", "sft.learning_rate=", "output_root=", "help=true recipe=NAME", "plan=true"):
        assert example in text, example
    codes = text[text.index("Exit codes:"):text.index("Examples:")]
    assert sorted(int(c) for c in re.findall(r"\b(\d+) [a-z]", codes)) == sorted(NAMES)  # the codes the run exits with
    assert "Config" not in text and "default 2e-05" not in text  # no dataclass names, no key listing


def test_help_true_shows_the_recipes_values_for_the_stages_it_runs(capsys):
    lines = _help(capsys, "help=true", "recipe=tiny", "sft.max_steps=7")
    cfg = load_config(["recipe=tiny", "sft.max_steps=7"])
    assert lines[0].startswith("recipe tiny: stages midtrain, sft, dpo")
    # the recipe's, not the default 2e-05, marked with where it came from
    assert "  sft.learning_rate=0.002  (number) peak learning rate [recipe recipes/tiny.yaml]" in lines
    assert any(line.startswith("  sft.max_steps=7 ") for line in lines)  # overrides apply too
    assert any(line.startswith("  tiny.pretrain_steps=200 ") for line in lines)  # the extension's section
    skipped = [s for s in stage_names(cfg) if s not in cfg.stages]
    assert skipped and not [line for line in lines if line.lstrip().startswith(tuple(f"{s}." for s in skipped))]
    shown = {line.split("=", 1)[0].strip() for line in lines if line.startswith("  ")}
    for key in _leaves(OmegaConf.to_container(cfg)):
        section = key.rsplit(".", 1)[0]
        if key.split(".")[0] not in skipped:
            # every key, or its all-null section in one line, or the mapping it is in (a sweep) in one line
            assert key in shown or f"{section}.*" in shown or section in shown, key


def test_help_true_skips_a_listed_but_disabled_stage(capsys):
    lines = _help(capsys, "help=true", "recipe=smol")
    assert load_config(["recipe=smol"]).stages[-1] == "ppo"
    assert lines[0].startswith("recipe smol: stages sft, midtrain, dpo (") and not any("  ppo." in x for x in lines)
    assert ("  dpo.beta=0.05  (number) DPO temperature: how far the policy may move from the reference [recipe "
            "recipes/smol.yaml]") in lines


def test_help_true_on_a_bad_recipe_is_one_error_line(capsys):
    assert main(["help=true", "recipe=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown recipe 'nope'; available: ")


@pytest.mark.slow
def test_launcher_help_is_the_usage_then_the_common_launcher_options(capsys):
    from accelerate.commands.launch import launch_command_parser

    from pipeline import launch

    assert launch.main(["--help"]) == 0
    text = capsys.readouterr().out
    ours, _, launcher = text.partition("\nLauncher options")
    assert ours.startswith("usage: smol-pipeline") and len(ours.splitlines()) < 80
    assert "accelerate launch --help" in launcher
    known = {o for a in launch_command_parser()._actions for o in a.option_strings}
    for option in launch.COMMON_OPTIONS:
        assert option in known and f"\n  {option} " in launcher, option
    assert len(launcher.splitlines()) == 1 + len(launch.COMMON_OPTIONS)
