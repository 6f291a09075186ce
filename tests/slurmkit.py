"""A real Slurm cluster on this machine, for tests/test_slurm.py (one node) and tests/test_slurm_two_nodes.py.

`cluster(state, nodes)` starts munged (unless it runs), one slurmctld and `nodes` slurmd. One node is this machine
under its own hostname. Several are named n1, n2, ..., and each slurmd runs in its own mount and UTS namespace
(`unshare`), so each node is a machine of its own as far as a job can tell: its hostname is the node's name, its
/etc/hosts resolves every node name to that node's loopback address (127.0.0.2, 127.0.0.3, ...), and its
`<state>/scratch` is its own folder `<state>/scratch-<node>` (a node-local disk; everything else, the repository
and tmp folders included, is shared). Every daemon listens on a free port of its own, so a cluster never meets
another one on this machine. Needs root and Debian's `slurm-wlm` and `munge` (and namespaces for several nodes);
without them the tests skip, except in CI (`CI` set), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT, missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def slurm_conf(state: Path, nodes: list[tuple[str, str]], ports: list[int]) -> str:
    """slurm.conf: the controller on this host at `ports[0]`, node i (name, address) at port `ports[i + 1]`."""
    memory_mb = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 * 8 // 10 // len(nodes)
    cpus = os.cpu_count() or 1
    lines = [f"NodeName={name} NodeAddr={addr} Port={port} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN"
             for (name, addr), port in zip(nodes, ports[1:], strict=True)]
    return f"""ClusterName=pipeline-test
SlurmctldHost={socket.gethostname().split(".")[0]}(127.0.0.1)
SlurmctldPort={ports[0]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire + 1 s (default 120) and the scheduler's next pass: keep both short
AuthInfo=cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool-%n
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd-%n.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd-%n.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{chr(10).join(lines)}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _start_munge() -> None:
    for path in ("/run/munge", "/var/lib/munge", "/var/log/munge"):
        os.makedirs(path, exist_ok=True)
        shutil.chown(path, "munge", "munge")
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode:
        subprocess.run(["runuser", "-u", "munge", "--", shutil.which("munged")], check=True)


def _slurmd(state: Path, name: str, env: dict, own_machine: bool) -> subprocess.Popen:
    """slurmd for node `name`; `own_machine`: in a mount and UTS namespace of its own (the module's docstring)."""
    (state / f"spool-{name}").mkdir()
    cmd = ["slurmd", "-D", "-N", name, "-f", str(state / "slurm.conf")]
    if own_machine:
        (state / f"scratch-{name}").mkdir()
        hosts, scratch = shlex.quote(str(state / "hosts")), shlex.quote(str(state / "scratch"))
        setup = (f"hostname {name} && mount --bind {hosts} /etc/hosts && "
                 f"mount --bind {scratch}-{name} {scratch} && exec {shlex.join(cmd)}")
        cmd = ["unshare", "--mount", "--uts", "--propagation", "private", "--", "sh", "-c", setup]
    with open(state / f"slurmd-{name}.out", "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def cluster(state: Path, nodes: int = 1) -> Iterator[dict]:
    """Start a cluster of `nodes` nodes with its files in `state`; yield the environment for Slurm commands and
    jobs (the project's Python first on PATH). On leaving, cancel every job and stop every daemon it started."""
    absent = [cmd for cmd in ("sbatch", "slurmctld", "slurmd", "munged") if not shutil.which(cmd)]
    if absent or os.geteuid() != 0:
        missing(f"Slurm needs root and slurm-wlm + munge (missing: {absent or 'root'})")
    if nodes > 1 and not (shutil.which("unshare") and subprocess.run(
            ["unshare", "--mount", "--uts", "true"], capture_output=True).returncode == 0):
        missing("several Slurm nodes on one machine need mount and UTS namespaces (unshare --mount --uts)")
    names = [(socket.gethostname().split(".")[0], "127.0.0.1")] if nodes == 1 else [
        (f"n{i + 1}", f"127.0.0.{i + 2}") for i in range(nodes)]
    (state / "ctld").mkdir()
    (state / "scratch").mkdir()
    conf = state / "slurm.conf"
    conf.write_text(slurm_conf(state, names, [_free_port() for _ in range(nodes + 1)]))
    (state / "hosts").write_text(Path("/etc/hosts").read_text() + "".join(f"{a} {n}\n" for n, a in names))
    _start_munge()
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    daemons = []
    try:
        with open(state / "slurmctld.out", "w") as out:
            daemons.append(subprocess.Popen(["slurmctld", "-D", "-c", "-f", str(conf)], env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        daemons += [_slurmd(state, name, env, own_machine=nodes > 1) for name, _ in names]
        deadline = time.time() + 60
        while (states := run(env, "sinfo", "-h", "-N", "-o", "%T").stdout.split()) != ["idle"] * nodes:
            logs = "".join(p.read_text()[-1500:] for p in sorted(state.glob("slurm*.log")))
            assert time.time() < deadline and all(d.poll() is None for d in daemons), f"{states}\n{logs}"
            time.sleep(0.5)
        yield env
    finally:
        jobs = run(env, "squeue", "-h", "-o", "%i").stdout.split()
        if jobs:
            run(env, "scancel", *jobs)
            deadline = time.time() + 30
            while run(env, "squeue", "-h", "-o", "%i").stdout.split() and time.time() < deadline:
                time.sleep(0.5)
        run(env, "scontrol", "shutdown")
        for daemon in daemons:
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


def run(env: dict, *cmd: str, timeout: int = 60) -> subprocess.CompletedProcess:
    """A command in the repository root, its output captured."""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def resources(out: Path, cpus: int = 2) -> list[str]:
    """sbatch options for this machine: no GPUs, `cpus` CPUs and 3 GB per node, the job's log in `out`."""
    return ["--gpus-per-node=0", f"--cpus-per-task={cpus}", "--mem=3G", "--time=30", f"--output={out}/slurm-%j.out"]


def logs(out: Path) -> str:
    """Every job log in `out`."""
    return "".join(p.read_text() for p in sorted(out.glob("slurm-*.out")))


def job(env: dict, job_id: str) -> list[dict]:
    """`scontrol show job` as one dict per job (an array gives one per task)."""
    text = run(env, "scontrol", "show", "job", "-o", job_id).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in text.splitlines() if line.strip()]


def wait_for_job(env: dict, job_id: str, timeout: float = 900) -> dict:
    """Wait until the job has ended (not pending, running or requeued); its `job` record."""
    deadline = time.time() + timeout
    while True:
        (info,) = job(env, job_id)
        if info["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
            return info
        assert time.time() < deadline, f"job {job_id} still {info['JobState']}"
        time.sleep(1)
