"""Plan / dry run (`plan=true`): stages, checkpoints, sweep, data and estimates, offline and without torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from conftest import FAST, ROOT, run_cli
from safetensors import safe_open

from pipeline.chain.plan import KNOWN_MODELS
from pipeline.config import load_config
from pipeline.data.mixtures import load_spec
from pipeline.grid import grid
from pipeline.train.flops import param_count


def _plan(*args: str) -> dict:
    """Run `main([... plan=true plan.output=json])` in a fresh interpreter; check that torch stayed unloaded."""
    code = (
        "import sys; from pipeline.run import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'the plan imported torch'; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code, *args, "plan=true", "plan.output=json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_smol_plan_offline_lists_stages_sweep_data_and_estimates(tmp_path):
    args = ("recipe=smol", f"output_root={tmp_path}")
    cfg = load_config(list(args))
    plan = _plan(*args)
    stages = plan["stages"]
    assert [s["stage"] for s in stages] == list(cfg.stages) == ["sft", "midtrain", "dpo", "ppo"]
    assert [s["action"] for s in stages] == ["train", "train", "train", "skip (ppo.enabled=false)"]
    assert stages[0]["input"] == "HuggingFaceTB/SmolLM3-3B-Base"
    for i, (prev, s) in enumerate(zip([None, *stages[:2]], stages[:3], strict=True), 1):
        assert s["output"] == str(tmp_path / "smol" / "stages" / f"{i:02d}-{s['stage']}" / "model")
        assert prev is None or s["input"] == prev["output"]
    for s in stages[:3]:
        spec = load_spec(cfg[s["stage"]].mixture)
        assert [src["weight"] for src in s["datasets"][0]["sources"]] == [src.weight for src in spec.sources]
        assert s["datasets"][0]["sources"][0]["source"].startswith("HuggingFaceTB/smoltalk2[")
    sweep = stages[2]["sweep"]
    assert [c["id"] for c in sweep["candidates"]] == [c["id"] for c in grid(cfg.dpo)] and len(sweep["candidates"]) == 9
    assert sweep["soup_top_k"] == 3 and sweep["merge"]["stage"] == "midtrain"
    for s in stages[:2]:  # epochs x the tokens the mixture states
        assert s["tokens"] == cfg[s["stage"]].num_train_epochs * load_spec(cfg[s["stage"]].mixture).tokens > 0
        assert s["gpu_hours"] > 0 and s["wall_hours"] == pytest.approx(s["gpu_hours"] / 8)
    assert stages[2]["tokens"] is None and plan["not_estimated"] == ["dpo"]  # smol_pref states no token count
    assert plan["model"]["params"] == param_count(KNOWN_MODELS["HuggingFaceTB/SmolLM3-3B"])
    assert plan["total_gpu_hours"] == pytest.approx(stages[0]["gpu_hours"] + stages[1]["gpu_hours"])
    assert not (tmp_path / "smol").exists()

    faster = _plan(*args, "plan.mfu=0.7", "plan.num_gpus=16", "dpo.max_steps=100")
    for a, b in zip(stages[:2], faster["stages"][:2], strict=True):  # same tokens; twice the MFU, twice the GPUs
        assert b["tokens"] == a["tokens"] and b["gpu_hours"] == pytest.approx(a["gpu_hours"] / 2)
        assert b["wall_hours"] == pytest.approx(a["wall_hours"] / 4)
    dpo = faster["stages"][2]  # an upper bound now: steps x global batch x 2 sequences x max_length
    assert dpo["tokens"] == 100 * (1 * 4 * 16) * 2 * 24576 and dpo["gpu_hours"] > 0 and not faster["not_estimated"]

    text = run_cli(*args, "plan=true")
    assert text.returncode == 0, text.stderr
    headers = [line for line in text.stdout.splitlines() if line.startswith("[")]
    assert headers == ["[01-sft] sft: train", "[02-midtrain] midtrain: train", "[03-dpo] dpo: train",
                       "[-] ppo: skip (ppo.enabled=false)"]
    assert "ESTIMATES (not measurements) assume 8 x H100 at MFU 0.35" in text.stdout
    assert "beta0.025-lr5e-07" in text.stdout
    bad = run_cli(*args, "plan=true", "plan.gpu=B200")
    assert bad.returncode == 2 and bad.stderr.startswith("error: 'plan.gpu' is 'B200'")
    missing = run_cli(*args, "plan=true", "sft.mixture=", f"sft.data={tmp_path / 'no_such.jsonl'}")
    assert missing.returncode == 2 and missing.stderr.startswith(
        f"error: 'sft' reads data {tmp_path / 'no_such.jsonl'}: dataset file not found: {tmp_path / 'no_such.jsonl'}")


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_parameter_counts_match_transformers(name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = KNOWN_MODELS[name]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("smollm3" if "SmolLM3" in name else "llama",
                                                                      **fields))
    assert param_count(fields) == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_tiny_plan_and_an_existing_run_planned_by_the_orchestrator(tmp_path, cache_dir, tiny_base):
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft,midtrain,dpo]"]
    plan = _plan(*args)
    assert [(s["stage"], s["action"]) for s in plan["stages"]] == [("sft", "train"), ("midtrain", "train"),
                                                                 ("dpo", "train")]
    assert plan["stages"][0]["input"].startswith(str(tiny_base))
    with safe_open(tiny_base / "model.safetensors", "pt") as weights:  # the built model, tied weights saved once
        built = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
    assert plan["model"]["params"] == built  # read from the built model's config.json
    unbuilt = _plan(*args, f"cache_dir={tmp_path / 'empty'}")["model"]  # from the tiny settings: an upper bound
    assert unbuilt["params"] > built and "upper bound" in unbuilt["source"]
    reseeded = _plan(*args, "seed=7")  # the base's pretraining ran with the training seed: another seed, another base
    assert not reseeded["stages"][0]["input"].startswith(str(tiny_base.parent))
    assert "upper bound" in reseeded["model"]["source"]
    assert all(s["tokens"] > 0 and s["gpu_hours"] > 0 for s in plan["stages"])
    assert plan["stages"][2]["datasets"][0]["role"] == "on-policy prompts"
    assert not (tmp_path / "tiny").exists()

    from pipeline.chain.resume import decide
    from pipeline.files import write_json

    cfg = load_config(args)
    first = decide(cfg, tmp_path / "tiny")[0]  # a stage interrupted mid-training resumes
    write_json(first.dir / "stage.json", {"status": "running", "fingerprint": first.fingerprint})
    proc = run_cli(*args, "plan=true", "plan.output=json")
    assert proc.returncode == 0, proc.stderr
    assert [s["action"] for s in json.loads(proc.stdout)["stages"]] == ["resume", "train", "train"]


@pytest.mark.parametrize("bad, message", [
    ("eval.tasks=[tiny_gsmm]", "error: unknown eval task 'tiny_gsmm': not among the run's tasks"),
    ("sft.gate.metric=tiny_gsm_val/exact_match,strict-matc", "error: 'sft.gate.metric' is "
     "'tiny_gsm_val/exact_match,strict-matc', which the stage's eval does not produce; did you mean "
     "'tiny_gsm_val/exact_match,strict-match'?"),
    ("sft.data=/no/such.jsonl", "error: 'sft' reads data /no/such.jsonl: dataset file not found: /no/such.jsonl"),
], ids=["task", "gate-metric", "data-file"])
def test_the_plan_refuses_what_the_preflight_would_without_loading_anything(bad, message, tmp_path, capsys):
    from pipeline.run import main

    extra = ["sft.mixture="] if bad.startswith("sft.data") else []
    assert main(["recipe=tiny", f"output_root={tmp_path}", "plan=true", bad, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("error: ") == 1
    assert not any(tmp_path.iterdir())  # nothing written, the synthetic data not generated
