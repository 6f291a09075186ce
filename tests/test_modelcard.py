"""Model cards (pipeline/report/modelcard.py) read back with huggingface_hub agree with the stage records: the
settings the model was trained with, eval results on their Hub datasets and splits, lineage and its relation,
datasets, gains, usage, versions. The cards of a real tiny run are checked in tests/test_hub_push.py."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard
from transformers import __version__ as transformers_version

from pipeline.config import load_config
from pipeline.report import modelcard
from pipeline.runfolder import StageRecord, base_dir, stage_dir

VAL, TEST = "gsm8k_local_val/exact_match,strict-match", "gsm8k_local/exact_match,strict-match"
PAIRED = {"diff": 0.03, "se": 0.012, "ci_low": 0.0065, "ci_high": 0.0535, "n": 200, "p_value": 0.0124}


GSM8K = {"dataset_path": "openai/gsm8k", "dataset_name": "main"}  # what lm-eval records of the shipped tasks


def _eval(val: float, test: float) -> dict:
    return {"metrics": {VAL: val, TEST: test}, "stderr": {VAL: 0.02, TEST: 0.015},
            "splits": {"gsm8k_local_val": "validation", "gsm8k_local": "test"},
            "task_configs": {"gsm8k_local_val": GSM8K, "gsm8k_local": GSM8K}}


def _run(root: Path) -> Path:
    """A run folder of base -> sft -> dpo (a sweep whose selected candidate is beta 2, lr 1e-5), by hand."""
    StageRecord(stage="base", index=0, status="done", eval=_eval(0.10, 0.11)).write(base_dir(root))
    sft = stage_dir(root, 1, "sft")
    StageRecord(stage="sft", index=1, status="done", config={"mixture": "smoltalk", "learning_rate": 3e-4},
                data=[{"hub": "HuggingFaceTB/smoltalk", "name": "all", "split": "train", "revision": "main"}],
                metrics={"steps": 10, "loss_first": 2.0, "loss_last": 1.0}, eval=_eval(0.13, 0.12),
                gate={"verdict": "pass", "reason": "passed", "paired": PAIRED}).write(sft)
    dpo = stage_dir(root, 2, "dpo")
    StageRecord(stage="dpo", index=2, status="done",
                config={"mixture": "prefs", "beta": 2.0, "learning_rate": 1e-5, "loss_type": ["apo_zero"]},
                data=[{"path": "data/prefs.jsonl", "sha256": "ab"}, {"hub": "openai/gsm8k", "split": "train"}],
                metrics={"selected": "beta2-lr1e-05", "selected_by": VAL, "candidates": [
                    {"candidate": "beta0.5-lr1e-05", VAL: 0.12}, {"candidate": "beta2-lr1e-05", VAL: 0.14}]},
                eval=_eval(0.14, 0.125), gate={"verdict": "pass", "reason": "passed", "paired": None}).write(dpo)
    for folder in (sft, dpo):
        (folder / "model").mkdir()
    return dpo


def test_card_matches_the_records_and_names_its_lineage(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# a base model\n")
    cfg = load_config(["recipe=smollm2", f"model.name_or_path={base}", f"output_root={tmp_path}", "run_name=r"])
    dpo = _run(tmp_path / "r")
    path = modelcard.write(cfg, tmp_path / "r", dpo)
    card = ModelCard.load(path)
    record = StageRecord.read(dpo)
    assert {f"{r.dataset_name}/{r.metric_name}": r.metric_value for r in card.data.eval_results} == record.scores()
    assert {r.dataset_name: r.dataset_split for r in card.data.eval_results} == record.eval["splits"]
    assert {(r.dataset_type, r.dataset_config, r.metric_type) for r in card.data.eval_results} == {
        ("openai/gsm8k", "main", "exact_match")}  # the Hub dataset each task reads, not the task's name
    assert card.data.base_model is None and "base_model_relation" not in card.data  # a local base: no Hub lineage
    assert (card.data.license, card.data.language) == ("apache-2.0", ["en"])  # from the base's own card
    assert card.data.datasets == ["HuggingFaceTB/smoltalk", "openai/gsm8k"]  # the Hub sources of the mixtures
    assert card.data.pipeline_tag == "text-generation" and {"trl", "sft", "dpo"} <= set(card.data.tags)
    line = next(x for x in card.text.splitlines() if x.startswith("| 02-dpo |"))
    assert "learning_rate=1e-05, beta=2, loss_type=apo_zero" in line  # the selected model's settings
    sft = next(x for x in card.text.splitlines() if x.startswith("| 01-sft |"))
    assert "HuggingFaceTB/smoltalk" in sft  # the gain with its interval:
    assert f"+0.030 [{PAIRED['ci_low']:+.3f}, {PAIRED['ci_high']:+.3f}], p=0.012" in sft
    assert "| beta2-lr1e-05 (selected) |" in card.text
    assert 'model="stages/02-dpo/model")  # its path in the run folder' in card.text  # no absolute path of this machine
    assert f"- transformers: {transformers_version}" in card.text


def test_hub_lineage_relation_and_usage(tmp_path):
    """The Hub base model is every stage's `base_model` (a branch of the run's repository cannot be one); the relation
    is finetune, merge for a soup or merge, adapter (library peft) for a PEFT adapter; the usage names the repository
    and the branch when the run pushes."""
    cfg = load_config(["recipe=smollm2", f"output_root={tmp_path}", "run_name=r"])
    dpo = _run(tmp_path / "r")
    sft = stage_dir(tmp_path / "r", 1, "sft")
    first = modelcard.card(cfg, tmp_path / "r", sft).data
    assert (first.base_model, first.base_model_relation, first.library_name) == (
        cfg.model.name_or_path, "finetune", "transformers")  # the Hub id
    pushed = load_config(["recipe=smollm2", f"output_root={tmp_path}", "run_name=r", "push_to_hub=me/smol"])
    later = modelcard.card(pushed, tmp_path / "r", dpo)
    assert later.data.base_model == cfg.model.name_or_path
    assert 'model="me/smol", revision="02-dpo")' in later.text
    assert "This is revision `02-dpo` of `me/smol`" in later.text
    assert 'model="me/smol")' in modelcard.card(pushed, tmp_path / "r", dpo, main=True).text
    record = StageRecord.read(dpo)
    record.metrics = {**record.metrics, "selected": "soup"}
    record.write(dpo)
    assert modelcard.card(cfg, tmp_path / "r", dpo).data.base_model_relation == "merge"
    (dpo / "model" / "adapter_config.json").write_text("{}")
    adapter = modelcard.card(cfg, tmp_path / "r", dpo).data
    assert (adapter.base_model_relation, adapter.library_name) == ("adapter", "peft")


def test_a_hub_mirror_copy_is_named_by_its_hub_id(tmp_path):
    mirror = tmp_path / "mirror"
    (mirror / "openai/gsm8k").mkdir(parents=True)
    cfg = load_config(["recipe=smollm2", f"output_root={tmp_path}", "run_name=r", f"hub_mirror={mirror}"])
    dpo = _run(tmp_path / "r")
    record = StageRecord.read(dpo)
    record.eval["task_configs"] = {t: {"dataset_path": str(mirror / "openai/gsm8k"), "dataset_name": "main"}
                                   for t in ("gsm8k_local_val", "gsm8k_local")}
    record.eval["task_configs"]["gsm8k_local"] = {"dataset_path": "json", "dataset_name": None}  # local files
    record.write(dpo)
    results = modelcard.card(cfg, tmp_path / "r", dpo).data.eval_results
    assert {(r.dataset_name, r.dataset_type, r.dataset_config) for r in results} == {
        ("gsm8k_local_val", "openai/gsm8k", "main"), ("gsm8k_local", "gsm8k_local", None)}
