"""Stop signals outside training steps (pipeline/preempt.py), in this process and in real child processes:
an interruptible section stops at once, a main-only section stops every rank, a second Ctrl-C is immediate, and
processes started shielded survive the signals the run handles itself. The runs they protect: test_reliability."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from pipeline import preempt
from pipeline.errors import Preempted


@pytest.fixture
def handlers():
    """The run's handlers, installed for the test and removed after it, with a clear flag."""
    saved = {sig: signal.getsignal(sig) for sig in preempt.SIGNALS}
    preempt.install()
    preempt._requested.update(signal=None, sigints=0, reason=None)
    yield
    preempt._requested.update(signal=None, sigints=0, reason=None)
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_signal_outside_a_section_only_sets_the_flag(handlers):
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preempt.requested() == "SIGUSR1"
    with pytest.raises(Preempted, match="SIGUSR1 received; stopped cleanly before scoring"):
        with preempt.interruptible("scoring"):
            pytest.fail("a section does not start after a signal")


def test_a_signal_inside_an_interruptible_section_stops_it_at_once(handlers):
    started = time.monotonic()
    with pytest.raises(Preempted, match="SIGTERM received; stopped tokenising; it is redone on the rerun"):
        with preempt.interruptible("tokenising"):
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
            _busy(30)
    assert time.monotonic() - started < 10
    assert preempt._requested["interruptible"] is None  # the section is over


def test_library_code_that_catches_exceptions_does_not_swallow_the_stop(handlers):
    with pytest.raises(Preempted):
        with preempt.interruptible("scoring"):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                _busy(0.1)
            except Exception:  # noqa: BLE001 - what a library's broad handler does
                pytest.fail("the stop reached a library's except Exception")


def test_a_second_ctrl_c_stops_at_once(handlers):
    os.kill(os.getpid(), signal.SIGINT)
    assert preempt.requested() == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        _busy(1)


def test_main_only_stops_a_single_process_with_the_section_named(handlers):
    with pytest.raises(Preempted, match="stopped on-policy sampling"):
        with preempt.main_only("on-policy sampling") as main:
            assert main
            os.kill(os.getpid(), signal.SIGUSR1)
            _busy(1)


def _wait_then_report(queue) -> None:
    queue.put(os.getpid())
    time.sleep(5)



def test_no_save_is_started_when_the_job_ends_sooner_than_the_last_save_took(handlers, monkeypatch):
    """Under Slurm (`SLURM_JOB_END_TIME`) a save is timed; one that could not finish before the job's end is not
    started: training stops without it and the run exits 75, to requeue from the checkpoint before."""
    from transformers import TrainerControl, TrainerState

    callback, state = preempt.PreemptCallback(), TrainerState(global_step=5)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 3600))
    control = callback.on_step_end(None, state, TrainerControl(should_save=True))
    assert control.should_save and not control.should_training_stop  # no save measured yet, an hour left
    _busy(0.3)  # the save
    callback.on_save(None, state, control)
    assert 0.3 <= callback.save_s < 5
    control = callback.on_step_end(None, state, TrainerControl(should_save=True))
    assert control.should_save and not control.should_training_stop and preempt.requested() is None
    state.global_step = 10
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 0.1))  # Slurm's warning came late, or saves grew
    control = callback.on_step_end(None, state, TrainerControl(should_save=True))
    assert not control.should_save and control.should_training_stop
    with pytest.raises(Preempted, match=r"^the job's time limit is nearer than a save \(0 s left, the last save "
                                        r"took 0 s\); stopped cleanly in 01-sft$"):
        preempt.check("in 01-sft")
    monkeypatch.delenv("SLURM_JOB_END_TIME")  # outside a timed job, saves are never skipped
    preempt._requested.update(signal=None, reason=None)
    control = callback.on_step_end(None, state, TrainerControl(should_save=True))
    assert control.should_save and not control.should_training_stop


def test_a_requeued_job_guards_its_first_save_with_the_time_its_checkpoint_took(handlers, monkeypatch, tmp_path):
    """The checkpoint a resume starts from says how long it took to write (its first file to its marker, written
    last): a job whose end is nearer than that starts no save before it has measured one of its own."""
    from transformers import TrainerControl, TrainerState

    from pipeline.train.trainer import save_seconds

    checkpoint = tmp_path / "checkpoint-5"
    (checkpoint / "shard").mkdir(parents=True)
    for name, at in (("shard/model.safetensors", 1000.0), ("optimizer.pt", 1030.0), (".complete", 1040.0)):
        (checkpoint / name).write_text("x")
        os.utime(checkpoint / name, (at, at))
    assert save_seconds(checkpoint) == 40.0
    callback = preempt.PreemptCallback(save_seconds(checkpoint))
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(time.time() + 20))
    control = callback.on_step_end(None, TrainerState(global_step=6), TrainerControl(should_save=True))
    assert not control.should_save and control.should_training_stop
    with pytest.raises(Preempted, match=r"the last save took 40 s"):
        preempt.check("in 01-sft")


@pytest.mark.slow
def test_processes_started_shielded_survive_the_stop_signals_and_the_run_still_gets_them(handlers):
    """As a vLLM engine core, which Slurm's `scancel --signal` and a terminal's Ctrl-C reach too."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with preempt.shielded():
        child = ctx.Process(target=_wait_then_report, args=(queue,))
        child.start()
        # to this thread, which blocks it: delivered when the block ends (a process-directed signal could go at once
        # to a thread an earlier test's library left running, which does not block it)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        assert preempt.requested() is None
    assert preempt.requested() == "SIGUSR1"
    pid = queue.get(timeout=60)
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        os.kill(pid, sig)
    time.sleep(0.5)
    assert child.is_alive()
    child.kill()
    child.join()
