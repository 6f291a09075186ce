"""Two "machines" on this host: the tiny chain (SFT, mid-training with LoRA) under two launchers with
`--num_machines 2 --machine_rank {0,1} --main_process_ip 127.0.0.1`, one process each, over gloo (docs/cluster.md),
matches one process with 2 gradient-accumulation steps, as tests/test_distributed.py's one-launcher test does.

Run twice: with `accelerate launch` as docs/cluster.md gives it, and with the exact command each node of a Slurm
job runs (slurm/node.sh, which slurm/launch.sh starts on every node with srun), for SLURM_NNODES=2 and
SLURM_NODEID=0 / 1, with the main address 127.0.0.1 (what launch.sh takes from the job's node list).

And on an empty cache, three times: both machines reach every cache folder (data, tokenizer, base model,
tokenised rows) before it exists, and both must come through.

And two machines that do not share their folders (each launcher in its own working directory, with a relative
`output_root` and `cache_dir`: a node-local /scratch): both stop at start, exit 2, and say why
(pipeline/chain/ranks.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST, ROOT, run_cli
from test_distributed import LOSS_TOL

pytestmark = pytest.mark.slow
STAGES = ("01-sft", "02-midtrain")
CHAIN = [*FAST, "sft.max_steps=6", "midtrain.max_steps=4", "sft.logging_steps=1", "midtrain.logging_steps=1",
         "midtrain.lora.r=8", "midtrain.learning_rate=3e-3", "midtrain.lora.dropout=0", "sft.gate.metric=",
         "midtrain.gate.metric=", "eval.tasks=[]"]


# the least that builds every cache folder on two machines: a few pretraining and SFT steps, no evaluation
EMPTY_CACHE = [*FAST, "tiny.pretrain_steps=4", "sft.max_steps=2", "sft.logging_steps=1", "stages=[sft]",
               "sft.gate.metric=", "eval.tasks=[]"]


def _accumulation(steps: int) -> list[str]:
    return [f"{stage}.gradient_accumulation_steps={steps}" for stage in ("sft", "midtrain")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_machines(port: int, args: list[str]) -> list[tuple[list[str], dict]]:
    """`accelerate launch` for machine 0 and machine 1 of a world of 2, one process each."""
    return [(["accelerate", "launch", "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
              "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--multi_gpu",
              "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "pipeline/run.py"), *args], {})
            for rank in (0, 1)]


def _both(commands: list[list[str]], env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run the two machines' commands side by side; return both results."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {}), **extra}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for cmd, extra in commands]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def _assert_matches(run: Path, reference: Path) -> None:
    for stage in STAGES:
        record = json.loads((run / "stages" / stage / "stage.json").read_text())
        ref = json.loads((reference / "stages" / stage / "stage.json").read_text())
        assert record["status"] == "done" and record["world_size"] == record["metrics"]["world_size"] == 2
        assert ref["metrics"]["world_size"] == 1
        steps, losses = zip(*record["metrics"]["losses"], strict=True)
        ref_steps, ref_losses = zip(*ref["metrics"]["losses"], strict=True)
        assert steps == ref_steps and losses[-1] < losses[0]
        assert list(losses) == pytest.approx(ref_losses, abs=LOSS_TOL), stage
    assert json.loads((run / "outcome.json").read_text())["outcome"] == "passed"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, cache_dir, tiny_base) -> Path:
    """The reference: the chain in one process, 2 gradient-accumulation steps."""
    out = tmp_path_factory.mktemp("one-process")
    proc = run_cli("recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *CHAIN, *_accumulation(2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "tiny"


def test_two_machines_under_accelerate_launch_match_one_process(one_process, tmp_path, cache_dir):
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *CHAIN, *_accumulation(1)]
    for proc in _both(_two_machines(_free_port(), args)):
        assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_matches(tmp_path / "tiny", one_process)


@pytest.mark.parametrize("attempt", range(3))
def test_two_machines_on_an_empty_cache_both_come_through(tmp_path, attempt):
    cache = tmp_path / "cache"
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache}", *EMPTY_CACHE]
    for rank, proc in enumerate(_both(_two_machines(_free_port(), args))):
        assert proc.returncode == 0, f"machine {rank}: {proc.stderr[-4000:]}"
    record = json.loads((tmp_path / "tiny" / "stages" / "01-sft" / "stage.json").read_text())
    assert record["status"] == "done" and record["world_size"] == record["metrics"]["world_size"] == 2
    (base,) = cache.glob("tiny-*/model")
    assert json.loads((base.parent / "pretrain.json").read_text())["world_size"] == 2  # built by both machines
    assert [p.name for p in cache.rglob(".*")] == []  # no temporary folder left behind


def test_the_slurm_node_commands_run_the_chain_on_two_machines(one_process, tmp_path, cache_dir):
    port = _free_port()
    env = {"SLURM_NNODES": "2", "MAIN_PROCESS_IP": "127.0.0.1", "MAIN_PROCESS_PORT": str(port),
           "NPROC_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    args = ["recipe=tiny", f"output_root={tmp_path}", f"cache_dir={cache_dir}", *CHAIN, *_accumulation(1)]
    commands = [([str(ROOT / "slurm/node.sh"), *args], {"SLURM_NODEID": str(rank)}) for rank in (0, 1)]
    results = _both(commands, env)
    for rank, proc in enumerate(results):
        assert proc.returncode == 0, proc.stderr[-4000:]
        said = f"slurm: node {rank} of 2: 1 process(es), 0 GPU(s), config DDP: smol-pipeline --num_machines 2 " \
               f"--machine_rank {rank} --num_processes 2 --main_process_ip 127.0.0.1 --main_process_port {port} " \
               f"--mixed_precision no --dynamo_backend no --multi_gpu -- recipe=tiny "
        assert said in proc.stderr
    _assert_matches(tmp_path / "tiny", one_process)


def test_machines_that_do_not_share_their_folders_both_stop_with_a_message(tmp_path):
    port, nodes = _free_port(), [tmp_path / "node-a", tmp_path / "node-b"]
    args = ["recipe=tiny", "output_root=runs", "cache_dir=cache", *EMPTY_CACHE, "collective_timeout_s=60"]
    smol = str(Path(sys.executable).with_name("smol-pipeline"))
    started, procs = time.monotonic(), []
    for rank, node in enumerate(nodes):
        node.mkdir()
        launch = [smol, "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
                  "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--multi_gpu",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--", *args]
        procs.append(subprocess.Popen(launch, cwd=node, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    errs = [proc.communicate(timeout=120)[1] for proc in procs]
    assert time.monotonic() - started < 120
    host = socket.gethostname()
    said = (f"error: rank 1 on {host} does not see the run folder {nodes[0]}/runs/tiny (looking in "
            f"{nodes[1]}/runs/tiny) or the cache folder {nodes[0]}/cache (looking in {nodes[1]}/cache) that rank 0 "
            f"on {host} writes: output_root and cache_dir must be on a filesystem every node shares\n")
    for proc, err, who in zip(procs, errs, ("", f"rank 1 on {host}: "), strict=True):
        assert proc.returncode == 2, err[-4000:]
        assert f"{who}{said}" in err, err[-4000:]
        assert "Traceback" not in err
    assert json.loads((nodes[0] / "runs/tiny/outcome.json").read_text())["outcome"] == "bad_input"
    assert not [p for node in nodes for p in node.rglob(".rank-check-*")]  # the tokens are gone
