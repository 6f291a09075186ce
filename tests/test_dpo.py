"""The DPO / APO-zero stage: training moves the margin, sweep + soup + merge + selection, resume."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAST, ink, render_in_chromium, run_cli
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOTrainer

from pipeline.config import load_config
from pipeline.evaluation import stats
from pipeline.evaluation.gsm import is_correct
from pipeline.grid import grid
from pipeline.runfolder import StageContext
from pipeline.stages import dpo
from pipeline.tiny.data import split_file
from pipeline.train.models import load_tokenizer

pytestmark = pytest.mark.slow
METRIC = "tiny_gsm_val/exact_match,strict-match"  # selection on validation; the test split is for the report
SWEEP = [
    "eval.tasks=[tiny_gsm_val,tiny_gsm]",
    "stages=[sft,midtrain,dpo]", "dpo.mixture=tiny_prefs", "dpo.max_steps=4", "dpo.per_device_train_batch_size=4",
    "dpo.logging_steps=1", "dpo.loss_type=[apo_zero]", "dpo.sweep.beta=[0.05,0.2]",
    "dpo.sweep.learning_rate=[1e-5,1e-3]",
    "dpo.soup.top_k=2", "dpo.merge.stage=midtrain", "dpo.merge.weight=0.1", "dpo.on_policy.max_prompts=24",
    f"dpo.gate.metric={METRIC}", "dpo.gate.max_drop=1.0",
]


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("dpo")
    args = ["recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST, *SWEEP]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "tiny", args, proc


def test_sweep_trains_four_candidates_then_soup_and_merge_and_selects_the_best(sweep_run):
    run, _, _ = sweep_run
    stage = json.loads((run / "stages/03-dpo/stage.json").read_text())
    names = sorted(p.name for p in (run / "stages/03-dpo/candidates").iterdir())
    assert names == sorted(["beta0.05-lr1e-05", "beta0.05-lr0.001", "beta0.2-lr1e-05", "beta0.2-lr0.001", "soup",
                            "merge"])
    table = stage["metrics"]["candidates"]
    assert [row["candidate"] for row in table][-2:] == ["soup", "merge"]
    best = max(row["selection_half"] for row in table)  # picked on the even problems of validation
    selected = stage["metrics"]["selected"]
    row = next(r for r in table if r["candidate"] == selected)
    assert stage["metrics"]["selection_problems"] == 25 and stage["metrics"]["selected_by"] == METRIC
    tie = "tiny_gsm_val_bpb/bits_per_byte,none"  # the recipe's tie-break, better lower
    assert f"the best {tie}" in stage["metrics"]["tie_rule"]
    if row["selection_half"] != best:  # a candidate not told apart from the best, with a better tie-break
        assert f"picked by {tie} among" in stage["metrics"]["picked"]
        assert row[tie] <= min(r[tie] for r in table if r["selection_half"] == best)
    assert stage["eval"]["metrics"][METRIC] == row[METRIC]
    # the gate judges the other half only: 25 problems the pick did not see
    assert stage["gate"]["paired"]["n"] == 25 and "gate half" in stage["gate"]["reason"]
    chosen = load_file(str(run / "stages/03-dpo/candidates" / selected / "model/model.safetensors"))
    final = load_file(str(run / "stages/03-dpo/model/model.safetensors"))
    assert all(torch.equal(chosen[k], final[k]) for k in final)
    rows = json.loads((run / "leaderboard.json").read_text())["rows"]
    assert {r["candidate"] for r in rows if r["checkpoint"] == "03-dpo"} >= set(names)


def test_candidates_are_scored_on_validation_only_and_the_selected_model_on_every_task(sweep_run):
    run, _, proc = sweep_run
    dpo = run / "stages/03-dpo"
    for cand in (dpo / "candidates").iterdir():
        record = json.loads((cand / "stage.json").read_text())
        # the gate's task and the tie-break's (the recipe's tiny_gsm_val_bpb, not in eval.tasks here)
        assert {m.partition("/")[0] for m in record["eval"]["metrics"]} == {"tiny_gsm_val", "tiny_gsm_val_bpb"}
        assert sorted(p.name for p in (cand / "eval").glob("samples_*")) == ["samples_tiny_gsm_val.jsonl",
                                                                            "samples_tiny_gsm_val_bpb.jsonl"]
    stage = json.loads((dpo / "stage.json").read_text())
    assert {m.partition("/")[0] for m in stage["eval"]["metrics"]} == {"tiny_gsm_val", "tiny_gsm_val_bpb", "tiny_gsm"}
    assert sorted(p.name for p in (dpo / "eval").glob("samples_*")) == [
        "samples_tiny_gsm.jsonl", "samples_tiny_gsm_val.jsonl", "samples_tiny_gsm_val_bpb.jsonl"]
    # validation: the selected candidate's own scoring, not a second one; only the test task is scored again
    chosen = dpo / "candidates" / stage["metrics"]["selected"]
    picked = json.loads((chosen / "stage.json").read_text())["eval"]
    assert {k: v for k, v in stage["eval"]["metrics"].items() if k.startswith("tiny_gsm_val")} == picked["metrics"]
    for samples in ("eval/samples_tiny_gsm_val.jsonl", "eval/samples_tiny_gsm_val_bpb.jsonl"):
        assert (dpo / samples).read_text() == (chosen / samples).read_text()
    assert stage["eval"]["settings"]["tasks"] == ["tiny_gsm_val", "tiny_gsm"]
    assert f"tiny_gsm_val, tiny_gsm_val_bpb taken from candidate {stage['metrics']['selected']}'s" in proc.stderr
    scored = [line for line in proc.stderr.splitlines() if re.search(r"03-dpo (scored in|scores reused)", line)]
    assert len(scored) == 1 and "tiny_gsm exact_match" in scored[0] and "tiny_gsm_val" not in scored[0]


def test_selection_reports_each_candidate_against_the_input_with_its_interval(sweep_run, tmp_path):
    run, _, _ = sweep_run
    stage = json.loads((run / "stages/03-dpo/stage.json").read_text())
    start = json.loads((run / "stages/02-midtrain/stage.json").read_text())["eval"]["metrics"][METRIC]
    halves = {h: stats.half_mean(run / "stages/02-midtrain/eval", METRIC, h)[0] for h in ("selection", "gate")}
    assert start == pytest.approx((halves["selection"] + halves["gate"]) / 2)
    for row in stage["metrics"]["candidates"]:
        paired = row["vs_input"]  # the same 25 problems: the mean of the differences is the difference of the means
        assert paired["n"] == 25 and paired["diff"] == pytest.approx(row["selection_half"] - halves["selection"])
        assert paired["ci_low"] <= paired["diff"] <= paired["ci_high"] and 0 <= paired["p_value"] <= 1
    gate_half = stats.half_mean(run / "stages/03-dpo/eval", METRIC, "gate")[0]
    assert stage["gate"]["paired"]["diff"] == pytest.approx(gate_half - halves["gate"])
    assert stage["gate"]["value"] == gate_half and stage["gate"]["previous"]["value"] == halves["gate"]
    selected = stage["metrics"]["selected"]
    card = ModelCard.load(run / "stages/03-dpo/model/README.md")
    assert "## Selection" in card.text and f"| {selected} (selected) |" in card.text
    assert "| 02-midtrain | tiny_midtrain" in card.text
    chosen = json.loads((run / "stages/03-dpo/candidates" / selected / "stage.json").read_text())["config"]
    line = next(x for x in card.text.splitlines() if x.startswith("| 03-dpo |"))
    assert all(f"{k}={v:.4g}" in line for k, v in chosen.items() if k in ("beta", "learning_rate"))  # what was trained
    splits = {r.dataset_name: r.dataset_split for r in card.data.eval_results}
    assert splits == stage["eval"]["splits"] and splits["tiny_gsm_val"] != splits["tiny_gsm"]
    scroll_width, shot, dom = render_in_chromium(run / "leaderboard.html", tmp_path)
    assert scroll_width <= 1280 and ink(shot) > 0.01
    charts = dom[dom.index('id="charts"'):dom.index('id="details"')]
    assert charts.count("<svg") == 3  # per stage: both gate metrics (FAST's test one, dpo's validation); the heatmap
    heatmap = charts[charts.rindex("<svg"):]
    assert "soup" in heatmap and "merge" in heatmap and f"selected {selected}" in heatmap


def _preference_gaps(model_dir: Path, pairs: list[dict], tok_dir: Path) -> torch.Tensor:
    """Per pair, log p(chosen) - log p(rejected) of the completions under the model at `model_dir`
    (prompts in the chat template of the tokenizer at `tok_dir`)."""
    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gaps = []
    for pair in pairs:
        prompt = tok.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
        start = len(tok(prompt, add_special_tokens=False).input_ids)
        logps = []
        for side in ("chosen", "rejected"):
            text = tok.apply_chat_template(pair["prompt"] + pair[side], tokenize=False)
            ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, start - 1:-1]
            logps.append(torch.log_softmax(logits.float(), -1).gather(1, ids[0, start:, None]).sum())
        gaps.append(logps[0] - logps[1])
    return torch.stack(gaps)


def test_candidates_change_parameters(sweep_run):
    run, _, _ = sweep_run
    start = load_file(str(run / "stages/02-midtrain/model/model.safetensors"))
    for name in ("beta0.05-lr0.001", "beta0.2-lr0.001"):
        record = json.loads((run / "stages/03-dpo/candidates" / name / "stage.json").read_text())
        after = load_file(str(run / "stages/03-dpo/candidates" / name / "model/model.safetensors"))
        assert any(not torch.equal(start[k], after[k]) for k in start)
        assert record["config"]["loss_type"] == ["apo_zero"] and record["config"]["beta"] in (0.05, 0.2)


def test_merge_is_the_weighted_soup_and_midtrain(sweep_run):
    run, _, _ = sweep_run
    merged = json.loads((run / "stages/03-dpo/candidates/merge/stage.json").read_text())
    assert merged["config"]["weights"] == [0.9, 0.1]
    assert merged["config"]["sources"][0].endswith("candidates/soup/model")
    soup, mid = (load_file(str(run / p / "model.safetensors")) for p in merged["config"]["sources"])  # run-relative
    out = load_file(str(run / "stages/03-dpo/candidates/merge/model/model.safetensors"))
    for key, value in out.items():
        assert torch.allclose(value, 0.9 * soup[key] + 0.1 * mid[key], atol=1e-6)


def test_on_policy_pairs_are_correct_over_incorrect(sweep_run, cache_dir):
    run, _, _ = sweep_run
    stats = json.loads((run / "stages/03-dpo/on_policy_stats.json").read_text())
    assert stats["prompts"] == 24 and stats["samples"] == 24 * 4
    rl = split_file(load_config(["recipe=tiny", *FAST, f"cache_dir={cache_dir}"]), "rl")  # this setup's prompts
    answers = {}
    for line in rl.read_text().splitlines():
        row = json.loads(line)
        answers[row["prompt"][0]["content"]] = row["answer"]
    for line in (run / "stages/03-dpo/on_policy_pairs.jsonl").read_text().splitlines():
        pair = json.loads(line)
        answer = answers[pair["prompt"][0]["content"]]
        assert is_correct(pair["chosen"][0]["content"], answer)
        assert not is_correct(pair["rejected"][0]["content"], answer)


def test_sigmoid_loss_raises_the_margin_of_its_pairs(tmp_path, cache_dir, tiny_base):
    prefs = split_file(load_config(["recipe=tiny", *FAST, f"cache_dir={cache_dir}"]), "prefs")
    pairs = [json.loads(line) for line in prefs.read_text().splitlines()[:16]]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (tmp_path / "mix.yaml").write_text(json.dumps({"sources": [{"path": str(tmp_path / "pairs.jsonl")}]}))
    proc = run_cli("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[dpo]",
                   f"dpo.mixture={tmp_path / 'mix.yaml'}", "dpo.on_policy.enabled=false", "dpo.loss_type=[sigmoid]",
                   "dpo.max_steps=16", "dpo.per_device_train_batch_size=4", "dpo.beta=0.1", "dpo.learning_rate=1e-4",
                   "dpo.sweep.beta=null", "dpo.sweep.learning_rate=null", "dpo.gate.metric=",
                   "dpo.soup.top_k=0", "dpo.merge.stage=")
    assert proc.returncode == 0, proc.stderr[-3000:]
    stage = json.loads((tmp_path / "tiny/stages/01-dpo/stage.json").read_text())
    assert "selected" not in stage["metrics"] and stage["config"]["loss_type"] == ["sigmoid"]  # no sweep
    # DPO's implicit reward margin over the 16 pairs it trained on (4 epochs), against the reference (its input)
    trained = tmp_path / "tiny/stages/01-dpo/model"
    margin = _preference_gaps(trained, pairs, trained) - _preference_gaps(tiny_base, pairs, trained)
    assert margin.mean() > 0, margin


def test_interrupted_sweep_reuses_finished_candidates(sweep_run, tmp_path):
    run, args, _ = sweep_run
    copy = tmp_path / "tiny"
    shutil.copytree(run, copy)
    dpo = copy / "stages/03-dpo"
    kept = dpo / "candidates/beta0.05-lr1e-05/stage.json"
    before = kept.stat().st_mtime_ns
    for cand in dpo.glob("candidates/*"):  # as if killed while training the second candidate
        if cand.name != "beta0.05-lr1e-05":
            shutil.rmtree(cand)
    shutil.rmtree(dpo / "model")
    record = json.loads((dpo / "stage.json").read_text())
    (dpo / "stage.json").write_text(json.dumps({**record, "status": "running"}))
    args = [a if not a.startswith("output_root=") else f"output_root={tmp_path}" for a in args]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "candidate beta0.05-lr1e-05: reusing" in proc.stderr
    assert proc.stderr.count(": training (beta") == 3
    assert kept.stat().st_mtime_ns == before
    assert json.loads((dpo / "stage.json").read_text())["status"] == "done"


def test_reference_log_probs_are_computed_once_per_stage(sweep_run):
    _, _, proc = sweep_run
    assert proc.stderr.count("computed once for every candidate") == 1
    assert proc.stderr.count(": training (beta") == 4


def _stage(cache_dir, tiny_base, out, *overrides) -> tuple:
    """A DPO stage context on the tiny base and `tiny_prefs` pairs (3 steps of 4 pairs), its tokenizer and pairs."""
    cfg = load_config(["recipe=tiny", f"cache_dir={cache_dir}", *FAST, "stages=[dpo]", "dpo.mixture=tiny_prefs",
                       "dpo.on_policy.enabled=false", "dpo.max_steps=3", "dpo.per_device_train_batch_size=4",
                       "dpo.logging_steps=1", "dpo.soup.top_k=0", "dpo.merge.stage=", "dpo.warmup_ratio=0",
                       "dpo.sweep.learning_rate=[1e-4,1e-3]", *overrides])
    ctx = StageContext(cfg, "dpo", tiny_base, out)
    pairs = dpo.on_disk(dpo.preference_pairs(ctx), out / "pairs")
    return ctx, load_tokenizer(tiny_base, cfg.model, need_template=True), pairs


@pytest.fixture(scope="module")
def shared_sweep(tmp_path_factory, cache_dir, tiny_base):
    """Two sweep candidates trained on reference log-probs computed once; reference forwards counted."""
    out = tmp_path_factory.mktemp("shared")
    forwards, real = [], DPOTrainer.compute_ref_log_probs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DPOTrainer, "compute_ref_log_probs", lambda self, *a: forwards.append(1) or real(self, *a))
        ctx, tok, pairs = _stage(cache_dir, tiny_base, out)
        shared = dpo.with_reference(ctx, tok, pairs, out / "pairs_ref")
        counts = {"reference": len(forwards)}
        metrics = {}
        for cand in grid(ctx.stage)[:2]:
            metrics[cand["id"]] = dpo.train_candidate(ctx.for_candidate(cand), tok, shared)
            counts[cand["id"]] = len(forwards) - sum(counts.values())
        dpo.with_reference(ctx, tok, pairs, out / "pairs_ref")
        counts["again"] = len(forwards) - sum(counts.values())
    return counts, metrics, shared, len(pairs)


def test_candidates_read_the_stored_reference_log_probs_without_a_reference_forward(shared_sweep):
    counts, metrics, shared, n_pairs = shared_sweep
    assert counts["reference"] == -(-n_pairs // 4)  # one forward per batch of 4 pairs, once
    assert list(counts.values())[1:] == [0, 0, 0]
    assert len(shared) == n_pairs and {"ref_chosen_logps", "ref_rejected_logps"} <= set(shared.column_names)
    assert all(-1e4 < lp < 0 for lp in [*shared["ref_chosen_logps"], *shared["ref_rejected_logps"]])
    assert all(len(m["losses"]) == 3 for m in metrics.values())


def test_shared_reference_log_probs_give_the_losses_of_a_per_step_reference(shared_sweep, cache_dir, tiny_base,
                                                                             tmp_path):
    _, metrics, _, _ = shared_sweep
    ctx, tok, pairs = _stage(cache_dir, tiny_base, tmp_path, "dpo.precompute_ref_log_probs=false")
    cand = grid(ctx.stage)[1]
    per_step = dpo.train_candidate(ctx.for_candidate(cand), tok, pairs)
    shared = metrics[cand["id"]]
    assert [s for s, _ in per_step["losses"]] == [s for s, _ in shared["losses"]] == [1, 2, 3]
    assert [v for _, v in shared["losses"]] == pytest.approx([v for _, v in per_step["losses"]], abs=1e-5)
    # float32 log-probs summed over a batch padded differently: agree to about 1e-5 relative to logps of ~100
    assert shared["last_logged"]["rewards/margins"] == pytest.approx(per_step["last_logged"]["rewards/margins"],
                                                                    abs=1e-4)


def test_each_trained_candidate_records_why_it_moved(sweep_run):
    """The on-policy sampling's pass rates and usable share, and the candidate's margins at its first and last step."""
    run, _, _ = sweep_run
    sampled = json.loads((run / "stages/03-dpo/on_policy_stats.json").read_text())
    for beta, lr in ((0.05, "1e-05"), (0.05, "0.001"), (0.2, "1e-05"), (0.2, "0.001")):
        metrics = json.loads((run / f"stages/03-dpo/candidates/beta{beta}-lr{lr}/stage.json").read_text())["metrics"]
        diag = metrics["diagnostics"]
        assert diag["prompts"] == sampled["prompts"] == 24 and diag["pass1"] == sampled["correct_rate"]
        assert diag["passk"] == 1 - sampled["all_wrong"] / 24 and 0 <= diag["usable"] <= 1
        assert diag["margin"] == [metrics["first_logged"]["rewards/margins"], metrics["last_logged"]["rewards/margins"]]
        assert diag["log_ratio_chosen"] == pytest.approx(metrics["last_logged"]["rewards/chosen"] / beta)
