"""The Slurm batch scripts (slurm/) against a real single-node Slurm started here (docs/cluster.md, "Slurm").

Needs root and Debian's `slurm-wlm` and `munge` (`.ci/run` installs them); without them the tests
are skipped, except in CI (`CI` set), where they fail. The node has 2 CPUs and no GPUs, so every job
asks for `--gpus-per-node=0` and CPUs that fit; `launch.sh` then runs the pipeline on CPU processes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator

import pytest
import slurmkit as sk
from conftest import FAST, ROOT

METRIC = "tiny_gsm/exact_match,strict-match"
NO_EVAL = ["eval.tasks=[]", "sft.gate.metric=", "midtrain.gate.metric="]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict]:
    """A one-node cluster (tests/slurmkit.py); yields the environment for Slurm commands and jobs."""
    with sk.cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


@pytest.mark.slow
def test_pipeline_sbatch_runs_the_tiny_recipe_on_two_processes(slurm, tiny_base, tmp_path, cache_dir):
    t0 = time.time()
    env = {**slurm, "NPROC_PER_NODE": "2", "ACCELERATE_CONFIG": "cpu"}  # a shipped config's name
    proc = sk.run(env, "timeout", "900", "sbatch", "--wait", *sk.resources(tmp_path), "slurm/pipeline.sbatch",
                  "recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST, timeout=960)
    logs = sk.logs(tmp_path)
    assert proc.returncode == 0, proc.stderr + logs[-4000:]
    assert "slurm: node 0 of 1: 2 process(es), 0 GPU(s), config cpu: smol-pipeline " \
           "--num_machines 1 --machine_rank 0 --num_processes 2 --main_process_ip " in logs
    run = tmp_path / "tiny"
    for name in ("01-sft", "02-midtrain"):
        record = json.loads((run / "stages" / name / "stage.json").read_text())
        assert record["status"] == "done" and record["world_size"] == 2
        assert record["eval"]["metrics"][METRIC] >= 0
        assert (run / "stages" / name / "model/model.safetensors").is_file()
    assert "world size 2" in (run / "pipeline.log").read_text()
    assert (run / "leaderboard.csv").is_file() and not (run / ".lock").exists()
    print(f"slurm pipeline.sbatch: {time.time() - t0:.1f} s")


@pytest.mark.slow
def test_a_job_exits_with_the_pipelines_own_code_and_its_log_holds_no_secret(slurm, tmp_path):
    planted = "hf_planted0secret0value"
    proc = sk.run(slurm, "timeout", "300", "sbatch", "--wait", *sk.resources(tmp_path), "slurm/pipeline.sbatch",
                  "recipe=tiny", "sft.learnin_rate=3e-4", f"sft.hub_token={planted}", timeout=320)
    logs = sk.logs(tmp_path)
    assert proc.returncode == 2, proc.stderr + logs[-4000:]  # `accelerate launch` would say 1
    assert "error: unknown config key 'sft.learnin_rate'" in logs
    assert "-- recipe=tiny sft.learnin_rate=3e-4 sft.hub_token=<redacted>\n" in logs
    assert planted not in logs and planted not in "".join(p.read_text() for p in tmp_path.rglob("*") if p.is_file())


@pytest.mark.slow
def test_sweep_runs_one_job_per_candidate_then_the_selection(slurm, tiny_base, tmp_path, cache_dir):
    """3 candidates: candidate 0 first (it also makes the pairs), then an array of 2 side by side, then select."""
    t0 = time.time()
    sweep = ["stages=[sft,midtrain,dpo]", "dpo.mixture=tiny_prefs", "dpo.max_steps=4", "dpo.logging_steps=1",
             "dpo.per_device_train_batch_size=4", "dpo.sweep.beta=[0.05,0.2,0.5]", "dpo.sweep.learning_rate=[1e-3]",
             "dpo.on_policy.max_prompts=24", "dpo.gate.max_drop=1.0", "dpo.soup.top_k=2", "dpo.merge.stage=midtrain"]
    proc = sk.run(slurm, "slurm/sweep.sh", *sk.resources(tmp_path, cpus=1), "recipe=tiny", f"output_root={tmp_path}",
                  f"cache_dir={cache_dir}", *FAST, *sweep)
    assert proc.returncode == 0, proc.stderr
    first, array, select = re.findall(r"job (\d+)", proc.stdout)
    info = sk.wait_for_job(slurm, select)
    logs = sk.logs(tmp_path)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", logs[-4000:]
    (head,), tasks = sk.job(slurm, first), sk.job(slurm, array)
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["1", "2"]
    assert all(t["JobState"] == "COMPLETED" for t in [head, *tasks])
    a, b = tasks  # times have 1 s resolution: the order of the dependencies, and the array side by side
    assert head["EndTime"] <= min(a["StartTime"], b["StartTime"])
    assert max(a["EndTime"], b["EndTime"]) <= info["StartTime"]
    assert a["StartTime"] < b["EndTime"] and b["StartTime"] < a["EndTime"]

    dpo = tmp_path / "tiny/stages/03-dpo"
    names = ["beta0.05-lr0.001", "beta0.2-lr0.001", "beta0.5-lr0.001"]
    for name in names:
        record = json.loads((dpo / "candidates" / name / "stage.json").read_text())
        assert record["status"] == "done" and METRIC in record["eval"]["metrics"]
    stage = json.loads((dpo / "stage.json").read_text())
    assert stage["status"] == "done"
    table = stage["metrics"]["candidates"]
    assert [row["candidate"] for row in table] == [*names, "soup", "merge"]
    assert stage["metrics"]["selected"] in {row["candidate"] for row in table}
    assert stage["eval"]["metrics"][METRIC] == max(row[METRIC] for row in table)
    chosen = stage["metrics"]["trained_with"]  # the selected model's settings (the record's config: the stage's)
    assert "sweep" not in chosen and "candidate" not in chosen and "sweep" in stage["config"]
    # each candidate trained once, in its own job; the pairs were sampled once; the selection reused them all
    for i, name in enumerate(names):
        assert logs.count(f"candidate {name}: training") == 1
        assert f"sweep candidate {i} done" in logs
    assert logs.count("on-policy pairs:") == 1
    select_log = (tmp_path / f"slurm-{select}.out").read_text()
    assert all(f"candidate {name}: reusing" in select_log for name in names) and "training (beta" not in select_log
    assert "selected candidate" in select_log
    print(f"slurm sweep: {time.time() - t0:.1f} s")


@pytest.mark.slow
def test_preempted_job_saves_requeues_itself_and_resumes(slurm, tiny_base, tmp_path, cache_dir):
    t0 = time.time()
    name = f"preempt-{os.getpid()}"
    job = subprocess.Popen(
        ["timeout", "900", "sbatch", "--wait", f"--job-name={name}", *sk.resources(tmp_path),
         "slurm/pipeline.sbatch", "recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *FAST,
         *NO_EVAL, "stages=[sft]", "sft.max_steps=40", "sft.save_steps=5"],
        cwd=ROOT, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work = tmp_path / "tiny/stages/01-sft/work"
    deadline = time.time() + 600
    while not (work / "checkpoint-5/trainer_state.json").exists():
        assert job.poll() is None and time.time() < deadline, sk.logs(tmp_path)[-4000:]
        time.sleep(0.5)
    (job_id,) = sk.run(slurm, "squeue", "-h", "-n", name, "-o", "%i").stdout.split()
    # what Slurm does 120 s before the time limit (--signal=B:USR1@120): signal the batch shell only
    assert sk.run(slurm, "scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    _, err = job.communicate(timeout=900)
    logs = sk.logs(tmp_path)
    assert job.returncode == 0, err + logs[-4000:]
    assert "slurm: USR1 received; forwarding USR1 to the job steps" in logs
    assert "preempted: SIGUSR1 received; stopped cleanly in 01-sft" in logs
    assert f"requeueing job {job_id} to resume" in logs and f"job {job_id} (restart 1)" in logs
    resumed = re.search(r"resuming 01-sft from (\S+/checkpoint-(\d+))", logs)
    assert resumed and int(resumed.group(2)) >= 5
    record = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert record["status"] == "done" and record["metrics"]["resumed_from"] == resumed.group(1)
    assert record["metrics"]["steps"] == 40
    assert sk.job(slurm, job_id)[0]["Restarts"] == "1"
    print(f"slurm preemption: {time.time() - t0:.1f} s")


@pytest.mark.slow
def test_one_candidate_option_is_checked_and_leaves_the_fingerprint_alone():
    from pipeline.config import load_config
    from pipeline.errors import ConfigError
    from pipeline.fingerprints import stage_section

    base = ["recipe=tiny", "stages=[sft,midtrain,dpo]"]  # the tiny sweep: 2 betas x 2 learning rates
    one = load_config([*base, "dpo.candidate=3"])
    assert stage_section(one, "dpo") == stage_section(load_config(base), "dpo")
    for bad in ("dpo.candidate=4", "dpo.candidate=-1"):
        with pytest.raises(ConfigError, match=re.escape("the sweep has 4 candidate(s), numbered 0 to 3")):
            load_config([*base, bad])
    with pytest.raises(ConfigError, match="list dpo in 'stages'"):
        load_config(["recipe=tiny", "stages=[sft]", "dpo.candidate=0"])
