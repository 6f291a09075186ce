"""The documented commands and their exit codes, run as a user runs them.

`smol-pipeline` (pipeline/launch.py: accelerate's own launcher) exits with the pipeline's code on 1 and 2
processes: 2 a bad key, 3 a gate stop, 75 a preemption (SIGTERM / SIGUSR1), 1 a crash, with no launcher
traceback. `accelerate launch pipeline/run.py` reports every failure as 1; `<run>/outcome.json` tells them
apart. A crash's traceback is appended to `<run>/pipeline.log`, and the last stderr line says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import FAST, ROOT, missing, run_cli

SMOL = Path(sys.executable).with_name("smol-pipeline")
ONE: list[str] = []
TWO = ["--config_file", str(ROOT / "recipes/accelerate/cpu.yaml"), "--num_processes", "2"]
NO_EVAL = ["eval.tasks=[]", "sft.gate.metric=", "midtrain.gate.metric="]
GATE = ["stages=[sft]", "sft.max_steps=2", "eval.limit=4", "eval.max_gen_toks=8", "sft.gate.min=1.0",
        "sft.gate.action=stop"]  # an exact-match floor above 1: the gate after sft stops the chain


@pytest.fixture(scope="module")
def smol() -> str:
    """The installed console script (`pip install -e .` puts it beside the interpreter)."""
    if not SMOL.is_file():
        why = f"{SMOL} is missing: install the project (pip install -e .)"
        missing(why)
    return str(SMOL)


def _args(out: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["recipe=tiny", f"output_root={out}", f"cache_dir={cache_dir}", *FAST, *extra]


def _command(kind: str, smol: str, launch: list[str], args: list[str]) -> list[str]:
    if kind == "smol-pipeline":
        return [smol, *launch, *args]
    return ["accelerate", "launch", *launch, str(ROOT / "pipeline/run.py"), *args]


def _outcome(run: Path) -> dict:
    return json.loads((run / "outcome.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("launch", [ONE, TWO], ids=["1-process", "2-processes"])
def test_a_bad_key_exits_2_with_one_line(smol, launch):
    proc = subprocess.run([smol, *launch, "recipe=tiny", "sft.learnin_rate=3e-4"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("error: unknown config key 'sft.learnin_rate'") == 1
    assert "Traceback" not in proc.stderr


def test_a_shipped_accelerate_config_by_name_names_its_deepspeed_json_from_any_folder(tmp_path, monkeypatch):
    from pipeline import launch

    monkeypatch.chdir(tmp_path)
    shipped = ROOT / "recipes/accelerate"
    assert launch.config_options("zero3", None) == ["--config_file", str(shipped / "zero3.yaml"),
                                                    "--deepspeed_config_file", str(shipped / "zero3.json")]
    assert launch.config_options("cpu", None) == ["--config_file", str(shipped / "cpu.yaml")]  # no DeepSpeed
    assert launch.config_options("zero2", "mine.json") == ["--config_file", str(shipped / "zero2.yaml")]  # given
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf/ds.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: "
                                           "ds.json\n")
    (tmp_path / "conf/ds.json").write_text("{}")
    assert launch.config_options("conf/ds.yaml", None) == ["--config_file", "conf/ds.yaml",
                                                           "--deepspeed_config_file", str(tmp_path / "conf/ds.json")]


def test_an_unknown_accelerate_config_exits_2_with_one_line(capsys):
    from pipeline import launch

    assert launch.main(["--config_file", "zero4", "recipe=tiny"]) == 2
    assert capsys.readouterr().err == ("error: --config_file 'zero4' is neither a file nor a shipped accelerate config "
                                       "(cpu, ddp, zero2, zero3, zero3_offload)\n")


@pytest.mark.slow
def test_accelerate_launch_reports_a_bad_key_as_1():
    proc = run_cli("recipe=tiny", "sft.learnin_rate=3e-4", launcher=["accelerate", "launch"], timeout=300)
    assert proc.returncode == 1 and "CalledProcessError" in proc.stderr  # why smol-pipeline exists


@pytest.mark.slow
@pytest.mark.parametrize("kind, launch, code", [
    ("smol-pipeline", ONE, 3), ("smol-pipeline", TWO, 3), ("accelerate", TWO, 1)])
def test_a_gate_stop_exits_3_and_is_recorded(kind, launch, code, smol, tiny_base, tmp_path, cache_dir):
    cmd = _command(kind, smol, launch, _args(tmp_path, cache_dir, *GATE))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == code, proc.stderr[-3000:]
    if kind == "smol-pipeline":
        assert "Traceback" not in proc.stderr
    outcome = _outcome(tmp_path / "tiny")
    assert (outcome["exit_code"], outcome["outcome"], outcome["stage"]) == (3, "gate_stop", "01-sft")
    assert outcome["reason"].startswith("gate after stage 01-sft: tiny_gsm/exact_match,strict-match = ")
    assert outcome["argv"][-1] == "sft.gate.action=stop" and outcome["started"] <= outcome["finished"]


def _signal(proc: subprocess.Popen, sig: int, whom: str) -> None:
    """Signal the launcher itself, (as Slurm does) the pipeline processes under it, or (as a terminal's Ctrl-C
    does) its whole process group."""
    if whom == "group":
        os.killpg(proc.pid, sig)
        return
    targets = [proc.pid] if whom == "launcher" else [p.pid for p in psutil.Process(proc.pid).children()]
    assert targets
    for pid in targets:
        os.kill(pid, sig)


@pytest.mark.slow
@pytest.mark.parametrize("kind, launch, sig, whom, code", [
    ("smol-pipeline", ONE, signal.SIGTERM, "launcher", 75), ("smol-pipeline", TWO, signal.SIGUSR1, "launcher", 75),
    ("smol-pipeline", TWO, signal.SIGINT, "group", 75), ("accelerate", ONE, signal.SIGUSR1, "pipeline", 1)],
    ids=["smol-1-TERM", "smol-2-USR1", "smol-2-ctrl-c", "accelerate-1-USR1"])
def test_a_preemption_exits_75_and_is_recorded(kind, launch, sig, whom, code, smol, tiny_base, tmp_path, cache_dir):
    args = _args(tmp_path, cache_dir, *NO_EVAL, "stages=[sft]", "sft.max_steps=40", "sft.save_steps=5")
    proc = subprocess.Popen(_command(kind, smol, launch, args), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    checkpoint = tmp_path / "tiny/stages/01-sft/work/checkpoint-5/trainer_state.json"
    deadline = time.time() + 600
    while not checkpoint.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    _signal(proc, sig, whom)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err[-3000:]
    forwarded = "SIGTERM" if sig == signal.SIGINT else signal.Signals(sig).name  # the launcher forwards Ctrl-C so
    assert f"preempted: {forwarded} received; stopped cleanly in 01-sft" in err
    outcome = _outcome(tmp_path / "tiny")
    assert (outcome["exit_code"], outcome["outcome"], outcome["stage"]) == (75, "preempted", "01-sft")
    assert json.loads((tmp_path / "tiny/stages/01-sft/stage.json").read_text())["status"] == "running"


@pytest.mark.slow
@pytest.mark.parametrize("kind, launch", [("smol-pipeline", ONE), ("smol-pipeline", TWO), ("accelerate", ONE)])
def test_a_crash_exits_1_with_its_traceback_in_the_log(kind, launch, smol, tiny_base, tmp_path, cache_dir):
    run = tmp_path / "tiny"
    run.mkdir()
    (run / "stages").write_text("")  # a file where the stage folders go: the first stage crashes on mkdir
    proc = subprocess.run(_command(kind, smol, launch, _args(tmp_path, cache_dir, *NO_EVAL, "stages=[sft]")),
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    reason = f"NotADirectoryError: [Errno 20] Not a directory: '{run / 'stages/01-sft'}'"
    log = (run / "pipeline.log").read_text()
    assert f"ERROR crashed: {reason}\nTraceback (most recent call last):" in log
    assert log.rstrip().endswith(reason)
    last = proc.stderr.rstrip().splitlines()[-1]
    if kind == "smol-pipeline" and launch == TWO:  # the launcher has the last word under torch elastic
        assert last.startswith("smol-pipeline: exit 1 (crashed) from rank ")
        assert last.endswith(f"log: {run}/pipeline.log")
    elif kind == "smol-pipeline":
        assert last == f"crashed: {reason}; traceback in {run}/pipeline.log"
    outcome = _outcome(run)
    assert (outcome["exit_code"], outcome["outcome"], outcome["stage"], outcome["reason"]) == (1, "crashed", "01-sft",
                                                                                              reason)
