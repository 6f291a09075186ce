"""slurm/pipeline.sbatch on a real Slurm cluster of three nodes on this machine (tests/slurmkit.py: one slurmd per
node, each in its own mount and UTS namespace: own hostname, own address 127.0.0.x, own `scratch` folder), as
docs/cluster.md ("Slurm") describes:

- a 2-node tiny chain (one process per node over gloo, world size 2) preempted while it scores its SFT stage is
  requeued by slurm/launch.sh (exit 75) with its first node drained, runs again on the other two nodes (the former
  rank 1 now the main node), scores the trained stage without training it again, and ends with exit 0;
- an `output_root` on each node's own scratch folder (same path, different folders) is refused at start on both
  nodes, exit 2 and one message per node, in seconds rather than at the collective timeout.

Needs root, Debian's `slurm-wlm` and `munge`, and mount and UTS namespaces (`unshare`): without them the tests skip,
except in CI.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurmkit as sk
from conftest import FAST

pytestmark = pytest.mark.slow
NODES = ["n1", "n2", "n3"]  # tests/slurmkit.py's names
METRIC = "tiny_gsm/exact_match,strict-match"
# one SFT stage of a few steps; answers scored one at a time, so scoring lasts seconds and a signal lands inside it
CHAIN = [*FAST, "stages=[sft]", "sft.max_steps=10", "eval.batch_size=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[dict, Path]]:
    """Three nodes; yields the environment for Slurm commands and jobs, and the cluster's folder."""
    state = tmp_path_factory.mktemp("slurm-nodes")
    with sk.cluster(state, len(NODES)) as env:
        yield env, state


def _submit(env: dict, out: Path, *args: str) -> str:
    """`sbatch --nodes=2 slurm/pipeline.sbatch recipe=tiny ARGS`; the job's id."""
    env = {**env, "PIPELINE_CPU_THREADS": "1"}  # the two nodes share this machine's cores
    proc = sk.run(env, "sbatch", "--parsable", "--nodes=2", *sk.resources(out, cpus=1), "slurm/pipeline.sbatch",
                  "recipe=tiny", *args)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_two_node_chain_preempted_while_scoring_is_requeued_onto_other_nodes_and_finishes(
        cluster, tiny_base, tmp_path, cache_dir):
    env, _ = cluster
    t0 = time.time()
    job_id = _submit(env, tmp_path, f"output_root={tmp_path}", f"cache_dir={cache_dir}", *CHAIN,
                     "collective_timeout_s=120")
    log = tmp_path / "tiny/pipeline.log"
    polls = 0
    while not (log.exists() and "sft: trained in" in log.read_text()):  # scoring 01-sft starts right after
        if (polls := polls + 1) % 5 == 0:
            state = sk.job(env, job_id)[0]["JobState"]
            assert state in ("PENDING", "CONFIGURING", "RUNNING") and time.time() < t0 + 300, sk.logs(tmp_path)
        time.sleep(0.2)
    first = sk.job(env, job_id)[0]["NodeList"]
    assert sk.run(env, "scancel", "--batch", "--signal=USR1", job_id).returncode == 0  # Slurm's warning signal
    # the first node goes away (drained): the requeued job runs on the other two
    assert sk.run(env, "scontrol", "update", f"NodeName={NODES[0]}", "State=DRAIN", "Reason=test").returncode == 0
    try:
        info = sk.wait_for_job(env, job_id, timeout=600)
    finally:
        sk.run(env, "scontrol", "update", f"NodeName={NODES[0]}", "State=RESUME")
    logs, second = sk.logs(tmp_path), info["NodeList"]
    print(f"\nslurm 2 nodes: job {job_id} ran on {first}, preempted while scoring, requeued onto {second}: "
          f"{time.time() - t0:.1f} s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", logs[-6000:]
    assert (first, second) == ("n[1-2]", "n[2-3]") and info["Restarts"] == "1"
    for restart, main in ((0, "n1"), (1, "n2")):
        assert re.search(rf"slurm: job {job_id} \(restart {restart}\): 2 node\(s\), main {main}:\d+", logs), logs
    assert logs.count("slurm: node 0 of 2: 1 process(es), 0 GPU(s)") == 2
    assert logs.count("slurm: node 1 of 2: 1 process(es), 0 GPU(s)") == 2
    assert "slurm: USR1 received; forwarding USR1 to the job steps" in logs
    assert re.search(r"preempted: SIGUSR1 received; stopped (cleanly before )?scoring 01-sft", logs), logs[-6000:]
    assert f"preempted (exit 75 after USR1); requeueing job {job_id} to resume" in logs

    record = json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())
    assert record["status"] == "done" and record["metrics"]["world_size"] == 2
    assert record["metrics"]["steps"] == 10 and METRIC in record["eval"]["metrics"]
    text = log.read_text()
    scored = re.findall("01-sft (scored in|scores reused)", text)
    assert text.count("sft: trained in") == 1 and len(scored) == 1  # trained once, scored once
    outcome = json.loads((tmp_path / "tiny/outcome.json").read_text())
    assert outcome["exit_code"] == 0, outcome


def test_node_local_output_root_is_refused_on_both_nodes(cluster, tiny_base, tmp_path, cache_dir):
    """`<state>/scratch` is a different folder on each node: the run folder under it is node-local."""
    env, state = cluster
    t0 = time.time()
    job_id = _submit(env, tmp_path, f"output_root={state}/scratch/runs", f"cache_dir={cache_dir}",
                     *CHAIN)  # the collective timeout stays its default, 5 h
    info = sk.wait_for_job(env, job_id, timeout=300)
    took, logs = time.time() - t0, sk.logs(tmp_path)
    print(f"\nslurm 2 nodes: node-local output_root refused on {info['NodeList']} in {took:.1f} s")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", logs[-6000:]
    main, other = sk.run(env, "scontrol", "show", "hostnames", info["NodeList"]).stdout.split()
    message = (f"error: rank 1 on {other} does not see the run folder {state}/scratch/runs/tiny that rank 0 on {main} "
               f"writes: output_root and cache_dir must be on a filesystem every node shares")
    assert logs.count(message) == 2, logs[-6000:]  # once per node
    for node, task in ((main, 0), (other, 1)):
        assert f"srun: error: {node}: task {task}: Exited with exit code 2" in logs, logs[-6000:]
    assert took < 120
    # the main node wrote the run folder on its own scratch; the other node and this machine see none
    assert (state / f"scratch-{main}/runs/tiny").is_dir()
    assert not (state / f"scratch-{other}/runs").exists() and not (state / "scratch/runs").exists()
