"""Atomic file and folder writes, and content fingerprints.

A crash must never leave a half-written file or checkpoint under its final name: everything is
written to a temporary name in the same folder, fsynced, then renamed. Temporary names carry the host, the
pid and a random part, so writers on several hosts of a shared filesystem (or threads of one process) never
share one. A content-addressed cache folder is published first-wins: any number of writers may build the
same entry at once, the first complete one is kept and the others discard theirs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.errors import LockLost


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@functools.cache
def pid_space() -> str:
    """Where this process's pid means something, as a temp name carries it: `<hostname>~<8 hex digits of the boot id
    and pid namespace>` (two containers may share a hostname, not a pid namespace); the hostname alone where /proc
    does not say."""
    ids = _pid_space()
    if None in ids.values():
        return socket.gethostname()
    return f"{socket.gethostname()}~{hashlib.sha256(repr(sorted(ids.items())).encode()).hexdigest()[:8]}"


def temp_name(path: Path, kind: str = "tmp") -> Path:
    """A hidden name beside `path` that no other writer, on any host, in any thread, picks; it names its writer's
    pid and where that pid means something (`pid_space`)."""
    return path.with_name(f".{path.name}.{kind}-{pid_space()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (temp file, fsync, rename); concurrent writers: the last one wins."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when the file is absent or unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _fsync_tree(tmp: Path) -> None:
    for file in tmp.rglob("*"):
        if file.is_file():
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())


def fsync_tree(path: Path, files: bool = True) -> None:
    """Flush a folder to disk: every file under it (unless `files` is false) and every folder, itself included,
    so that what a writer put there (and their names) survives a crash of the machine."""
    path = Path(path)
    if files:
        _fsync_tree(path)
    for folder in [path, *(p for p in path.rglob("*") if p.is_dir())] if files else [path]:
        _fsync_dir(folder)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of the existing `a` and `b` in one step (Linux's renameat2 with RENAME_EXCHANGE); False
    where the system or the filesystem cannot."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    here = -100  # AT_FDCWD: paths as given
    return rename is not None and rename(here, os.fsencode(a), here, os.fsencode(b), 2) == 0


def commit_dir(tmp: Path, path: Path) -> None:
    """Fsync every file under the finished folder `tmp`, then rename it to `path`, replacing it (for a folder
    with one writer, like a run's model; a content-addressed cache entry is published with `publish_dir`). At
    every instant `path` is the old folder or the new one: the two are swapped in one step, or, where the
    filesystem cannot, the old one is renamed aside first and `remove_leftovers` puts it back if a kill came
    before the new one took its place."""
    tmp, path = Path(tmp), Path(path)
    _fsync_tree(tmp)
    fence(path)
    if path.exists() and _exchange(tmp, path):
        old = tmp
    else:
        old = temp_name(path, "old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def move_dir(src: Path, dest: Path) -> None:
    """Rename the folder `src` to `dest`, which must not exist (creating its parent), durably: both parents are
    fsynced. A kill leaves it at one of the two names."""
    src, dest = Path(src), Path(dest)
    fence(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(src, dest)  # POSIX: onto a non-empty folder this fails, it never merges or replaces
    _fsync_dir(dest.parent)
    _fsync_dir(src.parent)


def publish_dir(tmp: Path, path: Path) -> bool:
    """Fsync the finished folder `tmp` and rename it to `path` unless another writer's complete folder is already
    there (the content is the same: `path` is content-addressed); then `tmp` is removed. Whether `tmp` won."""
    tmp, path = Path(tmp), Path(path)
    _fsync_tree(tmp)
    try:
        os.rename(tmp, path)  # POSIX: onto a non-empty folder this fails, it never merges or replaces
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not path.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    _fsync_dir(path.parent)
    return True


@contextlib.contextmanager
def atomic_dir(path: Path, first_wins: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `path`; on success commit it to `path`: replacing it (`commit_dir`),
    or with `first_wins` for a content-addressed cache entry, keeping the one already there (`publish_dir`).

    On error the temporary folder is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    tmp.mkdir()
    try:
        yield tmp
        (publish_dir if first_wins else commit_dir)(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-serialisable object."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


LEASE_S = 120.0  # a run lock whose heartbeat is older than this is stale (its holder is gone)
RENEW_S = 30.0  # how often the holder renews its lease


def lock_timing() -> tuple[float, float]:
    """(lease, renewal interval) in seconds: `LEASE_S`, `RENEW_S`, or for tests only the environment's
    `PIPELINE_TEST_LOCK_LEASE_S` / `PIPELINE_TEST_LOCK_RENEW_S`."""
    return (float(os.environ.get("PIPELINE_TEST_LOCK_LEASE_S") or LEASE_S),
            float(os.environ.get("PIPELINE_TEST_LOCK_RENEW_S") or RENEW_S))


_HOLDING: list[RunLock] = []  # the locks this process holds: checked before each commit (`fence`)


def lock_lost(path: Path) -> str | None:
    """Why this process may not write to `path`: another process took over the lock this process held on a run
    folder that contains it (`RunLock.lost`); None otherwise (no such lock, or it still holds it)."""
    for lock in _HOLDING:
        if Path(path).absolute().is_relative_to(lock.path.parent.absolute()):
            return lock.lost()
    return None


def fence(path: Path) -> None:
    """Before a commit to `path` (a record, a model, the leaderboard): raise `LockLost` if this process lost the
    lock of the run folder that contains it (`lock_lost`)."""
    why = lock_lost(path)
    if why:
        raise LockLost(why)


def _slurm() -> tuple[str | None, int]:
    """This process's Slurm job id (None outside Slurm) and restart count (0 before any requeue)."""
    count = os.environ.get("SLURM_RESTART_COUNT", "0")
    return os.environ.get("SLURM_JOB_ID") or None, int(count) if count.isdigit() else 0


class RunLock:
    """An exclusive lock on a run folder: `<run>/<name>` (default `.lock`), a lease its holder renews.

    The file records the holder's host, pid (with the boot id and pid namespace in which it is one), a random
    owner id, its Slurm job id and restart count, and a heartbeat time that a daemon thread renews every
    `RENEW_S` seconds. A second pipeline on the same run is refused while the lease is live. A lock is stale, and
    taken over, when its holder on this host (the same boot and pid namespace) is gone (its pid is dead, or is
    this process's own pid under another owner id: a restarted container), when it records this Slurm job's id
    with a lower restart count (the job's earlier incarnation, requeued), or when its heartbeat is older than its
    lease (any host: a job requeued onto another node) and the file then stays unchanged for a whole lease by
    this process's own clock, so that no clock skew between hosts takes a live holder's lock (its next renewal
    rewrites the file, and the contender is refused). Taking over is race-free: the contender hard-links the
    stale file to a claim named after its content, which only one contender can create, checks that it claimed
    the stale lock unchanged, removes it, and creates its own with a hard link,
    which fails if the file exists again. `release` removes the file only while it holds this owner id.
    """

    def __init__(self, run_dir: Path, name: str = ".lock", lease_s: float | None = None,
                 renew_s: float | None = None) -> None:
        self.path = Path(run_dir) / name
        lease, renew = lock_timing()
        self.lease_s, self.renew_s = lease_s or lease, renew_s or renew
        job, restarts = _slurm()
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), **_pid_space(), "owner": uuid.uuid4().hex,
                      "slurm_job_id": job, "slurm_restart_count": restarts,
                      "since": time.strftime("%Y-%m-%dT%H:%M:%S"), "lease_s": self.lease_s}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _content(self) -> str:
        return json.dumps({**self.owner, "heartbeat": time.time()})

    def _link_new(self) -> bool:
        """Create the lock file with our record, complete, unless a lock file exists (hard link: atomic, NFS too)."""
        tmp = temp_name(self.path)
        write_text(tmp, self._content())
        try:
            _link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def gone(self, held: dict) -> str | None:
        """Why the holder of the lock record `held` is known to be gone (a phrase: its pid on this host, or this
        Slurm job's earlier incarnation), or None."""
        if held.get("owner") == self.owner["owner"]:
            return None
        if all(held.get(k) == self.owner[k] for k in ("host", "boot_id", "pid_ns")):  # its pid is one we can see
            if not _alive(held.get("pid")):
                return f"its process {held.get('pid')} on this host is gone"
            if held.get("pid") == self.owner["pid"] and held.get("owner") not in {h.owner["owner"] for h in _HOLDING}:
                return "it names this process's pid, which holds no such lock (a restarted container)"
        job, restarts = held.get("slurm_job_id"), held.get("slurm_restart_count")
        if job and job == self.owner["slurm_job_id"] and isinstance(restarts, int) \
                and restarts < self.owner["slurm_restart_count"]:
            return f"Slurm job {job} was requeued (restart {restarts} -> {self.owner['slurm_restart_count']})"
        return None

    def _lease(self, held: dict) -> float:
        return held["lease_s"] if isinstance(held.get("lease_s"), (int, float)) else self.lease_s

    def _unchanged_for(self, raw: str, lease: float) -> bool:
        """Whether the lock file keeps the content `raw` for a whole `lease` by this process's own clock: a live
        holder rewrites it at every renewal, whatever its clock, or the file server's, says."""
        end = time.monotonic() + lease
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, max(lease / 20, 0.05)))
            if _read_text(self.path) != raw:
                return False
        return True

    def _take_over(self, raw: str) -> bool:
        """Remove the stale lock whose file held `raw` unless another contender claims it first, or the file
        changed meanwhile; whether this one removed it."""
        claim = self.path.with_name(f".{self.path.name}.stale-{hashlib.sha256(raw.encode()).hexdigest()[:16]}")
        try:
            _link(self.path, claim)  # only one contender creates the claim on this stale lock
        except FileExistsError:
            with contextlib.suppress(OSError):  # a claim left by a contender that died while taking over
                if time.time() - claim.stat().st_ctime > self.lease_s:  # ctime: when the claim was linked
                    claim.unlink()
            return False
        except FileNotFoundError:
            return False  # the lock went away meanwhile: try again
        try:
            if _read_text(claim) != raw:
                return False  # the lock changed between our look and the claim (renewed, or replaced): judge again
            self.path.unlink(missing_ok=True)
            return True
        finally:
            claim.unlink(missing_ok=True)

    def acquire(self) -> None:
        """Take the lock or raise `RuntimeError` naming the live owner; start renewing the lease."""
        for attempt in range(50):
            if self._link_new():
                _HOLDING.append(self)
                self._start_renewing()
                return
            raw = _read_text(self.path)
            if raw is None:
                continue  # removed meanwhile: try to create it again
            try:
                held = json.loads(raw)
            except ValueError:
                held = None
            watch = None  # a lease that looks expired by the clocks: confirmed by watching the file for one
            if isinstance(held, dict):
                why = self.gone(held)
                beat, lease = held.get("heartbeat"), self._lease(held)
                if why is None and isinstance(beat, (int, float)) and time.time() - beat > lease:
                    why, watch = f"it was not renewed for its lease ({lease:.0f} s)", lease
            elif time.time() - _mtime(self.path) > self.lease_s:
                held, why, watch = {}, "it cannot be read and was not rewritten for a lease", self.lease_s
            else:  # a lock an older version has created but not written yet
                held, why = {}, None
                if attempt < 10:
                    time.sleep(0.1)
                    continue
            if why is None:
                raise RuntimeError(self._refusal(held)) from None
            if watch is not None and not self._unchanged_for(raw, watch):
                raise RuntimeError(self._refusal(held, renewed_while_watched=True)) from None
            if self._take_over(raw):
                logging.getLogger("pipeline").warning("took over the lock %s: %s", self.path, why)
            else:
                time.sleep(0.02 * (1 + attempt % 5))
        raise RuntimeError(f"could not take the lock {self.path}: other processes contend for it")

    def _refusal(self, held: dict, renewed_while_watched: bool = False) -> str:
        beat = held.get("heartbeat")
        if renewed_while_watched:
            renewed = (", lease renewed while this process watched it (its clock and this host's differ); wait "
                       "for it to finish")
        elif isinstance(beat, (int, float)):
            renewed = (f", lease renewed {time.time() - beat:.0f} s ago; wait for it to finish (a lock whose "
                       f"holder stopped renewing it is taken over {self._lease(held):.0f} s after its last renewal)")
        else:
            renewed = "; wait for it to finish (its lock has no lease: an older version wrote it)"
        return (f"run folder {self.path.parent} is in use by pid {held.get('pid')} on {held.get('host')} since "
                f"{held.get('since')}{renewed}, or delete {self.path} if that process is gone")

    def _holder(self) -> dict | None:
        """The lock's record as it is now; None when there is no lock file. A file that cannot be read or parsed
        (a flaky shared filesystem) raises OSError: nothing is known, so nothing is concluded."""
        try:
            held = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as err:
            raise OSError(f"lock record {self.path} does not parse: {err}") from err
        return held if isinstance(held, dict) else {}

    def lost(self) -> str | None:
        """Why this process no longer holds the lock (its file names another owner, or is gone: a contender judged
        the lease expired), or None while it does; a lock file that cannot be read proves nothing (None)."""
        try:
            held = self._holder()
        except OSError:
            return None
        if held is not None and held.get("owner") == self.owner["owner"]:
            return None
        who = f"pid {held.get('pid')} on {held.get('host')}" if held else "no one (its file is gone)"
        return (f"lost the lock {self.path} to {who}: this process stopped renewing it within its "
                f"{self.lease_s:.0f} s lease, and writes nothing more into {self.path.parent}")

    def renew(self) -> bool:
        """Write a fresh heartbeat into the lock if this process still holds it; False once it does not. A lock
        file that cannot be read raises OSError (the renewal is tried again), never counts as lost."""
        held = self._holder()
        if held is not None and held.get("owner") != self.owner["owner"]:
            return False
        tmp = temp_name(self.path)
        write_text(tmp, self._content())
        try:
            if held is None:  # removed by a contender that judged the lease expired: claim it back, if still free
                _link(tmp, self.path)
            else:
                os.replace(tmp, self.path)
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def _start_renewing(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.renew_s):
                try:
                    kept = self.renew()
                except OSError as err:  # a flaky shared filesystem: try again at the next beat
                    logging.getLogger("pipeline").warning("could not renew the lock %s: %s", self.path, err)
                    continue
                if not kept:  # the next commit stops (`fence`)
                    logging.getLogger("pipeline").error(
                        "lost the lock %s: another process took it over (this one did not renew it within %.0f s)",
                        self.path, self.lease_s)
                    return

        self._stop.clear()
        self._thread = threading.Thread(target=beat, name=f"lease {self.path.name}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and remove the lock if this process holds it (the owner id compared)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self in _HOLDING:
            _HOLDING.remove(self)
        held = read_json(self.path) or {}
        if held.get("owner") == self.owner["owner"]:
            self.path.unlink(missing_ok=True)


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{12}$")


def _newest_mtime(path: Path) -> float:
    """The newest modification time of `path` and, for a folder, of everything under it (a file still being
    written has a fresh one)."""
    newest = _mtime(path)
    if path.is_dir() and not path.is_symlink():
        for sub, dirs, files in os.walk(path):
            for name in (*dirs, *files):
                newest = max(newest, _mtime(Path(sub) / name))
    return newest


def remove_leftovers(root: Path, lease_s: float | None = None) -> list[Path]:
    """Remove the temporary files and folders that killed writers left under the run folder `root`; return them.

    Names made by `temp_name` (`.<name>.tmp-<pid space>-<pid>-<id>`, `.<name>.old-...`) go when their writer is gone
    (an `.old` one whose `<name>` is missing is put back instead: `commit_dir` was killed between its renames):
    in this pid space (`pid_space`: this host's boot and pid namespace) its pid is dead; elsewhere (another host,
    another container of this host, or a writer of a release that named the host only) nothing under the name
    changed for a lease (`LEASE_S`), as a live writer there (a sweep array task on another node) keeps writing.
    Hidden `.<name>.tmp` folders, whose writer is unknown, go after a lease too. Ages are read on the storage's own
    clock (`storage_now`), never against this host's. Call it holding the run lock."""
    lease = lock_timing()[0] if lease_s is None else lease_s
    host, now, removed = pid_space(), storage_now(root), []
    for sub, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(sub) / name
            found = _LEFTOVER.match(name)
            if found and found["host"] == host:
                gone = int(found["pid"]) != os.getpid() and not _alive(int(found["pid"]))
            elif found or (name.startswith(".") and name.endswith(".tmp") and name in dirs):
                gone = now - _newest_mtime(path) > lease
            else:
                continue
            if name in dirs:
                dirs.remove(name)  # never walk into a temporary folder
            if not gone:
                continue
            if found and found["kind"] == "old" and not (original := Path(sub) / found["name"]).exists():
                try:
                    path.rename(original)  # a commit killed between its two renames: the old one back
                except OSError as err:  # another process restored it, or its writer went on after all
                    logging.getLogger("pipeline").warning("could not restore %s from %s: %s", original, path, err)
                else:
                    logging.getLogger("pipeline").warning("restored %s: its replacement was cut short", original)
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def storage_now(folder: Path) -> float:
    """The time as the storage holding `folder` stamps files (a network filesystem's server clock, whatever this
    host's says): the modification time of a file written there now; this host's clock where none can be."""
    probe = temp_name(Path(folder) / ".clock")
    try:
        probe.write_bytes(b"")
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        probe.unlink(missing_ok=True)


def _link(src: Path, dst: Path) -> None:
    """Make `dst` a hard link to `src`, atomically, raising `FileExistsError` if `dst` exists (NFS too); where
    the filesystem has no hard links, create `dst` exclusively and copy `src`'s bytes into it."""
    try:
        os.link(src, dst)
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        data = Path(src).read_bytes()
        fd = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())


def _read_text(path: Path) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _pid_space() -> dict:
    """Where this process's pid means something: the kernel's boot id and this pid namespace (two containers may
    share a hostname, not a pid namespace); None where /proc does not say."""
    ids = {}
    for key, read in (("boot_id", lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
                      ("pid_ns", lambda: os.readlink("/proc/self/ns/pid"))):
        try:
            ids[key] = read()
        except OSError:
            ids[key] = None
    return ids


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
