"""Atomic writes under concurrency: many processes publishing the same content-addressed folder into an empty
cache (as every node of a multi-node run may), and many writers of one file. The run lock as a lease: taken over
from a dead holder on any host, refused while its holder renews it, one winner among racing contenders; and the
removal of killed writers' temporary files."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT

from pipeline.errors import LockLost
from pipeline.files import RunLock, atomic_dir, fence, pid_space, read_json, remove_leftovers, temp_name, write_json

WRITERS = 8
PARTS = 20


def _publish(path: Path, start: multiprocessing.synchronize.Barrier) -> None:
    """One writer: fill a temporary folder, wait for every other writer, then commit at the same moment."""
    with atomic_dir(path, first_wins=True) as tmp:
        for i in range(PARTS):
            (tmp / f"part-{i}.txt").write_text(f"part {i}\n" * 100)
        start.wait()
    assert sorted(p.name for p in path.iterdir()) == sorted(f"part-{i}.txt" for i in range(PARTS))


@pytest.mark.slow
def test_concurrent_writers_of_one_content_addressed_folder_all_succeed(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    for round_ in range(3):
        path = tmp_path / "cache" / f"entry-{round_}"
        start = ctx.Barrier(WRITERS)
        writers = [ctx.Process(target=_publish, args=(path, start)) for _ in range(WRITERS)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(timeout=120)
        assert [w.exitcode for w in writers] == [0] * WRITERS
        assert {p.name for p in path.iterdir()} == {f"part-{i}.txt" for i in range(PARTS)}
        assert all((path / f"part-{i}.txt").read_text() == f"part {i}\n" * 100 for i in range(PARTS))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["entry-0", "entry-1", "entry-2"]  # no temps


def test_a_second_publish_keeps_the_first_folder(tmp_path):
    path = tmp_path / "entry"
    with atomic_dir(path, first_wins=True) as tmp:
        (tmp / "a.txt").write_text("first")
    with atomic_dir(path, first_wins=True) as tmp:
        (tmp / "a.txt").write_text("second")
    assert (path / "a.txt").read_text() == "first" and [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_a_replacing_commit_replaces(tmp_path):
    path = tmp_path / "model"
    for text in ("first", "second"):
        with atomic_dir(path) as tmp:
            (tmp / "a.txt").write_text(text)
    assert (path / "a.txt").read_text() == "second" and [p.name for p in tmp_path.iterdir()] == ["model"]


def test_concurrent_writers_of_one_file_in_one_process_all_succeed(tmp_path):
    path, errors = tmp_path / "run.json", []

    def write(i: int) -> None:
        try:
            for _ in range(50):
                write_json(path, {"writer": i, "rows": list(range(200))})
        except OSError as err:
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read_json(path)["rows"] == list(range(200)) and json.loads(path.read_text())["writer"] in range(WRITERS)
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


# -- the run lock: a lease its holder renews -----------------------------------------------------------------


def _lock_record(path: Path, **fields) -> None:
    """A lock file as another holder wrote it (an owner id of its own, a heartbeat `age` seconds old); on this host
    its pid is one of this boot and pid namespace unless the fields say otherwise."""
    age = fields.pop("age", 0.0)
    here = RunLock(path.parent).owner if fields.get("host") == socket.gethostname() else {}
    record = {"pid": 4242, "host": "node-b", "boot_id": here.get("boot_id"), "pid_ns": here.get("pid_ns"),
              "owner": uuid.uuid4().hex, "slurm_job_id": None, "slurm_restart_count": 0, "since": "then",
              "lease_s": 120.0, "heartbeat": time.time() - age, **fields}
    path.write_text(json.dumps(record))


def test_a_lock_from_another_host_whose_lease_expired_is_taken_over(tmp_path):
    _lock_record(tmp_path / ".lock", age=3, lease_s=1.0)  # and unchanged for a lease by this process's clock
    lock = RunLock(tmp_path)
    t0 = time.monotonic()
    lock.acquire()
    assert time.monotonic() - t0 >= 1.0
    try:
        held = read_json(tmp_path / ".lock")
        assert held["owner"] == lock.owner["owner"] and held["host"] == socket.gethostname()
        assert held["pid"] == os.getpid() and isinstance(held["heartbeat"], float)
        assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # no claim or temporary file left
    finally:
        lock.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_from_another_host_with_a_fresh_lease_is_refused(tmp_path):
    _lock_record(tmp_path / ".lock", age=100)
    before = (tmp_path / ".lock").read_text()
    with pytest.raises(RuntimeError, match="in use by pid 4242 on node-b .*lease renewed 100 s ago"):
        RunLock(tmp_path).acquire()
    RunLock(tmp_path).release()  # a release by a process that does not hold it removes nothing
    assert (tmp_path / ".lock").read_text() == before and [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_a_contender_whose_clock_is_ahead_is_refused_by_the_renewals_it_sees(tmp_path):
    """A contender 10 minutes ahead of the holder reads a lease that looks expired, watches the file for a lease by
    its own clock, sees the holder renew it and is refused; the holder keeps its lock."""
    holder = RunLock(tmp_path, lease_s=1.0, renew_s=0.2)
    holder.acquire()
    try:
        ahead = ("import sys, time\nreal = time.time\ntime.time = lambda: real() + 600\n"
                 "from pipeline.files import RunLock\ntry:\n    RunLock(sys.argv[1]).acquire()\n"
                 "except RuntimeError as err:\n    print(err)\n")
        proc = subprocess.run([sys.executable, "-c", ahead, str(tmp_path)], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "is in use by pid" in proc.stdout and "renewed while this process watched it" in proc.stdout
        assert read_json(tmp_path / ".lock")["owner"] == holder.owner["owner"]
    finally:
        holder.release()


def test_a_dead_pid_under_this_hostname_in_another_pid_namespace_is_not_judged(tmp_path):
    """Two containers may share a hostname: a pid of another pid namespace (or boot) says nothing here, so a lock
    with a fresh lease is refused."""
    _lock_record(tmp_path / ".lock", host=socket.gethostname(), pid=2**22 + 7, pid_ns="pid:[1]")
    with pytest.raises(RuntimeError, match=f"in use by pid {2**22 + 7}"):
        RunLock(tmp_path).acquire()


def test_a_lock_of_a_dead_process_on_this_host_or_of_this_pid_under_another_owner_is_taken_over(tmp_path):
    for pid in (2**22 + 7, os.getpid()):  # a dead pid; this process's pid, written by a restarted container's
        _lock_record(tmp_path / ".lock", host=socket.gethostname(), pid=pid)
        lock = RunLock(tmp_path)
        lock.acquire()
        assert read_json(tmp_path / ".lock")["owner"] == lock.owner["owner"]
        lock.release()


def test_an_older_version_s_lock_of_a_live_process_is_refused(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "since": "now"}))
    with pytest.raises(RuntimeError, match=f"in use by pid {os.getppid()}"):
        RunLock(tmp_path).acquire()


def test_a_renewing_holder_keeps_its_lock(tmp_path):
    holder = RunLock(tmp_path, lease_s=0.6, renew_s=0.1)
    holder.acquire()
    try:
        first = read_json(tmp_path / ".lock")["heartbeat"]
        for _ in range(4):  # well past the lease: the holder's heartbeat keeps it live
            time.sleep(0.3)
            with pytest.raises(RuntimeError, match="in use by pid"):
                RunLock(tmp_path, lease_s=0.6).acquire()
        assert read_json(tmp_path / ".lock")["heartbeat"] > first
    finally:
        holder.release()
    assert not (tmp_path / ".lock").exists()


def test_a_holder_that_stops_renewing_loses_its_lock_and_its_release_leaves_the_new_one(tmp_path):
    holder = RunLock(tmp_path, lease_s=0.3, renew_s=60)  # renews far too rarely: as if its node had gone away
    holder.acquire()
    time.sleep(0.5)
    taker = RunLock(tmp_path, lease_s=0.3)
    taker.acquire()
    with pytest.raises(LockLost, match=f"lost the lock {tmp_path / '.lock'} to pid {os.getpid()} on "):
        fence(tmp_path / "stages/01-sft/stage.json")  # the old holder's next commit into the folder stops
    model = tmp_path / "model"
    with pytest.raises(LockLost), atomic_dir(model) as tmp:
        (tmp / "a.txt").write_text("written after the lock was lost")
    assert not model.exists()  # nothing committed
    holder.release()  # the old holder's release compares owner ids: the new lock stays
    assert read_json(tmp_path / ".lock")["owner"] == taker.owner["owner"]
    assert holder.renew() is False  # and its next renewal finds the lock taken
    fence(tmp_path / "stages")  # the taker holds its lock
    fence(tmp_path.parent / "elsewhere")  # and nothing outside a locked folder is fenced
    taker.release()


def test_a_renewal_that_cannot_read_the_lock_keeps_it_and_tries_again(tmp_path, monkeypatch):
    holder = RunLock(tmp_path, lease_s=60, renew_s=60)
    holder.acquire()
    try:
        real, fails = Path.read_text, []

        def flaky(path, *args, **kwargs):  # the shared filesystem fails two reads
            if path.name == ".lock" and len(fails) < 2:
                fails.append(path)
                raise OSError(5, "Input/output error")
            return real(path, *args, **kwargs)
        monkeypatch.setattr(Path, "read_text", flaky)
        with pytest.raises(OSError):
            holder.renew()  # nothing concluded: the renewal loop logs it and tries at its next beat
        fence(tmp_path / "model")  # nor does a commit stop on it
        assert len(fails) == 2 and holder.renew() is True
        assert read_json(tmp_path / ".lock")["owner"] == holder.owner["owner"]
    finally:
        holder.release()


def test_a_requeued_slurm_job_takes_over_its_earlier_incarnation_s_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7001")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    _lock_record(tmp_path / ".lock", slurm_job_id="7001", slurm_restart_count=1)  # fresh lease, other node
    lock = RunLock(tmp_path)
    lock.acquire()
    held = read_json(tmp_path / ".lock")
    assert (held["owner"], held["slurm_job_id"], held["slurm_restart_count"]) == (lock.owner["owner"], "7001", 2)
    lock.release()
    for job, restarts in (("7001", 2), ("7002", 0)):  # the same incarnation (another step of it), another job
        _lock_record(tmp_path / ".lock", slurm_job_id=job, slurm_restart_count=restarts)
        with pytest.raises(RuntimeError, match="in use by pid 4242"):
            RunLock(tmp_path).acquire()


def _contend(run: str, start: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue) -> None:
    lock = RunLock(Path(run))
    start.wait()
    try:
        lock.acquire()
    except RuntimeError as err:
        results.put(("refused", str(err)))
        return
    results.put(("won", lock.owner["owner"]))
    time.sleep(1.0)  # hold it while the others judge it: a live lock now
    lock.release()


@pytest.mark.slow
def test_contenders_racing_on_a_stale_lock_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    for round_ in range(3):
        run = tmp_path / f"run-{round_}"
        run.mkdir()
        _lock_record(run / ".lock", age=500, lease_s=1.0)
        start, results = ctx.Barrier(WRITERS), ctx.Queue()
        procs = [ctx.Process(target=_contend, args=(str(run), start, results)) for _ in range(WRITERS)]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(timeout=120)
        assert [p.exitcode for p in procs] == [0] * WRITERS
        assert sorted(kind for kind, _ in got) == ["refused"] * (WRITERS - 1) + ["won"], got
        assert not (run / ".lock").exists() and list(run.iterdir()) == []  # released; no claim or temp left


def test_leftover_ages_are_read_on_the_storage_s_clock_not_this_host_s(tmp_path, monkeypatch):
    """Another host's temporary folder written just now stays when this host's clock runs 10 minutes ahead (the
    storage stamps its files by its own clock: a network filesystem's server)."""
    fresh = tmp_path / f".model.tmp-node-b-78-{'e' * 12}"
    (fresh / "sub").mkdir(parents=True)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600)
    assert remove_leftovers(tmp_path, lease_s=120) == [] and fresh.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name]  # the clock's probe is gone


def test_leftovers_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    host, dead = pid_space(), 2**22 + 11
    stage = tmp_path / "stages/01-sft"
    (stage / "work").mkdir(parents=True)
    dead_file = stage / f".stage.json.tmp-{host}-{dead}-{'a' * 12}"
    dead_dir = stage / f".model.tmp-{host}-{dead}-{'b' * 12}"
    live_file = stage / f".stage.json.tmp-{host}-{os.getppid()}-{'c' * 12}"  # a live writer on this host
    far_old = stage / "work" / f".model.old-node-b-77-{'d' * 12}"  # another host's, untouched for a lease
    far_new = stage / f".model.tmp-node-b-78-{'e' * 12}"  # another host's, written to just now
    # this hostname in another container (its own pid namespace), or a release that named the host only: a pid
    # dead here may be alive there, so the lease decides
    twin_new = stage / f".model.tmp-{socket.gethostname()}~0badf00d-{dead}-{'f' * 12}"
    twin_old = stage / f".model.tmp-{socket.gethostname()}-{dead}-{'9' * 12}"
    legacy = stage / ".model.tmp"  # save_checkpoint's old name: its writer is unknown
    for d in (dead_dir, far_old, far_new, legacy, twin_new, twin_old):
        (d / "sub").mkdir(parents=True)
        (d / "sub/weights.bin").write_bytes(b"x")
    for f in (dead_file, live_file):
        f.write_text("{")
    for old in (far_old, legacy, twin_old):
        for path in (old, old / "sub", old / "sub/weights.bin"):
            os.utime(path, (time.time() - 500, time.time() - 500))
    (stage / "stage.json").write_text("{}")
    (stage / "work" / "model").mkdir()  # far_old's commit went through: its old copy is a leftover
    removed = remove_leftovers(tmp_path, lease_s=120)
    assert sorted(removed) == sorted([dead_file, dead_dir, far_old, legacy, twin_old])
    assert all(not p.exists() for p in removed)
    assert live_file.exists() and (far_new / "sub/weights.bin").exists() and (stage / "stage.json").exists()
    assert (twin_new / "sub/weights.bin").exists()
    assert pid_space().startswith(f"{socket.gethostname()}~") and temp_name(stage / "x").name.startswith(
        f".x.tmp-{pid_space()}-{os.getpid()}-")


def test_a_commit_killed_between_its_renames_leaves_the_old_folder(tmp_path, monkeypatch):
    from pipeline import files

    path = tmp_path / "stages/01-sft/model"
    for text in ("first", "second"):  # in one step where the filesystem swaps two names
        with atomic_dir(path) as tmp:
            (tmp / "a.txt").write_text(text)
    assert (path / "a.txt").read_text() == "second" and [p.name for p in path.parent.iterdir()] == ["model"]
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)  # a filesystem that cannot: two renames
    renames = []

    def killed(src, dst):  # the process is killed after the first rename
        renames.append(dst)
        if len(renames) > 1:
            raise KeyboardInterrupt
        os.rename(src, dst)
    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt), atomic_dir(path) as tmp:
        (tmp / "a.txt").write_text("third")
    monkeypatch.undo()
    assert not path.exists()  # between the renames: the old folder aside, the new one not in place
    old = renames[0]
    old.rename(old.with_name(old.name.replace(f"-{os.getpid()}-", f"-{2**22 + 13}-")))  # its writer is now dead
    assert remove_leftovers(tmp_path, lease_s=120) == []  # nothing removed: the old folder is put back
    assert (path / "a.txt").read_text() == "second" and [p.name for p in path.parent.iterdir()] == ["model"]
