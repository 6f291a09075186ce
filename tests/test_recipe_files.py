"""Recipes anywhere: `recipe=path/to/my.yaml`, `base:` chains, relative paths read against the recipe's file, and
where each value came from in `help=true` and `plan=true`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT
from omegaconf import OmegaConf

from pipeline.config import _named_stages, load_config, load_with_sources, schema
from pipeline.errors import ConfigError
from pipeline.recipe_files import available_recipes
from pipeline.run import main

SHIPPED = ROOT / "recipes"
MIXTURE = (ROOT / "data_mixtures" / "gsm8k.yaml").read_text()


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _plain(cfg, *drop: str) -> dict:
    return {k: v for k, v in OmegaConf.to_container(cfg).items() if k not in drop}


def _error(*argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(list(argv))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("recipe", available_recipes())
def test_shipped_recipes_load_as_their_file_merged_over_the_defaults(recipe):
    """A shipped recipe loads as before: its YAML merged (OmegaConf.merge) over the schema's defaults, by name or by
    path, and its file's stem names the run either way."""
    values = OmegaConf.to_container(OmegaConf.load(SHIPPED / f"{recipe}.yaml"))
    expected = OmegaConf.merge(schema(values.get("extension", ""), _named_stages([values], [])), values)
    expected.recipe, expected.run_name = recipe, recipe
    assert OmegaConf.to_container(load_config([f"recipe={recipe}"])) == OmegaConf.to_container(expected)
    by_path = load_config([f"recipe={SHIPPED / f'{recipe}.yaml'}"])
    assert by_path.recipe == str(SHIPPED / f"{recipe}.yaml") and by_path.run_name == recipe
    assert _plain(by_path, "recipe") == _plain(expected, "recipe")


def test_a_recipe_file_with_a_base_by_name_is_that_recipe_with_the_same_values_set(tmp_path, monkeypatch):
    """`base: tiny` and three values over it give the config `recipe=tiny` with those three on the command line:
    the extension's section, named stages and merged mappings come through the base; lists replace."""
    _write(tmp_path / "mine.yml", "base: tiny\nstages: [sft, sft_long]\nsft: {learning_rate: 1.0e-4}\n"
                                  "sft_long: {kind: sft, mixture: tiny_sft}\ntiny: {pretrain_steps: 10}\n")
    monkeypatch.chdir(tmp_path)
    cfg, sources = load_with_sources(["recipe=mine.yml"])
    same = load_config(["recipe=tiny", "stages=[sft,sft_long]", "sft.learning_rate=1e-4", "sft_long.kind=sft",
                        "sft_long.mixture=tiny_sft", "tiny.pretrain_steps=10"])
    assert (cfg.recipe, cfg.run_name) == ("mine.yml", "mine")
    assert _plain(cfg, "recipe", "run_name") == _plain(same, "recipe", "run_name")  # so the same fingerprints
    assert cfg.sft.max_steps == 200 and cfg.sft.gate.min == pytest.approx(0.40)  # the base's, merged key by key
    assert sources["sft.learning_rate"] == "recipe mine.yml"
    assert sources["sft.max_steps"] == "base recipe recipes/tiny.yaml"
    assert "seed" not in sources  # a default


def test_a_chain_of_bases_by_relative_path_reads_each_files_paths_against_that_file(tmp_path):
    """C <- B <- A, each base a path relative to the file that names it; a mixture, an eval folder and a model
    written relative are each their own file's; names, Hub ids and the command line's paths are left as they are."""
    _write(tmp_path / "c" / "base.yaml", "base: smollm2\nsft: {mixture: mix.yaml, eval: {include_path: tasks}}\n"
                                         "dpo: {learning_rate: 1.0e-6}\n")
    _write(tmp_path / "c" / "mix.yaml", MIXTURE)
    (tmp_path / "c" / "tasks").mkdir()
    _write(tmp_path / "b" / "middle.yaml", "base: ../c/base.yaml\nmodel: {name_or_path: ./ckpt, tokenizer: org/tok}\n"
                                           "dpo: {learning_rate: 2.0e-6, on_policy: {mixture: gsm8k_rl}}\n")
    (tmp_path / "b" / "org" / "tok").mkdir(parents=True)  # a folder named like a Hub id: the Hub id still wins
    top = _write(tmp_path / "a" / "top.yaml", "base: ../b/middle.yaml\ndpo: {beta: 0.2}\noutput_root: ../runs\n")
    cfg, sources = load_with_sources([f"recipe={top}", "cache_dir=./cache", "dpo.mixture=./pairs.yaml"])
    assert cfg.sft.mixture == str(tmp_path / "c" / "mix.yaml")
    assert cfg.sft.eval.include_path == str(tmp_path / "c" / "tasks")
    assert cfg.model.name_or_path == str(tmp_path / "b" / "ckpt") and cfg.model.tokenizer == "org/tok"
    assert cfg.dpo.on_policy.mixture == "gsm8k_rl" and cfg.output_root == str(tmp_path / "runs")
    assert cfg.cache_dir == "./cache" and cfg.dpo.mixture == "./pairs.yaml"  # the command line's: the current folder
    assert (cfg.dpo.learning_rate, cfg.dpo.beta, cfg.sft.learning_rate) == (2e-6, 0.2, 2e-5)  # the nearest file wins
    assert cfg.run_name == "top"
    assert sources["dpo.learning_rate"] == f"base recipe {tmp_path / 'b' / 'middle.yaml'}"
    assert sources["sft.mixture"] == f"base recipe {tmp_path / 'c' / 'base.yaml'}"
    assert sources["sft.num_train_epochs"] == "base recipe recipes/smollm2.yaml"
    assert sources["dpo.beta"] == f"recipe {top}" and sources["cache_dir"] == "command line"


def test_missing_files_and_circles_are_one_line_naming_the_chain(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = ", ".join(available_recipes())
    assert _error("recipe=gone.yaml") == f"recipe file 'gone.yaml' not found ({tmp_path / 'gone.yaml'}); shipped " \
                                         f"recipes: {shipped}"
    assert _error("recipe=nope") == f"unknown recipe 'nope'; available: {shipped}"
    _write(tmp_path / "x.yaml", "base: sub/y.yaml\n")
    _write(tmp_path / "sub" / "y.yaml", "base: ../x.yaml\n")
    assert _error("recipe=x.yaml") == "the recipe's bases go round in a circle: x.yaml -> sub/y.yaml -> x.yaml"
    _write(tmp_path / "me.yaml", "base: ./me.yaml\nsft: {learning_rate: 1.0}\n")
    assert _error("recipe=me.yaml") == "the recipe's bases go round in a circle: me.yaml -> me.yaml"
    _write(tmp_path / "orphan.yaml", "base: smollm9\n")
    assert _error("recipe=orphan.yaml") == (f"base recipe 'smollm9' of orphan.yaml not found ("
                                            f"{SHIPPED / 'smollm9.yaml'}); chain: orphan.yaml -> recipes/"
                                            f"smollm9.yaml; shipped recipes: {shipped}")
    _write(tmp_path / "typo.yaml", "base: smollm2\nmodel: {name_or_pth: x}\n")
    assert _error("recipe=typo.yaml").startswith("unknown config key 'model.name_or_pth' in recipe typo.yaml")
    assert main(["recipe=x.yaml"]) == 2


def test_help_marks_where_each_value_came_from(tmp_path, capsys):
    mine = _write(tmp_path / "mine.yaml", "base: tiny\nsft: {learning_rate: 1.0e-3}\n")
    assert main(["help=true", f"recipe={mine}", "sft.max_steps=7"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"recipe {mine}: stages midtrain, sft, dpo")
    assert lines[1] == ("a value set over its default is marked with where it came from: [base recipe "
                        f"recipes/tiny.yaml], [recipe {mine}], [command line]")
    assert f"  sft.learning_rate=0.001  (number) peak learning rate [recipe {mine}]" in lines
    assert "  sft.max_grad_norm=1.0  (number) gradient clipping norm [base recipe recipes/tiny.yaml]" in lines
    assert any(x.startswith("  sft.max_steps=7 ") and x.endswith(" [command line]") for x in lines)
    assert "  sft.weight_decay=0.0  (number) AdamW weight decay" in lines  # a default: unmarked
    dpo_sweep = next(x for x in lines if x.startswith("  dpo.sweep="))
    assert dpo_sweep.endswith("[base recipe recipes/tiny.yaml]")


def test_plan_lists_where_each_setting_came_from(tmp_path):
    from pipeline.chain.plan import build, report

    _write(tmp_path / "mix.yaml", MIXTURE)
    mine = _write(tmp_path / "mine.yaml", "base: smollm2\nsft: {mixture: mix.yaml, learning_rate: 1.0e-4}\n")
    cfg, sources = load_with_sources([f"recipe={mine}", f"output_root={tmp_path / 'runs'}", "plan=true"])
    plan = build(cfg, sources)
    assert plan["provenance"]["sft.learning_rate"] == f"recipe {mine}"
    assert plan["provenance"]["stages"] == "base recipe recipes/smollm2.yaml"
    assert plan["provenance"]["plan.enabled"] == "command line" and "seed" not in plan["provenance"]
    assert plan["stages"][0]["datasets"][0]["mixture"] == str(tmp_path / "mix.yaml")
    assert json.loads(json.dumps(plan))["provenance"] == sources
    text = report(cfg, sources).splitlines()
    start = text.index("settings over the defaults, by where they came from:")
    block = " ".join(" ".join(text[start + 1:text.index("", start)]).split())
    assert f"recipe {mine}: sft.mixture, sft.learning_rate" in block
    assert "command line: recipe, output_root, plan.enabled" in block
    assert "base recipe recipes/smollm2.yaml: model.name_or_path," in block
