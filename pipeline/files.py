"""Atomic file and folder writes, and content fingerprints.

A crash must never leave a half-written file or checkpoint under its final name: everything is
written to a temporary name in the same folder, fsynced, then renamed. Temporary names carry the host, the
pid and a random part, so writers on several hosts of a shared filesystem (or threads of one process) never
share one. A content-addressed cache folder is published first-wins: any number of writers may build the
same entry at once, the first complete one is kept and the others discard theirs.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: Path, kind: str = "tmp") -> Path:
    """A hidden name beside `path` that no other writer, on any host, in any thread, picks."""
    return path.with_name(f".{path.name}.{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


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


def commit_dir(tmp: Path, path: Path) -> None:
    """Fsync every file under the finished folder `tmp`, then rename it to `path`, replacing it (for a folder
    with one writer, like a run's model; a content-addressed cache entry is published with `publish_dir`)."""
    tmp, path = Path(tmp), Path(path)
    _fsync_tree(tmp)
    old = temp_name(path, "old")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


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


class RunLock:
    """An exclusive lock on a run folder: `<run>/<name>` (default `.lock`) holding the owner's pid and host.

    A second pipeline on the same run is refused; a lock left by a dead process on this host is
    taken over.
    """

    def __init__(self, run_dir: Path, name: str = ".lock") -> None:
        self.path = Path(run_dir) / name
        self.owner = {"pid": os.getpid(), "host": socket.gethostname()}

    def acquire(self) -> None:
        """Take the lock or raise `RuntimeError` naming the live owner."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = read_json(self.path) or {}
                if held.get("host") == self.owner["host"] and not _alive(held.get("pid")):
                    self.path.unlink(missing_ok=True)  # stale: its process is gone
                    continue
                raise RuntimeError(f"run folder {self.path.parent} is in use by pid {held.get('pid')} on "
                                   f"{held.get('host')} since {held.get('since')}; wait for it to finish, or delete "
                                   f"{self.path} if that process is gone") from None
            with os.fdopen(fd, "w") as fh:
                json.dump({**self.owner, "since": time.strftime("%Y-%m-%dT%H:%M:%S")}, fh)
            return
        raise RuntimeError(f"could not take the lock {self.path}")

    def release(self) -> None:
        """Drop the lock if this process holds it."""
        held = read_json(self.path) or {}
        if held.get("pid") == self.owner["pid"] and held.get("host") == self.owner["host"]:
            self.path.unlink(missing_ok=True)


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
