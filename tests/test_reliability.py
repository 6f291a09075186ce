"""Fault injection through real processes: kills, signals, locks, broken saves, bad inputs, secrets."""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, ROOT, run_cli
from safetensors.torch import load_file

from pipeline.files import RunLock

pytestmark = pytest.mark.slow
STEPS = ["stages=[sft]", "sft.max_steps=30", "sft.save_steps=10", "sft.logging_steps=1"]


def _args(out: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST, *STEPS, *extra]


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "pipeline/run.py"), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _losses(run: Path) -> dict[int, float]:
    record = json.loads((run / "stages/01-sft/stage.json").read_text())
    return {step: loss for step, loss in record["metrics"]["losses"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    """An uninterrupted 30-step SFT run: the loss curve a resumed run must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    proc = run_cli(*_args(out, cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny"


@pytest.mark.fault("training", "SIGKILL", "137 (killed)",
                   "resumes from its last marked checkpoint, with the same losses after it")
def test_sigkill_mid_stage_resumes_from_the_last_checkpoint_with_the_same_losses(reference, tmp_path, cache_dir):
    args = _args(tmp_path, cache_dir)
    proc = _start(args)
    _wait_for(tmp_path / "tiny/stages/01-sft/work/checkpoint-20/.complete", proc)  # its marker: written last
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "tiny/.lock").exists()  # left behind by the killed run: stale, taken over below
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    record = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert record["metrics"]["resumed_from"].endswith("checkpoint-20")
    ref, got = _losses(reference), _losses(tmp_path / "tiny")
    after = [s for s in ref if s > 20]
    assert len(after) == 10
    for step in after:  # stated tolerance: 1e-4 relative per step after the resume point
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, got[step], ref[step])


@pytest.mark.fault("training", "SIGTERM", "75",
                   "resumes from the checkpoint it saved (an edited config is refused, the checkpoints kept)")
def test_sigterm_saves_and_exits_75_then_resumes(tmp_path, cache_dir):
    args = _args(tmp_path, cache_dir)
    proc = _start(args)
    _wait_for(tmp_path / "tiny/stages/01-sft/work/checkpoint-10/trainer_state.json", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert "preempted: SIGTERM received" in err
    record = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert record["status"] == "running"
    saved = sorted((tmp_path / "tiny/stages/01-sft/work").glob("checkpoint-*"))
    assert saved and not (tmp_path / "tiny/.lock").exists()
    changed = run_cli(*args, "sft.learning_rate=1e-4")  # what it trains: refused, its checkpoints kept
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "stage 01-sft was interrupted (its checkpoints are kept)" in changed.stderr
    assert "sft.learning_rate" in changed.stderr and "redo=[sft]" in changed.stderr
    assert sorted((tmp_path / "tiny/stages/01-sft/work").glob("checkpoint-*")) == saved
    again = run_cli(*args, "sft.logging_steps=7", "sft.save_steps=15")  # "save more often": resumes
    assert again.returncode == 0, again.stderr[-3000:]
    done = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert done["status"] == "done" and done["metrics"]["resumed_from"] == str(saved[-1])


@pytest.mark.fault("save", "corrupt file", "0", "sets the cut checkpoint aside and resumes from the one before")
def test_a_checkpoint_cut_short_is_set_aside_and_the_one_before_is_used(tmp_path, cache_dir):
    args = _args(tmp_path, cache_dir)
    proc = _start(args)
    work = tmp_path / "tiny/stages/01-sft/work"
    _wait_for(work / "checkpoint-20/.complete", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    (work / "checkpoint-20/trainer_state.json").write_text('{"log_history": [')  # corrupt after it was marked
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "setting aside checkpoint" in again.stderr and "trainer_state.json has 17 bytes" in again.stderr
    record = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert record["metrics"]["resumed_from"].endswith("checkpoint-10")


def test_lock_refuses_a_live_owner_touching_nothing_and_takes_over_an_expired_lease(reference, tmp_path, cache_dir):
    run = tmp_path / "tiny"
    shutil.copytree(reference, run)  # a finished run in another folder: its records name paths relative to it
    args = _args(tmp_path, cache_dir)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    holder = RunLock(run)  # a live run: this test's process, renewing its lease
    holder.acquire()
    try:
        busy = run_cli(*args)
    finally:
        holder.release()
    assert busy.returncode == 2 and f"in use by pid {os.getpid()}" in busy.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # outcome.json, pipeline.log too
    (run / ".lock").write_text(json.dumps({"pid": 4242, "host": "node-b", "owner": "f00d", "since": "then",
                                           "heartbeat": time.time() - 500, "lease_s": 2}))  # a dead job elsewhere
    taken = run_cli(*args)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert "reusing finished stage" in taken.stderr and "training from" not in taken.stderr
    assert not (run / ".lock").exists() and json.loads((run / "outcome.json").read_text())["outcome"] == "passed"
    assert json.loads((run / "stages/01-sft/stage.json").read_text())["output_model"] == "stages/01-sft/model"


def test_full_disk_during_save_keeps_the_previous_checkpoint(reference, tmp_path, cache_dir):
    """A redo that cannot save (a disk that takes no file over 1 MB) fails with exit 4; the finished model it was
    to replace is kept, and the first command puts it back."""
    run = tmp_path / "tiny"
    shutil.copytree(reference, run)
    before = load_file(str(run / "stages/01-sft/model/model.safetensors"))

    def small_files():  # every file this process writes is capped at 1 MB: the 4 MB weights fail
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    cmd = [sys.executable, str(ROOT / "pipeline/run.py"), *_args(tmp_path, cache_dir, "redo=[sft]",
                                                                  "sft.max_steps=3")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=small_files, timeout=600)
    assert proc.returncode == 4, proc.stderr[-3000:]  # training failed: not the input's fault, not a crash
    assert "could not write the checkpoint" in proc.stderr and "previous checkpoint (if any) is intact" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.startswith("training failed: ")]) == 1
    outcome = json.loads((run / "outcome.json").read_text())
    assert (outcome["exit_code"], outcome["outcome"]) == (4, "training_failed")
    assert json.loads((run / "stages/01-sft/stage.json").read_text())["status"] != "done"
    (kept,) = (run / "kept").glob("01-sft@*")  # the finished stage this redo (another config) replaces, kept whole
    after = load_file(str(kept / "model/model.safetensors"))
    assert all((before[k] == after[k]).all() for k in before)
    back = run_cli(*_args(tmp_path, cache_dir))  # its own config again: put back and reused, nothing trained
    assert back.returncode == 0, back.stderr[-3000:]
    assert "put back from" in back.stderr and "reusing finished stage" in back.stderr
    assert "training from" not in back.stderr


def test_secrets_never_reach_run_files(tmp_path, cache_dir):
    """Secrets in the environment and tokens given as config values (`<stage>.hub_token` on the command
    line) reach no file of the run folder; the token still reaches the trainer, and changing it changes no
    fingerprint (the finished stage is reused)."""
    env = {"HF_TOKEN": "hf_PLANTEDsecret123", "WANDB_API_KEY": "wandbPLANTED456"}
    cli = {"sft.hub_token": "hf_CLIplanted789", "dpo.hub_token": "hf_DPOplanted000"}
    args = _args(tmp_path, cache_dir, "sft.max_steps=2", "eval.limit=4", *(f"{k}={v}" for k, v in cli.items()))
    proc = run_cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = tmp_path / "tiny"
    record = json.loads((run / "stages/01-sft/stage.json").read_text())
    assert record["config"]["hub_token"] == "<redacted>"
    assert "sft.hub_token=<redacted>" in json.loads((run / "manifest.json").read_text())["argv"]
    again = run_cli(*[a.replace("hf_CLIplanted789", "hf_CLIchanged246") for a in args])  # a new token: reused
    assert again.returncode == 0 and "reusing finished stage" in again.stderr, again.stderr[-2000:]
    planted = [*env.values(), *cli.values(), "hf_CLIchanged246"]
    files = [p for p in run.rglob("*") if p.is_file()]
    assert len(files) > 10
    for path in files:
        blob = path.read_bytes()
        assert not any(s.encode() in blob for s in planted), path
    assert not any(s in proc.stderr + again.stderr for s in planted)


def test_the_trainer_gets_the_token_and_its_pickle_does_not(tmp_path):
    import io

    import torch
    from omegaconf import OmegaConf
    from trl import SFTConfig

    from pipeline.train.trainer import trl_config

    stage = OmegaConf.create({"hub_token": "hf_INMEMORYonly1"})
    args = trl_config(SFTConfig, stage, {"output_dir": str(tmp_path), "use_cpu": True})
    assert args.hub_token == "hf_INMEMORYonly1" and f"Bearer {args.hub_token}" == "Bearer hf_INMEMORYonly1"
    saved = io.BytesIO()
    torch.save(args, saved)
    assert b"hf_INMEMORYonly1" not in saved.getvalue()
    assert torch.load(io.BytesIO(saved.getvalue()), weights_only=False).hub_token == "<redacted>"


def test_same_seed_same_losses_in_deterministic_mode(tmp_path, cache_dir):
    runs = []
    for name in ("a", "b"):
        proc = run_cli(*_args(tmp_path / name, cache_dir, "sft.max_steps=6", "deterministic=true"))
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(tmp_path / name / "tiny")
    assert _losses(runs[0]) == _losses(runs[1]) and len(_losses(runs[0])) >= 6
    assert json.loads((runs[0] / "manifest.json").read_text())["deterministic"] is True


def _wait_for_status(path: Path, status: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while (json.loads(path.read_text()) if path.exists() else {}).get("status") != status:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} never reached {status}"
        time.sleep(0.05)


@pytest.mark.fault("scoring", "SIGKILL", "137 (killed)", "scores again, trains nothing")
def test_sigkill_during_eval_rescores_only(tmp_path, cache_dir):
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft]",
            "eval.max_gen_toks=256", "eval.batch_size=4"]  # a slower eval, so the kill lands inside it
    proc = _start(args)
    record = tmp_path / "tiny/stages/01-sft/stage.json"
    _wait_for_status(record, "trained", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = json.loads(record.read_text())
    assert killed["status"] == "trained" and not killed.get("eval")  # no partial result was recorded
    weights = (tmp_path / "tiny/stages/01-sft/model/model.safetensors").stat().st_mtime_ns
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "training from" not in again.stderr and re.search("01-sft (scored in|scores reused)", again.stderr)
    assert (tmp_path / "tiny/stages/01-sft/model/model.safetensors").stat().st_mtime_ns == weights
    assert json.loads(record.read_text())["eval"]["samples"] == {"tiny_gsm": 50}


@pytest.mark.fault("training", "SIGKILL", "137 (killed)", "a sweep's finished candidates; the killed one trains again")
def test_sigkill_during_a_sweep_candidate_keeps_the_finished_ones(tmp_path, cache_dir):
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft,dpo]",
            "dpo.mixture=tiny_prefs", "dpo.on_policy.enabled=false", "dpo.max_steps=30", "dpo.save_steps=1000",
            "dpo.per_device_train_batch_size=4", "dpo.sweep.beta=[0.1]", "dpo.sweep.learning_rate=[1e-5,2e-5]",
            "dpo.soup.top_k=0", "dpo.merge.stage=", f"dpo.gate.metric={'tiny_gsm/exact_match,strict-match'}"]
    proc = _start(args)
    cands = tmp_path / "tiny/stages/02-dpo/candidates"
    _wait_for_status(cands / "beta0.1-lr1e-05/stage.json", "done", proc)
    _wait_for(cands / "beta0.1-lr2e-05/work", proc)  # the second candidate is training
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = (cands / "beta0.1-lr1e-05/stage.json").stat().st_mtime_ns
    grown = [*args, "dpo.sweep.learning_rate=[1e-5,2e-5,4e-5]"]  # a grid that grows changes the stage
    refused = run_cli(*grown)
    assert refused.returncode == 2 and "dpo.sweep.learning_rate" in refused.stderr, refused.stderr[-3000:]
    again = run_cli(*grown, "redo=[dpo]")  # retrained: its finished candidate is still reused
    assert again.returncode == 0, again.stderr[-3000:]
    assert "candidate beta0.1-lr1e-05: reusing" in again.stderr
    assert "candidate beta0.1-lr2e-05: training" in again.stderr
    assert "candidate beta0.1-lr4e-05: training" in again.stderr
    assert (cands / "beta0.1-lr1e-05/stage.json").stat().st_mtime_ns == first
    assert json.loads((tmp_path / "tiny/stages/02-dpo/stage.json").read_text())["status"] == "done"


@pytest.mark.fault("scoring", "SIGTERM", "75", "scores, trains nothing")
def test_sigterm_while_scoring_stops_at_once_and_the_rerun_scores_without_retraining(reference, tmp_path,
                                                                                      cache_dir):
    # eval settings of its own: the reference run's scores of the same weights are not in the cache for these
    args = _args(tmp_path, cache_dir, "eval.max_gen_toks=128")
    proc = _start(args)
    record = tmp_path / "tiny/stages/01-sft/stage.json"
    _wait_for_status(record, "trained", proc)  # written just before its scoring starts
    trained = json.loads(record.read_text())["metrics"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "SIGTERM received; stopped" in err and "scoring 01-sft" in err
    assert json.loads((tmp_path / "tiny/outcome.json").read_text())["outcome"] == "preempted"
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    done = json.loads(record.read_text())
    assert done["status"] == "done" and done["metrics"] == trained  # scored, not trained again
    assert _losses(tmp_path / "tiny") == pytest.approx(_losses(reference), abs=1e-4)


@pytest.mark.fault("tokenising", "SIGTERM", "75 (SIGINT, handled alike)", "tokenises again, then trains")
def test_ctrl_c_while_tokenising_stops_at_once_and_the_rerun_finishes(tmp_path, cache_dir):
    """SIGINT to the process group, as a terminal sends it; tokenising is held up by the test hook."""
    args = _args(tmp_path, cache_dir, "sft.max_length=200", "eval.tasks=[]", "sft.gate.metric=")  # a new cache key
    env = {**os.environ, "PIPELINE_TEST_SLOW_PREP_S": "120"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "pipeline/run.py"), *args], cwd=ROOT, text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    log = tmp_path / "tiny/pipeline.log"
    deadline = time.time() + 600
    while "test hook: preparation slowed" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)  # well before the hook's 120 s
    assert proc.returncode == 75, err[-3000:]
    assert "SIGINT received; stopped tokenising" in err and "Traceback" not in err
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.parametrize("point", [
    pytest.param("model-saved", marks=pytest.mark.fault(
        "save", "SIGKILL", "137 (killed)", "resumes from its final checkpoint: no step trained twice")),
    pytest.param("scored 01-sft", marks=pytest.mark.fault(
        "scoring", "SIGKILL", "137 (killed)", "the trained model; scored again (or from the score cache)")),
    pytest.param("leaderboard", marks=pytest.mark.fault(
        "leaderboard", "SIGKILL", "137 (killed)", "every stage; the leaderboard is written again")),
])
def test_a_node_dying_at_any_point_resumes_with_the_same_losses_and_nothing_trained_twice(point, reference, tmp_path,
                                                                                          cache_dir):
    """SIGKILL (pipeline/faults.py) after a stage's model/ is committed but before its record says so, while its
    checkpoint is scored, and while the leaderboard is written: the rerun finishes and trains no step twice."""
    args = _args(tmp_path, cache_dir)
    env = {**os.environ, "PIPELINE_TEST_KILL_AT": point}
    killed = subprocess.run([sys.executable, str(ROOT / "pipeline/run.py"), *args], cwd=ROOT, env=env, text=True,
                            capture_output=True, timeout=900)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    before = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    after = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert after["status"] == "done" and (tmp_path / "tiny/leaderboard.html").is_file()
    assert _losses(tmp_path / "tiny") == pytest.approx(_losses(reference), abs=1e-4)
    if point == "model-saved":  # resumed from the last checkpoint, the final step's: no step trained again
        assert before["status"] == "running" and after["metrics"]["resumed_from"].endswith("checkpoint-30")
    else:  # finished before the kill: scored (again), not trained
        assert before["status"] in ("trained", "done") and after["metrics"] == before["metrics"]


def test_a_stop_signal_during_start_up_exits_75_and_the_rerun_runs(tmp_path, cache_dir):
    """SIGTERM as soon as the run holds its lock, before it has prepared anything: a clean stop with exit 75 and
    its outcome (before, the handlers were installed later and the signal killed the process: 143), nothing
    trained; the same command again runs the chain."""
    args = ("recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, "stages=[sft]",
            "sft.max_steps=2")
    stopped = run_cli(*args, env={"PIPELINE_TEST_TERM_AT": "locked"})
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    outcome = json.loads((tmp_path / "tiny/outcome.json").read_text())
    assert outcome["outcome"] == "preempted" and "SIGTERM received" in outcome["reason"]
    assert not (tmp_path / "tiny/stages").exists() and not (tmp_path / "tiny/.lock").exists()
    again = run_cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
