"""Atomic writes under concurrency: many processes publishing the same content-addressed folder into an empty
cache (as every node of a multi-node run may), and many writers of one file."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

from pipeline.files import atomic_dir, read_json, write_json

WRITERS = 8
PARTS = 20


def _publish(path: Path, start: multiprocessing.synchronize.Barrier) -> None:
    """One writer: fill a temporary folder, wait for every other writer, then commit at the same moment."""
    with atomic_dir(path, first_wins=True) as tmp:
        for i in range(PARTS):
            (tmp / f"part-{i}.txt").write_text(f"part {i}\n" * 100)
        start.wait()
    assert sorted(p.name for p in path.iterdir()) == sorted(f"part-{i}.txt" for i in range(PARTS))


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
